"""`compress eval` end to end on real SmolLM2: perplexity bounds, the compare gate, generation, bad input."""

import json

import pytest

from conftest import EVAL, SHARED, cli

pytestmark = pytest.mark.integration
WINDOWS = ["--text", EVAL, "--tokens", 1024, "--seq-len", 256]  # 4 windows, 1020 scored tokens


@pytest.fixture(scope="module")
def smollm2_noisy(smollm2_bf16, tmp_path_factory):
    """SmolLM2 with Gaussian noise (2% of each weight's std) on every decoder linear: a lossy candidate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.checkpoint import save_model

    model = AutoModelForCausalLM.from_pretrained(smollm2_bf16, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.ndim == 2:
                p.add_((torch.randn(p.shape, generator=gen) * p.float().std() * 0.02).to(p.dtype))
    out = tmp_path_factory.mktemp("noisy") / "model"
    return save_model(model, out, tokenizer=AutoTokenizer.from_pretrained(smollm2_bf16))


def test_perplexity_on_real_text(smollm2_bf16):
    r = cli("eval", "perplexity", smollm2_bf16, *WINDOWS, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["tokens"] == 4 * 255 and rep["windows"] == 4 and rep["seq_len"] == 256
    assert 20 < rep["perplexity"] < 60, rep  # measured 36.0 (SmolLM2-135M bf16, fp32 compute)
    assert rep["ci_low"] < rep["perplexity"] < rep["ci_high"]
    assert rep["tokens_per_s"] > 0 and rep["size_bytes"] > 200e6


def test_compare_is_exact_for_lossless_and_gates_lossy(smollm2_bf16, smollm2_noisy, tmp_path):
    enc = tmp_path / "enc"
    assert cli("encode", "ecf8", smollm2_bf16, "-o", enc, "--quiet").exit_code == 0
    r = cli("eval", "compare", smollm2_bf16, enc, *WINDOWS, "--max-ppl-increase", 0, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["ppl_increase"] == 0.0 and rep["top1_agreement"] == 1.0 and rep["passed"]
    assert 0.6 < rep["size_ratio"] < 0.7  # ECF8 on bf16
    r = cli("eval", "compare", smollm2_bf16, smollm2_noisy, *WINDOWS, "--json")
    assert r.exit_code == 0, r.output
    noisy = json.loads(r.stdout)
    assert 0 < noisy["ppl_increase"] < 0.2 and 0.8 < noisy["top1_agreement"] < 1.0, noisy
    lo, hi = noisy["ppl_increase_ci"]
    assert lo < noisy["ppl_increase"] < hi
    r = cli("eval", "compare", smollm2_bf16, smollm2_noisy, *WINDOWS, "--max-ppl-increase", noisy["ppl_increase"] / 2)
    assert r.exit_code == 3, r.output
    assert "more than --max-ppl-increase" in r.output
    r = cli("eval", "compare", smollm2_bf16, smollm2_noisy, *WINDOWS, "--max-ppl-increase", noisy["ppl_increase"] * 2)
    assert r.exit_code == 0, r.output


def test_generate_greedy(smollm2_bf16):
    r = cli("eval", "generate", smollm2_bf16, "-p", "The capital of France is", "--max-new-tokens", 6, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)["generations"][0]["completion"]
    assert "Paris" in out, out


@pytest.mark.parametrize("args,code,message", [
    (["perplexity", "{m}", "--text", "/nonexistent.txt"], 2, "no such text file"),
    (["perplexity", "{m}", "--text", EVAL, "--bits", 3], 2, "no multi-precision layers"),
    (["perplexity", "/nonexistent-model", "--text", EVAL], 2, "no such file or folder"),
    (["perplexity", "{minilm}", "--text", EVAL], 2, "not a causal language model"),
    (["perplexity", "{m}", "--text", EVAL, "--tokens", 100, "--seq-len", 512], 2, "less than one window"),
    (["compare", "{m}", "{minilm}", "--text", EVAL], 2, "not a causal language model"),
])
def test_bad_input(args, code, message, smollm2_bf16, minilm_fp32):
    args = [str(a).format(m=smollm2_bf16, minilm=minilm_fp32) for a in args]
    r = cli("eval", *args)
    assert r.exit_code == code, r.output
    assert message in r.output and "Traceback" not in r.output


def test_recipe_prune_then_anybcq_on_smollm2(smollm2_bf16, tmp_path):
    """A pruned SmolLM2 chained into AnyBCQ by one recipe; the result evaluates at every stored precision."""
    calib = SHARED / "data" / "wikitext2_test_calib.txt"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"steps:\n  - prune: {{method: cosine, remove: 3, text: '{calib}', samples: 2, seq_len: 64}}\n"
                      "  - anybcq: {bits: [2, 4], group_size: 128, iters: 0, method: rtn}\n")
    out = tmp_path / "out"
    r = cli("run", recipe, smollm2_bf16, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    assert [s["name"] for s in json.loads(r.stdout)["steps"]] == ["prune", "anybcq"]
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 27 and config["quantization_config"]["quant_method"] == "anybcq"
    ppl = {}
    for bits in (2, 4):
        r = cli("eval", "perplexity", out, *WINDOWS, "--bits", bits, "--json")
        assert r.exit_code == 0, r.output
        ppl[bits] = json.loads(r.stdout)["perplexity"]
    assert ppl[4] < ppl[2] and ppl[4] < 200, ppl
