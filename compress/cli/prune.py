"""``compress prune entropy|cosine|gradpruner``: remove decoder layers. Parsing and rendering only."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from compress.cli.common import JsonOpt, OverwriteOpt, QuietOpt, emit_json, human, run, stdout


class Estimator(str, Enum):
    knn = "knn"
    bucket = "bucket"
    renyi = "renyi"


class Scope(str, Enum):
    layer = "layer"
    attention = "attention"


ModelArg = typer.Argument(..., help="Checkpoint folder, Hub id, pkg:NAME or .gguf (quantized input needs --dequantize).")
OutOpt = typer.Option(None, "--output-dir", "-o", help="Folder to write (refused if it exists, unless --overwrite).")
RemoveOpt = typer.Option(None, "--remove", "-k", help="Number of layers to remove.", min=1)
RatioOpt = typer.Option(None, "--ratio", help="Fraction of the layers to remove (rounded), instead of --remove.")
CalibOpt = typer.Option(..., "--calib", "--text", help="Calibration text file (UTF-8).", dir_okay=False)
SamplesOpt = typer.Option(32, "--samples", help="Calibration windows (paper: 128).", min=1)
SeqLenOpt = typer.Option(256, "--seq-len", help="Tokens per calibration window.", min=2)
ScopeOpt = typer.Option(Scope.layer, "--scope", help="layer: remove whole decoder layers; attention: remove only "
                        "attention sub-blocks (Llama; loads with trust_remote_code=True, see docs/prune.md).")
DryRunOpt = typer.Option(False, "--dry-run", help="Print the per-layer scores and the layers that would go; write nothing.")
DequantOpt = typer.Option(False, "--dequantize", help="Accept a quantized input (GGUF, quantization_config) by "
                          "dequantizing it to bfloat16 first.")
SeedOpt = typer.Option(0, "--seed", help="Seed of the calibration windows, LoRA init and data order.")
DeviceOpt = typer.Option("cpu", "--device", help="torch device for scoring/training, e.g. cpu or cuda:0.")


def _render(r, json_out: bool) -> None:
    if json_out:
        emit_json(r)
        return
    gone = set(r.removed)
    table = Table(title=f"{r.method}{' / ' + r.estimator if r.estimator else ''} scores (low = removable), scope {r.scope}")
    for col in ("layer", "score", ""):
        table.add_column(col, justify="right" if col != "" else "left")
    for i, s in enumerate(r.scores):
        note = "removed" if i in gone else ("kept (protected)" if i in r.protected else "")
        if i in r.merged:
            note += f", merged into {r.merged[i]}"
        table.add_row(str(i), f"{s:.6g}", note)
    stdout.print(table)
    verb = "would remove" if r.dry_run else "removed"
    what = "attention sub-blocks of layers" if r.scope == "attention" else "layers"
    stdout.print(f"{verb} {what} {r.removed}: {r.layers_before} -> {r.layers_after} layers, parameters "
                 f"{r.params_before:,} -> {r.params_after:,} (-{1 - r.params_after / r.params_before:.2%}); scoring "
                 f"{r.scoring_seconds:.1f} s, peak RSS {human(r.peak_rss_bytes)}", soft_wrap=True)
    if r.output:
        stdout.print(f"wrote {r.output}", soft_wrap=True)


def _go(model, output_dir, overwrite, dry_run, json_out, quiet, **fields) -> None:
    def work():
        from pydantic import ValidationError

        from compress.errors import validation_error
        from compress.transforms.prune import PruneConfig, prune

        try:
            config = PruneConfig(**fields)
        except ValidationError as e:
            raise validation_error(e, option=True) from None
        return prune(model, output_dir, config, overwrite=overwrite, dry_run=dry_run)

    _render(run(work, json_out), json_out)


def entropy(
    model: str = ModelArg, output_dir: Optional[Path] = OutOpt, remove: Optional[int] = RemoveOpt,
    ratio: Optional[float] = RatioOpt, calib: Path = CalibOpt, samples: int = SamplesOpt, seq_len: int = SeqLenOpt,
    estimator: Estimator = typer.Option(Estimator.knn, "--estimator", help="knn (k=25), bucket (histogram) or renyi."),
    scope: Scope = ScopeOpt, dequantize: bool = DequantOpt, seed: int = SeedOpt, device: str = DeviceOpt,
    dry_run: bool = DryRunOpt, overwrite: bool = OverwriteOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Entropy-based block pruning (arXiv 2504.03794): drop the blocks whose output adds the least entropy."""
    _go(model, output_dir, overwrite, dry_run, json_out, quiet, method="entropy", remove=remove, ratio=ratio, text=calib,
        samples=samples, seq_len=seq_len, estimator=estimator.value, scope=scope.value, dequantize=dequantize,
        seed=seed, device=device)


