"""GradPruner: layer importance from the first steps of LoRA fine-tuning (arXiv 2601.19503).

1. Run the first T steps of LoRA fine-tuning (peft; rank 8, alpha 32, every linear of the
   decoder) on the task data, through ``accelerate`` (``Accelerator.prepare``/``backward``), so
   the same code runs on one CPU or many GPUs.
2. For every LoRA-wrapped linear and every step, the simulated full-weight gradient is
   ``G = ∇B · ∇A`` (``[out, r] @ [r, in] -> [out, in]``); the IGIA matrix is
   ``F = mean over steps of G ⊙ G``. At step 0 B = 0, so ∇A = 0 and G = 0: that step counts
   towards the mean as in the paper's code (it divides by T).
3. Layer score = Σ F over the layer's linears; the lowest-scoring layers are pruned.
4. Each pruned linear is sparsified to its top ``(1 - sparsity)`` fraction of elements by F, and
   those elements whose sign agrees with the preceding kept layer's weight are added into it:
   ``W_keep += M ⊙ W_pruned``, ``M = TopK(F) ∧ (W_keep · W_pruned > 0)``. Norms are not merged.
   Same-sign additions never flip a sign, so several pruned layers merging into one kept layer
   give the same result in any order.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Callable

_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.(.+)$")


def igia(model, input_ids, *, steps: int, rank: int = 8, alpha: int = 32, lr: float = 2e-4, batch_size: int = 1,
         seed: int = 0, progress: Callable[[int], None] | None = None) -> tuple[dict[int, dict[str, "object"]], list[float]]:
    """Accumulate the IGIA matrix of every decoder linear over ``steps`` LoRA fine-tuning steps.

    The model is wrapped by peft in place (LoRA on every linear except the output head) and
    trained with AdamW through ``accelerate``; the caller should discard it afterwards.

    Args:
        model: a transformers causal LM in float32 (float32 gradients).
        input_ids: (Tensor[S, L], int64) training windows; S >= steps · batch_size (cycled otherwise).
        steps: number of optimizer steps T (>= 1).
        rank, alpha: LoRA rank and alpha.
        lr: AdamW learning rate.
        batch_size: windows per step.
        seed: seed of the LoRA initialisation and the data order.

    Returns:
        ``(F, losses)``: F maps layer index -> {linear name relative to the layer (e.g.
        ``self_attn.q_proj``) -> IGIA (Tensor[out, in], float32, on CPU)}; losses is the training
        loss of every step.
    """
    import torch
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=next(model.parameters()).device.type == "cpu")
    with warnings.catch_warnings():  # peft calls a transformers method deprecated for v6
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                                                      target_modules="all-linear", task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(input_ids), batch_size=batch_size,
                                         shuffle=True, generator=gen, drop_last=input_ids.shape[0] >= batch_size)
    peft_model, optimizer, loader = accelerator.prepare(peft_model, optimizer, loader)
    lora = {}
    for name, module in accelerator.unwrap_model(peft_model).named_modules():
        m = _LAYER_NAME.search(name)
        if isinstance(module, LoraLayer) and m and "default" in module.lora_A:
            lora[(int(m[1]), m[2])] = module
    fisher = {key: torch.zeros(mod.out_features, mod.in_features, dtype=torch.float32) for key, mod in lora.items()}
    peft_model.train()
    losses: list[float] = []
    step = 0
    while step < steps:
        for (ids,) in loader:
            if step >= steps:
                break
            loss = peft_model(input_ids=ids, labels=ids, use_cache=False).loss
            accelerator.backward(loss)
            with torch.no_grad():
                for key, mod in lora.items():
                    grad_a = mod.lora_A["default"].weight.grad                # [r, in]
                    grad_b = mod.lora_B["default"].weight.grad                # [out, r]
                    if grad_a is None or grad_b is None:
                        continue
                    g = (grad_b.float() @ grad_a.float()).cpu()               # [out, in] simulated full gradient
                    fisher[key].addcmul_(g, g)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            step += 1
            if progress is not None:
                progress(1)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for (layer, name), f in fisher.items():
        out.setdefault(layer, {})[name] = f.div_(steps)
    return out, losses


def layer_scores(fisher: dict[int, dict[str, "object"]], n_layers: int) -> list[float]:
    """Layer importance: Σ of the IGIA matrices of each layer's linears (0.0 for a layer without any)."""
    return [float(sum(float(f.double().sum()) for f in fisher.get(i, {}).values())) for i in range(n_layers)]


def merge_mask(w_keep, w_pruned, fisher, sparsity: float):
    """GradPruner's merge mask ``M = TopK(F) ∧ (W_keep · W_pruned > 0)``.

    Args:
        w_keep: (Tensor[out, in], float) weight of the kept layer receiving the merge.
        w_pruned: (Tensor[out, in], float) same linear in the pruned layer.
        fisher: (Tensor[out, in], float) IGIA of the pruned linear.
        sparsity: fraction of the pruned weight dropped (0.8 keeps the top 20% by F).

    Returns:
        (Tensor[out, in], bool) the elements of ``w_pruned`` to add.
    """
    import torch

    numel = fisher.numel()
    keep = max(0, min(numel, math.ceil((1.0 - sparsity) * numel)))
    top = torch.zeros(numel, dtype=torch.bool)
    if keep:
        top[fisher.reshape(-1).float().topk(keep, sorted=False).indices] = True   # [out*in]
    return top.view_as(fisher) & ((w_keep.float() * w_pruned.float()) > 0)


def merge_into(w_keep, w_pruned, fisher, sparsity: float):
    """``w_keep + M ⊙ w_pruned`` with M from :func:`merge_mask`; float32 result (Tensor[out, in])."""
    mask = merge_mask(w_keep, w_pruned, fisher, sparsity)
    return w_keep.float() + mask * w_pruned.float()


def merge_targets(n_layers: int, removed: list[int]) -> dict[int, int]:
    """Each removed layer -> the nearest preceding kept layer, which receives its merge.

    Raises:
        ValueError: a removed layer has no kept layer before it (layer 0 removed).
    """
    removed_set = set(removed)
    out = {}
    for p in removed:
        t = p - 1
        while t >= 0 and t in removed_set:
            t -= 1
        if t < 0:
            raise ValueError(f"layer {p} has no kept layer before it to merge into")
        out[p] = t
    return out
