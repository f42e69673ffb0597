"""``compress upload``: publish a checkpoint folder to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from compress.cli.common import JsonOpt, QuietOpt, emit_json, human, run, stdout


def upload(
    folder: Path = typer.Argument(..., help="Checkpoint folder (any format compress writes, or a plain one)."),
    repo_id: str = typer.Argument(..., help="Hub model id, org/name (created if missing)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch to commit to (default main)."),
    private: bool = typer.Option(False, "--private", help="Create the repository private."),
    message: Optional[str] = typer.Option(None, "--message", "-m", help="Commit message."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List what would be uploaded; contact nothing."),
    json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Upload FOLDER to the Hub in one commit; a folder with a compress manifest is verified first (exit 3)."""
    from compress.checkpoint import push_to_hub

    r = run(lambda: push_to_hub(folder, repo_id, revision=revision, private=private, commit_message=message,
                                dry_run=dry_run), json_out)
    if json_out:
        emit_json(r)
        return
    verb = "would upload" if r.dry_run else "uploaded"
    card = " (model card generated)" if r.generated_card else ""
    stdout.print(f"{verb} {len(r.files)} files, {human(r.bytes)}, to {r.repo_id}{card}"
                 + (f": {r.url}" if r.url else ""), soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``upload`` to ``app``."""
    app.command("upload")(upload)
