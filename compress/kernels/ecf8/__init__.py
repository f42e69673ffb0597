"""ECF8 decode kernels: ``reference`` (torch), ``triton`` (GPU; CPU under TRITON_INTERPRET=1)
and ``cpu`` (numba, the fast path without a GPU). All take the same arguments:

    decode_slices(codes, sign_mantissa, slice_start, lut, *, numel, slice_size, lanes,
                  bits, mantissa_bits, raw_bits) -> value bits [numel]

``slice_start`` comes from :func:`slice_offsets`. Spec: ``docs/formats/ecf8.md``.
"""

from __future__ import annotations

import numpy as np


def slice_offsets(slice_bits: np.ndarray, lanes: int) -> np.ndarray:
    """Absolute start bit of every slice.

    Tiles start on byte boundaries; slices inside a tile follow each other bit by bit.

    Args:
        slice_bits: ``ndarray[n_tiles * lanes], uint16``: coded bits per slice.
        lanes: slices per tile (W).

    Returns:
        ``(slice_start ndarray[n_tiles * lanes] int64, total_bytes int)``: bit offsets and the
        byte length of the coded stream without padding.
    """
    sb = slice_bits.astype(np.int64).reshape(-1, lanes)  # [n_tiles, W]
    tile_bytes = (sb.sum(1) + 7) // 8  # [n_tiles]
    tile_start = np.cumsum(tile_bytes) - tile_bytes
    within = np.cumsum(sb, axis=1) - sb  # [n_tiles, W]
    return (tile_start[:, None] * 8 + within).reshape(-1), int(tile_bytes.sum())


def _int_dtype(bits: int):
    import torch

    return {8: torch.uint8, 16: torch.int16, 32: torch.int32}[bits]


def check_backend(backend: str, device: str | None = None) -> str:
    """Resolve ``backend`` for ``device`` without decoding anything.

    Returns:
        ``"cpu"``, ``"torch"`` or ``"triton"``.

    Raises:
        ConfigError: unknown backend. UnsupportedError: triton without a CUDA device (unless
        ``TRITON_INTERPRET=1``).
    """
    import os

    if backend == "auto":
        return "triton" if device is not None and str(device).startswith("cuda") else "cpu"
    if backend not in ("cpu", "torch", "triton"):
        from compress.errors import ConfigError

        raise ConfigError(f"unknown backend {backend!r} (auto, cpu, torch, triton)")
    if backend == "triton" and device is None and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            from compress.errors import UnsupportedError

            raise UnsupportedError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1 to run it on "
                                   "the CPU, slowly); use --backend cpu")
    return backend


def decode(ct, lut: np.ndarray, backend: str = "auto", device: str | None = None):
    """Decode a :class:`compress.formats.ecf8.CodedTensor` with the chosen backend.

    Returns an ndarray (``cpu``) or a Tensor (``torch``/``triton``) of value bits, shaped like
    the original tensor. Raises ConfigError on an unknown backend, UnsupportedError for triton
    without a CUDA device (unless TRITON_INTERPRET=1).
    """
    starts, _ = slice_offsets(ct.slice_bits, ct.lanes)
    layout = ct.layout  # mantissa_bits below: the mantissa bits left in the raw field
    kwargs = dict(numel=ct.numel, slice_size=ct.slice_size, lanes=ct.lanes, bits=layout.bits,
                  mantissa_bits=max(ct.raw_bits - 1, 0), raw_bits=ct.raw_bits)
    backend = check_backend(backend, device)
    if backend == "cpu":
        from compress.kernels.ecf8 import cpu

        return cpu.decode_slices(ct.codes, ct.sign_mantissa, starts, lut, **kwargs).reshape(ct.shape)
    import torch

    if backend == "triton" and device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1 (check_backend)
    dev = torch.device(device or "cpu")
    args = [torch.from_numpy(a).to(dev) for a in (ct.codes, ct.sign_mantissa, starts, lut)]
    if backend == "torch":
        from compress.kernels.ecf8 import reference

        return reference.decode_slices(*args, **kwargs).reshape(ct.shape)
    if backend == "triton":
        from compress.kernels.ecf8 import triton as tkernel

        return tkernel.decode_slices(*args, **kwargs).reshape(ct.shape)
    raise AssertionError(backend)  # check_backend admits nothing else
