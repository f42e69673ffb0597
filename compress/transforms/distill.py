"""Knowledge distillation: concrete score distillation (CSD) and the KL family, through accelerate.

Losses (one code path, :func:`distill_loss`, always in float32 or wider):

- ``csd``: Concrete Score Distillation (Kim et al., arXiv 2509.25837). It matches the relative
  logit differences of student ``s`` and teacher ``t`` over all vocabulary pairs,
  ``¼ Σ_{u,v} w1_u w2_v [(s_v - s_u) - (t_v - t_u)]²`` with stop-gradient weights ``w1, w2``,
  computed in O(V) as ``¼ [Var_w1(d) + Var_w2(d) + (E_w1 d - E_w2 d)²]`` with ``d = s - t``.
  With ``w1 = w2 = p`` this is ``½ Var_p(s - t)``, whose gradient wrt ``s_k`` is
  ``p_k (d_k - E_p d)``. Weightings (the temperature ``τ`` enters the weights only, never ``d``):

  * ``ss`` (default, mode-seeking): ``w1 = w2 = softmax(s/τ)``, the student's distribution.
  * ``ts``: ``w1 = softmax(t/τ)`` (teacher), ``w2 = softmax(s/τ)`` (student); more mode-covering.
  * ``us``: ``w1 = 1/V`` (uniform over the shared vocabulary), ``w2 = softmax(s/τ)``.

  The objective is symmetric in (w1, w2), so the order does not matter. Note: at τ = 1, ``ss`` has
  exactly the gradient of reverse KL(p_s ‖ p_t) (``∂KL/∂s_k = p_k (d_k - E_p d)``), so it trains like
  ``rkl``; ``ts``, ``us`` and τ ≠ 1 are where CSD differs from the KL family. The logged value is the
  objective itself: ``½ Var_p(s - t)`` for ``ss``. It is a surrogate whose gradient is CSD's, not a
  divergence between the two distributions.
- ``fkl``: forward KL(p_t ‖ p_s). ``rkl``: reverse KL(p_s ‖ p_t).
- ``skl``: skew KL(p_t ‖ α p_t + (1-α) p_s), ``srkl``: skew reverse KL(p_s ‖ α p_s + (1-α) p_t)
  (DistiLLM, Ko et al., arXiv 2402.03898; α = ``skew_alpha``, default 0.1).
- ``jsd``: generalized JSD of GKD (Agarwal et al., arXiv 2306.13649),
  ``β KL(p_t ‖ m) + (1-β) KL(p_s ‖ m)`` with ``m = β p_t + (1-β) p_s`` (β = ``jsd_beta``, default 0.5).

For the KL family ``p_s = softmax(s/τ)`` and ``p_t = softmax(t/τ)``; the logged value is the
divergence. Every loss is summed over the vocabulary and averaged over scored positions.

Training (:func:`distill`): ``accelerate.Accelerator`` (prepare, backward, gradient
accumulation, save_state/load_state), so ``accelerate launch -m compress distill ...`` runs the
same command on many GPUs; LoRA students through ``peft`` (merged into the output). Optional
on-policy mixing: a fraction of micro-batches replace the second half of each data window by a
continuation the student generates from the first half; the loss is then taken on the
positions that predict generated tokens only (as in GKD).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from compress.errors import ConfigError, UnsupportedError
from compress.eval.memory import peak_rss_bytes as peak_rss

LOSSES = ("csd", "fkl", "rkl", "skl", "srkl", "jsd")
WEIGHTINGS = ("ss", "ts", "us")
STATE_FILE = "distill_state.json"

#: fields of DistillConfig that must match between a saved state and the run resuming it
_RESUME_KEYS = ("loss", "weighting", "temperature", "skew_alpha", "jsd_beta", "steps", "lr", "warmup_steps",
                "seq_len", "batch_size", "grad_accum", "lora", "lora_rank", "train_from_layer", "on_policy", "on_policy_mode", "seed",
                "max_grad_norm")


# --------------------------------------------------------------------------------------------- losses

def _csd_weights(s, t, weighting: str, temperature: float):
    """Stop-gradient weights (w1, w2) of CSD, each (Tensor[N, V], like ``s``); w2 is w1 for ``ss``."""
    import torch

    ps = torch.softmax(s.detach() / temperature, dim=-1)                    # [N, V]
    if weighting == "ss":
        return ps, ps
    if weighting == "ts":
        return torch.softmax(t.detach() / temperature, dim=-1), ps
    if weighting == "us":
        return torch.full_like(ps, 1.0 / ps.shape[-1]), ps
    raise ConfigError(f"--weighting {weighting!r}: expected one of {', '.join(WEIGHTINGS)}")


def csd_per_position(s, t, weighting: str = "ss", temperature: float = 1.0):
    """CSD objective per position in its O(V) form (arXiv 2509.25837).

    ``¼ Σ_{u,v} w1_u w2_v [(s_v - s_u) - (t_v - t_u)]² = ¼ [Var_w1(d) + Var_w2(d) + (E_w1 d - E_w2 d)²]``
    with ``d = s - t`` and detached weights (see the module docstring for w1, w2). For ``ss`` it
    is ``½ Var_p(d)``, gradient ``p_k (d_k - E_p d)``.

    Args:
        s: student logits (Tensor[N, V], float32 or float64).
        t: teacher logits (Tensor[N, V], same dtype); no gradient flows into it.
        weighting: ``ss``, ``ts`` or ``us``.
        temperature: τ of the weights only (> 0).

    Returns:
        Tensor[N], the objective per position.
    """
    d = s - t.detach()                                                      # [N, V]
    w1, w2 = _csd_weights(s, t, weighting, temperature)
    mu1 = (w1 * d).sum(-1, keepdim=True)                                    # [N, 1]
    var1 = (w1 * (d - mu1).square()).sum(-1)                                # [N]
    if w2 is w1:
        return 0.5 * var1
    mu2 = (w2 * d).sum(-1, keepdim=True)                                    # [N, 1]
    var2 = (w2 * (d - mu2).square()).sum(-1)                                # [N]
    return 0.25 * (var1 + var2 + (mu1 - mu2).squeeze(-1).square())


def _kl(logp, logq):
    """KL(p ‖ q) per row from log-probabilities (Tensor[N, V]) -> Tensor[N]."""
    return (logp.exp() * (logp - logq)).sum(-1)


def _log_mix(loga, logb, a: float):
    """log(a·exp(loga) + (1-a)·exp(logb)), elementwise and stable."""
    import torch

    return torch.logaddexp(loga + math.log(a), logb + math.log1p(-a))


def divergence_per_position(s, t, loss: str, temperature: float = 1.0, skew_alpha: float = 0.1, jsd_beta: float = 0.5):
    """A KL-family divergence per position between ``p_t = softmax(t/τ)`` and ``p_s = softmax(s/τ)``.

    Args:
        s: student logits (Tensor[N, V], float32 or float64).
        t: teacher logits (Tensor[N, V], same dtype); no gradient flows into it.
        loss: ``fkl`` KL(p_t‖p_s); ``rkl`` KL(p_s‖p_t); ``skl`` KL(p_t‖α p_t+(1-α) p_s) and ``srkl``
            KL(p_s‖α p_s+(1-α) p_t) (DistiLLM, arXiv 2402.03898); ``jsd`` β KL(p_t‖m)+(1-β) KL(p_s‖m),
            m = β p_t+(1-β) p_s (GKD, arXiv 2306.13649).
        temperature: τ applied to both logits.
        skew_alpha: α of skl/srkl, in (0, 1).
        jsd_beta: β of jsd, in (0, 1).

    Returns:
        Tensor[N], nats.
    """
    import torch

    ls = torch.log_softmax(s / temperature, dim=-1)                         # [N, V]
    lt = torch.log_softmax(t.detach() / temperature, dim=-1)                # [N, V]
    if loss == "fkl":
        return _kl(lt, ls)
    if loss == "rkl":
        return _kl(ls, lt)
    if loss == "skl":
        return _kl(lt, _log_mix(lt, ls, skew_alpha))
    if loss == "srkl":
        return _kl(ls, _log_mix(ls, lt, skew_alpha))
    if loss == "jsd":
        lm = _log_mix(lt, ls, jsd_beta)                                     # [N, V] log of the mixture
        return jsd_beta * _kl(lt, lm) + (1 - jsd_beta) * _kl(ls, lm)
    raise ConfigError(f"--loss {loss!r}: expected one of {', '.join(LOSSES)}")


def distill_loss(student_logits, teacher_logits, loss: str = "csd", *, weighting: str = "ss", temperature: float = 1.0,
                 skew_alpha: float = 0.1, jsd_beta: float = 0.5, mask=None):
    """The distillation loss of a batch, in float32 (float64 inputs stay float64).

    Args:
        student_logits: Tensor[..., V], any float dtype (upcast to float32), over the shared vocabulary.
        teacher_logits: Tensor[..., V], same shape; treated as a constant.
        loss: one of :data:`LOSSES`.
        weighting: CSD weighting (``ss``, ``ts``, ``us``); ignored by the KL family.
        temperature: CSD: τ of the weights only; KL family: τ of both distributions.
        skew_alpha: α of skl/srkl. jsd_beta: β of jsd.
        mask: optional Tensor[...] (bool) of positions to score; default all.

    Returns:
        Scalar tensor: the mean over scored positions of the per-position objective. Its value
        is also the monitored quantity (½Var_p(s-t) for CSD ``ss``, the divergence otherwise).

    Raises:
        ConfigError: unknown loss or weighting; shapes differ.
    """
    import torch

    if student_logits.shape != teacher_logits.shape:
        raise ConfigError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                          f"{tuple(teacher_logits.shape)} differ; slice both to the shared vocabulary")
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    V = student_logits.shape[-1]
    s = student_logits.to(dtype).reshape(-1, V)                             # [N, V]
    t = teacher_logits.detach().to(dtype).reshape(-1, V)                    # [N, V]
    if mask is not None:
        keep = mask.reshape(-1)                                             # [N]
        s, t = s[keep], t[keep]
    if loss == "csd":
        per = csd_per_position(s, t, weighting, temperature)                # [N']
    else:
        per = divergence_per_position(s, t, loss, temperature, skew_alpha, jsd_beta)
    return per.mean()


# --------------------------------------------------------------------------------------------- checks

def check_tokenizers(student_tok, teacher_tok) -> None:
    """Refuse pairs whose tokenizers differ: same vocabulary (token -> id) and same special tokens.

    Raises:
        ConfigError: the vocabularies or special tokens differ (cross-tokenizer distillation is
            not supported: logits over different vocabularies cannot be compared position by position).
    """
    sv, tv = student_tok.get_vocab(), teacher_tok.get_vocab()
    if sv != tv:
        only_s = len(set(sv) - set(tv))
        only_t = len(set(tv) - set(sv))
        moved = sum(1 for k in set(sv) & set(tv) if sv[k] != tv[k])
        raise ConfigError(f"student and teacher tokenizers differ (student {len(sv)} tokens, teacher {len(tv)}; "
                          f"{only_s} only in the student, {only_t} only in the teacher, {moved} with other ids); "
                          "cross-tokenizer distillation is not supported: use a teacher with the student's tokenizer")
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    ss = {n: getattr(student_tok, n, None) for n in names}
    ts = {n: getattr(teacher_tok, n, None) for n in names}
    sa, ta = sorted(student_tok.all_special_tokens), sorted(teacher_tok.all_special_tokens)
    if ss != ts or sa != ta:
        diff = [n for n in names if ss[n] != ts[n]] or ["special tokens"]
        raise ConfigError(f"student and teacher tokenizers have different special tokens ({', '.join(diff)}: "
                          f"student {[ss[n] for n in names]}, teacher {[ts[n] for n in names]}); use a teacher with the "
                          "student's tokenizer")


def shared_vocab(tokenizer, student, teacher) -> int:
    """Size of the shared real vocabulary: ``len(tokenizer)``; padded output rows beyond it are sliced off.

    Args:
        tokenizer: the (common) tokenizer.
        student, teacher: transformers causal LMs.

    Returns:
        V, the number of logit columns both models are compared on.

    Raises:
        ConfigError: a model has fewer output rows than the tokenizer has tokens.
    """
    n = len(tokenizer)
    for name, model in (("student", student), ("teacher", teacher)):
        rows = model.get_output_embeddings().weight.shape[0]
        if rows < n:
            raise ConfigError(f"the {name}'s output layer has {rows} rows but the tokenizer has {n} tokens; "
                              "its embeddings were not resized for this tokenizer")
    return n


# --------------------------------------------------------------------------------------------- model helpers

def drop_layers(model, indices) -> None:
    """Remove decoder layers in place (plain layer dropping), renumbering the remaining ones.

    Works for models with ``model.model.layers`` (Llama, Mistral, Qwen2, ...). Updates
    ``config.num_hidden_layers``, ``config.layer_types`` if present and each attention's
    ``layer_idx`` (the KV-cache slot).

    Args:
        model: a transformers causal LM.
        indices: layer indices to remove (0-based).

    Raises:
        UnsupportedError: the model has no ``model.layers``.
        ConfigError: an index is out of range or every layer would be removed.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise UnsupportedError(f"{type(model).__name__}: no model.layers to drop")
    drop = sorted(set(int(i) for i in indices))
    if any(i < 0 or i >= len(layers) for i in drop) or len(drop) >= len(layers):
        raise ConfigError(f"cannot drop layers {drop} of a model with {len(layers)} layers")
    keep = [i for i in range(len(layers)) if i not in drop]
    import torch

    model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    for new, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = new
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]


