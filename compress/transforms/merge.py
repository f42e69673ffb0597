"""Classic model merges of same-architecture checkpoints, streamed tensor by tensor.

Methods (mergekit semantics, arXiv 2403.13257; differences listed per function):

* ``linear``: weighted average of the parents (model soups, arXiv 2203.05482).
* ``slerp``: spherical interpolation of two parents, per tensor (flattened), falling back to
  linear interpolation when the two are (anti-)colinear.
* ``task_arithmetic``: ``base + lambda * sum_i w_i (theta_i - base)`` (arXiv 2212.04089).
* ``ties``: TIES-Merging (arXiv 2306.01708): trim each task vector to its largest-magnitude
  ``density`` fraction, elect a sign per element, average the agreeing entries.

Plan first, execute second: :func:`plan_merge` checks the parents (tensor names and shapes,
vocabulary rows, tied embeddings, quantization, tokenizer) and lists one :class:`TensorTask` per
output tensor without reading any tensor data; :func:`execute_plan` then reads one tensor from
each parent, combines them in float32, writes the result through
:class:`compress.checkpoint.CheckpointWriter` and frees it. Peak memory is the parents' copies of
the largest tensor, independent of the model size.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from compress.errors import ConfigError, UnsupportedError
from compress.eval.memory import peak_rss_bytes as peak_rss

METHODS = ("linear", "slerp", "task_arithmetic", "ties")
#: tensor names of input embeddings and output heads (rows = vocabulary, padded rows allowed)
EMBED_RE = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in)\.weight$")
HEAD_RE = re.compile(r"(^|\.)(lm_head|embed_out)\.weight$")
#: tensor-name suffixes of quantized layouts (GPTQ/AWQ/bitsandbytes/FP8 scales, compress formats)
_QUANT_SUFFIX = re.compile(r"(qweight|qzeros|g_idx|weight_scale|weight_scale_inv|_scale_inv|absmax|quant_map|SCB|"
                           r"weight_packed|weight_shape|_ecf8_codes)$")
_QUANT_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "I32", "I16", "U16", "U32"}


# -- configuration ---------------------------------------------------------------------------
class ModelParameters(BaseModel):
    """Per-parent parameters (mergekit ``models[i].parameters``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    weight: Optional[float] = None
    density: Optional[float] = Field(default=None, gt=0.0, le=1.0)


class MergeModelEntry(BaseModel):
    """One parent: a folder, Hub id, ``pkg:NAME`` or GGUF file, and its parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    parameters: ModelParameters = ModelParameters()


class MergeParameters(BaseModel):
    """Global parameters (mergekit ``parameters``); per-model values override ``weight``/``density``."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    t: Optional[float] = None
    normalize: Optional[bool] = None
    lambda_: float = Field(default=1.0, alias="lambda")
    weight: Optional[float] = None
    density: Optional[float] = Field(default=None, gt=0.0, le=1.0)


class MergeConfig(BaseModel):
    """A merge, as a mergekit-like YAML or built from CLI flags.

    YAML example::

        merge_method: ties
        base_model: ./smollm2
        models:
          - model: ./smollm2-math
            parameters: {weight: 1.0, density: 0.5}
          - model: ./smollm2-code
            parameters: {weight: 0.5, density: 0.5}
        parameters: {normalize: true, lambda: 1.0}
        dtype: bfloat16

    Unknown keys are errors (unlike mergekit). ``dtype`` is the output dtype (default: the
    reference parent's stored dtype). ``slerp`` takes exactly two models; the first (or
    ``base_model``) is ``t = 0``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    merge_method: Literal["linear", "slerp", "task_arithmetic", "ties"]
    models: tuple[MergeModelEntry, ...] = Field(min_length=1)
    base_model: Optional[str] = None
    parameters: MergeParameters = MergeParameters()
    dtype: Optional[str] = None

    @field_validator("merge_method", mode="before")
    @classmethod
    def _snake(cls, v: Any) -> Any:
        return v.replace("-", "_") if isinstance(v, str) else v

    @field_validator("models", mode="before")
    @classmethod
    def _plain_names(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [{"model": m} if isinstance(m, str) else m for m in v]
        return v

    @model_validator(mode="after")
    def _rules(self) -> "MergeConfig":
        m = self.merge_method
        names = [e.model for e in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"a model is listed twice ({names}); list each parent once and give it the combined weight")
        for where, params in [("parameters", self.parameters)] + [(f"models[{i}]", e.parameters) for i, e in enumerate(self.models)]:
            for key in ("weight", "t", "density", "lambda_"):
                v = getattr(params, key, None)
                if v is not None and not math.isfinite(float(v)):
                    raise ValueError(f"{where}.{key} is {v}; it must be a finite number")
        if self.parameters.t is not None and not 0.0 <= float(self.parameters.t) <= 1.0:
            raise ValueError(f"parameters.t is {self.parameters.t}; slerp's t must be between 0 and 1")
        if m == "slerp":
            if self.parameters.t is None:
                raise ValueError("slerp needs parameters.t (0 = the base/first model, 1 = the other)")
            others = [n for n in names if n != self.base_model] if self.base_model else names[1:]
            if len(others) != 1 or (self.base_model is None and len(names) != 2):
                raise ValueError(f"slerp merges exactly two models (found {len(names)} and base {self.base_model!r})")
        elif m in ("task_arithmetic", "ties"):
            if self.base_model is None:
                raise ValueError(f"{m} needs base_model (the model the task vectors are taken from)")
            if not [n for n in names if n != self.base_model]:
                raise ValueError(f"{m} needs at least one model besides base_model")
        else:
            if len(names) < 2:
                raise ValueError("linear needs at least two models")
            if self.base_model is not None and self.base_model not in names:
                raise ValueError("linear: base_model only picks the parent whose config and tokenizer the output "
                                 "keeps; list it under models too (with its weight)")
        if m != "slerp" and self.parameters.t is not None:
            raise ValueError(f"parameters.t is for slerp only, not {m}")
        if m not in ("ties",) and (self.parameters.density is not None or any(e.parameters.density is not None for e in self.models)):
            raise ValueError(f"density is for ties only, not {m}")
        return self

    # resolved views -----------------------------------------------------------------------
    def reference(self) -> str:
        """The parent whose config, tokenizer, tensor order and shapes the output keeps."""
        return self.base_model or self.models[0].model

    def parents(self) -> list[MergeModelEntry]:
        """Every parent in plan order: the reference first (for task_arithmetic/ties it only
        supplies the base; for linear and slerp it is a weighted/t=0 parent)."""
        ref = self.reference()
        first = next((e for e in self.models if e.model == ref), MergeModelEntry(model=ref))
        return [first] + [e for e in self.models if e.model != ref]

    def weight(self, entry: MergeModelEntry) -> float:
        w = entry.parameters.weight if entry.parameters.weight is not None else self.parameters.weight
        return 1.0 if w is None else float(w)

    def density(self, entry: MergeModelEntry) -> float:
        d = entry.parameters.density if entry.parameters.density is not None else self.parameters.density
        return 1.0 if d is None else float(d)

    def normalize(self) -> bool:
        if self.parameters.normalize is not None:
            return self.parameters.normalize
        return self.merge_method in ("linear", "ties")  # mergekit defaults


def config_error(e: ValidationError, where: str = "merge config") -> ConfigError:
    """One-line ConfigError with the field path of the first pydantic error."""
    from compress.errors import validation_error

    return validation_error(e, where)


def load_merge_config(path: str | Path) -> MergeConfig:
    """Read and validate a merge-config YAML (see :class:`MergeConfig`).

    Raises:
        ConfigError: unreadable file, bad YAML, unknown key or invalid value (with its field path).
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"merge config {path}: {e}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"merge config {path}: expected a mapping with merge_method and models")
    try:
        return MergeConfig(**data)
    except ValidationError as e:
        raise config_error(e, f"merge config {path}") from None


# -- the merge functions (float32 tensors in, float32 out) ------------------------------------------
def linear(tensors: list, weights: list[float], normalize: bool = True):
    """Weighted sum of same-shape tensors (mergekit ``linear``).

    Args:
        tensors: k tensors (Tensor[*shape], float32).
        weights: k weights.
        normalize: divide by the sum of the weights (mergekit default True).

    Returns:
        Tensor[*shape], float32.

    Raises:
        ConfigError: ``normalize`` with weights summing to zero.
    """
    import torch

    out = torch.zeros_like(tensors[0])                                                 # [*shape]
    for t, w in zip(tensors, weights):  # in place: no [k, *shape] stack in memory
        out.add_(t, alpha=float(w))
    if normalize:
        total = float(sum(weights))
        if abs(total) < 1e-12:
            raise ConfigError("linear merge: the weights sum to 0; pass other --weights or normalize: false")
        out = out / total
    return out


def slerp(t: float, v0, v1, dot_threshold: float = 0.9995, eps: float = 1e-8):
    """Spherical linear interpolation of two tensors, each treated as one flat vector (mergekit ``slerp``).

    The angle comes from the normalized vectors; the result combines the *unnormalized* inputs
    with the slerp coefficients ``sin((1-t)θ)/sinθ`` and ``sin(tθ)/sinθ``. When
    ``|cos θ| > dot_threshold`` (colinear or anti-colinear) it falls back to linear interpolation
    ``(1-t)·v0 + t·v1``. A vector with norm <= ``eps`` is left unnormalized (so a zero tensor gives
    θ = π/2), as in mergekit. Differs from mergekit only in computing the dot product in float64.

    Args:
        t: interpolation factor; 0 gives ``v0``, 1 gives ``v1`` (values outside [0, 1] extrapolate).
        v0, v1: Tensor[*shape], float32.

    Returns:
        Tensor[*shape], float32.
    """
    a, b = v0.double().reshape(-1), v1.double().reshape(-1)                          # [n]
    na, nb = a.norm(), b.norm()
    an = a / na if na > eps else a
    bn = b / nb if nb > eps else b
    dot = float((an * bn).sum())
    if abs(dot) > dot_threshold:
        return ((1 - t) * v0 + t * v1).float()
    theta0 = math.acos(max(-1.0, min(1.0, dot)))
    s0 = math.sin(theta0 - theta0 * t) / math.sin(theta0)
    s1 = math.sin(theta0 * t) / math.sin(theta0)
    return (s0 * v0.double() + s1 * v1.double()).float()


def task_arithmetic(base, tensors: list, weights: list[float], lambda_: float = 1.0, normalize: bool = False):
    """``base + lambda * sum_i w_i (theta_i - base)`` (arXiv 2212.04089; mergekit ``task_arithmetic``).

    Args:
        base: Tensor[*shape], float32.
        tensors: k fine-tuned tensors, each Tensor[*shape], float32.
        weights: k task-vector weights.
        lambda_: scale of the summed task vector.
        normalize: divide the weighted sum by the sum of weights (mergekit default False here).

    Returns:
        Tensor[*shape], float32.
    """
    delta = linear([t - base for t in tensors], weights, normalize=False)               # [*shape]
    if normalize and abs(sum(weights)) > 1e-8:
        delta = delta / float(sum(weights))
    return base + lambda_ * delta


def magnitude_mask(delta, density: float):
    """Keep the ``int(density · numel)`` largest-magnitude entries of ``delta`` (TIES trim step).

    Ties between equal magnitudes at the threshold are broken by ``torch.topk``'s order (mergekit
    uses ``argsort``; results can differ only on exactly equal magnitudes). ``k = 0`` keeps nothing
    (mergekit asserts instead).

    Args:
        delta: Tensor[*shape], float32.
        density: fraction kept, in (0, 1].

    Returns:
        Tensor[*shape], float32: ``delta`` with the trimmed entries set to 0.
    """
    import torch

    if density >= 1.0:
        return delta
    k = int(density * delta.numel())
    flat = delta.reshape(-1)                                                           # [n]
    out = torch.zeros_like(flat)
    if k > 0:
        idx = torch.topk(flat.abs(), k, sorted=False).indices                          # [k]
        out[idx] = flat[idx]
    return out.view_as(delta)


def ties(base, tensors: list, weights: list[float], densities: list[float], lambda_: float = 1.0, normalize: bool = True):
    """TIES-Merging of one tensor (arXiv 2306.01708; mergekit ``ties`` with ``consensus_method: sum``).

    Steps: task vectors ``d_i = theta_i - base`` trimmed to their top ``density_i`` magnitudes;
    weighted ``w_i d_i``; elected sign per element ``sign(sum_i w_i d_i)`` (a zero sum elects +);
    kept entries are those whose weighted sign equals the elected one; merged delta
    ``sum_i w_i d_i [kept] / sum_i w_i [kept]`` (the "disjoint mean"; without ``normalize`` the
    sum is not divided; an element no parent keeps divides by 1); result ``base + lambda * delta``.

    Args:
        base: Tensor[*shape], float32.
        tensors: k fine-tuned tensors, each Tensor[*shape], float32.
        weights: k weights. densities: k fractions in (0, 1].

    Returns:
        Tensor[*shape], float32.
    """
    import torch

    deltas = torch.stack([magnitude_mask(t - base, d) for t, d in zip(tensors, densities)])  # [k, *shape]
    w = torch.tensor(weights, dtype=torch.float32).view(-1, *[1] * base.dim())            # [k, 1, ...]
    weighted = deltas * w                                                                  # [k, *shape]
    elected = (weighted.sum(0) >= 0).float() * 2 - 1                                       # [*shape] in {-1, +1}
    keep = weighted.sign() == elected                                                      # [k, *shape]
    mixed = (weighted * keep).sum(0)                                                       # [*shape]
    if normalize:
        divisor = (w * keep).sum(0)                                                        # [*shape]
        divisor[divisor == 0] = 1
        mixed = mixed / divisor
    return base + lambda_ * mixed


# -- planning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorTask:
    """One output tensor: where each parent's copy lives and how it is combined.

    Attributes:
        name: output tensor name (the reference parent's name).
        dtype: output safetensors dtype.
        shape: output shape (the reference parent's).
        sources: per parent (in :attr:`MergePlan.sources` order), the stored tensor name to read.
        rows: for vocabulary tensors whose row counts differ (padded vocabularies): the rows
            shared by all parents, which are merged; later rows come from the reference. None otherwise.
        copy: copied from the reference unchanged (non-float tensors such as index buffers).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    rows: Optional[int] = None
    copy: bool = False


@dataclass
class MergePlan:
    """The checked parents and one task per output tensor, built without reading tensor data.

    Attributes:
        sources: parent sources in order; index 0 is the reference (base, else first model).
        checkpoints: the open :class:`compress.checkpoint.Checkpoint` of each.
        tasks: output tensors in the reference's stored order.
        notes: facts worth telling the user (tied heads, padded rows, GGUF dequantization).
    """

    sources: list[str]
    checkpoints: list[Any]
    tasks: list[TensorTask]
    notes: list[str]

    def close(self) -> None:
        for c in self.checkpoints:
            c.close()


def check_unquantized(ckpt) -> None:
    """Refuse a quantized or compress-format checkpoint (merging needs plain float weights).

    Raises:
        UnsupportedError: ``quantization_config`` in config.json, compress format metadata,
            or tensors with quantized dtypes/names.
    """
    config = ckpt.config()
    q = config.get("quantization_config")
    if q:
        method = q.get("quant_method", "?") if isinstance(q, dict) else "?"
        raise UnsupportedError(f"{ckpt.source}: quantized checkpoint (quantization_config.quant_method={method!r}); "
                               "merge the unquantized parents, then quantize the merge")
    for shard, meta in ckpt.shard_metadata.items():
        if meta.get("compress.format"):
            raise UnsupportedError(f"{ckpt.source}: compress-format checkpoint ({meta['compress.format']}); "
                                   "decode it (`compress decode`) before merging")
    for name, info in ckpt.tensors.items():
        if (info.dtype in _QUANT_DTYPES and len(info.shape) >= 2) or _QUANT_SUFFIX.search(name) or info.dtype.startswith("F8"):
            raise UnsupportedError(f"{ckpt.source}: tensor {name!r} ({info.dtype}) is quantized; "
                                   "merge the unquantized parents, then quantize the merge")


def tokenizer_fingerprint(path: Path) -> Optional[str]:
    """A hash of what decides token ids: tokenizer.json's ``model`` and ``added_tokens`` (ids and
    contents), else the bytes of vocab files. None when the folder has no tokenizer."""
    tj = path / "tokenizer.json"
    if tj.exists():
        try:
            data = json.loads(tj.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{tj}: unreadable tokenizer ({e})") from None
        added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
        key = json.dumps({"model": data.get("model"), "added": added}, sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()
    files = [f for f in ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "spiece.model") if (path / f).exists()]
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.encode() + b"\0" + (path / f).read_bytes())
    return h.hexdigest()


def check_tokenizers(ckpts: list) -> list[str]:
    """Require the same tokenizer in every parent that has one.

    Returns:
        Notes (e.g. that no parent has a tokenizer).

    Raises:
        ConfigError: tokenizers differ, or only some parents have one.
    """
    prints = [tokenizer_fingerprint(c.path) for c in ckpts]
    if all(p is None for p in prints):
        return ["no parent has tokenizer files; the output has none either"]
    for c, p in zip(ckpts[1:], prints[1:]):
        if p != prints[0]:
            what = "has no tokenizer" if p is None or prints[0] is None else "has a different tokenizer (vocabulary or added tokens)"
            raise ConfigError(f"{c.source} {what} than {ckpts[0].source}; merging needs parents with the same "
                              "tokenizer (merging or remapping vocabularies is not supported)")
    return []


def tied(ckpt) -> bool:
    """True when the output head shares the input embedding (config flag, or no head stored)."""
    config = ckpt.config()
    flag = config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings"))
    has_head = any(HEAD_RE.search(n) for n in ckpt.tensors)
    return bool(flag) or (flag is None and not has_head)


def embed_name(ckpt) -> Optional[str]:
    names = [n for n in ckpt.tensors if EMBED_RE.search(n)]
    return names[0] if names else None


def open_parents(sources: list[str], dtype: Optional[str] = None) -> tuple[list[Any], list[str]]:
    """Open every parent (GGUF dequantized to bf16) and run the checks common to all merges.

    Raises:
        ConfigError: a parent is missing or duplicated; tokenizers differ.
        UnsupportedError: a parent is quantized.
    """
    from compress.checkpoint import Checkpoint

    notes: list[str] = []
    ckpts = []
    try:
        for s in sources:
            c = Checkpoint.open(s)
            ckpts.append(c)
            if c._tmp is not None:
                notes.append(f"{s}: GGUF dequantized to bfloat16 before merging")
            check_unquantized(c)
        notes += check_tokenizers(ckpts)
    except BaseException:
        for c in ckpts:
            c.close()
        raise
    return ckpts, notes


def source_name(ckpt, name: str, ref_tied: bool) -> Optional[str]:
    """The tensor of ``ckpt`` that plays the role of the reference's ``name`` (a tied head reads the embedding)."""
    if name in ckpt.tensors:
        return name
    if HEAD_RE.search(name) and tied(ckpt):
        return embed_name(ckpt)
    return None


