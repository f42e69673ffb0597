"""The ``anybcq`` on-disk format and its runtime: multi-precision binary-coded linears (spec: docs/formats/anybcq.md).

A quantized linear ``P.weight`` (``P`` its module path) is stored as
``P.qweight`` (int32 [ceil(in_pad/32), n_planes, out]), ``P.alpha_{p}`` (F16 [n_groups, p, out]) for each
stored precision ``p`` and, for asymmetric fits, ``P.beta_{p}`` (F16 [n_groups, out]); ``P.bias`` stays
as stored. :class:`AnyBCQLinear` runs at any stored precision, switched at call time with
``set_precision(bits)``; it imports no calibration code. ``register_transformers`` plugs the format
into transformers' quantizer registry (called by ``compress.formats.hf``), so ``compress.load(dir)``
and ``AutoModelForCausalLM.from_pretrained(dir)`` after ``import compress`` both build the model.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from compress.errors import FormatError

FORMAT_NAME = "anybcq"
FORMAT_VERSION = 1
WORD = 32


def _padded_in(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


def bytes_for_precision(out: int, in_features: int, group_size: int, bits: int, asymmetric: bool) -> int:
    """Bytes a ``bits``-bit matmul reads for one ``[out, in_features]`` weight: ``bits`` packed planes,
    ``bits`` F16 scales per group, plus one F16 offset per group when asymmetric."""
    ip = _padded_in(in_features, group_size)
    groups = ip // group_size
    return bits * out * ip // 8 + 2 * groups * out * (bits + (1 if asymmetric else 0))


def quantization_config(bits, group_size: int, method: str, asymmetric: bool, modules: dict[str, tuple[int, int]],
                        recipe: dict | None = None) -> dict[str, Any]:
    """The ``quantization_config`` block of ``config.json`` (docs/formats/anybcq.md).

    Args:
        bits: stored precisions; group_size; method: ``anybcq`` or ``rtn``; asymmetric: beta stored.
        modules: quantized module name -> (out_features, in_features).
        recipe: the resolved transform settings, recorded as-is.
    """
    bits = sorted(bits)
    if method == "rtn":
        offsets, off = {}, 0
        for p in bits:
            offsets[str(p)] = off
            off += p
    else:
        offsets, off = {str(p): 0 for p in bits}, max(bits)
    return {"quant_method": FORMAT_NAME, "format_version": FORMAT_VERSION, "bits": bits, "default_bits": max(bits),
            "group_size": group_size, "method": method, "asymmetric": asymmetric, "num_planes": off,
            "plane_offsets": offsets, "modules": {m: list(s) for m, s in sorted(modules.items())},
            "recipe": recipe or {}}


def tensors_for(module_path: str, qw) -> dict[str, tuple[str, tuple[int, ...], Any]]:
    """The stored tensors of one quantized weight, name -> (dtype, shape, little-endian ndarray).

    Args:
        module_path: the module's path in the checkpoint (the ``.weight`` name without ``.weight``).
        qw: :class:`compress.transforms.anybcq.QuantizedWeight` (codes, per-precision alpha/beta).
    """
    from compress.kernels.bcq.reference import pack_planes

    q = pack_planes(qw.codes)  # [W, P, out] int32
    out = {f"{module_path}.qweight": ("I32", tuple(q.shape), q.numpy())}
    for p, a in sorted(qw.alpha.items()):
        a16 = a.to(torch.float16).contiguous()  # [G, p, out]
        out[f"{module_path}.alpha_{p}"] = ("F16", tuple(a16.shape), a16.view(torch.int16).numpy())
    for p, b in sorted((qw.beta or {}).items()):
        b16 = b.to(torch.float16).contiguous()  # [G, out]
        out[f"{module_path}.beta_{p}"] = ("F16", tuple(b16.shape), b16.view(torch.int16).numpy())
    return out


class AnyBCQLinear(torch.nn.Module):
    """A linear layer stored as BCQ bit-planes; runs at any stored precision (AnyBCQ, arXiv 2510.10467).

    Buffers (names as in the file): ``qweight`` (Tensor[n_words, n_planes, out], int32), ``alpha_{p}``
    (Tensor[n_groups, p, out]), ``beta_{p}`` (Tensor[n_groups, out]) when asymmetric, ``bias`` (Tensor[out]).

    On the CPU (backend ``auto``/``torch``) the weight of the current precision is dequantized once,
    on first use after a precision switch, and cached in float32; on CUDA the Triton kernel reads
    only the planes of the current precision from the packed words for every call (batch <= 16
    tokens) and a cached dense weight otherwise.

    Args:
        in_features, out_features: the original shape. bits: stored precisions. group_size.
        plane_offsets: precision -> first plane. num_planes: planes stored. asymmetric: beta stored.
        bias: whether the layer has a bias. dtype: dtype of the scale buffers.
    """

    def __init__(self, in_features: int, out_features: int, *, bits, group_size: int, plane_offsets: dict[int, int],
                 num_planes: int, asymmetric: bool, bias: bool, dtype=torch.float16, backend: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits = tuple(sorted(bits))
        self.group_size = group_size
        self.plane_offsets = {int(k): int(v) for k, v in plane_offsets.items()}
        self.asymmetric = asymmetric
        self.backend = backend
        groups = _padded_in(in_features, group_size) // group_size
        words = _padded_in(in_features, group_size) // WORD
        self.register_buffer("qweight", torch.zeros(words, num_planes, out_features, dtype=torch.int32))
        for p in self.bits:
            self.register_buffer(f"alpha_{p}", torch.zeros(groups, p, out_features, dtype=dtype))
            if asymmetric:
                self.register_buffer(f"beta_{p}", torch.zeros(groups, out_features, dtype=dtype))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)
        self.precision = max(self.bits)
        self._cache: tuple[int, Any] | None = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={list(self.bits)}, "
                f"precision={self.precision}, group_size={self.group_size}")

    def set_precision(self, bits: int) -> None:
        """Use ``bits`` for the following calls. Raises ConfigError if ``bits`` is not stored."""
        if bits not in self.bits:
            from compress.errors import ConfigError

            raise ConfigError(f"--bits {bits}: this AnyBCQ checkpoint stores precisions {list(self.bits)}")
        if bits != self.precision:
            self._cache = None
        self.precision = bits

    def _parts(self, bits: int):
        return (getattr(self, f"alpha_{bits}"), getattr(self, f"beta_{bits}") if self.asymmetric else None,
                self.plane_offsets[bits])

    def dequantize(self, bits: int | None = None) -> torch.Tensor:
        """The dense weight (Tensor[out, in], float32) at ``bits`` (default: the current precision)."""
        from compress.kernels.bcq.reference import dequantize

        alpha, beta, off = self._parts(bits or self.precision)
        return dequantize(self.qweight, alpha, beta, group_size=self.group_size, in_features=self.in_features,
                          plane_offset=off)

    def _apply(self, fn, *args, **kwargs):
        self._cache = None  # device/dtype moves invalidate the dense cache
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (Tensor[..., in_features]) -> Tensor[..., out_features], x.dtype (float32 accumulation)."""
        from compress.kernels.bcq import resolve_backend

        backend = resolve_backend(self.backend, x.device)
        tokens = x.numel() // max(self.in_features, 1)
        if backend == "triton" and (tokens <= 16 or self.backend == "triton"):
            from compress.kernels.bcq import triton as tk

            alpha, beta, off = self._parts(self.precision)
            return tk.bcq_linear(x, self.qweight, alpha, beta, group_size=self.group_size, in_features=self.in_features,
                                 plane_offset=off, bias=self.bias)
        if self._cache is None or self._cache[0] != self.precision:
            self._cache = (self.precision, self.dequantize().to(x.device).contiguous())
        w = self._cache[1]
        y = torch.nn.functional.linear(x.to(w.dtype), w, None if self.bias is None else self.bias.to(w.dtype))
        return y.to(x.dtype)


