"""Real text as token windows: evaluation windows and calibration batches shared by every method.

The project never ships or reads a dataset at run time: commands take a text file
(``--text``, ``--calib``, ``--data``), or fetch WikiText-2 through ``datasets`` when online.
"""

from __future__ import annotations

import os
from pathlib import Path

from compress.errors import ConfigError

WIKITEXT = "wikitext2"


def read_text(source: str | os.PathLike | None, split: str = "test") -> str:
    """The text of a UTF-8 file, or WikiText-2 (raw) through ``datasets`` when ``source`` is None or "wikitext2".

    Args:
        source: path of a UTF-8 text file, ``"wikitext2"``, or None (same as ``"wikitext2"``).
        split: the WikiText-2 split when it is fetched.

    Returns:
        The text (str).

    Raises:
        ConfigError: the file is missing, empty or not UTF-8; or WikiText-2 cannot be fetched.
    """
    if source is None or str(source) == WIKITEXT:
        try:
            import datasets  # optional: only this online path needs it

            rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
        except Exception as e:
            raise ConfigError(f"cannot fetch WikiText-2 ({type(e).__name__}); pass a text file with --text") from None
        return "".join(rows)
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"{path}: no such text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); pass a UTF-8 text file") from None
    if not text.strip():
        raise ConfigError(f"{path}: the text file is empty")
    return text


def tokenize(tokenizer, text: str, max_tokens: int | None = None):
    """Token ids of ``text``, without special tokens (BOS is added per window by the caller if wanted).

    Returns:
        ids (Tensor[n], int64), at most ``max_tokens`` long.
    """
    import torch
    from transformers.utils import logging as hf_logging

    # Tokenize in pieces so a multi-MB file never builds one huge string batch; pieces end at line breaks.
    ids: list[int] = []
    start, piece = 0, 200_000
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # no "longer than the maximum sequence length" warning: windows are cut below
    while start < len(text) and (max_tokens is None or len(ids) < max_tokens):
        end = min(len(text), start + piece)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        ids.extend(tokenizer(text[start:end], add_special_tokens=False)["input_ids"])
        start = end
    hf_logging.set_verbosity(verbosity)
    out = torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)
    return out


def eval_windows(tokenizer, text: str, seq_len: int = 512, max_tokens: int | None = 8192):
    """Non-overlapping evaluation windows from the start of ``text``.

    Every window is a fresh context of ``seq_len`` tokens; the first token of each window is
    context only, so a window scores ``seq_len - 1`` tokens. Same text, tokenizer, ``seq_len`` and
    ``max_tokens`` give the same windows, so two models are compared on identical tokens.

    Args:
        tokenizer: a transformers tokenizer.
        text: the evaluation text.
        seq_len: tokens per window (>= 2).
        max_tokens: stop after this many tokens (None: the whole text).

    Returns:
        windows (Tensor[n_windows, seq_len], int64).

    Raises:
        ConfigError: ``seq_len`` < 2 or the text is shorter than one window.
    """
    if seq_len < 2:
        raise ConfigError(f"--seq-len {seq_len}: a window needs at least 2 tokens")
    if max_tokens is not None and max_tokens < seq_len:
        raise ConfigError(f"--tokens {max_tokens} is less than one window (--seq-len {seq_len})")
    ids = tokenize(tokenizer, text, max_tokens)
    n = ids.numel() // seq_len
    if n == 0:
        raise ConfigError(f"the text has {ids.numel()} tokens, fewer than one window of {seq_len}; "
                          "use a longer text or a smaller --seq-len")
    return ids[: n * seq_len].view(n, seq_len)


def calibration_batches(tokenizer, text: str, samples: int = 128, seq_len: int = 256, seed: int = 0):
    """Calibration set: ``samples`` windows of ``seq_len`` tokens drawn at random offsets of the text.

    Args:
        tokenizer: a transformers tokenizer.
        text: the calibration text (never the evaluation text).
        samples: number of windows (>= 1).
        seq_len: tokens per window (>= 2).
        seed: seed of the offsets; the same seed gives the same set.

    Returns:
        input_ids (Tensor[samples, seq_len], int64).

    Raises:
        ConfigError: bad sizes, or a text shorter than one window.
    """
    import torch

    if samples < 1 or seq_len < 2:
        raise ConfigError(f"calibration set: --samples {samples} and --seq-len {seq_len} must be >= 1 and >= 2")
    ids = tokenize(tokenizer, text)
    if ids.numel() < seq_len:
        raise ConfigError(f"calibration text has {ids.numel()} tokens, fewer than --seq-len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (samples,), generator=gen)
    return torch.stack([ids[s: s + seq_len] for s in starts.tolist()])
