"""Recipes: an ordered chain of transforms, each step validated by its transform's config.

YAML form (``recipes/*.yaml``)::

    steps:
      - prune_entropy: {remove: 3, calib: calib.txt}
      - ecf8: {slice_size: 2048}

Unknown keys anywhere are errors (pydantic ``extra="forbid"``); an unknown transform name
lists the valid ones and the closest match. Cross-step rules live in :meth:`Recipe.parse`:
a lossless encoding is last.

A transform takes part in recipes by defining ``RECIPE_STEPS`` in its module under
``compress/transforms/``: a list of :class:`TransformSpec`. They are discovered on first use, so
a new method touches no file but its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError

from compress.errors import ConfigError, validation_error
from compress.registry import Registry


@dataclass(frozen=True)
class TransformSpec:
    """How a transform runs as a recipe step.

    Attributes:
        name: registry key: the same string in YAML, on the command line and in file metadata.
        config: its pydantic config class (``extra="forbid"``, ``frozen=True``).
        apply: ``apply(source, output_dir, config, overwrite) -> report`` reads ``source`` (any
            path :meth:`compress.checkpoint.Checkpoint.open` accepts), writes ``output_dir``
            atomically and returns a pydantic report (or None).
        lossless: a lossless encoding: it must be the last step.
    """

    name: str
    config: type[BaseModel]
    apply: Callable[[str, Path, Any, bool], Any]
    lossless: bool = False


#: transform name -> its :class:`TransformSpec`
TRANSFORMS: Registry[TransformSpec] = Registry("transform")
_discovered = False


def _register_builtin() -> None:
    """Import every module of ``compress.transforms`` and register its ``RECIPE_STEPS``."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    import importlib
    import pkgutil

    import compress.transforms

    for info in sorted(pkgutil.iter_modules(compress.transforms.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"compress.transforms.{info.name}")
        for spec in getattr(module, "RECIPE_STEPS", ()):
            TRANSFORMS.register(spec.name, spec)


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
        if not data["steps"]:
            raise ConfigError("recipe: 'steps' is empty; a recipe needs at least one transform")
        steps = []
        for i, raw in enumerate(data["steps"]):
            if not isinstance(raw, dict) or len(raw) != 1:
                raise ConfigError(f"recipe: steps[{i}] must be a mapping with one transform name")
            (name, options), = raw.items()
            config_cls = TRANSFORMS.get(name).config
            try:
                config = config_cls(**(options or {}))
            except ValidationError as e:
                raise validation_error(e, "recipe", root=f"steps[{i}].{name}") from None
            steps.append(Step(name=name, config=config))
        for i, step in enumerate(steps[:-1]):
            if TRANSFORMS.get(step.name).lossless:
                raise ConfigError(f"recipe: steps[{i}] is the lossless encoding {step.name!r}; it must be the last step")
        return cls(steps=tuple(steps))

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        """Read and validate a YAML recipe file."""
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"recipe {path}: {e}") from None
        return cls.parse(data)


class StepReport(BaseModel):
    """One executed step: its name, wall time and the transform's own report (as JSON)."""

    name: str
    seconds: float
    report: Any = None


class RecipeReport(BaseModel):
    """The result of :func:`run_recipe`."""

    source: str
    output: str
    steps: list[StepReport]


def run_recipe(recipe: Recipe, source: str | os.PathLike, output_dir: str | os.PathLike, *,
               overwrite: bool = False) -> RecipeReport:
    """Run every step of ``recipe`` in order; each step reads the previous step's output.

    Intermediate checkpoints go to a temporary folder beside ``output_dir`` that is removed at
    the end (also on failure); only the last step writes ``output_dir``, atomically.

    Raises:
        ConfigError: the output exists (without ``overwrite``) or a step's options are wrong;
            any error a step raises passes through unchanged.
    """
    import shutil
    import tempfile
    import time

    out = Path(output_dir).resolve()
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.recipe-", dir=out.parent))
    reports, current = [], os.fspath(source)
    try:
        for i, step in enumerate(recipe.steps):
            last = i == len(recipe.steps) - 1
            target = out if last else work / f"step{i}-{step.name}"
            start = time.perf_counter()
            report = TRANSFORMS.get(step.name).apply(current, target, step.config, overwrite if last else False)
            if isinstance(report, tuple):
                report = report[0]
            dumped = report.model_dump(mode="json") if hasattr(report, "model_dump") else None
            reports.append(StepReport(name=step.name, seconds=time.perf_counter() - start, report=dumped))
            current = os.fspath(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return RecipeReport(source=os.fspath(source), output=os.fspath(out), steps=reports)
