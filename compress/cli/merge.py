"""``compress merge``: classic merges (linear, slerp, task-arithmetic, ties), the weight VAE and latent merging."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from compress.cli.common import JsonOpt, OverwriteOpt, QuietOpt, emit_json, human, run, stdout

ModelsArg = typer.Argument(None, help="Parent checkpoints: folders, Hub ids, pkg:NAME or .gguf (dequantized).")
OutOpt = typer.Option(..., "--output-dir", "-o", help="Folder to write (refused if it exists, unless --overwrite).")
BaseOpt = typer.Option(None, "--base", help="Base model (task vectors for task-arithmetic/ties; t=0 parent for slerp; "
                                            "the parent whose config and tokenizer the output keeps).")
WeightsOpt = typer.Option(None, "--weights", help="Comma-separated weight per model, in order (default 1 each).")
ConfigOpt = typer.Option(None, "--config", help="Merge-config YAML (mergekit-like) instead of the flags.", dir_okay=False)
DtypeOpt = typer.Option(None, "--dtype", help="Output dtype: bfloat16, float16 or float32 (default: the base's).")
DryRunOpt = typer.Option(False, "--dry-run", help="Check the parents and plan the merge; write nothing.")


def _floats(text: Optional[str], what: str, n: int) -> Optional[list[float]]:
    from compress.errors import ConfigError

    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: expected comma-separated numbers") from None
    if len(values) == 1 and n > 1:
        values = values * n
    if len(values) != n:
        raise ConfigError(f"--{what}: {len(values)} values for {n} models")
    return values


def _classic(method: str, models, output_dir, base, weights, t, density, lam, normalize, config, dtype,
             overwrite, dry_run, json_out):
    def work():
        from pydantic import ValidationError

        from compress.errors import ConfigError
        from compress.transforms.merge import MergeConfig, config_error, load_merge_config, merge

        if config is not None:
            if models:
                raise ConfigError("give the models either as arguments or in --config, not both")
            cfg = load_merge_config(config)
            if cfg.merge_method != method:
                raise ConfigError(f"--config says merge_method {cfg.merge_method!r}, but the command is {method!r}")
        else:
            names = list(models or [])
            if base is not None and base not in names and method in ("linear", "slerp"):
                names = [base] + names
            ws = _floats(weights, "weights", len(names))
            ds = _floats(density, "density", len(names))
            entries = [{"model": m, "parameters": {k: v for k, v in (("weight", ws and ws[i]), ("density", ds and ds[i]))
                                                   if v is not None}} for i, m in enumerate(names)]
            params = {k: v for k, v in (("t", t), ("lambda", lam), ("normalize", normalize)) if v is not None}
            try:
                cfg = MergeConfig(merge_method=method, models=entries, base_model=base, parameters=params, dtype=dtype)
            except ValidationError as e:
                raise config_error(e, f"merge {method}") from None
        return merge(cfg, output_dir, overwrite=overwrite, dry_run=dry_run)

    r = run(work, json_out)
    if json_out:
        emit_json(r)
        return
    verb = "planned" if dry_run else "wrote"
    stdout.print(f"{r.method}: {verb} {r.tensors} tensors ({r.merged} merged, {r.copied} copied) from "
                 f"{len(r.parents)} parents to {r.output}, {human(r.output_bytes)} in {r.seconds:.1f} s, "
                 f"peak RSS {human(r.peak_rss_bytes)}", soft_wrap=True)
    for note in r.notes:
        stdout.print(f"  note: {note}", soft_wrap=True)


def linear(models: Optional[list[str]] = ModelsArg, output_dir: Path = OutOpt, base: Optional[str] = BaseOpt,
           weights: Optional[str] = WeightsOpt,
           normalize: Optional[bool] = typer.Option(None, "--normalize/--no-normalize", help="Divide by the weight sum (default on)."),
           config: Optional[Path] = ConfigOpt, dtype: Optional[str] = DtypeOpt, overwrite: bool = OverwriteOpt,
           dry_run: bool = DryRunOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt) -> None:
    """Weighted average of same-architecture models (mergekit `linear`)."""
    _classic("linear", models, output_dir, base, weights, None, None, None, normalize, config, dtype, overwrite, dry_run, json_out)


def slerp(models: Optional[list[str]] = ModelsArg, output_dir: Path = OutOpt, base: Optional[str] = BaseOpt,
          t: Optional[float] = typer.Option(None, "--t", help="Interpolation factor: 0 = first/base model, 1 = the other."),
          config: Optional[Path] = ConfigOpt, dtype: Optional[str] = DtypeOpt, overwrite: bool = OverwriteOpt,
          dry_run: bool = DryRunOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt) -> None:
    """Spherical interpolation of two models, per tensor (mergekit `slerp`; lerp for colinear tensors)."""
    _classic("slerp", models, output_dir, base, None, t, None, None, None, config, dtype, overwrite, dry_run, json_out)


def task_arithmetic(models: Optional[list[str]] = ModelsArg, output_dir: Path = OutOpt, base: Optional[str] = BaseOpt,
                    weights: Optional[str] = WeightsOpt,
                    lam: Optional[float] = typer.Option(None, "--lambda", help="Scale of the summed task vector (default 1)."),
                    config: Optional[Path] = ConfigOpt, dtype: Optional[str] = DtypeOpt, overwrite: bool = OverwriteOpt,
                    dry_run: bool = DryRunOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt) -> None:
    """base + lambda * sum_i w_i (model_i - base) (arXiv 2212.04089)."""
    _classic("task_arithmetic", models, output_dir, base, weights, None, None, lam, None, config, dtype, overwrite, dry_run, json_out)


def ties(models: Optional[list[str]] = ModelsArg, output_dir: Path = OutOpt, base: Optional[str] = BaseOpt,
         weights: Optional[str] = WeightsOpt,
         density: Optional[str] = typer.Option(None, "--density", help="Fraction of each task vector kept (one value or one per model)."),
         lam: Optional[float] = typer.Option(None, "--lambda", help="Scale of the merged task vector (default 1)."),
         config: Optional[Path] = ConfigOpt, dtype: Optional[str] = DtypeOpt, overwrite: bool = OverwriteOpt,
         dry_run: bool = DryRunOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt) -> None:
    """TIES-Merging: trim, elect sign, disjoint mean (arXiv 2306.01708)."""
    _classic("ties", models, output_dir, base, weights, None, density, lam, None, config, dtype, overwrite, dry_run, json_out)


class Target(str, Enum):
    """Which parent's architecture and shapes the latent merge decodes into."""

    A = "A"
    B = "B"


