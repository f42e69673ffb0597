"""`compress merge` end to end: classic merges of the real SmolLM2 and a perturbed copy, the weight
VAE and latent merges on tiny synthetic models, and bad inputs with their exit codes."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from compress.checkpoint import Checkpoint, CheckpointWriter
from compress.transforms import merge as mg
from conftest import cli

pytestmark = pytest.mark.integration
PROBE = ["model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight", "model.layers.7.input_layernorm.weight"]


def shared_data() -> Path:
    """The shared data folder: ../shared/data from the repository (a worktree sits one level deeper)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "shared" / "data").is_dir():
            return parent / "shared" / "data"
    pytest.skip("no shared/data folder with the evaluation text")


def tensors(path, names):
    with Checkpoint.open(path) as c:
        return {n: c.get(n).float() for n in names}


def perturb_copy(src_dir, out, layers=None, seed=0):
    """A copy of ``src_dir`` with seeded noise of 1% of each tensor's std on every tensor (a stand-in
    fine-tune); with ``layers``, only the embedding, final norm and the first ``layers`` decoder layers."""
    from compress.transforms.lsmerge import split_layer

    g = torch.Generator().manual_seed(seed)
    with Checkpoint.open(src_dir) as src, CheckpointWriter(out) as w:
        for name in src.names():
            p = split_layer(name)
            if layers is not None and p and p[1] >= layers:
                continue
            t = src.get(name).float()
            if seed:
                t = t + 0.01 * t.std() * torch.randn(t.shape, generator=g)
            w.add({name: ("BF16", tuple(t.shape), mg.to_array(t, "BF16"))})
        w.copy_files(src.path, [r for r in src.extra_files() if str(r) != "config.json"])
        config = src.config()
        if layers is not None:
            config["num_hidden_layers"] = layers
        w.write_text("config.json", json.dumps(config, indent=2))
        w.commit()
    return out


@pytest.fixture(scope="module")
def perturbed(smollm2_bf16, tmp_path_factory):
    """SmolLM2 with 1% noise on every tensor."""
    return perturb_copy(smollm2_bf16, tmp_path_factory.mktemp("merge") / "perturbed", seed=1)


@pytest.fixture(scope="module")
def small_pair(smollm2_bf16, tmp_path_factory):
    """SmolLM2 cut to its first 2 decoder layers (real tensors), and a perturbed copy of that."""
    d = tmp_path_factory.mktemp("small")
    return perturb_copy(smollm2_bf16, d / "a", layers=2), perturb_copy(smollm2_bf16, d / "b", layers=2, seed=2)


def link_copy(src, dst, replace=None):
    """A folder of symlinks to ``src``'s files, with some files replaced by new text."""
    dst.mkdir()
    for p in src.iterdir():
        if replace and p.name in replace:
            (dst / p.name).write_text(replace[p.name])
        else:
            os.symlink(p, dst / p.name)
    return dst


