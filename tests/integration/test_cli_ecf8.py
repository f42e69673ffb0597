"""The CLI end to end on real checkpoints: encode, verify, decode, inspect, load, bad input."""

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from compress.checkpoint import Checkpoint
from conftest import cli, tree_hash

pytestmark = pytest.mark.integration


def assert_same_tensors(a, b):
    ca, cb = Checkpoint.open(a), Checkpoint.open(b)
    assert ca.names() == cb.names()
    for name in ca.names():
        assert ca.info(name).dtype == cb.info(name).dtype and ca.info(name).shape == cb.info(name).shape
        assert np.array_equal(ca.read_bytes(name), cb.read_bytes(name)), name


@pytest.mark.parametrize("variant,max_ratio", [("fp32", 0.835), ("bf16", 0.667), ("fp8", 0.83)])
def test_minilm_encode_verify_decode(variant, max_ratio, request, tmp_path):
    src = request.getfixturevalue(f"minilm_{variant}")
    before = tree_hash(src)
    enc, dec = tmp_path / "enc", tmp_path / "dec"
    r = cli("encode", "ecf8", src, "-o", enc, "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["ratio"] < max_ratio, report["ratio"]
    if variant != "fp8":  # within 1% (relative) of the per-tensor exponent-entropy bound
        assert report["file_bytes"] <= 1.01 * report["bound_bytes"]
    assert tree_hash(src) == before  # the input is never modified
    r = cli("verify", src, enc, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ok"] is True
    r = cli("decode", enc, "-o", dec, "--json")
    assert r.exit_code == 0, r.output
    assert_same_tensors(src, dec)
    assert json.loads((dec / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert (dec / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    if variant == "fp8":  # scale tensors are kept intact, raw, under their own names
        ck = Checkpoint.open(enc)
        scales = [n for n in ck.names() if n.endswith("weight_scale_inv")]
        assert scales and all(ck.info(n).dtype == "F32" for n in scales)


def test_minilm_loads_bit_exact_through_transformers(minilm_fp32, tmp_path):
    import compress
    from transformers import AutoModel

    enc = tmp_path / "enc"
    assert cli("encode", "ecf8", minilm_fp32, "-o", enc, "-q").exit_code == 0
    original = Checkpoint.open(minilm_fp32)
    for model in (compress.load(enc), AutoModel.from_pretrained(enc)):
        state = model.state_dict()
        for name in original.names():
            if name in state:
                assert torch.equal(state[name], original.get(name)), name


def test_plain_transformers_refuses_instead_of_random_weights(minilm_fp32, tmp_path):
    enc = tmp_path / "enc"
    assert cli("encode", "ecf8", minilm_fp32, "-o", enc, "-q").exit_code == 0
    code = f"from transformers import AutoModel; AutoModel.from_pretrained({str(enc)!r})"  # no `import compress`
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "mismatch" in (out.stdout + out.stderr).lower()


def test_backend_errors_are_usage_errors(minilm_bf16, tmp_path, monkeypatch):
    enc = tmp_path / "enc"
    assert cli("encode", "ecf8", minilm_bf16, "-o", enc, "-q").exit_code == 0
    r = cli("decode", enc, "-o", tmp_path / "d", "--backend", "bogus")
    assert r.exit_code == 2
    monkeypatch.delenv("TRITON_INTERPRET")
    import torch

    if not torch.cuda.is_available():
        r = cli("decode", enc, "-o", tmp_path / "d", "--backend", "triton")
        assert r.exit_code == 2 and "CUDA" in r.output and "Traceback" not in r.output


def test_smollm2_bf16_and_gguf_route(smollm2_bf16, smollm2_gguf, tmp_path):
    enc = tmp_path / "enc"
    r = cli("encode", "ecf8", smollm2_bf16, "-o", enc, "--json", "--verify")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["verify"]["ok"] and report["ratio"] < 0.67
    assert report["file_bytes"] <= 1.01 * report["bound_bytes"]
    import compress

    model = compress.load(enc)
    original = Checkpoint.open(smollm2_bf16)
    state = model.state_dict()
    for name in original.names():
        assert torch.equal(state[name].view(torch.int16), original.get(name).view(torch.int16)), name
    # the GGUF route: encode straight from the .gguf, verify against it (dtype read from the metadata)
    genc = tmp_path / "genc"
    r = cli("encode", "ecf8", smollm2_gguf, "--dtype", "bfloat16", "-o", genc, "-q")
    assert r.exit_code == 0, r.output
    r = cli("verify", smollm2_gguf, genc, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tensors"] == len(original.names())


def test_one_flipped_byte_fails_verify_with_exit_3(minilm_bf16, tmp_path):
    enc = tmp_path / "enc"
    assert cli("encode", "ecf8", minilm_bf16, "-o", enc, "-q").exit_code == 0
    shard = enc / "model.safetensors"
    data = bytearray(shard.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    for where in (header_end + (len(data) - header_end) // 3, len(data) - 3, 100):  # payload, padding, header
        bad = tmp_path / f"bad{where}"
        shutil.copytree(enc, bad)
        flipped = bytearray(data)
        flipped[where] ^= 0x10
        (bad / "model.safetensors").write_bytes(bytes(flipped))
        r = cli("verify", minilm_bf16, bad)
        assert r.exit_code == 3, (where, r.output)
        assert "Traceback" not in r.output


def test_bad_input_gives_one_line_errors(minilm_fp32, tmp_path):
    r = cli("encode", "ecf8", tmp_path / "missing", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "no such file" in r.output and "Traceback" not in r.output
    r = cli("encode", "ecf8", minilm_fp32, "-o", minilm_fp32 / "inside")
    assert r.exit_code == 2 and "inside the input" in r.output
    (tmp_path / "exists").mkdir()
    r = cli("encode", "ecf8", minilm_fp32, "-o", tmp_path / "exists")
    assert r.exit_code == 2 and "--overwrite" in r.output
    r = cli("encode", "ecf8", minilm_fp32, "-o", tmp_path / "o", "--slice-size", "5")
    assert r.exit_code == 2 and "--slice-size" in r.output
    r = cli("decode", minilm_fp32, "-o", tmp_path / "d")
    assert r.exit_code == 1 and "not an ecf8 checkpoint" in r.output
    broken = tmp_path / "broken"
    shutil.copytree(minilm_fp32, broken)
    (broken / "model.safetensors").write_bytes((minilm_fp32 / "model.safetensors").read_bytes()[:5000])
    r = cli("encode", "ecf8", broken, "-o", tmp_path / "o2")
    assert r.exit_code == 1 and "truncated" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o2").exists() and not list(tmp_path.glob(".o2.tmp-*"))


def test_inspect_reports_entropy_and_bound(minilm_bf16, tmp_path):
    r = cli("inspect", minilm_bf16, "--json")
    assert r.exit_code == 0, r.output
    plain = json.loads(r.stdout)
    q = next(t for t in plain["tensors"] if t["name"].endswith("query.weight"))
    assert 2.0 < q["exponent_entropy"] < 3.5 and q["stored_bytes"] == q["original_bytes"]
    enc = tmp_path / "enc"
    assert cli("encode", "ecf8", minilm_bf16, "-o", enc, "-q").exit_code == 0
    coded = json.loads(cli("inspect", enc, "--json").stdout)
    assert coded["original_bytes"] == plain["original_bytes"]
    assert coded["ratio"] < 0.67 and abs(coded["bound_bytes"] - plain["bound_bytes"]) < 1


def test_help_is_fast_and_module_entry_point_works():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "compress", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "encode" in out.stdout
    assert time.perf_counter() - start < 1.5
    assert "torch" not in subprocess.run([sys.executable, "-c", "import sys, compress.cli.main; print(sorted(sys.modules))"],
                                         capture_output=True, text=True).stdout


def test_sharded_input_and_output_round_trip(minilm_fp32, tmp_path):
    sharded, enc, dec = tmp_path / "sharded", tmp_path / "enc", tmp_path / "dec"
    assert cli("convert", minilm_fp32, "-o", sharded, "--max-shard-size", "30MB", "-q").exit_code == 0
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and (sharded / "model.safetensors.index.json").exists()
    assert cli("encode", "ecf8", sharded, "-o", enc, "--max-shard-size", "20MB", "-q", "--verify").exit_code == 0
    assert len(list(enc.glob("*.safetensors"))) >= 3 and (enc / "model.safetensors.index.json").exists()
    assert cli("decode", enc, "-o", dec, "-q").exit_code == 0
    assert sorted(p.name for p in dec.glob("*.safetensors")) == shards  # the original shard names
    assert json.loads((dec / "model.safetensors.index.json").read_text())["weight_map"] == \
        json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert_same_tensors(sharded, dec)
