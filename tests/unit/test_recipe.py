"""Recipes: strict validation with field paths, closest-name hints, lossless-last rule."""

from pathlib import Path

import pytest

from compress.errors import ConfigError
from compress.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_recipes_validate():
    for path in (ROOT / "recipes").glob("*.yaml"):
        recipe = Recipe.load(path)
        assert recipe.steps and recipe.steps[-1].name == "ecf8"


def test_bad_recipes_name_the_field():
    with pytest.raises(ConfigError, match=r"steps\[0\]\.ecf8\.slice_size"):
        Recipe.parse({"steps": [{"ecf8": {"slice_size": 1}}]})
    with pytest.raises(ConfigError, match=r"steps\[0\]\.ecf8\.colour"):
        Recipe.parse({"steps": [{"ecf8": {"colour": 1}}]})
    with pytest.raises(ConfigError, match="did you mean 'ecf8'"):
        Recipe.parse({"steps": [{"ecf9": {}}]})
    with pytest.raises(ConfigError, match="must be the last step"):
        Recipe.parse({"steps": [{"ecf8": {}}, {"ecf8": {}}]})