def _model_set_precision(model, bits: int) -> int:
    """``model.set_precision(bits)``: switch every AnyBCQ layer. Returns the number switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, AnyBCQLinear):
            m.set_precision(bits)
            n += 1
    return n


def check_config(qcfg: dict) -> None:
    """Raise FormatError if ``quantization_config`` is not a readable anybcq block."""
    version = qcfg.get("format_version")
    if version != FORMAT_VERSION:
        raise FormatError(f"anybcq format_version {version!r} is not supported (this version reads {FORMAT_VERSION})")
    for key in ("bits", "group_size", "num_planes", "plane_offsets", "modules"):
        if key not in qcfg:
            raise FormatError(f"anybcq quantization_config lacks {key!r} (docs/formats/anybcq.md)")
    if qcfg["group_size"] % WORD or qcfg["group_size"] <= 0:
        raise FormatError(f"anybcq group_size {qcfg['group_size']} is not a positive multiple of 32")
    for p in qcfg["bits"]:
        off = qcfg["plane_offsets"].get(str(p))
        if off is None or off < 0 or off + p > qcfg["num_planes"]:
            raise FormatError(f"anybcq precision {p}: plane offset {off} outside the {qcfg['num_planes']} stored planes")


def replace_linears(model, qcfg: dict, dtype=torch.float16) -> int:
    """Swap every module listed in ``qcfg["modules"]`` for an :class:`AnyBCQLinear` (before loading weights).

    Returns:
        The number of modules replaced.

    Raises:
        FormatError: a listed module is missing from the model or has another shape.
    """
    check_config(qcfg)
    bits = [int(b) for b in qcfg["bits"]]
    offsets = {int(k): int(v) for k, v in qcfg["plane_offsets"].items()}
    n = 0
    for name, (out, inf) in qcfg["modules"].items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise FormatError(f"anybcq module {name!r} is not in {type(model).__name__}; load it with the model "
                              "class it was saved from") from None
        if (getattr(old, "out_features", None), getattr(old, "in_features", None)) != (out, inf):
            raise FormatError(f"anybcq module {name!r}: stored [{out}, {inf}], model has "
                              f"[{getattr(old, 'out_features', '?')}, {getattr(old, 'in_features', '?')}]")
        new = AnyBCQLinear(inf, out, bits=bits, group_size=int(qcfg["group_size"]), plane_offsets=offsets,
                           num_planes=int(qcfg["num_planes"]), asymmetric=bool(qcfg.get("asymmetric")),
                           bias=getattr(old, "bias", None) is not None, dtype=dtype)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        n += 1
    model.set_precision = types.MethodType(_model_set_precision, model)
    return n


def register_transformers() -> None:
    """Register the ``anybcq`` quantization config and quantizer with transformers (idempotent per process;
    called from ``compress.formats.hf``)."""
    from transformers.quantizers.auto import register_quantization_config, register_quantizer
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    @register_quantization_config(FORMAT_NAME)
    class AnyBCQQuantizationConfig(QuantizationConfigMixin):
        """``quantization_config`` of an anybcq checkpoint (docs/formats/anybcq.md)."""

        def __init__(self, **kwargs):
            self.quant_method = FORMAT_NAME
            self.raw = dict(kwargs, quant_method=FORMAT_NAME)
            for k, v in kwargs.items():
                setattr(self, k, v)

        def to_dict(self):
            return dict(self.raw)

    @register_quantizer(FORMAT_NAME)
    class AnyBCQHfQuantizer(HfQuantizer):
        """Builds AnyBCQ linears in place of the stored modules; transformers then loads their buffers."""

        requires_calibration = True

        def validate_environment(self, *args, **kwargs):
            return None

        def _process_model_before_weight_loading(self, model, **kwargs):
            replace_linears(model, self.quantization_config.raw)

        def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
            return False

        def _process_model_after_weight_loading(self, model, **kwargs):
            if not hasattr(model, "set_precision"):
                model.set_precision = types.MethodType(_model_set_precision, model)
            return model

        def is_serializable(self, *args, **kwargs):
            return False

        @property
        def is_trainable(self):
            return False
