"""Insert a Chain & Hash fingerprint by fine-tuning (arXiv 2407.10887, §3.2).

Every step trains a batch of fingerprint pairs, each wrapped at random (tokenizer chat template or a
generic layout, a default or meta system prompt, random padding around the question; loss on the
answer tokens and the end token only), plus a batch of benign text windows (ordinary next-token
loss) that keeps the model's utility. LoRA (peft) by default, merged into the weights or written
as an adapter alone; full fine-tuning on request. The loop runs through ``accelerate``.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Callable, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from compress.errors import ConfigError
from compress.transforms.fingerprint.key import FingerprintKey, load_key
from compress.transforms.fingerprint.prompts import TRAIN_META_PROMPTS, read_meta_prompts, training_prompt
from compress.eval.memory import peak_rss_bytes

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class InsertConfig(BaseModel):
    """Options of :func:`insert_fingerprint`.

    ``lr`` None: 3e-3 for LoRA, 5e-5 for full fine-tuning. ``batch_size``: fingerprint examples per
    step; ``benign_batch`` windows of ``benign_seq_len`` tokens of benign text per step, weighted
    ``benign_weight``. ``dtype``: output dtype (default: the input's stored dtype). ``check``: after
    training, ask every question plainly on the final (rounded) weights and report the hit rate.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["lora", "full"] = "lora"
    merge: bool = True
    steps: int = Field(60, ge=1, le=1_000_000)
    lr: Optional[float] = Field(None, gt=0.0, le=1.0)
    batch_size: int = Field(4, ge=1, le=4096)
    benign_batch: int = Field(1, ge=0, le=4096)
    benign_seq_len: int = Field(128, ge=8, le=32768)
    benign_weight: float = Field(1.0, ge=0.0)
    lora_rank: int = Field(16, ge=1, le=4096)
    lora_alpha: float = Field(32.0, gt=0.0)
    warmup: int = Field(5, ge=0)
    seed: int = 0
    dtype: Optional[str] = None
    device: str = "cpu"
    check: bool = True

    @property
    def learning_rate(self) -> float:
        """``lr`` or the method's default."""
        return self.lr if self.lr is not None else (3e-3 if self.method == "lora" else 5e-5)


class InsertResult(BaseModel):
    """What an insertion did. Holds no part of the key.

    ``loss``/``benign_loss``: mean of the last 10 steps' fingerprint / benign losses (nats per token).
    ``plain_hit_rate``: fraction of questions whose plain query returns the chosen answer on the
    written weights (None with ``check`` off). ``peak_rss_bytes``: the process's peak resident memory.
    """

    output: str
    method: str
    merged: bool
    steps: int
    lr: float
    batch_size: int
    benign_batch: int
    benign: bool
    meta_prompts: int
    dtype: str
    trainable_parameters: int
    loss: float
    benign_loss: Optional[float]
    plain_hit_rate: Optional[float]
    train_seconds: float
    seconds: float
    peak_rss_bytes: int



def fingerprint_batch(tokenizer, key: FingerprintKey, answers: list[str], order: list[int], rng: random.Random,
                      meta_prompts: tuple[str, ...]):
    """One training batch of wrapped fingerprint pairs, left-padded so every answer ends the row.

    Args:
        order: question indices of the batch's examples.

    Returns:
        (input_ids, attention_mask, labels): input_ids and attention_mask (Tensor[b, L], int64);
        labels (Tensor[b, A], int64), the last A tokens of each row (answer tokens and the end
        token), -100 where a shorter answer leaves prompt tokens.
    """
    import torch

    eos = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    rows = []
    for i in order:
        prompt, answer_prefix, chat = training_prompt(tokenizer, key.questions[i].text, rng, meta_prompts)
        p_ids = tokenizer(prompt, add_special_tokens=not chat)["input_ids"]
        a_ids = tokenizer(answer_prefix + answers[i], add_special_tokens=False)["input_ids"] + [eos]
        rows.append((p_ids, a_ids))
    width = max(len(p) + len(a) for p, a in rows)
    span = max(len(a) for _, a in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # [b, L]
    mask = torch.zeros((len(rows), width), dtype=torch.long)             # [b, L]
    labels = torch.full((len(rows), span), -100, dtype=torch.long)       # [b, A]
    for r, (p, a) in enumerate(rows):
        seq = torch.tensor(p + a)
        input_ids[r, width - seq.numel():] = seq
        mask[r, width - seq.numel():] = 1
        labels[r, span - len(a):] = torch.tensor(a)
    return input_ids, mask, labels


def answer_loss(model, input_ids, attention_mask, labels):
    """Mean cross-entropy of the answer tokens; logits are computed for the last A+1 positions only.

    Args:
        input_ids, attention_mask: (Tensor[b, L], int64), left-padded.
        labels: (Tensor[b, A], int64), targets of the last A positions, -100 to ignore.
    """
    import torch.nn.functional as F

    span = labels.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=span + 1).logits  # [b, A+1, V]
    logits = logits[:, :-1].float()                                                                     # [b, A, V]
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)


