"""Perplexity with confidence intervals, paired comparison of two models, greedy generation.

Perplexity is exp of the mean next-token negative log-likelihood (natural log) over
non-overlapping windows (:func:`compress.eval.text.eval_windows`); every window has the same
number of scored tokens, so the token mean equals the mean of the per-window means. The 95%
interval treats windows as the independent unit (arXiv 2510.08730: report intervals, and prefer
hundreds of samples for close comparisons): mean NLL ± 1.96·sd/√n, exponentiated. A comparison
of two models is paired window by window, which is far tighter than two separate intervals.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from pydantic import BaseModel

Z95 = 1.959963984540054


@dataclass
class WindowScores:
    """Per-window results of one model on a set of windows.

    Attributes:
        nll: (Tensor[n_windows], float64) mean NLL per scored token of each window, nats.
        top1: (Tensor[n_windows, seq_len-1], int32) the model's argmax next token at each scored position.
        seconds: wall time of the forward passes.
    """

    nll: "object"
    top1: "object"
    seconds: float

    @property
    def tokens(self) -> int:
        """Scored tokens (n_windows · (seq_len - 1))."""
        return int(self.top1.numel())


def score_windows(model, windows, batch_size: int = 4, progress: Optional[Callable[[int], None]] = None) -> WindowScores:
    """Run ``model`` over every window and keep each window's mean NLL and argmax tokens.

    Logits are upcast to float32 for the loss whatever the compute dtype.

    Args:
        model: a causal LM (transformers), on any device.
        windows: (Tensor[n_windows, seq_len], int64) token ids.
        batch_size: windows per forward pass.
        progress: called with the number of windows finished after each batch.

    Returns:
        :class:`WindowScores`.
    """
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    nll, top1 = [], []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, windows.shape[0], batch_size):
            ids = windows[i: i + batch_size].to(device)                     # [b, L]
            logits = model(input_ids=ids).logits[:, :-1].float()            # [b, L-1, V]
            target = ids[:, 1:]                                             # [b, L-1]
            loss = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # [b, L-1]
            nll.append(loss.double().mean(dim=1).cpu())
            top1.append(logits.argmax(dim=-1).to(torch.int32).cpu())
            if progress is not None:
                progress(ids.shape[0])
    return WindowScores(torch.cat(nll), torch.cat(top1), time.perf_counter() - start)


def mean_interval(values) -> tuple[float, float, float]:
    """Mean of per-window values and its 95% normal interval (mean, low, high); half-width 0 for one window."""
    n = int(values.numel())
    mean = float(values.mean())
    sd = float(values.std(unbiased=True)) if n > 1 else 0.0
    half = Z95 * sd / math.sqrt(n) if n > 1 else 0.0
    return mean, mean - half, mean + half


class PerplexityReport(BaseModel):
    """Perplexity of one model on one set of windows.

    ``perplexity``, ``ci_low``, ``ci_high``: exp of the mean NLL and of its 95% interval bounds.
    ``nll``: mean NLL per token in nats. ``tokens``: scored tokens (windows · (seq_len-1)).
    ``tokens_per_s``: scored tokens per second of forward passes.
    """

    model: str
    perplexity: float
    ci_low: float
    ci_high: float
    nll: float
    tokens: int
    windows: int
    seq_len: int
    seconds: float
    tokens_per_s: float
    size_bytes: Optional[int] = None
    bits: Optional[int] = None


def perplexity_report(name: str, scores: WindowScores, seq_len: int, size_bytes: int | None = None,
                      bits: int | None = None) -> PerplexityReport:
    """Summarize :class:`WindowScores` as a :class:`PerplexityReport`."""
    mean, lo, hi = mean_interval(scores.nll)
    return PerplexityReport(model=name, perplexity=math.exp(mean), ci_low=math.exp(lo), ci_high=math.exp(hi),
                            nll=mean, tokens=scores.tokens, windows=int(scores.nll.numel()), seq_len=seq_len,
                            seconds=scores.seconds, tokens_per_s=scores.tokens / max(scores.seconds, 1e-9),
                            size_bytes=size_bytes, bits=bits)


class CompareReport(BaseModel):
    """Paired comparison of a candidate with a base model on the same windows.

    ``ppl_increase``: relative perplexity change exp(mean(nll_cand - nll_base)) - 1 (0.02 = +2%),
    with its paired 95% interval ``ppl_increase_ci``. ``top1_agreement``: fraction of scored
    positions where both models' argmax next token is the same. ``passed``: ``ppl_increase`` is at
    most ``max_ppl_increase`` (always True when no threshold is set).
    """

    base: PerplexityReport
    candidate: PerplexityReport
    ppl_increase: float
    ppl_increase_ci: tuple[float, float]
    top1_agreement: float
    size_ratio: Optional[float] = None
    max_ppl_increase: Optional[float] = None
    passed: bool = True


def compare_scores(base: PerplexityReport, base_scores: WindowScores, cand: PerplexityReport, cand_scores: WindowScores,
                   max_ppl_increase: float | None = None) -> CompareReport:
    """Paired statistics of two models' :class:`WindowScores` on identical windows.

    Raises:
        ValueError: the two score sets are not on the same windows (different shapes).
    """
    if base_scores.top1.shape != cand_scores.top1.shape:
        raise ValueError(f"scores on different windows: {tuple(base_scores.top1.shape)} vs {tuple(cand_scores.top1.shape)}")
    diff = cand_scores.nll - base_scores.nll                                 # [n_windows]
    mean, lo, hi = mean_interval(diff)
    increase = math.expm1(mean)
    agreement = float((base_scores.top1 == cand_scores.top1).double().mean())
    ratio = cand.size_bytes / base.size_bytes if base.size_bytes and cand.size_bytes is not None else None
    passed = max_ppl_increase is None or increase <= max_ppl_increase
    return CompareReport(base=base, candidate=cand, ppl_increase=increase, ppl_increase_ci=(math.expm1(lo), math.expm1(hi)),
                         top1_agreement=agreement, size_ratio=ratio, max_ppl_increase=max_ppl_increase, passed=passed)


def greedy_generate(model, tokenizer, prompt: str, max_new_tokens: int = 32, chat: bool = False) -> str:
    """Greedy continuation of ``prompt`` (no sampling), decoded without special tokens.

    Args:
        chat: wrap the prompt as one user turn with the tokenizer's chat template.
    """
    import torch

    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat).to(next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def evaluate(source: str, *, text: str | None, tokens: int | None = 8192, seq_len: int = 512, batch_size: int = 4,
             bits: int | None = None, dtype: str | None = None, device: str = "cpu", revision: str | None = None,
             progress: Optional[Callable[[int], None]] = None) -> tuple[PerplexityReport, WindowScores]:
    """Load ``source`` and measure its perplexity on the first ``tokens`` tokens of ``text``.

    Args:
        source: any checkpoint :func:`compress.eval.model.load_causal_lm` loads.
        text: text file path, or None for WikiText-2 test through ``datasets`` (online only).
        tokens: tokens to evaluate (None: all of the text); windows are ``seq_len`` long.
        bits: precision of a multi-precision checkpoint.

    Returns:
        (:class:`PerplexityReport`, :class:`WindowScores`).

    Raises:
        ConfigError, UnsupportedError, FormatError: see the loaders.
    """
    from compress.eval.model import load_causal_lm
    from compress.eval.text import eval_windows, read_text

    body = read_text(text)
    loaded = load_causal_lm(source, revision=revision, dtype=dtype, device=device, bits=bits)
    windows = eval_windows(loaded.tokenizer, body, seq_len, tokens)
    scores = score_windows(loaded.model, windows, batch_size, progress)
    return perplexity_report(str(source), scores, seq_len, loaded.size_bytes, bits), scores


def compare(base: str, candidate: str, *, text: str | None, tokens: int | None = 8192, seq_len: int = 512,
            batch_size: int = 4, bits: int | None = None, max_ppl_increase: float | None = None,
            dtype: str | None = None, device: str = "cpu") -> CompareReport:
    """Perplexity of ``base`` and ``candidate`` on the same windows, paired; one model in memory at a time.

    Both models must share the tokenizer (the windows are tokenized once, by the base's).

    Args:
        bits: precision of the candidate when it is multi-precision.
        max_ppl_increase: relative threshold (0.02 = +2%); ``passed`` is False beyond it.

    Raises:
        ConfigError: the two tokenizers differ, or any loader error.
    """
    import gc

    from compress.errors import ConfigError
    from compress.eval.model import load_causal_lm
    from compress.eval.text import eval_windows, read_text

    body = read_text(text)
    reports = []
    windows = vocab = None
    for source, b in ((base, None), (candidate, bits)):
        loaded = load_causal_lm(source, dtype=dtype, device=device, bits=b)
        if windows is None:
            windows, vocab = eval_windows(loaded.tokenizer, body, seq_len, tokens), loaded.tokenizer.get_vocab()
        elif loaded.tokenizer.get_vocab() != vocab:
            raise ConfigError(f"{candidate}: its tokenizer differs from {base}'s; perplexities on different tokens "
                              "cannot be paired")
        scores = score_windows(loaded.model, windows, batch_size)
        reports.append((perplexity_report(str(source), scores, seq_len, loaded.size_bytes, b), scores))
        del loaded
        gc.collect()
    (rb, sb), (rc, sc) = reports
    return compare_scores(rb, sb, rc, sc, max_ppl_increase)