def _task(ref, ckpts: list, name: str, out_dtype: Optional[str], notes: list[str]) -> TensorTask:
    from compress.checkpoint import FLOAT_DTYPES

    info = ref.tensors[name]
    sources = []
    rows = None
    for c in ckpts:
        src = source_name(c, name, tied(ref))
        if src is None:
            raise ConfigError(f"tensor {name!r} of {ref.source} is missing from {c.source}; the parents must have "
                              "the same architecture (for different depths use `compress merge latent`)")
        shape = c.tensors[src].shape
        if shape != info.shape:
            vocab = EMBED_RE.search(name) or HEAD_RE.search(name)
            if vocab and len(shape) == len(info.shape) and shape[1:] == info.shape[1:]:
                rows = min(rows or info.shape[0], shape[0], info.shape[0])
            else:
                raise ConfigError(f"tensor {name!r}: shape {list(shape)} in {c.source} but {list(info.shape)} in "
                                  f"{ref.source}; the parents must have the same architecture")
        sources.append(src)
    if rows is not None:
        notes.append(f"{name}: vocabulary rows differ (padded vocabularies); rows 0..{rows - 1} merged, "
                     f"rows {rows}..{info.shape[0] - 1} kept from {ref.source}")
    is_float = info.dtype in FLOAT_DTYPES
    dtype = out_dtype if (out_dtype and is_float) else info.dtype
    return TensorTask(name, dtype, info.shape, tuple(sources), rows, copy=not is_float)


