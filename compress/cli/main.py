"""The ``compress`` command: one Typer app, one module per command group."""

from __future__ import annotations

import typer

from compress.cli import ecf8

app = typer.Typer(name="compress", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Compress Hugging Face checkpoints: lossless ECF8 coding, verification, inspection.")
encode_app = typer.Typer(no_args_is_help=True, help="Encode a checkpoint into a compress format.")
app.add_typer(encode_app, name="encode")
encode_app.command("ecf8")(ecf8.encode)
app.command("decode")(ecf8.decode)
app.command("verify")(ecf8.verify)
app.command("inspect")(ecf8.inspect)
app.command("convert")(ecf8.convert)


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