class Align(str, Enum):
    """How layers of different-depth parents are paired."""

    ot = "ot"
    depth = "depth"


def train_vae(models: list[str] = typer.Argument(..., help="Checkpoints whose weights the VAE learns (same family)."),
              output_dir: Path = OutOpt,
              chunk_size: int = typer.Option(10240, "--chunk-size", min=16, help="Values per chunk (a chunk never crosses a tensor)."),
              tokens: int = typer.Option(16, "--tokens", min=1, help="Tokens per chunk (token width = chunk-size / tokens)."),
              width: int = typer.Option(768, "--width", min=8, help="Transformer width."),
              layers: int = typer.Option(4, "--layers", min=1, help="Encoder blocks (and as many decoder blocks)."),
              heads: int = typer.Option(4, "--heads", min=1, help="Attention heads."),
              code_dim: int = typer.Option(64, "--code-dim", min=1, help="Per-token width of the stage-2 compact code."),
              steps: int = typer.Option(2000, "--steps", min=1, help="Stage-1 optimizer steps (full-capacity latent)."),
              neck_steps: Optional[int] = typer.Option(None, "--neck-steps", min=0, help="Stage-2 steps (compact neck; default steps/4)."),
              batch_size: int = typer.Option(32, "--batch-size", min=1, help="Chunks per step."),
              lr: float = typer.Option(3e-4, "--lr", min=0.0, help="AdamW learning rate."),
              max_chunks: int = typer.Option(0, "--max-chunks", min=0, help="Chunks per model to train on (0: all)."),
              seed: int = typer.Option(0, "--seed"), overwrite: bool = OverwriteOpt,
              json_out: bool = JsonOpt, quiet: bool = QuietOpt) -> None:
    """Train the LS-Merge weight VAE (two stages) on the parents' weights; saves safetensors + config."""
    def work():
        from pydantic import ValidationError

        from compress.transforms.lsmerge import VAEConfig, VAETrainConfig, train_vae as train
        from compress.transforms.merge import config_error

        try:
            vae = VAEConfig(chunk_size=chunk_size, tokens=tokens, width=width, layers=layers, heads=heads, code_dim=code_dim)
            tc = VAETrainConfig(steps=steps, neck_steps=steps // 4 if neck_steps is None else neck_steps, batch_size=batch_size,
                                lr=lr, max_chunks=max_chunks or None, seed=seed)
        except ValidationError as e:
            raise config_error(e, "train-vae") from None
        return train(models, output_dir, vae, tc, overwrite=overwrite, log=not (quiet or json_out))

    r = run(work, json_out)
    if json_out:
        emit_json(r)
        return
    stdout.print(f"VAE ({r.parameters / 1e6:.2f} M parameters) trained on {r.train_chunks} chunks of {len(r.models)} "
                 f"model(s) in {r.seconds:.0f} s: stage-1 loss {r.stage1_loss:.4f}, stage-2 loss {r.stage2_loss:.4f}, "
                 f"relative error {r.relative_error:.4f} (full latent) / {r.relative_error_compact:.4f} (compact code) "
                 f"-> {r.output}", soft_wrap=True)


