"""Physical removal of decoder layers from a checkpoint, streamed tensor by tensor.

Reusable by every method that drops layers (pruning, distillation students, merging of
models of different depths): :func:`remove_layers` reads a checkpoint lazily, skips the
tensors of the removed layers, renumbers the rest, lets the caller replace any kept tensor
(GradPruner's merged weights), rewrites ``config.json`` (``num_hidden_layers`` and every
per-layer field) and writes the result atomically with :class:`compress.checkpoint.CheckpointWriter`.

Why streaming and not ``save_pretrained``: the pass needs no model in memory, so its peak is
one tensor (plus the replacements the caller holds); a 70B checkpoint prunes in a few GB of RAM.
The output is a plain HF checkpoint that ``from_pretrained`` loads without compress.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from compress.errors import ConfigError, UnsupportedError

#: Name of the record every pruned checkpoint carries (scores, removed indices, method).
RECORD_NAME = "compress_prune.json"
#: ``config.json`` key holding the same record in short form.
CONFIG_KEY = "compress_prune"

# Config fields that list layer *indices* (not one entry per layer): indices are remapped.
_INDEX_LIST_KEYS = ("mlp_only_layers", "attn_layer_indices", "full_attn_idxs", "global_attn_layers", "swa_layers",
                    "no_rope_layers_idx", "moe_layers", "dense_layers", "pruned_attention_layers")
# Config fields that hold a layer count boundary ("layers below k are ..."): recomputed.
_BOUNDARY_KEYS = ("max_window_layers", "first_k_dense_replace")
# Top-level names under which decoder layers are commonly stored, most specific first.
_LAYER_LIST = re.compile(r"^(?P<prefix>(?:[\w.]*\.)?(?:layers|h|blocks|layer|decoder_layers))\.(?P<idx>\d+)\.")


def config_layers(config: Mapping[str, Any]) -> int:
    """The number of decoder layers a ``config.json`` declares.

    Raises:
        UnsupportedError: no ``num_hidden_layers`` (or ``n_layer``/``num_layers``) field, top-level or in ``text_config``.
    """
    for cfg in (config, config.get("text_config") or {}):
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(cfg.get(key), int):
                return int(cfg[key])
    raise UnsupportedError(f"model type {config.get('model_type')!r}: config.json has no num_hidden_layers; "
                           "cannot find its decoder layers")


def find_layer_prefix(names: list[str], n_layers: int) -> str:
    """The tensor-name prefix of the decoder layer list, e.g. ``"model.layers"``.

    The prefix is the one whose numbered children are exactly ``0 .. n_layers-1``.

    Raises:
        UnsupportedError: no prefix has exactly ``n_layers`` numbered layers.
    """
    found: dict[str, set[int]] = {}
    for name in names:
        m = _LAYER_LIST.match(name)
        if m:
            found.setdefault(m["prefix"], set()).add(int(m["idx"]))
    hits = [p for p, idx in found.items() if idx == set(range(n_layers))]
    if len(hits) != 1:
        seen = ", ".join(f"{p} ({len(i)})" for p, i in sorted(found.items())) or "none"
        raise UnsupportedError(f"cannot find the decoder layer list: expected one tensor prefix with layers 0..{n_layers - 1} "
                               f"(num_hidden_layers), found {seen}; this model family is not supported")
    return hits[0]


def find_layer_modules(model):
    """The ``nn.ModuleList`` of decoder layers of an in-memory transformers model.

    Raises:
        UnsupportedError: no ModuleList with ``num_hidden_layers`` entries.
    """
    import torch

    n = config_layers(model.config.to_dict())
    try:
        layers = model.get_decoder().layers
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
            return layers
    except (AttributeError, NotImplementedError, TypeError):
        pass
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    if len(lists) != 1:
        raise UnsupportedError(f"{type(model).__name__}: cannot find its list of {n} decoder layers; "
                               "this model family is not supported")
    return lists[0]


def check_removal(n_layers: int, remove: list[int], protect_first: int = 2, protect_last: int = 1) -> list[int]:
    """Validate layer indices to remove; returns them sorted.

    Raises:
        ConfigError: an index is out of range, repeated, protected, or every layer would go.
    """
    out = sorted(set(remove))
    if len(out) != len(remove):
        raise ConfigError(f"layers to remove {remove} contain duplicates")
    bad = [i for i in out if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"layer indices {bad} are out of range for a model with {n_layers} layers")
    if len(out) >= n_layers:
        raise ConfigError(f"removing {len(out)} of {n_layers} layers would leave none")
    protected = set(range(min(protect_first, n_layers))) | set(range(max(n_layers - protect_last, 0), n_layers))
    hit = sorted(protected & set(out))
    if hit:
        raise ConfigError(f"layers {hit} are protected (the first {protect_first} and the last {protect_last} are kept)")
    return out


def prune_config(config: dict[str, Any], keep: list[int], record: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``config`` for a model that keeps only layers ``keep`` (old indices, ascending).

    Updates, at top level and in ``text_config``: ``num_hidden_layers`` (or ``n_layer``/``num_layers``);
    every list with one entry per layer (``layer_types``, per-layer sliding windows, ...) filtered;
    lists of layer indices (``mlp_only_layers``, ...) remapped to the new numbering; boundaries such as
    ``max_window_layers`` recounted. Adds ``compress_prune`` = ``record`` when given.
    """
    out = json.loads(json.dumps(config))
    old_n = config_layers(config)
    new_index = {old: new for new, old in enumerate(keep)}

    def fix(cfg: dict[str, Any]) -> None:
        for key in ("num_hidden_layers", "n_layer", "num_layers"):
            if isinstance(cfg.get(key), int) and cfg[key] == old_n:
                cfg[key] = len(keep)
        for key, value in list(cfg.items()):
            if key in _INDEX_LIST_KEYS and isinstance(value, list) and all(isinstance(v, int) for v in value):
                cfg[key] = [new_index[v] for v in value if v in new_index]
            elif isinstance(value, list) and len(value) == old_n:
                cfg[key] = [value[i] for i in keep]
            elif key in _BOUNDARY_KEYS and isinstance(value, int):
                cfg[key] = sum(1 for i in keep if i < value)

    fix(out)
    if isinstance(out.get("text_config"), dict):
        fix(out["text_config"])
    if record is not None:
        out[CONFIG_KEY] = record
    return out


