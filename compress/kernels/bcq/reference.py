"""Binary-coded quantization (BCQ) kernels, torch reference: pack/unpack bit-planes, dequantize, matmul.

Written to be read; ``triton.py`` has the same ``bcq_linear`` signature. Layout (docs/formats/anybcq.md):

- ``qweight`` (Tensor[n_words, n_planes, out], int32): bit ``t`` of ``qweight[k, i, n]`` is plane ``i``'s
  code of weight ``(n, 32k + t)``; 1 means +1, 0 means -1. Columns past ``in_features`` are padding (0).
- ``alpha`` (Tensor[n_groups, p, out], float): the scales of a ``p``-bit precision, plane ``i`` of group ``g``.
- ``beta`` (Tensor[n_groups, out], float) or None: the per-group offset (asymmetric BCQ).

A ``p``-bit weight is ``W[n, k] = beta[g, n] + sum_{i<p} alpha[g, i, n] * b[off + i, n, k]`` with
``g = k // group_size`` (AnyBCQ, arXiv 2510.10467).
"""

from __future__ import annotations

import torch

WORD = 32


def padded_in(in_features: int, group_size: int) -> int:
    """Columns after padding: ``in_features`` rounded up to a whole group (group_size is a multiple of 32)."""
    return -(-in_features // group_size) * group_size


def pack_planes(codes: torch.Tensor) -> torch.Tensor:
    """Pack sign codes into int32 words.

    Args:
        codes (Tensor[n_planes, out, in_pad], bool): True for +1; ``in_pad`` a multiple of 32.

    Returns:
        qweight (Tensor[in_pad/32, n_planes, out], int32).
    """
    planes, out, in_pad = codes.shape
    if in_pad % WORD:
        raise ValueError(f"pack_planes: {in_pad} columns is not a multiple of {WORD}")
    bits = codes.reshape(planes, out, in_pad // WORD, WORD).to(torch.int64)  # [P, out, W, 32]
    shifts = torch.arange(WORD, dtype=torch.int64)
    words = (bits << shifts).sum(-1)  # [P, out, W] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.permute(2, 0, 1).contiguous()  # [W, P, out]


def unpack_planes(qweight: torch.Tensor, plane_offset: int = 0, bits: int | None = None) -> torch.Tensor:
    """Unpack planes ``plane_offset .. plane_offset+bits-1`` to signs.

    Args:
        qweight (Tensor[n_words, n_planes, out], int32).

    Returns:
        signs (Tensor[bits, out, n_words*32], float32): +1 / -1.
    """
    n_words, n_planes, out = qweight.shape
    bits = n_planes - plane_offset if bits is None else bits
    words = qweight[:, plane_offset:plane_offset + bits, :]  # [W, p, out]
    shifts = torch.arange(WORD, dtype=torch.int32, device=qweight.device)
    b = (words.unsqueeze(-1) >> shifts) & 1  # [W, p, out, 32]
    b = b.permute(1, 2, 0, 3).reshape(bits, out, n_words * WORD)  # [p, out, in_pad]
    return b.to(torch.float32) * 2 - 1


def dequantize(qweight: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None, *, group_size: int,
               in_features: int, plane_offset: int = 0) -> torch.Tensor:
    """The dense weight of one precision (``p = alpha.shape[1]`` bits).

    Args:
        qweight (Tensor[n_words, n_planes, out], int32); alpha (Tensor[n_groups, p, out], float);
        beta (Tensor[n_groups, out], float) or None; group_size: columns per scale group (multiple of 32);
        in_features: columns before padding; plane_offset: first plane of this precision.

    Returns:
        weight (Tensor[out, in_features], float32).
    """
    n_groups, p, out = alpha.shape
    signs = unpack_planes(qweight, plane_offset, p)  # [p, out, in_pad]
    signs = signs[:, :, : n_groups * group_size].reshape(p, out, n_groups, group_size)
    a = alpha.to(torch.float32).permute(1, 2, 0).unsqueeze(-1)  # [p, out, G, 1]
    w = (signs * a).sum(0)  # [out, G, g]
    if beta is not None:
        w = w + beta.to(torch.float32).t().unsqueeze(-1)  # [out, G, 1]
    return w.reshape(out, n_groups * group_size)[:, :in_features]


def bcq_linear(x: torch.Tensor, qweight: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None, *,
               group_size: int, in_features: int, plane_offset: int = 0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W_p^T + bias`` for the ``p``-bit weight (``p = alpha.shape[1]``), reading only its planes.

    Args:
        x (Tensor[..., in_features], float): activations.
        qweight, alpha, beta, group_size, in_features, plane_offset: see :func:`dequantize`.
        bias (Tensor[out], float) or None.

    Returns:
        y (Tensor[..., out], x.dtype), computed in float32.
    """
    w = dequantize(qweight, alpha, beta, group_size=group_size, in_features=in_features, plane_offset=plane_offset)
    y = x.to(torch.float32) @ w.t()  # [..., out]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)
