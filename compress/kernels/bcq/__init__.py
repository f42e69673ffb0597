"""BCQ bit-plane matmul kernels: ``reference`` (torch), ``triton`` (GPU; CPU under TRITON_INTERPRET=1).

Both implement ``bcq_linear(x, qweight, alpha, beta, *, group_size, in_features, plane_offset=0,
bias=None) -> y``. :func:`bcq_linear` dispatches at call time; importing this package never imports
triton. Layout: docs/formats/anybcq.md.
"""

from __future__ import annotations

import os

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device) -> str:
    """``"torch"`` or ``"triton"`` for ``backend`` on ``device``.

    ``auto``: triton on CUDA, torch elsewhere. Raises ConfigError on an unknown name and
    UnsupportedError for triton without CUDA (unless ``TRITON_INTERPRET=1``).
    """
    from compress.errors import ConfigError, UnsupportedError

    if backend not in BACKENDS:
        raise ConfigError(f"unknown BCQ backend {backend!r} (auto, torch, triton)")
    cuda = str(device).startswith("cuda")
    if backend == "auto":
        return "triton" if cuda else "torch"
    if backend == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise UnsupportedError("the triton BCQ kernel needs a CUDA device (or TRITON_INTERPRET=1 on the CPU); use torch")
    return backend


def bcq_linear(x, qweight, alpha, beta, *, group_size: int, in_features: int, plane_offset: int = 0, bias=None,
               backend: str = "auto"):
    """``y = x @ W_p^T + bias`` from packed bit-planes; see ``reference.bcq_linear`` for shapes."""
    which = resolve_backend(backend, x.device)
    if which == "triton":
        from compress.kernels.bcq import triton as impl
    else:
        from compress.kernels.bcq import reference as impl
    return impl.bcq_linear(x, qweight, alpha, beta, group_size=group_size, in_features=in_features,
                           plane_offset=plane_offset, bias=bias)