def _stored_dtype(path: Path):
    """The dtype a checkpoint folder stores its weights in (``config.json``); bfloat16 when the folder
    is gone (a GGUF input, dequantized to bf16 in a temporary folder)."""
    import json

    import torch

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return torch.bfloat16
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * frac))


def train_fingerprint(model, tokenizer, key: FingerprintKey, config: InsertConfig, benign_ids=None,
                      meta_prompts: tuple[str, ...] = TRAIN_META_PROMPTS, accelerator=None,
                      progress: Optional[Callable[[int, float, Optional[float]], None]] = None) -> dict:
    """Fine-tune ``model`` in place on the fingerprint pairs of ``key`` (and benign windows).

    Args:
        model: a causal LM in float32 (a peft model for LoRA), on the accelerator's device.
        benign_ids: (Tensor[n], int64) token ids of benign text, or None for no benign mixing.
        accelerator: an ``accelerate.Accelerator`` (a CPU one is made when None).
        progress: called after every step with (step, fingerprint loss, benign loss or None).

    Returns:
        ``{"loss", "benign_loss", "seconds"}``: means over the last 10 steps.
    """
    import torch
    from accelerate import Accelerator

    accelerator = accelerator or Accelerator(cpu=config.device == "cpu")
    torch.manual_seed(config.seed)
    rng = random.Random(f"insert-{config.seed}-{accelerator.process_index}")
    gen = torch.Generator().manual_seed(config.seed + accelerator.process_index)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0, betas=(0.9, 0.99))
    model, opt = accelerator.prepare(model, opt)
    model.train()
    answers = key.answers()
    k = len(key.questions)
    queue: list[int] = []
    losses, benign_losses = [], []
    use_benign = benign_ids is not None and config.benign_batch > 0 and config.benign_weight > 0
    start = time.perf_counter()
    for step in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, config.steps, config.warmup, config.learning_rate)
        order = []
        while len(order) < config.batch_size:  # every question equally often: shuffled rounds
            if not queue:
                queue = rng.sample(range(k), k)
            order.append(queue.pop())
        ids, mask, labels = (t.to(accelerator.device) for t in fingerprint_batch(tokenizer, key, answers, order, rng,
                                                                                   meta_prompts))
        loss = answer_loss(model, ids, mask, labels)
        total = loss
        if use_benign:
            span = config.benign_seq_len
            offs = torch.randint(0, benign_ids.numel() - span + 1, (config.benign_batch,), generator=gen)
            windows = torch.stack([benign_ids[o: o + span] for o in offs.tolist()]).to(accelerator.device)  # [bb, S]
            b_loss = model(input_ids=windows, labels=windows).loss
            total = loss + config.benign_weight * b_loss
            benign_losses.append(float(b_loss.detach()))
        opt.zero_grad(set_to_none=True)
        accelerator.backward(total)
        accelerator.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(step + 1, losses[-1], benign_losses[-1] if use_benign else None)
    model.eval()
    tail = lambda xs: sum(xs[-10:]) / len(xs[-10:]) if xs else None  # noqa: E731
    return {"loss": tail(losses), "benign_loss": tail(benign_losses), "seconds": time.perf_counter() - start,
            "model": accelerator.unwrap_model(model)}


