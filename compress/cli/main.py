"""The ``compress`` command: one Typer app, one module per command group."""

from __future__ import annotations

import importlib
import pkgutil

import typer

import compress.cli

app = typer.Typer(name="compress", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Compress Hugging Face checkpoints: lossless coding, quantization, pruning, merging, "
                       "fingerprints, distillation, evaluation.")


def _register_all() -> None:
    """Import every command module in ``compress.cli`` and call its ``register(app)``.

    A new method adds one module here and touches nothing else. Modules import heavy libraries
    (torch, transformers) inside their commands only, so ``compress --help`` stays fast.
    """
    for info in sorted(pkgutil.iter_modules(compress.cli.__path__), key=lambda m: m.name):
        if info.name in ("main", "common"):
            continue
        module = importlib.import_module(f"compress.cli.{info.name}")
        if hasattr(module, "register"):
            module.register(app)


_register_all()


def main() -> None:
    """Console-script entry point: usage errors as one line (exit 2), SIGTERM like Ctrl-C
    (temporary outputs are removed on the way out)."""
    import signal
    import sys

    try:  # typer >= 0.20 vendors click
        from typer._click import exceptions as click_exc
    except ImportError:  # pragma: no cover - older typer on real click
        from click import exceptions as click_exc

    def _terminate(signum, frame):
        sys.stderr.write("error: terminated; no output was written\n")
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, _terminate)
    try:
        code = app(standalone_mode=False)  # a typer.Exit raised in a command comes back as its code
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        sys.stderr.write("error: interrupted\n")
        code = 130
    except click_exc.NoArgsIsHelpError as e:
        sys.stdout.write(e.ctx.get_help() + "\n")
        code = 0
    except click_exc.UsageError as e:
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        sys.stderr.write(f"error: {e.format_message()}{hint}\n")
        code = 2
        if "--json" in sys.argv[1:]:
            import json

            sys.stdout.write(json.dumps({"error": e.format_message(), "exit_code": 2}) + "\n")
    except click_exc.ClickException as e:
        sys.stderr.write(f"error: {e.format_message()}\n")
        code = e.exit_code
    sys.exit(code if isinstance(code, int) else 0)
