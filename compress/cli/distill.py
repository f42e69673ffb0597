"""``compress distill``: heal a compressed student from its teacher (CSD or the KL family). Parsing and rendering only.

Many GPUs: ``accelerate launch --multi_gpu --num_processes 8 -m compress distill STUDENT --teacher T -o OUT --data F``
(each process trains on its own micro-batches; ``--batch-size`` is per process).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from compress.cli.common import JsonOpt, OverwriteOpt, QuietOpt, emit_json, human, run, stderr, stdout


class Loss(str, Enum):
    """Distillation losses (compress.transforms.distill)."""

    csd = "csd"
    fkl = "fkl"
    rkl = "rkl"
    skl = "skl"
    srkl = "srkl"
    jsd = "jsd"


class Weighting(str, Enum):
    """CSD weightings: student/student, teacher/student, uniform/student."""

    ss = "ss"
    ts = "ts"
    us = "us"


class Mode(str, Enum):
    """How the student generates on-policy continuations."""

    sample = "sample"
    greedy = "greedy"


def distill(
    student: str = typer.Argument(..., help="Student checkpoint: folder, pkg:NAME, .gguf, or an ECF8 checkpoint."),
    teacher: str = typer.Option(..., "--teacher", "-t", help="Teacher checkpoint with the same tokenizer."),
    output_dir: Path = typer.Option(..., "--output-dir", "-o", help="Folder of the distilled plain HF checkpoint."),
    data: Path = typer.Option(..., "--data", help="UTF-8 training text; windows at random offsets.", dir_okay=False),
    loss: Loss = typer.Option(Loss.csd, "--loss", help="csd (concrete score distillation), fkl, rkl, skl, srkl or jsd."),
    weighting: Weighting = typer.Option(Weighting.ss, "--weighting", help="CSD weights: ss (mode-seeking), ts, us."),
    steps: int = typer.Option(100, "--steps", min=1, help="Optimizer steps."),
    lr: float = typer.Option(1e-4, "--lr", min=0.0, help="AdamW peak learning rate (cosine decay to 10%)."),
    warmup: int = typer.Option(0, "--warmup", min=0, help="Linear warmup steps."),
    seq_len: int = typer.Option(256, "--seq-len", min=4, help="Tokens per training window."),
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="Windows per micro-batch (per process)."),
    grad_accum: int = typer.Option(1, "--grad-accum", min=1, help="Micro-batches per optimizer step."),
    lora: bool = typer.Option(False, "--lora", help="Train LoRA adapters (peft) and merge them into the output."),
    lora_rank: int = typer.Option(16, "--lora-rank", min=1),
    train_from_layer: int = typer.Option(0, "--train-from-layer", min=0,
                                         help="Freeze embeddings and layers below this index (cheaper healing)."),
    on_policy: float = typer.Option(0.0, "--on-policy", min=0.0, max=1.0,
                                    help="Fraction of micro-batches continued by the student (GKD-style)."),
    on_policy_mode: Mode = typer.Option(Mode.sample, "--on-policy-mode", help="sample or greedy continuations."),
    temperature: float = typer.Option(1.0, "--temperature", min=0.0,
                                      help="CSD: of the weights only; KL family: of both distributions."),
    skew_alpha: float = typer.Option(0.1, "--skew-alpha", help="α of skl/srkl."),
    jsd_beta: float = typer.Option(0.5, "--jsd-beta", help="β of jsd."),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", min=0.0, help="Gradient clipping (0: off)."),
    seed: int = typer.Option(0, "--seed", help="Seed of windows, on-policy choices, sampling."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Output dtype (default: the student's stored dtype)."),
    save_state: Optional[Path] = typer.Option(None, "--save-state", help="Folder for resumable training state."),
    save_every: int = typer.Option(0, "--save-every", min=0, help="Save the state every N steps (needs --save-state)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Resume from a --save-state folder (same options)."),
    overwrite: bool = OverwriteOpt, json_out: bool = JsonOpt, quiet: bool = QuietOpt,
) -> None:
    """Distill TEACHER into STUDENT (same tokenizer); logs ½Var_p(s-t) for CSD, the divergence otherwise."""

    def work():
        from pydantic import ValidationError

        from compress.errors import validation_error
        from compress.transforms.distill import DistillConfig, distill as distill_

        try:
            config = DistillConfig(
                student=student, teacher=teacher, output_dir=str(output_dir), data=str(data), loss=loss.value,
                weighting=weighting.value, temperature=temperature, skew_alpha=skew_alpha, jsd_beta=jsd_beta, steps=steps,
                lr=lr, warmup_steps=warmup, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, lora=lora,
                lora_rank=lora_rank, train_from_layer=train_from_layer, on_policy=on_policy, on_policy_mode=on_policy_mode.value, seed=seed,
                max_grad_norm=max_grad_norm, dtype=dtype, state_dir=str(save_state) if save_state else None,
                save_every=save_every, resume=str(resume) if resume else None, overwrite=overwrite)
        except ValidationError as e:
            raise validation_error(e, option=True) from None
        show = not (quiet or json_out)
        return distill_(config, log=(lambda s: stderr.print(
            f"step {s.step}: loss {s.loss:.5f} lr {s.lr:.2e} {s.seconds:.1f} s" + (" (on-policy)" if s.on_policy else ""),
            highlight=False)) if show else None)

    r = run(work, json_out)
    if json_out:
        emit_json(r)
        return
    first, last = r.history[0].loss if r.history else float("nan"), r.history[-1].loss if r.history else float("nan")
    name = r.loss + (f" ({r.weighting})" if r.weighting else "")
    stdout.print(f"{name}: {r.monitored} {first:.5f} -> {last:.5f} over steps {r.start_step + 1}-{r.steps}; "
                 f"{r.seconds_per_step:.2f} s/step, {r.tokens_per_step} tokens/step, {r.trainable_params:,} trainable "
                 f"parameters, peak RSS {human(r.peak_rss_bytes)}", soft_wrap=True)
    stdout.print(f"wrote {r.output}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    """Add ``distill`` to ``app``."""
    app.command("distill")(distill)