def plan_merge(config: MergeConfig) -> MergePlan:
    """Open and check the parents and list the output tensors, without reading tensor data.

    Order of ``MergePlan.sources``: the reference (base, else first model), then every
    contributor not equal to it.

    Raises:
        ConfigError: different architectures (a tensor name or shape differs; a missing
            ``lm_head.weight`` is fine when that parent ties it to the embedding), different tokenizers.
        UnsupportedError: a quantized parent.
    """
    from compress.checkpoint import dtype_name

    out_dtype = dtype_name(config.dtype) if config.dtype else None
    if out_dtype is not None and out_dtype not in ("F32", "F16", "BF16"):
        raise ConfigError(f"dtype {config.dtype}: a merge is written in float32, float16 or bfloat16")
    sources = [e.model for e in config.parents()]  # distinct: MergeConfig refuses a model listed twice
    ckpts, notes = open_parents(sources)
    try:
        ref_ckpt = ckpts[0]
        tasks = [_task(ref_ckpt, ckpts, name, out_dtype, notes) for name in ref_ckpt.names()]
        ref_names = set(ref_ckpt.tensors)
        for c in ckpts[1:]:
            extra = [n for n in c.tensors if n not in ref_names and not (HEAD_RE.search(n) and tied(ref_ckpt))]
            if extra:
                raise ConfigError(f"{c.source} has tensors {extra[:3]} that {ref_ckpt.source} lacks; the parents must "
                                  "have the same architecture")
            if any(HEAD_RE.search(n) for n in c.tensors) and tied(ref_ckpt) and not tied(c):
                notes.append(f"{c.source} has an untied lm_head; the output ties it to the merged embedding like {ref_ckpt.source}")
    except BaseException:
        for c in ckpts:
            c.close()
        raise
    return MergePlan(sources, ckpts, tasks, notes)


