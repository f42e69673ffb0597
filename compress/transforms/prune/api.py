"""``prune``: score decoder layers (entropy, cosine or GradPruner), choose, and remove them.

One library entry point, :func:`prune`, takes a :class:`PruneConfig` and returns a
:class:`PruneResult`; the CLI (``compress prune entropy|cosine|gradpruner``) only renders it.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from compress.errors import ConfigError, UnsupportedError
from compress.eval.memory import peak_rss_bytes

METHODS = ("entropy", "cosine", "gradpruner")
PROTECT_FIRST, PROTECT_LAST = 2, 1


class PruneConfig(BaseModel):
    """Options of one pruning run.

    Attributes:
        method: ``entropy`` (arXiv 2504.03794), ``cosine`` (ShortGPT Block Influence, arXiv 2403.03853)
            or ``gradpruner`` (arXiv 2601.19503).
        remove: number of layers (or attention sub-blocks) to remove; or ``ratio`` of all layers (rounded).
        text: calibration text file (entropy, cosine) or fine-tuning data (gradpruner).
        samples, seq_len: calibration windows (entropy/cosine) or training windows per step x steps (gradpruner).
        estimator: entropy estimator: knn (k=25), bucket (histogram) or renyi (matrix-based, α=2).
        scope: ``layer`` removes whole decoder layers; ``attention`` removes only attention sub-blocks (Llama).
        steps, lora_rank, lora_alpha, lr, batch_size: GradPruner's LoRA warm-up.
        sparsity: GradPruner: fraction of each pruned linear dropped before merging (0.8 keeps the top 20% by IGIA).
        merge_layers: GradPruner: how many of the removed layers are merged into their preceding kept
            layer, the highest-scoring removed layers first; None merges all, 0 merges none.
        dequantize: accept a quantized input (GGUF, a quantization_config checkpoint) by dequantizing it.
        seed: calibration sampling, LoRA init and data order.
        device: torch device for scoring / training.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["entropy", "cosine", "gradpruner"]
    remove: Optional[int] = None
    ratio: Optional[float] = None
    text: Path
    samples: int = 32
    seq_len: int = 256
    estimator: Literal["knn", "bucket", "renyi"] = "knn"
    scope: Literal["layer", "attention"] = "layer"
    steps: int = 40
    lora_rank: int = 8
    lora_alpha: int = 32
    lr: float = 2e-4
    batch_size: int = 1
    sparsity: float = 0.8
    merge_layers: Optional[int] = None
    dequantize: bool = False
    seed: int = 0
    device: str = "cpu"

    @field_validator("samples", "seq_len", "steps", "lora_rank", "lora_alpha", "batch_size")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v

    @field_validator("sparsity")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError("must be between 0 and 1")
        return v

    @model_validator(mode="after")
    def _amount(self) -> "PruneConfig":
        if (self.remove is None) == (self.ratio is None):
            raise ValueError("give exactly one of --remove K and --ratio R")
        if self.remove is not None and self.remove < 1:
            raise ValueError("--remove must be >= 1")
        if self.ratio is not None and not 0.0 < self.ratio < 1.0:
            raise ValueError("--ratio must be between 0 and 1 (exclusive)")
        if self.merge_layers is not None and self.merge_layers < 0:
            raise ValueError("--merge-layers must be >= 0")
        if self.method == "gradpruner" and self.scope != "layer":
            raise ValueError("gradpruner removes whole layers only (--scope layer)")
        return self

    def count(self, n_layers: int) -> int:
        """Layers to remove from a model of ``n_layers``."""
        return self.remove if self.remove is not None else int(round(self.ratio * n_layers))


class PruneResult(BaseModel):
    """What :func:`prune` did (or would do, under ``dry_run``).

    ``scores``: per-layer score (ΔH in nats for entropy, Block Influence for cosine, Σ IGIA for
    gradpruner; low = removable). ``removed``: original indices removed. ``merged``: removed layer
    -> kept layer it was merged into. ``params_*``: parameters stored in the checkpoint.
    ``scoring_seconds`` and ``peak_rss_bytes``: wall time of scoring and the process's peak RSS.
    """

    source: str
    output: Optional[str] = None
    dry_run: bool
    method: str
    estimator: Optional[str] = None
    scope: str
    layers_before: int
    layers_after: int
    scores: list[float]
    removed: list[int]
    merged: dict[int, int] = {}
    protected: list[int]
    params_before: int
    params_after: int
    scoring_seconds: float
    total_seconds: float
    peak_rss_bytes: int
    train_losses: list[float] = []