def insert_fingerprint(model: str, key_path: str | os.PathLike, output_dir: str | os.PathLike,
                       config: InsertConfig = InsertConfig(), *, benign: str | os.PathLike | None = None,
                       meta_prompts: str | os.PathLike | None = None, overwrite: bool = False,
                       progress: Optional[Callable[[int, float, Optional[float]], None]] = None) -> InsertResult:
    """Fine-tune the fingerprint of ``key_path`` into ``model`` and write the result to ``output_dir``.

    Computes in float32; the written weights are rounded to ``config.dtype`` (default: the input's
    stored dtype) and the reported ``plain_hit_rate`` is measured on those rounded weights.

    Args:
        model: any checkpoint :func:`compress.eval.model.load_causal_lm` loads.
        key_path: the owner's key file (never copied into the output).
        output_dir: a plain HF checkpoint (merged, or full fine-tuning) or a peft adapter folder
            (LoRA without merge); written atomically.
        benign: UTF-8 text mixed into training to keep utility (None: no mixing).
        meta_prompts: file of training system prompts, one per line (default: a built-in set).
        overwrite: replace an existing ``output_dir``.
        progress: called after every training step with (step, fingerprint loss, benign loss or None).

    Returns:
        :class:`InsertResult`.

    Raises:
        ConfigError: bad options, missing files, an existing output; FormatError: a bad key file.
    """
    import torch

    from compress.checkpoint import CheckpointWriter, dtype_name, save_model, torch_dtype
    from compress.eval.model import load_causal_lm
    from compress.eval.text import read_text, tokenize
    from compress.transforms.fingerprint.verify import LocalChat, contains_answer

    start = time.perf_counter()
    key = load_key(key_path)
    metas = read_meta_prompts(meta_prompts, TRAIN_META_PROMPTS)
    out = Path(output_dir)
    if out.exists() and not overwrite:  # refuse before minutes of training
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it")
    if config.method == "full" and not config.merge:
        raise ConfigError("--adapter-only needs --lora (full fine-tuning has no adapter)")
    body = read_text(benign) if benign is not None else None
    loaded = load_causal_lm(model, dtype="F32", device=config.device)  # safetensors name: eval_dtype reads those
    net, tok = loaded.model, loaded.tokenizer
    if loaded.quant_method is not None:
        raise ConfigError(f"{model}: a quantized ({loaded.quant_method}) checkpoint; insert into the unquantized model")
    stored = _stored_dtype(loaded.path)
    out_dtype = torch_dtype(dtype_name(config.dtype)) if config.dtype else stored
    if isinstance(out_dtype, str) or not out_dtype.is_floating_point:
        raise ConfigError(f"--dtype {config.dtype}: expected float32, bfloat16 or float16")
    benign_ids = None
    if body is not None:
        need = max(200_000, config.steps * config.benign_batch * config.benign_seq_len)
        benign_ids = tokenize(tok, body, need)  # [n]
        if benign_ids.numel() < config.benign_seq_len:
            raise ConfigError(f"{benign}: {benign_ids.numel()} tokens, fewer than one window of {config.benign_seq_len}")
    if config.method == "lora":
        from peft import LoraConfig, get_peft_model

        targets = [t for t in LORA_TARGETS if any(n.endswith(t) for n, _ in net.named_modules())]
        if not targets:
            raise ConfigError(f"{model}: no {', '.join(LORA_TARGETS)} linear layers for LoRA; use --full")
        net = get_peft_model(net, LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                                             target_modules=targets, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    trained = train_fingerprint(net, tok, key, config, benign_ids, metas, progress=progress)
    net = trained["model"]
    adapter_only = config.method == "lora" and not config.merge
    if config.method == "lora" and config.merge:
        net = net.merge_and_unload()
    with torch.no_grad():  # round to the output dtype now, so the check sees the written weights
        base = net.get_base_model() if adapter_only else net
        for p in base.parameters():
            p.copy_(p.to(out_dtype).to(p.dtype))
    hit_rate = None
    if config.check:
        from compress.transforms.fingerprint.prompts import Query

        answers = key.answers()
        outs = LocalChat(net, tok).complete([Query(i, "plain", None, q.text) for i, q in enumerate(key.questions)], 16)
        hit_rate = sum(contains_answer(o, a) for o, a in zip(outs, answers)) / len(answers)
    if adapter_only:
        net.peft_config["default"].base_model_name_or_path = str(model)
        with CheckpointWriter(out, overwrite=overwrite, inputs=(loaded.path,)) as writer:
            net.save_pretrained(writer.tmp, safe_serialization=True)
            tok.save_pretrained(writer.tmp)
            written = writer.publish()
    else:
        net.to(out_dtype)
        net.config.dtype = out_dtype
        written = save_model(net, out, tokenizer=tok, overwrite=overwrite, inputs=(loaded.path,))
    return InsertResult(output=str(written), method=config.method, merged=not adapter_only, steps=config.steps,
                        lr=config.learning_rate, batch_size=config.batch_size,
                        benign_batch=config.benign_batch if benign_ids is not None else 0, benign=benign_ids is not None,
                        meta_prompts=len(metas), dtype=str(out_dtype).removeprefix("torch."),
                        trainable_parameters=trainable, loss=trained["loss"], benign_loss=trained["benign_loss"],
                        plain_hit_rate=hit_rate, train_seconds=trained["seconds"],
                        seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss_bytes())