def tiny(path, layers=4, hidden=32, seed=0, tie=True, vocab=128):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tinies(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {"a": tiny(d / "a", seed=0), "b": tiny(d / "b", seed=1), "c": tiny(d / "c", layers=3, seed=2),
            "w": tiny(d / "w", hidden=48, seed=3), "u": tiny(d / "u", seed=4, tie=False),
            "p": tiny(d / "p", seed=5, vocab=136)}


# -- classic merges on the real model --------------------------------------------------------------
def test_linear_real_model(smollm2_bf16, perturbed, tmp_path):
    out = tmp_path / "lin"
    r = cli("merge", "linear", smollm2_bf16, perturbed, "-o", out, "--weights", "0.3,0.7", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["tensors"] == 272 and res["merged"] == 272
    a, b, m = tensors(smollm2_bf16, PROBE), tensors(perturbed, PROBE), tensors(out, PROBE)
    for n in PROBE:
        expect = mg.linear([a[n], b[n]], [0.3, 0.7]).to(torch.bfloat16).float()
        assert torch.equal(m[n], expect), n
    assert json.loads((out / "config.json").read_text()) == json.loads((smollm2_bf16 / "config.json").read_text())
    assert (out / "tokenizer.json").read_bytes() == (smollm2_bf16 / "tokenizer.json").read_bytes()
    card = (out / "README.md").read_text()
    assert str(smollm2_bf16) in card and str(perturbed) in card and "linear" in card
    # a plain HF checkpoint: loads with transformers alone and predicts like the parent
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    from compress.eval.perplexity import perplexity_report, score_windows
    from compress.eval.text import eval_windows, read_text

    windows = eval_windows(tok, read_text(shared_data() / "wikitext2_test_eval.txt"), seq_len=256, max_tokens=1024)
    ppl = perplexity_report("lin", score_windows(model, windows, 4), 256).perplexity
    assert 20 < ppl < 45, ppl  # the parent scores about 33 on the standard windows


def test_slerp_config_and_ties_flags(small_pair, tmp_path):
    smollm2_bf16, perturbed = small_pair
    probe = ["model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight"]
    cfg = tmp_path / "slerp.yaml"
    cfg.write_text(f"merge_method: slerp\nbase_model: {smollm2_bf16}\nmodels:\n  - model: {smollm2_bf16}\n"
                   f"  - model: {perturbed}\nparameters: {{t: 0.4}}\ndtype: float32\n")
    r = cli("merge", "slerp", "--config", cfg, "-o", tmp_path / "slerp", "--json")
    assert r.exit_code == 0, r.output
    a, b, m = tensors(smollm2_bf16, probe), tensors(perturbed, probe), tensors(tmp_path / "slerp", probe)
    for n in probe:
        torch.testing.assert_close(m[n], mg.slerp(0.4, a[n], b[n]), rtol=0, atol=0)
    with Checkpoint.open(tmp_path / "slerp") as c:
        assert c.info(probe[0]).dtype == "F32"
    r = cli("merge", "ties", perturbed, "--base", smollm2_bf16, "--density", "0.5", "--weights", "0.8",
            "-o", tmp_path / "ties", "--json")
    assert r.exit_code == 0, r.output
    m = tensors(tmp_path / "ties", probe)
    for n in probe:
        expect = mg.ties(a[n], [b[n]], [0.8], [0.5]).to(torch.bfloat16).float()
        assert torch.equal(m[n], expect), n
    # a command whose --config says another method is refused
    r = cli("merge", "linear", "--config", cfg, "-o", tmp_path / "x")
    assert r.exit_code == 2 and "merge_method 'slerp'" in r.output


def test_bad_inputs(smollm2_bf16, tinies, tmp_path):
    # shape mismatch
    r = cli("merge", "linear", tinies["a"], tinies["w"], "-o", tmp_path / "o")
    assert r.exit_code == 2 and "shape" in r.output and "same architecture" in r.output
    r = cli("merge", "linear", tinies["a"], tinies["c"], "-o", tmp_path / "o")
    assert r.exit_code == 2 and "missing" in r.output
    # quantized input
    config = json.loads((smollm2_bf16 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    q = link_copy(smollm2_bf16, tmp_path / "q", {"config.json": json.dumps(config)})
    r = cli("merge", "linear", smollm2_bf16, q, "-o", tmp_path / "o")
    assert r.exit_code == 2 and "quantized" in r.output
    # different tokenizer (one token renamed)
    tj = json.loads((smollm2_bf16 / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["zzzz_new"] = vocab.pop(next(iter(vocab)))
    t = link_copy(smollm2_bf16, tmp_path / "t", {"tokenizer.json": json.dumps(tj)})
    r = cli("merge", "slerp", smollm2_bf16, t, "--t", "0.5", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "different tokenizer" in r.output
    assert not (tmp_path / "o").exists()
    # existing output is refused and left alone; --overwrite replaces it
    (tmp_path / "exists").mkdir()
    (tmp_path / "exists" / "keep.txt").write_text("x")
    r = cli("merge", "linear", tinies["a"], tinies["b"], "-o", tmp_path / "exists", "--json")
    assert r.exit_code == 2 and "already exists" in r.output
    assert (tmp_path / "exists" / "keep.txt").read_text() == "x"
    r = cli("merge", "linear", tinies["a"], tinies["b"], "-o", tmp_path / "exists", "--overwrite")
    assert r.exit_code == 0 and not (tmp_path / "exists" / "keep.txt").exists()
    # missing flags / values
    r = cli("merge", "slerp", tinies["a"], tinies["b"], "-o", tmp_path / "o2")
    assert r.exit_code == 2 and "slerp needs parameters.t" in r.output
    r = cli("merge", "linear", tinies["a"], tinies["b"], "--weights", "1,x", "-o", tmp_path / "o2")
    assert r.exit_code == 2 and "comma-separated" in r.output


def test_tied_and_untied_parents(tinies, tmp_path):
    # a tied parent (no lm_head stored) merges with an untied one: the tied reference keeps no lm_head
    r = cli("merge", "linear", tinies["a"], tinies["u"], "-o", tmp_path / "m", "--json")
    assert r.exit_code == 0, r.output
    with Checkpoint.open(tmp_path / "m") as c:
        assert "lm_head.weight" not in c.tensors
    assert any("untied lm_head" in n for n in json.loads(r.stdout)["notes"])
    # the untied reference: its head merges with the tied parent's embedding
    r = cli("merge", "linear", tinies["u"], tinies["a"], "-o", tmp_path / "m2", "--json")
    assert r.exit_code == 0, r.output
    u, a = tensors(tinies["u"], ["lm_head.weight"]), tensors(tinies["a"], ["model.embed_tokens.weight"])
    m = tensors(tmp_path / "m2", ["lm_head.weight"])
    torch.testing.assert_close(m["lm_head.weight"], (u["lm_head.weight"] + a["model.embed_tokens.weight"]) / 2)


def test_padded_vocabulary(tinies, tmp_path):
    # the reference's padded rows (128..135) are kept; the shared rows are merged
    r = cli("merge", "linear", tinies["p"], tinies["a"], "-o", tmp_path / "m", "--json")
    assert r.exit_code == 0, r.output
    assert any("padded vocabularies" in n for n in json.loads(r.stdout)["notes"])
    e = "model.embed_tokens.weight"
    p, a, m = tensors(tinies["p"], [e])[e], tensors(tinies["a"], [e])[e], tensors(tmp_path / "m", [e])[e]
    assert m.shape == (136, 32)
    torch.testing.assert_close(m[:128], (p[:128] + a) / 2)
    assert torch.equal(m[128:], p[128:])


# -- weight VAE and latent merge on tiny synthetic models -----------------------------------------------
@pytest.fixture(scope="module")
def vae(tinies, tmp_path_factory):
    out = tmp_path_factory.mktemp("vae") / "vae"
    r = cli("merge", "train-vae", tinies["a"], tinies["b"], "-o", out, "--chunk-size", "256", "--tokens", "8",
            "--width", "16", "--layers", "1", "--heads", "2", "--code-dim", "8", "--steps", "12", "--neck-steps", "4",
            "--batch-size", "8", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["steps"] == 12 and res["train_chunks"] == res["total_chunks"] > 0
    doc = json.loads((out / "vae_config.json").read_text())
    assert doc["format"] == "lsmerge-vae" and doc["vae"]["chunk_size"] == 256
    return out


def test_latent_merge_same_architecture(tinies, vae, tmp_path):
    from transformers import AutoModelForCausalLM

    r = cli("merge", "latent", tinies["a"], tinies["b"], "-o", tmp_path / "l", "--vae", vae, "--t", "0.5", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["encoded_tensors"] == 4 * 7 + 1 and res["carried_tensors"] == 4 * 2 + 1  # + embedding / final norm
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "l")
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()
    # the corrected form is exact at the end points whatever the VAE's reconstruction error
    names = ["model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight", "model.norm.weight"]
    for t, parent in (("0", "a"), ("1", "b")):
        out = tmp_path / f"c{t}"
        r = cli("merge", "latent", tinies["a"], tinies["b"], "-o", out, "--vae", vae, "--t", t, "--corrected")
        assert r.exit_code == 0, r.output
        got, want = tensors(out, names), tensors(tinies[parent], names)
        for n in names:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6)
    # uncorrected t = 0 is the VAE's reconstruction of A (not A itself)
    r = cli("merge", "latent", tinies["a"], tinies["b"], "-o", tmp_path / "u0", "--vae", vae, "--t", "0")
    got = tensors(tmp_path / "u0", names[:1])[names[0]]
    assert not torch.allclose(got, tensors(tinies["a"], names[:1])[names[0]])


def test_latent_merge_different_depth_and_width(tinies, vae, tmp_path):
    from transformers import AutoModelForCausalLM

    r = cli("merge", "latent", tinies["a"], tinies["c"], "-o", tmp_path / "d", "--vae", vae, "--target", "B", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert sorted(map(int, res["layer_map"])) == [0, 1, 2] and len(set(res["layer_map"].values())) == 3
    assert json.loads((tmp_path / "d" / "config.json").read_text())["num_hidden_layers"] == 3
    AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    r = cli("merge", "latent", tinies["a"], tinies["c"], "-o", tmp_path / "dd", "--vae", vae, "--target", "B",
            "--align", "depth", "--json")
    assert json.loads(r.stdout)["layer_map"] == {"0": 0, "1": 2, "2": 3}
    r = cli("merge", "latent", tinies["w"], tinies["a"], "-o", tmp_path / "w", "--vae", vae, "--target", "B",
            "--corrected", "--json")
    assert r.exit_code == 0, r.output
    assert any("widths differ" in n for n in json.loads(r.stdout)["notes"])
    with Checkpoint.open(tmp_path / "w") as c:
        assert c.info("model.layers.0.mlp.up_proj.weight").shape == (64, 32)
    AutoModelForCausalLM.from_pretrained(tmp_path / "w")
    # bad inputs
    r = cli("merge", "latent", tinies["a"], tinies["b"], "-o", tmp_path / "x", "--vae", tmp_path / "novae")
    assert r.exit_code == 2 and "no such folder" in r.output
    r = cli("merge", "latent", tinies["a"], tinies["a"], "-o", tmp_path / "x", "--vae", vae)
    assert r.exit_code == 2 and "two different parents" in r.output
    shutil.copytree(vae, tmp_path / "badvae")
    (tmp_path / "badvae" / "vae_config.json").write_text("{}")
    r = cli("merge", "latent", tinies["a"], tinies["b"], "-o", tmp_path / "x", "--vae", tmp_path / "badvae")
    assert r.exit_code == 1 and "lsmerge-vae" in r.output
    assert not (tmp_path / "x").exists()