def _quantization(ckpt) -> str | None:
    """What makes a checkpoint quantized, or None for plain float weights."""
    if ckpt._tmp is not None:
        return "GGUF"
    qc = ckpt.config().get("quantization_config")
    if qc:
        return f"quantization_config {qc.get('quant_method', '?')!r}"
    if any(m.get("compress.format") for m in ckpt.shard_metadata.values()):
        return "compress format"
    for name, info in ckpt.tensors.items():
        if info.dtype.startswith("F8") or name.endswith(("_scale_inv", "weight_scale")):
            return f"FP8/scaled weights ({name})"
    return None


def _open_source(source: str, dequantize: bool, stack):
    """Open ``source`` as a plain float checkpoint (dequantizing it into a temporary folder when allowed)."""
    from compress.checkpoint import Checkpoint, _resolve_package

    if not dequantize:  # refuse a GGUF before paying for its dequantization
        path = _resolve_package(source) if str(source).startswith("pkg:") else Path(source)
        if (path.is_file() and path.suffix == ".gguf") or (
                path.is_dir() and any(path.glob("*.gguf")) and not any(path.glob("*.safetensors"))):
            raise UnsupportedError(f"{source} is quantized (GGUF); layer pruning needs float weights: pass --dequantize "
                                   "to dequantize it first (bf16), or prune the unquantized model")
    ckpt = stack.enter_context(Checkpoint.open(source))
    kind = _quantization(ckpt)
    if kind is None or (kind == "GGUF" and dequantize):
        return ckpt
    if not dequantize:
        raise UnsupportedError(f"{source} is quantized ({kind}); layer pruning needs float weights: pass --dequantize "
                               "to dequantize it first (bf16), or prune the unquantized model")
    if kind.startswith("FP8"):
        raise UnsupportedError(f"{source}: cannot dequantize {kind} here; convert it to bfloat16 first")
    from compress.checkpoint import save_model
    from compress.eval.model import load_causal_lm

    stored = ckpt.config().get("dtype") or ckpt.config().get("torch_dtype") or "bfloat16"
    loaded = load_causal_lm(source, dtype="F32")  # exact upcast; eval_dtype takes safetensors names
    model = loaded.model
    quantizer = getattr(model, "hf_quantizer", None)
    try:
        if quantizer is not None:
            try:
                model = model.dequantize()
            except Exception:  # e.g. lossless formats: weights are already plain tensors after loading
                quantizer.remove_quantization_config(model)
    except Exception as e:
        raise UnsupportedError(f"{source}: cannot dequantize {kind} ({type(e).__name__}: {e})") from None
    plain = all(type(m).__module__.startswith("torch.nn") for m in model.modules() if "Linear" in type(m).__name__)
    if not plain or getattr(model.config, "quantization_config", None):
        raise UnsupportedError(f"{source}: cannot dequantize {kind}: its layers are not plain linears after loading")
    from compress.checkpoint import dtype_name, torch_dtype

    model = model.to(torch_dtype(dtype_name(stored)))  # back to the stored float dtype (bit-exact for bf16/fp16)
    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="compress-prune-"))
    save_model(model, Path(tmp) / "model", tokenizer=loaded.tokenizer)
    del model, loaded
    return stack.enter_context(Checkpoint.open(Path(tmp) / "model"))


def _load_model(path: Path, device: str, trust_remote_code: bool = False):
    from compress.eval.model import load_causal_lm

    return load_causal_lm(path, dtype="F32", device=device, trust_remote_code=trust_remote_code)