# -- execution ------------------------------------------------------------------------------------
def to_array(tensor, dtype: str) -> np.ndarray:
    """A torch float tensor as the little-endian bits of safetensors dtype ``dtype`` (for CheckpointWriter)."""
    import torch

    from compress.checkpoint import torch_dtype

    t = tensor.detach().to(torch_dtype(dtype)).contiguous().cpu()
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(ints).numpy()


def _combine(config: MergeConfig, vals: list):
    """Merge one tensor; ``vals`` follow :meth:`MergeConfig.parents` (reference first)."""
    entries = config.parents()
    m = config.merge_method
    if m == "linear":
        return linear(vals, [config.weight(e) for e in entries], config.normalize())
    if m == "slerp":
        return slerp(float(config.parameters.t), vals[0], vals[1])
    contrib = entries[1:]
    weights = [config.weight(e) for e in contrib]
    if m == "task_arithmetic":
        return task_arithmetic(vals[0], vals[1:], weights, config.parameters.lambda_, config.normalize())
    return ties(vals[0], vals[1:], weights, [config.density(e) for e in contrib], config.parameters.lambda_, config.normalize())


class MergeResult(BaseModel):
    """What a merge wrote.

    ``tensors``: output tensors; ``merged``: those combined from the parents; ``copied``: taken
    from the reference unchanged. ``peak_rss_bytes``: this process's peak resident memory (VmHWM).
    """

    output: str
    method: str
    parents: list[str]
    base_model: Optional[str]
    tensors: int
    merged: int
    copied: int
    output_bytes: int
    seconds: float
    peak_rss_bytes: int
    notes: list[str]