def remove_layers(source, output_dir: str | Path, remove: list[int], *, replace: Mapping[str, Any] | None = None,
                  record: dict[str, Any] | None = None, drop: Callable[[str], bool] | None = None,
                  config_update: Callable[[dict], dict] | None = None, extra_files: Mapping[str, str] | None = None,
                  overwrite: bool = False, max_shard_size: int | str = "5GB", protect_first: int = 0,
                  protect_last: int = 0) -> dict[str, Any]:
    """Write ``source`` without the decoder layers ``remove``, renumbered, as a plain HF checkpoint.

    Streams tensor by tensor (peak memory: one tensor plus ``replace``). Tied embeddings stay
    tied (an absent ``lm_head.weight`` stays absent; ``tie_word_embeddings`` is kept), the
    tokenizer and every other non-weight file is copied, ``config.json`` is rewritten by
    :func:`prune_config`, and ``compress_prune.json`` holds ``record`` (scores, removed indices).

    Args:
        source: an open :class:`compress.checkpoint.Checkpoint`.
        output_dir: folder to create (atomic; refused if it exists unless ``overwrite``).
        remove: layer indices (0-based, original numbering) to drop; may be empty.
        replace: tensor name (original numbering) -> torch tensor to write instead of the stored one
            (same shape; cast to the stored dtype). Used for GradPruner's merged weights.
        record: JSON-able record written to ``compress_prune.json`` and ``config.json["compress_prune"]``.
        drop: extra predicate on original tensor names: True drops the tensor (attention-only pruning).
        config_update: final edit of the new config dict (returns it).
        extra_files: more text files to write, relative path -> text.
        protect_first, protect_last: layers that may not be removed (0: no rule here).

    Returns:
        ``{"output", "layers_before", "layers_after", "params_before", "params_after", "tensors"}``.

    Raises:
        ConfigError: bad indices, removing every layer, an existing output, a replacement of an unknown tensor.
        UnsupportedError: the layer list cannot be found.
    """
    import numpy as np
    import torch

    from compress.checkpoint import CheckpointWriter, dtype_name, torch_dtype

    config = source.config()
    n = config_layers(config)
    prefix = find_layer_prefix(source.names(), n)
    remove = check_removal(n, list(remove), protect_first, protect_last)
    keep = [i for i in range(n) if i not in set(remove)]
    new_index = {old: new for new, old in enumerate(keep)}
    replace = dict(replace or {})
    unknown = sorted(set(replace) - set(source.names()))
    if unknown:
        raise ConfigError(f"replacement tensors {unknown[:3]} are not in {source.source}")
    pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)\.(.*)$")
    params_before = params_after = count = 0
    new_config = prune_config(config, keep, record)
    if config_update is not None:
        new_config = config_update(new_config)
    with CheckpointWriter(output_dir, max_shard_size=max_shard_size, overwrite=overwrite, inputs=(source.path,)) as writer:
        for name in source.names():
            info = source.info(name)
            params_before += info.numel
            m = pattern.match(name)
            if m and int(m[1]) not in new_index:
                continue
            if drop is not None and drop(name):
                continue
            out_name = f"{prefix}.{new_index[int(m[1])]}.{m[2]}" if m else name
            if name in replace:
                t = replace[name].detach().to("cpu")
                if tuple(t.shape) != info.shape:
                    raise ConfigError(f"replacement for {name!r} has shape {tuple(t.shape)}, stored {list(info.shape)}")
                dtype = source.cast or info.dtype
                t = t.to(torch_dtype(dtype)).contiguous()
                bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()
                writer.add({out_name: (dtype_name(t.dtype), tuple(t.shape), np.ascontiguousarray(bits))})
            else:
                dtype, bits = source.read_array(name)
                writer.add({out_name: (dtype, tuple(bits.shape), bits)})
            params_after += info.numel
            count += 1
        files = [f for f in source.extra_files() if str(f) not in ("config.json", RECORD_NAME)]
        writer.copy_files(source.path, files)
        writer.write_text("config.json", json.dumps(new_config, indent=2, sort_keys=True) + "\n")
        if record is not None:
            writer.write_text(RECORD_NAME, json.dumps(record, indent=1) + "\n")
        for rel, text in (extra_files or {}).items():
            writer.write_text(rel, text)
        out = writer.commit()
    return {"output": str(out), "layers_before": n, "layers_after": len(keep), "params_before": params_before,
            "params_after": params_after, "tensors": count}