def latent(model_a: str = typer.Argument(..., help="Parent A."), model_b: str = typer.Argument(..., help="Parent B."),
           output_dir: Path = OutOpt, vae: Path = typer.Option(..., "--vae", help="VAE folder from `compress merge train-vae`."),
           t: float = typer.Option(0.5, "--t", help="0 = A, 1 = B."),
           target: Target = typer.Option(Target.A, "--target", help="Architecture of the output."),
           corrected: bool = typer.Option(False, "--corrected", help="Add back the interpolated reconstruction residuals: "
                                          "lerp(W_A, W_B) + Dec(z_t) - lerp(Dec(z_A), Dec(z_B))."),
           align: Align = typer.Option(Align.ot, "--align", help="Layer pairing for different depths: ot (assignment on "
                                       "latents) or depth (relative depth)."),
           space: str = typer.Option("full", "--space", help="Interpolate the full latent or the compact code (compact)."),
           batch_size: int = typer.Option(256, "--batch-size", min=1, help="Chunks per encoder/decoder pass."),
           dtype: Optional[str] = DtypeOpt, overwrite: bool = OverwriteOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt) -> None:
    """Latent-space merge (LS-Merge): encode both parents' chunks, align, interpolate, decode into the target's shapes."""
    def work():
        from pydantic import ValidationError

        from compress.transforms.lsmerge import LatentMergeConfig, latent_merge
        from compress.transforms.merge import config_error

        try:
            cfg = LatentMergeConfig(t=t, target=target.value, corrected=corrected, align=align.value, space=space,
                                    batch_size=batch_size, dtype=dtype)
        except ValidationError as e:
            raise config_error(e, "merge latent") from None
        return latent_merge(model_a, model_b, vae, output_dir, cfg, overwrite=overwrite)

    r = run(work, json_out)
    if json_out:
        emit_json(r)
        return
    stdout.print(f"latent merge t={r.t} into {r.target} ({'corrected' if r.corrected else 'decoded'}): {r.encoded_tensors} "
                 f"tensors through the VAE ({r.chunks} chunks), {r.carried_tensors} interpolated directly, "
                 f"{r.seconds:.1f} s -> {r.output}", soft_wrap=True)
    if r.layer_map:
        stdout.print(f"  layers (target <- other parent): {r.layer_map}", soft_wrap=True)
    for note in r.notes:
        stdout.print(f"  note: {note}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``merge linear|slerp|task-arithmetic|ties|train-vae|latent`` to ``app``."""
    from compress.cli.common import group

    sub = group(app, "merge", "Merge models: linear, slerp, task-arithmetic, ties, and latent-space (LS-Merge).")
    sub.command("linear")(linear)
    sub.command("slerp")(slerp)
    sub.command("task-arithmetic")(task_arithmetic)
    sub.command("ties")(ties)
    sub.command("train-vae")(train_vae)
    sub.command("latent")(latent)