def model_card(method: str, parents: list[str], base: Optional[str], details: dict[str, Any]) -> str:
    """README.md of a merged checkpoint: parents, method and resolved parameters."""
    lines = ["---", "tags: [merge, compress]", "---", "", f"# Merged model ({method})", "",
             f"Made with `compress merge {method.replace('_', '-')}`.", "", "## Parents", ""]
    for p in parents:
        lines.append(f"- `{p}`" + (" (base)" if p == base else ""))
    lines += ["", "## Method", "", f"`{method}`", "", "```json", json.dumps(details, indent=2, sort_keys=True, default=str), "```", ""]
    return "\n".join(lines)


def write_output(writer, ref, card: str, config_yaml: Optional[str] = None, config_json: Optional[dict] = None) -> None:
    """Copy the reference's non-weight files (config, tokenizer) and write the model card."""
    writer.copy_files(ref.path, list(ref.extra_files()), skip={"README.md", "config.json"} if config_json else {"README.md"})
    if config_json is not None:
        writer.write_text("config.json", json.dumps(config_json, indent=2) + "\n")
    writer.write_text("README.md", card)
    if config_yaml is not None:
        writer.write_text("merge_config.yaml", config_yaml)


def execute_plan(config: MergeConfig, plan: MergePlan, output_dir: str | Path, *, overwrite: bool = False,
                 max_shard_size: str = "5GB", progress=None) -> MergeResult:
    """Stream the plan: per tensor, read each parent's copy (float32), combine, write, free.

    Raises:
        ConfigError: the output exists (without ``overwrite``) or lies inside a parent.
    """
    import yaml

    from compress.checkpoint import CheckpointWriter

    start = time.perf_counter()
    ref = plan.checkpoints[0]
    merged = copied = 0
    with CheckpointWriter(output_dir, max_shard_size=max_shard_size, overwrite=overwrite,
                          inputs=tuple(c.path for c in plan.checkpoints)) as writer:
        for task in plan.tasks:
            if task.copy:
                dt, bits = ref.read_array(task.name)
                writer.add({task.name: (dt, task.shape, bits)})
                copied += 1
            else:
                vals = [c.get(src).float() for c, src in zip(plan.checkpoints, task.sources)]   # k x [*shape] fp32
                if task.rows is not None:
                    out = vals[0].clone()                                                     # [V_ref, ...]
                    out[: task.rows] = _combine(config, [v[: task.rows] for v in vals])
                else:
                    out = _combine(config, vals)                                              # [*shape]
                writer.add({task.name: (task.dtype, task.shape, to_array(out, task.dtype))})
                del vals, out
                merged += 1
            if progress:
                progress(ref.tensors[task.name].nbytes)
        details = config.model_dump(mode="json", by_alias=True, exclude_none=True)
        card = model_card(config.merge_method, plan.sources, config.base_model, details)
        write_output(writer, ref, card, yaml.safe_dump(details, sort_keys=False))
        writer.finish()
        size = sum(p.stat().st_size for p in writer.tmp.glob("*.safetensors"))
        out_path = writer.publish()
    return MergeResult(output=str(out_path), method=config.merge_method, parents=plan.sources, base_model=config.base_model,
                       tensors=len(plan.tasks), merged=merged, copied=copied, output_bytes=size,
                       seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss(), notes=plan.notes)


