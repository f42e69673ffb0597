"""Layer pruning: entropy-based block pruning, the ShortGPT cosine baseline, GradPruner.

- :mod:`.scoring`: hidden-state entropy estimators (knn, bucket, renyi) and Block Influence.
- :mod:`.gradpruner`: IGIA scores from LoRA warm-up gradients, sparsify-and-merge.
- :mod:`.layers`: streamed physical layer removal, reusable by other methods
  (:func:`remove_layers`, :func:`prune_config`).
- :mod:`.attn_pruned_llama`: the model class of attention-only pruned Llama checkpoints.
- :mod:`.api`: :func:`prune` with :class:`PruneConfig` -> :class:`PruneResult`.

Importing this package does not import torch.
"""

from compress.transforms.prune.api import PruneConfig, PruneResult, prune
from compress.transforms.prune.layers import RECORD_NAME, prune_config, remove_layers

__all__ = ["PruneConfig", "PruneResult", "prune", "remove_layers", "prune_config", "RECORD_NAME"]


def _apply(source, output_dir, config: PruneConfig, overwrite: bool) -> PruneResult:
    """Recipe step ``prune``: :func:`prune` with the step's :class:`PruneConfig`."""
    return prune(str(source), output_dir, config, overwrite=overwrite)


def _recipe_steps():
    from compress.recipe import TransformSpec

    return [TransformSpec(name="prune", config=PruneConfig, apply=_apply)]


RECIPE_STEPS = _recipe_steps()
