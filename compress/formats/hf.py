"""transformers integration: a quantizer per compress format, and :func:`load`.

``import compress`` installs an import hook; the quantizer is registered with transformers the
moment ``transformers.quantizers.auto`` is imported (or at once if it already is), so
``import compress`` stays fast and ``AutoModel*.from_pretrained(encoded_dir)`` works after it.
Without ``import compress``, transformers warns "unknown quantization type ecf8" and then fails:
each coded tensor's name holds an empty placeholder, a size mismatch it refuses, so it never
loads random weights in their place.

Loading never silently keeps a random weight: every coded tensor is decoded (checksum
checked) and copied into the model after transformers' own loading; a tensor that has no
place in the model raises FormatError.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_TARGET = "transformers.quantizers.auto"
_registered = False
_CODED_PART = r"_ecf8_(codes|sign_mantissa|codebook|slice_bits)$"


def _register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from transformers.quantizers.auto import register_quantization_config, register_quantizer
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from compress.formats.ecf8 import FORMAT_NAME

    @register_quantization_config(FORMAT_NAME)
    class ECF8QuantizationConfig(QuantizationConfigMixin):
        """``quantization_config`` of an ecf8 checkpoint (docs/formats/ecf8.md)."""

        def __init__(self, format_version: int = 1, original_quantization_config=None, **kwargs):
            self.quant_method = FORMAT_NAME
            self.format_version = format_version
            self.original_quantization_config = original_quantization_config

        def to_dict(self):
            return {"quant_method": self.quant_method, "format_version": self.format_version,
                    "original_quantization_config": self.original_quantization_config}

    @register_quantizer(FORMAT_NAME)
    class ECF8HfQuantizer(HfQuantizer):
        """Loads ecf8 checkpoints: decodes every coded tensor into the model, bit for bit."""

        requires_calibration = False

        def __init__(self, quantization_config, **kwargs):
            super().__init__(quantization_config, **kwargs)
            self._encoded = None
            self._coded: set[str] = set()

        def validate_environment(self, *args, **kwargs):
            return None

        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            from compress.formats.ecf8 import EncodedCheckpoint

            if not checkpoint_files:
                from compress.errors import FormatError

                raise FormatError("ecf8: transformers passed no checkpoint files to decode")
            from compress.errors import VerificationError
            from compress.eval.verify import check_manifest

            folder = Path(checkpoint_files[0]).parent
            problems = check_manifest(folder)  # every file, raw-stored tensors and config included
            if problems:
                raise VerificationError(f"{folder}: {problems[0]}")
            self._encoded = EncodedCheckpoint.open(folder)
            prefix = getattr(model, "base_model_prefix", "") or ""
            self._coded = set()
            for name, record in self._encoded.records.items():
                if record.get("codec") != "raw":
                    self._coded |= {name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")}
            model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {_CODED_PART}

        def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
            # the empty placeholder stored under a coded tensor's name is expected, not a mismatch
            return param_name in self._coded

        def _process_model_after_weight_loading(self, model, **kwargs):
            place_decoded(model, self._encoded)
            return model

        def is_serializable(self, *args, **kwargs):
            return False

        @property
        def is_trainable(self):
            return False

    from compress.formats.anybcq import register_transformers as register_anybcq

    register_anybcq()


def place_decoded(model, encoded, backend: str = "auto") -> int:
    """Decode every coded tensor of ``encoded`` and copy it into ``model`` in place.

    Args:
        model: a transformers model whose parameters/buffers carry the checkpoint's names
            (with or without ``base_model_prefix``).
        encoded: :class:`compress.formats.ecf8.EncodedCheckpoint`.

    Returns:
        The number of tensors placed.

    Raises:
        FormatError: a decoded tensor matches no model tensor, or its shape differs.
        VerificationError: a checksum does not match.
    """
    import torch

    from compress.checkpoint import _np_signed, torch_dtype
    from compress.errors import FormatError

    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    prefix = getattr(model, "base_model_prefix", "") or ""
    placed = 0
    for name, record in encoded.records.items():
        if record.get("codec") == "raw":
            continue
        candidates = [name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")]
        target = next((targets[c] for c in candidates if c in targets), None)
        if target is None:
            raise FormatError(f"decoded tensor {name!r} has no place in {type(model).__name__}; load it with the "
                              "model class it was saved from")
        dtype, bits = encoded.read_array(name)
        value = torch.from_numpy(bits.view(_np_signed(dtype))).view(torch_dtype(dtype))
        if target.numel() and tuple(target.shape) != tuple(value.shape):  # empty: the format's placeholder
            raise FormatError(f"decoded tensor {name!r} has shape {list(value.shape)}, model expects {list(target.shape)}")
        with torch.no_grad():
            target.data = value.to(device=target.device, dtype=target.dtype if target.is_floating_point() else value.dtype)
        placed += 1
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return placed


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install_hook() -> None:
    """Register compress's transformers quantizers now, or when transformers loads its registry."""
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def load(path, model_class=None, *, revision: str | None = None, dtype=None, **kwargs):
    """Load a checkpoint written by compress (or a plain one) into a transformers model.

    Args:
        path: encoded checkpoint folder or Hub id.
        model_class: a transformers class; default: the class named in ``config.architectures``
            (else ``AutoModel``).
        revision: Hub revision.
        dtype: torch dtype; default: the stored dtype (``"auto"``), so tensors are bit-exact.
        **kwargs: passed to ``from_pretrained``.

    Returns:
        The model, in eval mode, every weight equal to the original's bit for bit.

    Raises:
        FormatError, VerificationError: see :func:`place_decoded`.
    """
    import transformers

    _register()
    if model_class is None:
        config = transformers.AutoConfig.from_pretrained(path, revision=revision)
        arch = (getattr(config, "architectures", None) or [None])[0]
        model_class = getattr(transformers, arch, None) if arch else None
        model_class = model_class or transformers.AutoModel
    return model_class.from_pretrained(path, revision=revision, dtype=dtype or "auto", **kwargs)
