"""Loading any checkpoint this project reads or writes as a causal LM, for evaluation and calibration.

Plain HF folders, Hub ids, ``pkg:NAME`` packages and GGUF files (dequantized through
transformers' loader) load as they are; checkpoints in a compress format load through the
quantizer ``import compress`` registers (the format is read from ``config.json``), so every
format this project writes is evaluated by the same code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.errors import ConfigError, UnsupportedError


@dataclass
class LoadedModel:
    """A model ready for evaluation.

    Attributes:
        model: the transformers model, eval mode.
        tokenizer: its tokenizer.
        path: the local folder it was loaded from (a temporary folder for GGUF input, since removed).
        size_bytes: bytes of its safetensors shards (for GGUF input: of the dequantized bf16 copy evaluated).
        quant_method: ``quantization_config.quant_method`` or None for a plain checkpoint.
    """

    model: Any
    tokenizer: Any
    path: Path
    size_bytes: int
    quant_method: str | None


def weight_bytes(path: Path) -> int:
    """Bytes of the weight files of a checkpoint folder or GGUF file (safetensors shards or .gguf)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def eval_dtype(dtype: str | None, device: str):
    """The torch dtype to compute in: float32 on CPU by default (bf16 matmul there is ~50x slower;
    bf16 weights upcast to fp32 exactly), the stored dtype (``"auto"``) on an accelerator."""
    from compress.checkpoint import dtype_name, torch_dtype

    if dtype is None or dtype == "auto":
        if device == "cpu":
            import torch

            return torch.float32
        return "auto"
    try:
        name = dtype_name(dtype)
    except ConfigError:
        name = None
    if name not in ("F32", "BF16", "F16"):
        raise ConfigError(f"--dtype {dtype}: expected float32, bfloat16, float16 or auto")
    return torch_dtype(name)


def set_precision(model, bits: int | None) -> int:
    """Switch every multi-precision layer of ``model`` (e.g. AnyBCQ linears) to ``bits``.

    A layer is multi-precision when it has a ``set_precision(bits)`` method.

    Returns:
        The number of layers switched.

    Raises:
        ConfigError: ``bits`` is given but the model has no multi-precision layer.
    """
    if bits is None:
        return 0
    layers = [m for m in model.modules() if m is not model and callable(getattr(m, "set_precision", None))]
    if not layers:
        raise ConfigError(f"--bits {bits}: this model has no multi-precision layers (only AnyBCQ checkpoints do)")
    for layer in layers:
        layer.set_precision(bits)
    return len(layers)


def _check_causal(source, config: dict) -> None:
    """Refuse checkpoints whose architectures are not causal LMs (an encoder such as BERT would load
    as a randomly-headed ``BertLMHeadModel`` and give a meaningless perplexity)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = config.get("architectures") or []
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if archs and not any(a in causal or a.endswith("ForCausalLM") for a in archs):
        raise UnsupportedError(f"{source}: not a causal language model (architectures {archs}); "
                               "perplexity needs a next-token model")


def load_causal_lm(source: str | os.PathLike, *, revision: str | None = None, dtype: str | None = None,
                   device: str = "cpu", bits: int | None = None, trust_remote_code: bool = False) -> LoadedModel:
    """Load a causal LM from any source :meth:`compress.checkpoint.Checkpoint.open` accepts.

    Args:
        source: folder, Hub id, ``pkg:NAME`` or ``.gguf`` file; plain or in a compress format.
        revision: Hub revision.
        dtype: compute dtype name, or None (float32 on CPU, stored dtype elsewhere).
        device: torch device string.
        bits: precision for multi-precision checkpoints (AnyBCQ); None keeps the stored default.
        trust_remote_code: passed to transformers (off by default).

    Returns:
        :class:`LoadedModel`.

    Raises:
        ConfigError: the source cannot be found; ``bits`` given for a model without precisions.
        UnsupportedError: the checkpoint is not a causal LM transformers can build.
        FormatError, VerificationError: a compress-format checkpoint is damaged.
    """
    import compress  # noqa: F401  (registers compress formats with transformers)
    from compress.checkpoint import Checkpoint

    import transformers
    from transformers.utils import logging as hf_logging

    torch_dtype_ = eval_dtype(dtype, device)
    ckpt = Checkpoint.open(source, revision=revision)  # GGUF: dequantized to bf16 in a temporary folder
    try:
        path = ckpt.path
        size = weight_bytes(path)
        config = ckpt.config()
        if config.get("model_type") == "llama_attn_pruned":  # attention-only pruned Llama (docs/prune.md)
            from compress.transforms.prune.attn_pruned_llama import register

            register()
        quant = (config.get("quantization_config") or {}).get("quant_method")
        _check_causal(source, config)
        verbosity = hf_logging.get_verbosity()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype_, trust_remote_code=trust_remote_code)
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except ValueError as e:
            if "Unrecognized configuration class" in str(e) or "does not recognize" in str(e):
                raise UnsupportedError(f"{source}: not a causal language model transformers can build "
                                       f"({str(e).splitlines()[0][:160]})") from None
            raise
        except OSError as e:
            raise ConfigError(f"{source}: cannot load model or tokenizer ({str(e).splitlines()[0][:200]})") from None
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
    finally:
        if ckpt._tmp is not None:  # GGUF: weights are in memory now; drop the dequantized copy
            ckpt.close()
    model.to(device).eval()
    set_precision(model, bits)
    return LoadedModel(model, tokenizer, path, size, quant)
