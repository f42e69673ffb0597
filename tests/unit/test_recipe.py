"""Recipes: strict validation with field paths, closest-name hints, lossless-last rule."""

from pathlib import Path

import pytest

from compress.errors import ConfigError
from compress.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_recipes_validate():
    for path in (ROOT / "recipes").glob("*.yaml"):
        recipe = Recipe.load(path)
        assert recipe.steps and all(s.name in ("ecf8", "prune", "anybcq") for s in recipe.steps)


def test_bad_recipes_name_the_field():
    with pytest.raises(ConfigError, match=r"steps\[0\]\.ecf8\.slice_size"):
        Recipe.parse({"steps": [{"ecf8": {"slice_size": 1}}]})
    with pytest.raises(ConfigError, match=r"steps\[0\]\.ecf8\.colour"):
        Recipe.parse({"steps": [{"ecf8": {"colour": 1}}]})
    with pytest.raises(ConfigError, match="did you mean 'ecf8'"):
        Recipe.parse({"steps": [{"ecf9": {}}]})
    with pytest.raises(ConfigError, match="must be the last step"):
        Recipe.parse({"steps": [{"ecf8": {}}, {"ecf8": {}}]})


def test_transforms_are_discovered_with_their_specs():
    from compress.recipe import TRANSFORMS
    from compress.transforms.ecf8 import ECF8Config

    Recipe.parse({"steps": [{"ecf8": {}}]})
    spec = TRANSFORMS.get("ecf8")
    assert spec.config is ECF8Config and spec.lossless and callable(spec.apply)


def test_run_recipe_end_to_end(minilm_bf16, tmp_path):
    import json

    from typer.testing import CliRunner

    from compress.checkpoint import Checkpoint
    from compress.cli.main import app

    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["run", str(ROOT / "recipes" / "lossless-ecf8.yaml"), str(minilm_bf16), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert [s["name"] for s in rep["steps"]] == ["ecf8"] and rep["steps"][0]["report"]["ratio"] < 0.67
    assert Checkpoint.open(out).shard_metadata["model.safetensors"]["compress.format"] == "ecf8"
    assert not list(tmp_path.glob(".out.recipe-*"))  # the work folder is gone
    r = CliRunner().invoke(app, ["run", str(ROOT / "recipes" / "lossless-ecf8.yaml"), str(minilm_bf16), "-o", str(out)])
    assert r.exit_code == 2 and "already exists" in r.output
    (tmp_path / "bad.yaml").write_text("steps:\n  - ecf9: {}\n")
    r = CliRunner().invoke(app, ["run", str(tmp_path / "bad.yaml"), str(minilm_bf16), "-o", str(tmp_path / "o2")])
    assert r.exit_code == 2 and "did you mean 'ecf8'" in r.output
