"""Llama with the attention sub-block of some layers removed (``model_type: llama_attn_pruned``).

This file is self-contained (it imports only torch and transformers): ``compress prune ...
--scope attention`` copies it into the output checkpoint as ``modeling_attn_pruned.py`` and points
``config.json``'s ``auto_map`` at it, so plain transformers loads the pruned model with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``; inside compress,
:func:`register` makes the type known without remote code.

In a pruned layer ``self_attn`` and ``input_layernorm`` are replaced by modules without weights
(the checkpoint holds no tensors for them): the layer computes ``h + MLP(norm(h))`` only.
Without ``trust_remote_code`` (and without :func:`register`), transformers refuses the unknown
model type instead of loading random attention weights.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

MODEL_TYPE = "llama_attn_pruned"


class AttnPrunedLlamaConfig(LlamaConfig):
    """LlamaConfig plus ``pruned_attention_layers``: indices of the layers without attention."""

    model_type = MODEL_TYPE
    pruned_attention_layers: list | None = None


class SkippedAttention(torch.nn.Module):
    """Stands where a removed attention sub-block was: contributes nothing to the residual stream."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


class AttnPrunedLlamaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose layers in ``config.pruned_attention_layers`` have no attention."""

    config_class = AttnPrunedLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        for i in config.pruned_attention_layers or []:
            layer = self.model.layers[i]
            layer.self_attn = SkippedAttention()
            layer.input_layernorm = torch.nn.Identity()
        self.post_init()


def register() -> None:
    """Make ``llama_attn_pruned`` known to transformers' Auto classes in this process (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoConfig.register(MODEL_TYPE, AttnPrunedLlamaConfig)
        AutoModelForCausalLM.register(AttnPrunedLlamaConfig, AttnPrunedLlamaForCausalLM)
    except ValueError:  # already registered
        pass