def _freeze_below(model, first: int) -> None:
    """Freeze input embeddings and decoder layers ``< first`` (names ``...layers.<i>....``)."""
    import re

    n_layers = model.config.num_hidden_layers
    if first >= n_layers:
        raise ConfigError(f"--train-from-layer {first}: the student has only {n_layers} layers")
    layer = re.compile(r"\.layers\.(\d+)\.")
    for name, p in model.named_parameters():
        m = layer.search(name)
        if "embed_tokens" in name or (m is not None and int(m.group(1)) < first):
            p.requires_grad_(False)


def _plain_student(loaded) -> None:
    """Make a student loaded from a compress checkpoint trainable and savable as plain weights.

    ECF8 decodes to exact plain weights at load: its quantizer is dropped. Other quantized formats
    (AnyBCQ, GGUF quant types kept packed, bitsandbytes, ...) are refused.
    """
    model = loaded.model
    if loaded.quant_method is None:
        return
    if loaded.quant_method == "ecf8":
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        return
    raise UnsupportedError(f"student quantized with {loaded.quant_method!r}: only plain, pruned and ECF8 checkpoints can "
                           "be distilled into (training quantized weights or scales is not supported yet); "
                           "decode it to a plain checkpoint first")


class TeacherCache:
    """Teacher final hidden states keyed by the input ids, reused across runs on identical batches.

    For benchmarks that train several students on the same data (same seed): the teacher's
    decoder runs once per batch; its logits are recomputed from the cached hidden state through
    the output layer, which gives the same logits. On first use the cached path is checked
    against the full forward once; a model whose head is not a plain linear layer raises.
    Holds ``batch · seq_len · hidden`` floats per batch (on the CPU).
    """

    def __init__(self) -> None:
        self._hidden: dict[str, object] = {}
        self._checked = False
        self.hits = 0

    def logits(self, teacher, ids):
        """Teacher logits (Tensor[B, L, rows], float32) for ids (Tensor[B, L], int64)."""
        import torch

        key = hashlib.sha1(ids.cpu().numpy().tobytes() + str(tuple(ids.shape)).encode()).hexdigest()
        head = teacher.get_output_embeddings()
        h = self._hidden.get(key)
        if h is None:
            h = teacher.get_decoder()(input_ids=ids).last_hidden_state      # [B, L, H]
            self._hidden[key] = h.detach().cpu()
        else:
            self.hits += 1
            h = h.to(ids.device)
        logits = head(h)                                                     # [B, L, rows]
        if not self._checked:
            full = teacher(input_ids=ids).logits
            if not torch.allclose(full.float(), logits.float(), atol=1e-4, rtol=1e-4):
                raise UnsupportedError(f"{type(teacher).__name__}: its logits are not the output layer of the decoder's "
                                       "last hidden state; run without a teacher cache")
            self._checked = True
        return logits


