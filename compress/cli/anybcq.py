"""``compress quantize anybcq``: multi-precision binary-coded quantization. Parsing and rendering only."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from compress.cli.common import JsonOpt, OverwriteOpt, QuietOpt, RevisionOpt, emit_json, human, run, stderr, stdout


class Method(str, Enum):
    """Weight fit: AnyBCQ or the round-to-nearest baseline."""

    anybcq = "anybcq"
    rtn = "rtn"


def _parse_bits(text: str) -> tuple[int, ...]:

    from compress.errors import ConfigError

    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise ConfigError(f"--bits {text!r}: expected comma-separated integers, e.g. 2,3,4") from None


def quantize_anybcq(
    model: str = typer.Argument(..., help="Float checkpoint: folder, Hub id, pkg:NAME or .gguf file."),
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Folder to write (refused if it exists, unless --overwrite)."),
    bits: str = typer.Option("2,3,4", "--bits", help="Stored precisions, comma-separated; one set of planes serves all."),
    group_size: int = typer.Option(128, "--group-size", help="Input columns per scale group (multiple of 32)."),
    calib: Optional[Path] = typer.Option(None, "--calib", dir_okay=False,
                                         help="Calibration text file (UTF-8); needed when --iters > 0."),
    samples: int = typer.Option(8, "--samples", help="Calibration windows."),
    seq_len: int = typer.Option(128, "--seq-len", help="Tokens per calibration window."),
    iters: int = typer.Option(10, "--iters", help="Adam steps of block reconstruction per block and precision; "
                                                  "0 = calibration-free."),
    ignore: Optional[list[str]] = typer.Option(None, "--ignore", help="Leave matching linears unquantized (glob on the "
                                               "module name, or re:REGEX); repeatable; each must match."),
    method: Method = typer.Option(Method.anybcq, "--method", help="anybcq, or rtn (round-to-nearest baseline)."),
    asymmetric: bool = typer.Option(False, "--asymmetric", help="Fit an offset beta per group and precision."),
    seed: int = typer.Option(0, "--seed", help="Seed of calibration sampling and training batches."),
    revision: Optional[str] = RevisionOpt,
    overwrite: bool = OverwriteOpt,
    json_out: bool = JsonOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Quantize every linear (lm_head and embeddings kept) to the multi-precision anybcq format."""

    def work():
        from compress.checkpoint import Checkpoint
        from pydantic import ValidationError

        from compress.errors import ConfigError, validation_error
        from compress.eval.text import read_text
        from compress.transforms.anybcq import AnyBCQConfig, quantize_checkpoint

        try:
            config = AnyBCQConfig(bits=_parse_bits(bits), group_size=group_size, method=method.value,
                                  asymmetric=asymmetric, iters=iters, samples=samples, seq_len=seq_len,
                                  ignore=tuple(ignore or ()), seed=seed)
        except ValidationError as e:
            raise validation_error(e, option=True) from None
        text = read_text(calib) if calib is not None and config.iters > 0 and config.method == "anybcq" else None
        if calib is None and config.iters > 0 and config.method == "anybcq":
            raise ConfigError("--iters > 0 needs --calib FILE (calibration text); use --iters 0 for the "
                              "calibration-free version")
        log = None if (quiet or json_out) else (lambda s: stderr.print(s, highlight=False))
        with Checkpoint.open(model, revision=revision) as src:
            return quantize_checkpoint(src, output_dir, config, calib_text=text, overwrite=overwrite, log=log)

    r = run(work, json_out)
    if json_out:
        emit_json(r)
        return
    table = Table(title=f"{r.method} {','.join(map(str, r.bits))} bits, group {r.group_size} -> {r.output}")
    for col in ("bits", "bytes/weight", "rel. weight error", "block MSE before -> after"):
        table.add_column(col, justify="right")
    for p in r.precisions:
        mse = "-" if p.block_mse_before is None else f"{p.block_mse_before:.4g} -> {p.block_mse_after:.4g}"
        table.add_row(str(p.bits), f"{p.bytes_per_weight:.4f}", f"{p.relative_error:.4f}", mse)
    stdout.print(table)
    stdout.print(f"{r.quantized_modules} linears ({r.quantized_weights:,} weights) quantized; "
                 f"{len(r.ignored_modules)} kept; checkpoint {human(r.input_bytes)} -> {human(r.output_bytes)} "
                 f"({r.output_bytes / max(r.input_bytes, 1):.2%}); {r.seconds:.1f} s; peak RSS {r.peak_rss_mb:.0f} MiB",
                 soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``quantize anybcq`` to ``app``."""
    from compress.cli.common import group

    sub = group(app, "quantize", "Lossy quantization of checkpoints (AnyBCQ, RTN baseline).")
    sub.command("anybcq")(quantize_anybcq)
