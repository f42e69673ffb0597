"""Bad configurations found by a new-user review: each is refused with a ConfigError, never run."""

import pytest

from compress.errors import ConfigError


@pytest.mark.parametrize("config,message", [
    ({"merge_method": "linear", "models": ["a", "a"]}, "listed twice"),
    ({"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": float("nan")}}, "b"]}, "finite"),
    ({"merge_method": "linear", "models": [{"model": "a", "parameters": {"weight": float("inf")}}, "b"]}, "finite"),
    ({"merge_method": "slerp", "models": ["a", "b"], "parameters": {"t": 1.5}}, "between 0 and 1"),
    ({"merge_method": "slerp", "models": ["a", "b"], "parameters": {"t": float("nan")}}, "finite"),
])
def test_merge_config_refusals(config, message):
    from pydantic import ValidationError

    from compress.transforms.merge import MergeConfig

    with pytest.raises(ValidationError, match=message):
        MergeConfig(**config)


def test_recipe_refusals(tmp_path):
    from compress.recipe import Recipe

    with pytest.raises(ConfigError, match="empty"):
        Recipe.parse({"steps": []})
    (tmp_path / "bin.yaml").write_bytes(b"\x00\xff\xfe")
    with pytest.raises(ConfigError, match="utf-8"):
        Recipe.load(tmp_path / "bin.yaml")


def test_bad_ignore_regex():
    from compress.transforms.anybcq import _matches

    assert _matches("model.layers.0.mlp.up_proj", "re:mlp") and _matches("a.b", "a.*")
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        _matches("x", "re:[")