# --------------------------------------------------------------------------------------------- config / result

class DistillConfig(BaseModel):
    """Options of :func:`distill`.

    Attributes:
        student: student checkpoint (folder, ``pkg:NAME``, GGUF, or an ECF8 checkpoint).
        teacher: teacher checkpoint, same tokenizer.
        output_dir: folder of the distilled plain HF checkpoint.
        data: UTF-8 text file of training text; windows of ``seq_len`` tokens at random offsets.
        loss: one of :data:`LOSSES`. weighting: CSD weighting (:data:`WEIGHTINGS`).
        temperature: CSD: of the weights only; KL family: of both distributions.
        skew_alpha: α of skl/srkl. jsd_beta: β of jsd.
        steps: optimizer steps. lr: AdamW peak learning rate (linear warmup over ``warmup_steps``,
            then cosine decay to 10% of the peak).
        seq_len: tokens per window. batch_size: windows per micro-batch (per process).
        grad_accum: micro-batches per optimizer step.
        lora: train LoRA adapters (peft, rank ``lora_rank``, all linear layers) and merge them into the output.
        train_from_layer: freeze the input embeddings (and a tied output layer) and decoder layers
            below this index; backward then stops there (cheaper healing of a cut deep in the model).
        on_policy: fraction of micro-batches whose second half is generated by the student.
        on_policy_mode: ``sample`` (temperature 1) or ``greedy`` generation.
        seed: seed of the data windows, on-policy choices, sampling and dropout.
        max_grad_norm: gradient clipping (0: off).
        dtype: output dtype name (default: the student's stored dtype).
        state_dir: folder for resumable training state (accelerate ``save_state`` + ``distill_state.json``).
        save_every: save the state every this many steps (0: only at an interruption by ``stop_after``).
        resume: a state folder to resume from (written by an earlier run with the same options).
        overwrite: replace an existing output.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    student: str
    teacher: str
    output_dir: str
    data: str
    loss: Literal["csd", "fkl", "rkl", "skl", "srkl", "jsd"] = "csd"
    weighting: Literal["ss", "ts", "us"] = "ss"
    temperature: float = Field(1.0, gt=0)
    skew_alpha: float = Field(0.1, gt=0, lt=1)
    jsd_beta: float = Field(0.5, gt=0, lt=1)
    steps: int = Field(100, ge=1)
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    seq_len: int = Field(256, ge=4)
    batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    lora: bool = False
    lora_rank: int = Field(16, ge=1)
    train_from_layer: int = Field(0, ge=0)
    on_policy: float = Field(0.0, ge=0, le=1)
    on_policy_mode: Literal["sample", "greedy"] = "sample"
    seed: int = 0
    max_grad_norm: float = Field(1.0, ge=0)
    dtype: Optional[str] = None
    state_dir: Optional[str] = None
    save_every: int = Field(0, ge=0)
    resume: Optional[str] = None
    overwrite: bool = False


class StepLog(BaseModel):
    """One optimizer step: mean loss (the monitored quantity) over its micro-batches, lr, seconds."""

    step: int
    loss: float
    lr: float
    seconds: float
    on_policy: int = 0


class DistillResult(BaseModel):
    """Result of :func:`distill`.

    ``monitored``: what ``loss`` values mean (``½Var_p(s-t)`` for CSD ss, the divergence for the KL
    family). ``output``: the written checkpoint, None when stopped early by ``stop_after``.
    ``seconds_per_step``: mean wall time of the steps of this run. ``peak_rss_bytes``: VmHWM.
    """

    output: Optional[str]
    loss: str
    weighting: Optional[str]
    monitored: str
    steps: int
    start_step: int
    vocab: int
    trainable_params: int
    tokens_per_step: int
    seconds: float
    seconds_per_step: float
    peak_rss_bytes: int
    history: list[StepLog]
    state_dir: Optional[str] = None


def monitored_name(loss: str, weighting: str) -> str:
    """Human name of the logged quantity."""
    if loss == "csd":
        return "½Var_p(s-t)" if weighting == "ss" else f"CSD({weighting}) pairwise objective"
    return {"fkl": "KL(p_t‖p_s)", "rkl": "KL(p_s‖p_t)", "skl": "KL(p_t‖αp_t+(1-α)p_s)", "srkl": "KL(p_s‖αp_s+(1-α)p_t)",
            "jsd": "JSD_β(p_t‖p_s)"}[loss]



# --------------------------------------------------------------------------------------------- training

def _lr_lambda(steps: int, warmup: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        frac = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return f


def _stored_dtype(loaded) -> str:
    """The dtype named in the student's config.json (GGUF input, whose folder is gone: bfloat16, what it was
    dequantized to)."""
    config = Path(loaded.path) / "config.json"
    if not config.is_file():
        return "bfloat16"
    meta = json.loads(config.read_text())
    d = str(meta.get("dtype") or meta.get("torch_dtype") or "float32").removeprefix("torch.")
    return d if d in ("float32", "bfloat16", "float16") else "float32"


def _check_resume(config: DistillConfig, state: Path) -> int:
    meta_path = state / STATE_FILE
    if not meta_path.is_file():
        raise ConfigError(f"--resume {state}: no {STATE_FILE} there; pass a folder written by --save-state")
    try:
        meta = json.loads(meta_path.read_text())
        step, saved = int(meta["step"]), meta["config"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume {state}: unreadable {STATE_FILE} ({e})") from None
    diff = [k for k in _RESUME_KEYS if saved.get(k) != getattr(config, k)]
    if diff:
        raise ConfigError(f"--resume {state}: saved with other options ({', '.join(f'{k}={saved.get(k)!r}' for k in diff)}); "
                          "resume with the same options")
    if step > config.steps:
        raise ConfigError(f"--resume {state}: saved at step {step}, beyond --steps {config.steps}")
    return step


def _save_state(accelerator, state_dir: Path, step: int, config: DistillConfig) -> None:
    """accelerate.save_state into a temporary folder, then rename over ``state_dir`` (atomic)."""
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "config": config.model_dump(mode="json")}, indent=1))
        old = state_dir.with_name(state_dir.name + ".old")
        if state_dir.exists():
            os.replace(state_dir, old)
        os.replace(tmp, state_dir)
        if old.exists():
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def _generate(model, ids, mode: str, pad_id: int):
    """Replace the second half of each window by the student's continuation of the first half.

    Returns:
        (ids Tensor[B, L] int64, prefix length P).
    """
    import torch

    B, L = ids.shape
    P = L // 2
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids[:, :P], attention_mask=torch.ones_like(ids[:, :P]), max_new_tokens=L - P,
                             min_new_tokens=L - P, do_sample=mode == "sample", temperature=1.0, top_k=0, top_p=1.0,
                             num_beams=1, pad_token_id=pad_id, use_cache=True)
    model.train(was_training)
    return out[:, :L].contiguous(), P


def distill(config: DistillConfig, *, teacher_cache: TeacherCache | None = None, stop_after: int | None = None,
            log: Callable[[StepLog], None] | None = None) -> DistillResult:
    """Distill ``config.teacher`` into ``config.student`` and save the student as a plain HF checkpoint.

    Runs under ``accelerate`` on whatever ``accelerate launch`` configured (one CPU by default).
    Student weights train in float32 (mixed precision comes from the accelerate config); the
    teacher computes in float32 on CPU and in its stored dtype on accelerators; losses in float32.

    Args:
        config: :class:`DistillConfig`.
        teacher_cache: optional :class:`TeacherCache` shared by several runs on the same batches.
        stop_after: stop after this global step, saving the state to ``config.state_dir`` (as a
            job with a time limit would); no output is written.
        log: called after each optimizer step with its :class:`StepLog` (main process).

    Returns:
        :class:`DistillResult`.

    Raises:
        ConfigError: bad paths or options; tokenizers differ; output exists without overwrite;
            a resume state saved with other options.
        UnsupportedError: a student in a quantized format other than ECF8.
    """
    import gc

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from compress.checkpoint import save_model
    from compress.eval.model import load_causal_lm
    from compress.eval.text import calibration_batches, read_text

    start = time.perf_counter()
    out = Path(config.output_dir)
    if out.exists() and not config.overwrite and stop_after is None:
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it")
    if config.state_dir is None and (config.save_every or stop_after is not None):
        raise ConfigError("--save-every needs --save-state DIR (or --resume DIR)")
    if config.on_policy > 0 and config.seq_len < 4:
        raise ConfigError("--on-policy needs --seq-len >= 4 (half prompt, half continuation)")
    if config.dtype is not None:
        if config.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype {config.dtype}: expected float32, bfloat16 or float16")
    text = read_text(config.data)
    state_dir = Path(config.state_dir) if config.state_dir else None
    start_step = _check_resume(config, Path(config.resume)) if config.resume else 0

    accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum)
    device = str(accelerator.device)
    set_seed(config.seed)
    teacher = load_causal_lm(config.teacher, dtype=None, device=device)
    student = load_causal_lm(config.student, dtype="F32", device=device)  # float32 master weights
    check_tokenizers(student.tokenizer, teacher.tokenizer)
    _plain_student(student)
    tokenizer = student.tokenizer
    V = shared_vocab(tokenizer, student.model, teacher.model)
    out_dtype = config.dtype or _stored_dtype(student)
    tmodel = teacher.model.eval().requires_grad_(False)
    smodel = student.model
    smodel.config.use_cache = False
    if config.lora:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UnsupportedError("--lora needs peft: pip install peft") from None

        smodel = get_peft_model(smodel, LoraConfig(r=config.lora_rank, lora_alpha=2 * config.lora_rank, lora_dropout=0.0,
                                                   target_modules="all-linear", task_type="CAUSAL_LM"))
    if config.train_from_layer:
        _freeze_below(smodel, config.train_from_layer)
    smodel.train()
    params = [p for p in smodel.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in params)

    per_step = config.batch_size * config.grad_accum * accelerator.num_processes
    windows = calibration_batches(tokenizer, text, samples=config.steps * per_step, seq_len=config.seq_len,
                                  seed=config.seed)                            # [steps·per_step, L]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(windows), batch_size=config.batch_size,
                                         shuffle=False)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(config.steps, config.warmup_steps))
    smodel, opt, loader = accelerator.prepare(smodel, opt, loader)
    accelerator.register_for_checkpointing(sched)
    if config.resume:
        accelerator.load_state(config.resume)
        state_dir = state_dir or Path(config.resume)
    batches = iter(accelerator.skip_first_batches(loader, start_step * config.grad_accum) if start_step else loader)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    history: list[StepLog] = []
    step_times: list[float] = []
    step = start_step
    while step < config.steps:
        t0 = time.perf_counter()
        total, n_on = 0.0, 0
        for micro in range(config.grad_accum):
            (ids,) = next(batches)                                           # [B, L]
            k = (step * config.grad_accum + micro) * accelerator.num_processes + accelerator.process_index
            torch.manual_seed(config.seed * 1_000_003 + k)                   # dropout, sampling: same on resume
            mask = None
            on = config.on_policy > 0 and torch.rand((), generator=torch.Generator().manual_seed(
                config.seed * 7_919 + k)).item() < config.on_policy
            if on:
                ids, P = _generate(accelerator.unwrap_model(smodel), ids, config.on_policy_mode, pad_id)
                mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
                mask[:, P - 1: -1] = True                                    # positions predicting generated tokens
                n_on += 1
            with accelerator.accumulate(smodel):
                with torch.no_grad():
                    if teacher_cache is not None and not on:
                        t_logits = teacher_cache.logits(tmodel, ids)
                    else:
                        t_logits = tmodel(input_ids=ids).logits                  # [B, L, rows_t]
                s_logits = smodel(input_ids=ids).logits                          # [B, L, rows_s]
                loss = distill_loss(s_logits[..., :V], t_logits[..., :V], config.loss, weighting=config.weighting,
                                    temperature=config.temperature, skew_alpha=config.skew_alpha,
                                    jsd_beta=config.jsd_beta, mask=mask)
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, config.max_grad_norm)
                opt.step()
                opt.zero_grad()
            total += float(loss.detach())
            del s_logits, t_logits, loss
        lr = sched.get_last_lr()[0]
        sched.step()
        step += 1
        mean = float(accelerator.reduce(torch.tensor(total / config.grad_accum, device=accelerator.device), "mean"))
        step_times.append(time.perf_counter() - t0)
        entry = StepLog(step=step, loss=mean, lr=lr, seconds=step_times[-1], on_policy=n_on)
        history.append(entry)
        if log is not None and accelerator.is_main_process:
            log(entry)
        stopping = stop_after is not None and step >= stop_after and step < config.steps
        if state_dir is not None and (stopping or (config.save_every and step % config.save_every == 0)):
            _save_state(accelerator, state_dir, step, config)
        if stopping:
            break

    written = None
    if step >= config.steps:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            final = accelerator.unwrap_model(smodel)
            if config.lora:
                final = final.merge_and_unload()
            final.config.use_cache = True
            final = final.to(device="cpu", dtype=getattr(torch, out_dtype))
            inputs = tuple(Path(p) for p in (config.student, config.teacher) if Path(p).is_dir())
            report = {"loss": config.loss, "weighting": config.weighting if config.loss == "csd" else None,
                      "teacher": config.teacher, "student": config.student, "steps": config.steps,
                      "config": config.model_dump(mode="json", exclude={"overwrite", "resume"})}
            written = str(save_model(final, out, tokenizer=tokenizer, overwrite=config.overwrite, inputs=inputs,
                                     text_files={"distill_report.json": json.dumps(report, indent=1)}))
        accelerator.wait_for_everyone()
    del smodel, tmodel, teacher, student, opt
    gc.collect()
    seconds = time.perf_counter() - start
    return DistillResult(output=written, loss=config.loss, weighting=config.weighting if config.loss == "csd" else None,
                         monitored=monitored_name(config.loss, config.weighting), steps=step, start_step=start_step,
                         vocab=V, trainable_params=n_trainable, tokens_per_step=per_step * config.seq_len, seconds=seconds,
                         seconds_per_step=sum(step_times) / max(1, len(step_times)), peak_rss_bytes=peak_rss(),
                         history=history, state_dir=str(state_dir) if state_dir else None)