def merge(config: MergeConfig, output_dir: str | Path, *, overwrite: bool = False, max_shard_size: str = "5GB",
          dry_run: bool = False, progress=None) -> MergeResult:
    """Plan and run a classic merge (the library entry point of ``compress merge linear|slerp|...``).

    Args:
        config: the validated :class:`MergeConfig`.
        output_dir: folder to create (a plain HF checkpoint: safetensors shards, config and
            tokenizer of the reference parent, README.md model card, merge_config.yaml).
        overwrite: replace an existing output.
        dry_run: check the parents and plan, write nothing.

    Returns:
        :class:`MergeResult`.

    Raises:
        ConfigError, UnsupportedError, FormatError: see :func:`plan_merge`.
    """
    out = Path(output_dir)
    if out.exists() and not overwrite and not dry_run:
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it")
    plan = plan_merge(config)
    try:
        if dry_run:
            return MergeResult(output=str(out), method=config.merge_method, parents=plan.sources, base_model=config.base_model,
                               tensors=len(plan.tasks), merged=sum(not t.copy for t in plan.tasks),
                               copied=sum(t.copy for t in plan.tasks), output_bytes=0, seconds=0.0,
                               peak_rss_bytes=peak_rss(), notes=plan.notes + ["dry run: nothing written"])
        return execute_plan(config, plan, out, overwrite=overwrite, max_shard_size=max_shard_size, progress=progress)
    finally:
        plan.close()
