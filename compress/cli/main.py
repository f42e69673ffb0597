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
    """Console-script entry point."""
    app()