def score_layers(model, tokenizer, config: PruneConfig, metrics: tuple[str, ...],
                 progress: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Per-layer entropy/cosine scores of an in-memory model on ``config.text`` (see :mod:`.scoring`).

    Returns:
        metric -> per-layer mean score.
    """
    from compress.eval.text import calibration_batches, read_text
    from compress.transforms.prune.layers import find_layer_modules
    from compress.transforms.prune.scoring import collect_scores

    ids = calibration_batches(tokenizer, read_text(config.text), config.samples, config.seq_len, config.seed)  # [S, L]
    return collect_scores(model, find_layer_modules(model), ids, metrics, config.scope, progress)


def prune(source: str, output_dir: str | os.PathLike | None, config: PruneConfig, *, overwrite: bool = False,
          dry_run: bool = False, progress: Callable[[int], None] | None = None) -> PruneResult:
    """Score the decoder layers of ``source``, pick the lowest, and write the pruned checkpoint.

    Layers 0, 1 and the last are never removed (arXiv 2504.03794's rule, applied to every method
    so they compete on the same candidates).

    Args:
        source: folder, Hub id, ``pkg:NAME`` or GGUF file (GGUF and other quantized inputs need ``config.dequantize``).
        output_dir: folder to create; may be None with ``dry_run``.
        config: :class:`PruneConfig`.
        overwrite: replace an existing output.
        dry_run: score and choose only; nothing is written.
        progress: called with 1 after each calibration sample / training step.

    Returns:
        :class:`PruneResult`.

    Raises:
        ConfigError: bad amounts (K too large, every layer), an existing output, a bad text file.
        UnsupportedError: a quantized input without ``dequantize``, a model whose layer list is not found,
            attention scope on a non-Llama model.
    """
    import contextlib
    import gc

    import torch

    from compress.transforms.prune.layers import config_layers, find_layer_prefix, remove_layers

    start = time.perf_counter()
    if not dry_run and output_dir is None:
        raise ConfigError("give an output folder with -o/--output-dir (or use --dry-run)")
    if not dry_run and Path(output_dir).exists() and not overwrite:
        raise ConfigError(f"{Path(output_dir).resolve()} already exists; pass --overwrite to replace it")
    from compress.eval.text import read_text

    read_text(config.text)  # a bad --calib/--data file fails before any model is opened
    torch.manual_seed(config.seed)
    with contextlib.ExitStack() as stack:
        ckpt = _open_source(source, config.dequantize, stack)
        hf_config = ckpt.config()
        n = config_layers(hf_config)
        find_layer_prefix(ckpt.names(), n)  # fail early on an unknown family
        k = config.count(n)
        removable = n - PROTECT_FIRST - PROTECT_LAST
        if k < 1:
            raise ConfigError(f"--ratio {config.ratio} of {n} layers removes no layer")
        if k >= n:
            raise ConfigError(f"cannot remove {k} layers: the model has only {n}; removing every layer leaves no model")
        if k > removable:
            raise ConfigError(f"cannot remove {k} of {n} layers: the first {PROTECT_FIRST} and the last {PROTECT_LAST} "
                              f"are always kept, so at most {removable} can go")
        if config.scope == "attention" and hf_config.get("model_type") != "llama":
            raise UnsupportedError(f"--scope attention supports Llama-family checkpoints (model_type llama), "
                                   f"not {hf_config.get('model_type')!r}; use --scope layer")
        loaded = _load_model(ckpt.path, config.device)
        model, tokenizer = loaded.model, loaded.tokenizer
        t0 = time.perf_counter()
        fisher, losses = None, []
        if config.method == "gradpruner":
            from compress.eval.text import calibration_batches
            from compress.transforms.prune import gradpruner

            ids = calibration_batches(tokenizer, read_text(config.text), config.steps * config.batch_size,
                                      config.seq_len, config.seed)                       # [T·B, L]
            fisher, losses = gradpruner.igia(model, ids, steps=config.steps, rank=config.lora_rank,
                                             alpha=config.lora_alpha, lr=config.lr, batch_size=config.batch_size,
                                             seed=config.seed, progress=progress)
            scores = gradpruner.layer_scores(fisher, n)
        else:
            metric = config.estimator if config.method == "entropy" else "cosine"
            scores = score_layers(model, tokenizer, config, (metric,), progress)[metric]
        scoring_seconds = time.perf_counter() - t0
        del model, loaded
        gc.collect()
        from compress.transforms.prune.scoring import choose_lowest

        removed = choose_lowest(scores, k, PROTECT_FIRST, PROTECT_LAST)
        merged: dict[int, int] = {}
        if config.method == "gradpruner" and config.merge_layers != 0:
            from compress.transforms.prune.gradpruner import merge_targets

            order = sorted(removed, key=lambda i: -scores[i])
            chosen = order if config.merge_layers is None else order[: config.merge_layers]
            merged = {p: t for p, t in merge_targets(n, removed).items() if p in chosen}
        protected = list(range(PROTECT_FIRST)) + list(range(n - PROTECT_LAST, n))
        record = {"method": config.method, "estimator": config.estimator if config.method == "entropy" else None,
                  "scope": config.scope, "layers_before": n, "removed": removed, "scores": scores,
                  "merged": {str(p): t for p, t in merged.items()}, "protected": protected,
                  "config": config.model_dump(mode="json", exclude={"device"}), "source": str(source)}
        params = sum(i.numel for i in ckpt.tensors.values())
        result = dict(source=str(source), dry_run=dry_run, method=config.method, scope=config.scope,
                      estimator=record["estimator"], layers_before=n, scores=scores, removed=removed, merged=merged,
                      protected=protected, params_before=params, scoring_seconds=scoring_seconds, train_losses=losses)
        if dry_run:
            after = params - _removed_params(ckpt, n, removed, config.scope)
            return PruneResult(**result, layers_after=n - (len(removed) if config.scope == "layer" else 0),
                               params_after=after, total_seconds=time.perf_counter() - start,
                               peak_rss_bytes=peak_rss_bytes())
        if config.scope == "attention":
            written = _write_attention_pruned(ckpt, output_dir, removed, record, overwrite)
        else:
            replace = _merged_weights(ckpt, n, fisher, merged, config.sparsity) if merged else None
            fisher = None
            written = remove_layers(ckpt, output_dir, removed, replace=replace, record=record, overwrite=overwrite)
        return PruneResult(**result, output=written["output"], layers_after=written["layers_after"],
                           params_after=written["params_after"], total_seconds=time.perf_counter() - start,
                           peak_rss_bytes=peak_rss_bytes())


def _removed_params(ckpt, n: int, removed: list[int], scope: str) -> int:
    import re

    from compress.transforms.prune.layers import find_layer_prefix

    prefix = re.escape(find_layer_prefix(ckpt.names(), n))
    gone = set(removed)
    total = 0
    for name, info in ckpt.tensors.items():
        m = re.match(rf"^{prefix}\.(\d+)\.(.*)$", name)
        if m and int(m[1]) in gone and (scope == "layer" or _is_attention(m[2])):
            total += info.numel
    return total


def _is_attention(rel: str) -> bool:
    return rel.startswith("self_attn.") or rel.startswith("input_layernorm.")


def _merged_weights(ckpt, n: int, fisher, merged: dict[int, int], sparsity: float) -> dict:
    """GradPruner merge: new weights of the kept layers that receive pruned layers (original names)."""
    from compress.transforms.prune.gradpruner import merge_into
    from compress.transforms.prune.layers import find_layer_prefix

    prefix = find_layer_prefix(ckpt.names(), n)
    replace = {}
    for pruned, target in sorted(merged.items()):
        for rel, f in fisher.get(pruned, {}).items():
            src, dst = f"{prefix}.{pruned}.{rel}.weight", f"{prefix}.{target}.{rel}.weight"
            if src not in ckpt.tensors or dst not in ckpt.tensors:
                raise UnsupportedError(f"GradPruner merge: tensor {src!r} or {dst!r} not in the checkpoint")
            current = replace.get(dst, ckpt.get(dst).float())               # [out, in]
            replace[dst] = merge_into(current, ckpt.get(src).float(), f, sparsity)
    return replace


def _write_attention_pruned(ckpt, output_dir, removed: list[int], record: dict, overwrite: bool) -> dict:
    """Write a ``llama_attn_pruned`` checkpoint: the attention tensors of ``removed`` layers dropped."""
    import re

    from compress.transforms.prune import attn_pruned_llama
    from compress.transforms.prune.layers import remove_layers

    gone = set(removed)
    pattern = re.compile(r"^model\.layers\.(\d+)\.(.*)$")

    def drop(name: str) -> bool:
        m = pattern.match(name)
        return bool(m) and int(m[1]) in gone and _is_attention(m[2])

    def update(cfg: dict) -> dict:
        cfg["model_type"] = attn_pruned_llama.MODEL_TYPE
        cfg["architectures"] = ["AttnPrunedLlamaForCausalLM"]
        cfg["pruned_attention_layers"] = sorted(removed)
        cfg["auto_map"] = {"AutoConfig": "modeling_attn_pruned.AttnPrunedLlamaConfig",
                           "AutoModelForCausalLM": "modeling_attn_pruned.AttnPrunedLlamaForCausalLM"}
        return cfg

    code = Path(attn_pruned_llama.__file__).read_text()
    return remove_layers(ckpt, output_dir, [], record=record, drop=drop, config_update=update,
                         extra_files={"modeling_attn_pruned.py": code}, overwrite=overwrite)

