"""Recipes: an ordered chain of transforms, each step validated by its transform's config.

YAML form (``recipes/*.yaml``)::

    steps:
      - ecf8: {slice_size: 2048}

Unknown keys anywhere are errors (pydantic ``extra="forbid"``); an unknown transform name
lists the valid ones and the closest match. Cross-step rule: a lossless encoding is last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from compress.errors import ConfigError
from compress.registry import Registry

#: transform name -> its pydantic config class (the name used in YAML, CLI and file metadata)
TRANSFORMS: Registry[type[BaseModel]] = Registry("transform")
LOSSLESS = {"ecf8"}


def _register_builtin() -> None:
    from compress.transforms.ecf8 import ECF8Config

    if "ecf8" not in TRANSFORMS:
        TRANSFORMS.register("ecf8", ECF8Config)


class Step(BaseModel):
    """One validated step: the transform's registry name and its config."""

    model_config = ConfigDict(frozen=True)
    name: str
    config: Any


class Recipe(BaseModel):
    """An ordered, validated chain of transforms."""

    model_config = ConfigDict(frozen=True)
    steps: tuple[Step, ...]

    @classmethod
    def parse(cls, data: Any) -> "Recipe":
        """Validate a recipe given as a dict (parsed YAML).

        Raises:
            ConfigError: one line naming the field path, e.g. ``steps[0].ecf8.slice_size``.
        """
        _register_builtin()
        if not isinstance(data, dict) or set(data) != {"steps"} or not isinstance(data["steps"], list):
            raise ConfigError("recipe: expected exactly one key 'steps' holding a list")
        steps = []
        for i, raw in enumerate(data["steps"]):
            if not isinstance(raw, dict) or len(raw) != 1:
                raise ConfigError(f"recipe: steps[{i}] must be a mapping with one transform name")
            (name, options), = raw.items()
            config_cls = TRANSFORMS.get(name)
            try:
                config = config_cls(**(options or {}))
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ConfigError(f"recipe: steps[{i}].{name}.{where}: {err['msg']}") from None
            steps.append(Step(name=name, config=config))
        for i, step in enumerate(steps[:-1]):
            if step.name in LOSSLESS:
                raise ConfigError(f"recipe: steps[{i}] is the lossless encoding {step.name!r}; it must be the last step")
        return cls(steps=tuple(steps))

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        """Read and validate a YAML recipe file."""
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"recipe {path}: {e}") from None
        return cls.parse(data)
