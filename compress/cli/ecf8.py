"""ECF8 commands: encode ecf8, decode, verify, inspect, convert. Parsing and rendering only."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from compress.cli.common import JsonOpt, OverwriteOpt, QuietOpt, RevisionOpt, emit_json, human, progress, run, stderr, stdout

DtypeOpt = typer.Option(None, "--dtype", help="GGUF input: dtype to dequantize to (default bfloat16). "
                                              "Safetensors input: cast float tensors to it.")
class Backend(str, Enum):
    """Decoder backends (compress.kernels.ecf8)."""

    auto = "auto"
    cpu = "cpu"
    torch = "torch"
    triton = "triton"


BackendOpt = typer.Option(Backend.auto, "--backend", help="Decoder: auto, cpu (compiled), torch (reference) or "
                                                          "triton (CUDA; CPU only under TRITON_INTERPRET=1).")


def _size_table(report, title: str) -> Table:
    table = Table(title=title)
    for col in ("", "bytes", "% of original"):
        table.add_column(col, justify="right" if col else "left")
    table.add_row("original", human(report.original_bytes), "100.00%")
    table.add_row("stored (weight files)", human(report.file_bytes), f"{100 * report.ratio:.2f}%")
    table.add_row("exponent-entropy bound*", human(report.bound_bytes), f"{100 * report.bound_ratio:.2f}%")
    table.add_row("distance to bound", human(report.file_bytes - report.bound_bytes),
                  f"{100 * (report.file_bytes / max(report.bound_bytes, 1) - 1):+.2f}% rel.")
    table.caption = ("* exponents at their per-tensor entropy, sign and mantissa raw; ECF8 can go below it "
                     "by coding top mantissa bits with the exponent")
    return table


def encode(
    model: str = typer.Argument(..., help="Checkpoint folder, Hub id, pkg:NAME or .gguf file."),
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Folder to write (refused if it exists, "
                                    "unless --overwrite)."),
    revision: Optional[str] = RevisionOpt,
    dtype: Optional[str] = DtypeOpt,
    slice_size: int = typer.Option(2048, "--slice-size", help="Symbols per independently decodable slice."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard, e.g. 5GB."),
    verify: bool = typer.Option(False, "--verify", help="Decode the result and compare every tensor."),
    overwrite: bool = OverwriteOpt,
    json_out: bool = JsonOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Losslessly encode every float tensor's exponents (ECF8); prints sizes against the bound."""

    def work():
        from compress.checkpoint import Checkpoint
        from pydantic import ValidationError

        from compress.errors import validation_error
        from compress.transforms.ecf8 import ECF8Config, encode_checkpoint

        try:
            config = ECF8Config(slice_size=slice_size)
        except ValidationError as e:
            raise validation_error(e, option=True) from None
        start = time.perf_counter()
        with Checkpoint.open(model, revision=revision, dtype=dtype) as src:
            total = sum(i.nbytes for i in src.tensors.values())
            with progress(total, "encoding", not (quiet or json_out)) as advance:
                report, checked = encode_checkpoint(src, output_dir, config, max_shard_size=max_shard_size,
                                                    overwrite=overwrite, verify=verify, progress=advance)
            skipped = src.skipped_files()
        seconds = time.perf_counter() - start
        result = {"output": str(output_dir), "seconds": seconds, "skipped_files": skipped,
                  **report.model_dump(exclude={"tensors"})}
        if checked is not None:
            result["verify"] = checked.model_dump()
            if not checked.ok:
                result.update(output=None, error="verification failed; the output was not written", exit_code=3)
        if json_out:
            emit_json(result)
            return result
        stdout.print(_size_table(report, f"ECF8 {model} -> {output_dir}"))
        stdout.print(f"{len(report.tensors)} tensors, {seconds:.1f} s end to end")
        if skipped:
            stdout.print(f"not carried over (other copies of the weights): {', '.join(skipped)}")
        if checked is not None and checked.ok:
            stdout.print(f"verify: [green]OK[/green] ({checked.tensors} tensors bit-identical, files match)")
        elif checked is not None:
            stdout.print(f"verify: [red]FAILED[/red], nothing written: {checked.mismatches}", soft_wrap=True)
        return result

    result = run(work, json_out)
    if verify and not result["verify"]["ok"]:
        stderr.print("[red]error:[/red] verification failed; the output was not written")
        raise typer.Exit(3)


