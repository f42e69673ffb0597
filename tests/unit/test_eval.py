"""The evaluation harness's statistics and text windows, on hand-made numbers and a real tokenizer."""

import math

import pytest
import torch

from compress.errors import ConfigError
from compress.eval.perplexity import WindowScores, compare_scores, mean_interval, perplexity_report
from compress.eval.text import calibration_batches, eval_windows, read_text


def test_mean_interval_matches_normal_formula():
    v = torch.tensor([1.0, 2.0, 4.0, 7.0], dtype=torch.float64)
    mean, lo, hi = mean_interval(v)
    sd = math.sqrt(sum((x - 3.5) ** 2 for x in [1, 2, 4, 7]) / 3)
    assert mean == 3.5
    assert hi - mean == pytest.approx(1.959963984540054 * sd / 2, rel=1e-12)
    assert mean - lo == pytest.approx(hi - mean, rel=1e-12)
    assert mean_interval(torch.tensor([2.0], dtype=torch.float64)) == (2.0, 2.0, 2.0)


def _scores(nll, top1):
    return WindowScores(torch.tensor(nll, dtype=torch.float64), torch.tensor(top1, dtype=torch.int32), 1.0)


def test_report_and_paired_compare():
    base = _scores([2.0, 3.0], [[1, 2, 3], [4, 5, 6]])
    cand = _scores([2.1, 3.1], [[1, 2, 0], [4, 0, 6]])
    rb, rc = perplexity_report("b", base, 4, 100), perplexity_report("c", cand, 4, 50)
    assert rb.perplexity == pytest.approx(math.exp(2.5)) and rb.tokens == 6 and rb.windows == 2
    r = compare_scores(rb, base, rc, cand, max_ppl_increase=0.2)
    assert r.ppl_increase == pytest.approx(math.expm1(0.1))
    assert r.ppl_increase_ci[0] == pytest.approx(r.ppl_increase) == pytest.approx(r.ppl_increase_ci[1])  # constant diff
    assert r.top1_agreement == pytest.approx(4 / 6) and r.size_ratio == 0.5 and r.passed
    assert not compare_scores(rb, base, rc, cand, max_ppl_increase=0.1).passed
    with pytest.raises(ValueError):
        compare_scores(rb, base, rc, _scores([1.0], [[1, 2, 3]]))


@pytest.fixture(scope="module")
def tokenizer(smollm2_bf16):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_bf16)


def test_windows_are_deterministic_and_non_overlapping(tokenizer):
    text = "The quick brown fox jumps over the lazy dog.\n" * 200
    w = eval_windows(tokenizer, text, seq_len=64, max_tokens=640)
    assert w.shape == (10, 64) and w.dtype == torch.long
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert w.flatten().tolist() == ids[:640]
    assert torch.equal(w, eval_windows(tokenizer, text, seq_len=64, max_tokens=640))
    c1, c2 = calibration_batches(tokenizer, text, 8, 32, seed=1), calibration_batches(tokenizer, text, 8, 32, seed=1)
    assert c1.shape == (8, 32) and torch.equal(c1, c2)
    assert not torch.equal(c1, calibration_batches(tokenizer, text, 8, 32, seed=2))


def test_bad_text_and_sizes(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="no such text file"):
        read_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        read_text(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_text(tmp_path / "bin.txt")
    with pytest.raises(ConfigError, match="fewer than one window"):
        eval_windows(tokenizer, "short text", seq_len=64, max_tokens=None)
    with pytest.raises(ConfigError, match="at least 2"):
        eval_windows(tokenizer, "short text", seq_len=1)
    with pytest.raises(ConfigError, match="fewer than --seq-len"):
        calibration_batches(tokenizer, "short text", 4, 64)


def test_eval_dtype_names():
    import torch

    from compress.eval.model import eval_dtype

    assert eval_dtype(None, "cpu") is torch.float32 and eval_dtype(None, "cuda") == "auto"
    assert eval_dtype("float32", "cpu") is torch.float32 and eval_dtype("bf16", "cpu") is torch.bfloat16
    with pytest.raises(ConfigError, match="--dtype int8"):
        eval_dtype("int8", "cpu")
