"""``compress run``: apply a YAML recipe (a chain of transforms) to a checkpoint."""

from __future__ import annotations

from pathlib import Path

import typer

from compress.cli.common import JsonOpt, OverwriteOpt, QuietOpt, emit_json, run, stdout


def run_recipe(
    recipe: Path = typer.Argument(..., help="Recipe YAML (see recipes/).", dir_okay=False),
    model: str = typer.Argument(..., help="Checkpoint: folder, Hub id, pkg:NAME or .gguf."),
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Folder to write (refused if it exists, "
                                    "unless --overwrite)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate the recipe and print the steps; write nothing."),
    overwrite: bool = OverwriteOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Run every step of RECIPE in order on MODEL; only the last step writes OUTPUT_DIR."""
    from compress.recipe import Recipe
    from compress.recipe import run_recipe as run_

    plan = run(lambda: Recipe.load(recipe), json_out)
    if dry_run:
        steps = [{"name": s.name, "config": s.config.model_dump(mode="json")} for s in plan.steps]
        if json_out:
            emit_json({"recipe": str(recipe), "steps": steps})
        else:
            for i, s in enumerate(steps):
                stdout.print(f"{i}: {s['name']} {s['config']}", soft_wrap=True)
        return
    r = run(lambda: run_(plan, model, output_dir, overwrite=overwrite), json_out)
    if json_out:
        emit_json(r)
    else:
        for s in r.steps:
            stdout.print(f"{s.name}: {s.seconds:.1f} s", soft_wrap=True)
        stdout.print(f"wrote {r.output}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``run`` to ``app``."""
    app.command("run")(run_recipe)
