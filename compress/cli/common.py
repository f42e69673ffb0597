"""Shared CLI plumbing: one-line errors with the exit codes of STYLE.md, --json output, progress.

Heavy libraries (torch, transformers, numba) are imported inside commands, never here, so
``compress --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Callable, Iterator

import typer
from rich.console import Console

stderr = Console(stderr=True, highlight=False)
stdout = Console(highlight=False, width=None if sys.stdout.isatty() else 160)

JsonOpt = typer.Option(False, "--json", help="Print exactly one JSON object on stdout.")
QuietOpt = typer.Option(False, "--quiet", "-q", help="No progress or logs on stderr.")
OverwriteOpt = typer.Option(False, "--overwrite", help="Replace an existing output folder.")
RevisionOpt = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit) for Hub ids.")


def group(app: typer.Typer, name: str, help: str) -> typer.Typer:
    """The sub-command group ``name`` of ``app`` (``compress encode``, ``compress quantize``, ...),
    made on first use so several modules can add commands to one group."""
    for info in app.registered_groups:
        if info.name == name:
            return info.typer_instance
    sub = typer.Typer(no_args_is_help=True, help=help)
    app.add_typer(sub, name=name)
    return sub


def fail(message: str, code: int, json_out: bool = False) -> None:
    """Print one error line on stderr (and, under --json, ``{"error", "exit_code"}`` on stdout); exit."""
    stderr.print(f"[red]error:[/red] {message}", soft_wrap=True, markup=True)
    if json_out:
        emit_json({"error": message, "exit_code": code})
    raise typer.Exit(code)


def run(fn: Callable[[], Any], json_out: bool = False) -> Any:
    """Call ``fn``; turn errors into one line on stderr and the mapped exit code.

    CompressError subclasses carry their exit code (1 runtime, 2 usage/config, 3 verification);
    anything else is an internal error (exit 1). ``COMPRESS_DEBUG=1`` re-raises with a traceback.
    """
    from compress.errors import CompressError

    debug = os.environ.get("COMPRESS_DEBUG") == "1"
    try:
        return fn()
    except CompressError as e:
        if debug:
            raise
        fail(_escape(str(e)), e.exit_code, json_out)
    except KeyboardInterrupt:
        fail("interrupted; no output was written", 130, json_out)
    except OSError as e:
        if debug:
            raise
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        fail(_escape(f"{e.strerror or e}{where}"), 1, json_out)
    except MemoryError:
        fail("out of memory", 1, json_out)
    except Exception as e:  # internal error: still one line unless debugging
        if debug:
            raise
        fail(_escape(f"internal error: {type(e).__name__}: {e} (COMPRESS_DEBUG=1 shows the traceback)"), 1, json_out)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text.replace("\n", " "))


def emit_json(obj: Any) -> None:
    """Print one JSON object on stdout (pydantic models are dumped)."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(mode="json")
    sys.stdout.write(json.dumps(obj, indent=None, separators=(",", ":")) + "\n")


@contextlib.contextmanager
def progress(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich byte-progress bar on stderr, off under --json, --quiet or a non-TTY stderr.

    Yields:
        ``advance(n_bytes)``.
    """
    if not enabled or not stderr.is_terminal:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=stderr, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def human(n: float) -> str:
    """Bytes as a short human string (decimal units)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"