def cosine(
    model: str = ModelArg, output_dir: Optional[Path] = OutOpt, remove: Optional[int] = RemoveOpt,
    ratio: Optional[float] = RatioOpt, calib: Path = CalibOpt, samples: int = SamplesOpt, seq_len: int = SeqLenOpt,
    scope: Scope = ScopeOpt, dequantize: bool = DequantOpt, seed: int = SeedOpt, device: str = DeviceOpt,
    dry_run: bool = DryRunOpt, overwrite: bool = OverwriteOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """ShortGPT baseline (arXiv 2403.03853): drop the blocks with the lowest Block Influence 1 - cos(in, out)."""
    _go(model, output_dir, overwrite, dry_run, json_out, quiet, method="cosine", remove=remove, ratio=ratio, text=calib,
        samples=samples, seq_len=seq_len, scope=scope.value, dequantize=dequantize, seed=seed, device=device)


def gradpruner(
    model: str = ModelArg, output_dir: Optional[Path] = OutOpt, remove: Optional[int] = RemoveOpt,
    ratio: Optional[float] = RatioOpt,
    data: Path = typer.Option(..., "--data", help="Fine-tuning text file (UTF-8).", dir_okay=False),
    steps: int = typer.Option(40, "--steps", help="LoRA warm-up steps T (paper: 40).", min=1),
    lora_rank: int = typer.Option(8, "--lora-rank", min=1), lora_alpha: int = typer.Option(32, "--lora-alpha", min=1),
    lr: float = typer.Option(2e-4, "--lr", help="AdamW learning rate of the warm-up.", min=0.0),
    batch_size: int = typer.Option(1, "--batch-size", help="Windows per step.", min=1),
    seq_len: int = SeqLenOpt,
    sparsity: float = typer.Option(0.8, "--sparsity", help="Fraction of each pruned linear dropped before merging "
                                   "(0.8 keeps the top 20% by IGIA)."),
    merge_layers: Optional[int] = typer.Option(None, "--merge-layers", help="How many removed layers to merge into "
                                               "their preceding kept layer, highest score first (default: all; 0: none).",
                                               min=0),
    dequantize: bool = DequantOpt, seed: int = SeedOpt, device: str = DeviceOpt, dry_run: bool = DryRunOpt,
    overwrite: bool = OverwriteOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """GradPruner (arXiv 2601.19503): score layers by IGIA from T LoRA steps, prune, sparsify and merge."""
    _go(model, output_dir, overwrite, dry_run, json_out, quiet, method="gradpruner", remove=remove, ratio=ratio, text=data,
        steps=steps, lora_rank=lora_rank, lora_alpha=lora_alpha, lr=lr, batch_size=batch_size, seq_len=seq_len,
        sparsity=sparsity, merge_layers=merge_layers, dequantize=dequantize, seed=seed, device=device)


def register(app: typer.Typer) -> None:
    """Add ``prune entropy|cosine|gradpruner`` to ``app``."""
    from compress.cli.common import group

    sub = group(app, "prune", "Remove decoder layers: entropy-based, ShortGPT cosine baseline, GradPruner.")
    sub.command("entropy")(entropy)
    sub.command("cosine")(cosine)
    sub.command("gradpruner")(gradpruner)