def _verify(original, encoded_path: str, backend: str, quiet: bool):
    from compress.checkpoint import MANIFEST_NAME
    from compress.errors import ConfigError, FormatError
    from compress.eval.verify import VerifyReport, verify_checkpoint
    from compress.formats.ecf8 import EncodedCheckpoint
    from compress.kernels.ecf8 import check_backend

    check_backend(backend)
    if not Path(encoded_path).exists():
        raise ConfigError(f"{encoded_path}: no such folder")
    try:
        encoded = EncodedCheckpoint.open(encoded_path)
    except (FormatError, ConfigError) as e:
        if not (Path(encoded_path) / MANIFEST_NAME).exists():
            raise  # not a compress output at all: a format or usage error, not a failed check
        return VerifyReport(ok=False, tensors=0, bytes=0, mismatches=[f"cannot read encoded checkpoint: {e}"])
    total = sum(i.nbytes for i in original.tensors.values())
    with progress(total, "verifying", not quiet) as advance:
        return verify_checkpoint(original, encoded, backend=backend, progress=advance)


def verify(
    original: str = typer.Argument(..., help="The original checkpoint (folder, Hub id, pkg:NAME or .gguf)."),
    encoded: str = typer.Argument(..., help="The encoded checkpoint."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Dtype the original was read at when encoding "
                                        "(default: the one recorded in the encoded checkpoint)."),
    revision: Optional[str] = RevisionOpt,
    backend: Backend = BackendOpt,
    json_out: bool = JsonOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Decode ENCODED and compare every tensor, the index and the other files with ORIGINAL. Exit 3 on any difference."""

    def work():
        import json

        from compress.checkpoint import Checkpoint, read_header

        from compress.checkpoint import dtype_name
        from compress.errors import CompressError
        from compress.eval.verify import VerifyReport

        cast = dtype
        if cast is None:  # the encoder records the dtype it read the original at
            try:
                shards = sorted(Path(encoded).glob("*.safetensors"))
                cast = json.loads(read_header(shards[0])[1].get("compress.source", "{}")).get("dtype") if shards else None
                if cast is not None and dtype_name(cast) not in ("F32", "F16", "BF16"):
                    raise ValueError(cast)
            except (CompressError, ValueError, TypeError, AttributeError, OSError) as e:
                return VerifyReport(ok=False, tensors=0, bytes=0,
                                    mismatches=[f"cannot read the encoded checkpoint's provenance: {e}"])
        with Checkpoint.open(original, revision=revision, dtype=cast) as src:
            return _verify(src, encoded, backend.value, quiet or json_out)

    report = run(work, json_out)
    if json_out:
        emit_json({**report.model_dump(), **({} if report.ok else {"error": "verification failed", "exit_code": 3})})
    elif report.ok:
        stdout.print(f"[green]OK[/green]: {report.tensors} tensors ({human(report.bytes)}) bit-identical; index and files match")
    else:
        stdout.print(f"[red]FAILED[/red]: {len(report.mismatches)} problem(s)")
        for line in report.mismatches:
            stdout.print(f"  {line}", soft_wrap=True)
    if not report.ok:
        stderr.print(f"[red]error:[/red] verification failed: {len(report.mismatches)} problem(s)")
        raise typer.Exit(3)


def decode(
    encoded: str = typer.Argument(..., help="An ecf8 checkpoint (folder or Hub id)."),
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Folder to write (refused if it exists, "
                                    "unless --overwrite)."),
    revision: Optional[str] = RevisionOpt,
    backend: Backend = BackendOpt,
    overwrite: bool = OverwriteOpt,
    json_out: bool = JsonOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Write the original checkpoint back, every tensor bit-identical (checksums checked)."""

    def work():
        from compress.formats.ecf8 import EncodedCheckpoint, decode_checkpoint

        start = time.perf_counter()
        enc = EncodedCheckpoint.open(encoded, revision=revision)
        total = sum(i.nbytes for i in enc.checkpoint.tensors.values())
        with progress(total, "decoding", not (quiet or json_out)) as advance:
            result = decode_checkpoint(enc, output_dir, overwrite=overwrite, backend=backend.value, progress=advance)
        result["seconds"] = time.perf_counter() - start
        return result

    result = run(work, json_out)
    if json_out:
        emit_json(result)
    else:
        stdout.print(f"decoded {result['tensors']} tensors ({human(result['bytes'])}) into {result['output']} "
                     f"in {result['seconds']:.1f} s; checksums OK")


def inspect(
    path: str = typer.Argument(..., help="A checkpoint, encoded or not."),
    revision: Optional[str] = RevisionOpt,
    dtype: Optional[str] = DtypeOpt,
    json_out: bool = JsonOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Per tensor: dtype, shape, bytes before/after, exponent entropy, bits/weight, distance to the bound."""

    def work():
        from compress.eval.size import inspect_checkpoint

        return inspect_checkpoint(path, revision=revision, dtype=dtype)

    report = run(work, json_out)
    if json_out:
        emit_json({**report.model_dump(), "tensors": [{**t.model_dump(), "bits_per_weight": t.bits_per_weight}
                                                      for t in report.tensors]})
        return
    table = Table(title=f"{path}")
    for col in ("tensor", "dtype", "shape", "codec", "before", "after", "exp. H", "bits/w", "vs bound"):
        table.add_column(col, justify="left" if col in ("tensor", "dtype", "codec") else "right")
    for t in report.tensors:
        table.add_row(t.name, t.dtype, "x".join(map(str, t.shape)) or "()", t.codec + (f"/{t.symbol}" if t.symbol else ""),
                      human(t.original_bytes), human(t.stored_bytes),
                      f"{t.exponent_entropy:.3f}" if t.exponent_entropy is not None else "-",
                      f"{t.bits_per_weight:.3f}", f"{100 * (t.stored_bytes / max(t.bound_bytes, 1) - 1):+.2f}%")
    stdout.print(table)
    stdout.print(_size_table(report, "totals"))


def convert(
    model: str = typer.Argument(..., help="Checkpoint folder, Hub id, pkg:NAME or .gguf file."),
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Folder to write (refused if it exists, "
                                    "unless --overwrite)."),
    dtype: Optional[str] = DtypeOpt,
    revision: Optional[str] = RevisionOpt,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard, e.g. 5GB."),
    overwrite: bool = OverwriteOpt,
    json_out: bool = JsonOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Write any readable checkpoint (GGUF included) as plain safetensors, optionally cast.

    float8_e4m3fn stores every 2-d+ weight as FP8 with a per-tensor <name>_scale_inv (float32):
    real FP8 weights for lossless-coding work; transformers does not load this layout as a model.
    """

    def work():
        from compress.checkpoint import Checkpoint, dtype_name
        from compress.transforms.cast import convert_checkpoint

        fp8 = dtype is not None and dtype_name(dtype) == "F8_E4M3"
        with Checkpoint.open(model, revision=revision, dtype=None if fp8 else dtype) as src:
            total = sum(i.nbytes for i in src.tensors.values())
            with progress(total, "converting", not (quiet or json_out)) as advance:
                return convert_checkpoint(src, output_dir, fp8=fp8, max_shard_size=max_shard_size,
                                          overwrite=overwrite, progress=advance)

    result = run(work, json_out)
    if json_out:
        emit_json(result)
    else:
        stdout.print(f"wrote {result['tensors']} tensors to {result['output']}")


def register(app: typer.Typer) -> None:
    """Add ``encode ecf8``, ``decode``, ``verify``, ``inspect`` and ``convert`` to ``app``."""
    from compress.cli.common import group

    group(app, "encode", "Encode a checkpoint into a lossless compress format.").command("ecf8")(encode)
    app.command("decode")(decode)
    app.command("verify")(verify)
    app.command("inspect")(inspect)
    app.command("convert")(convert)
