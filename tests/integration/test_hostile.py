"""Hostile and unusual inputs on tiny synthetic checkpoints: nothing is lost, nothing passes
verification that differs, and bad input is a one-line usage or format error."""

import json
import shutil

import numpy as np
import pytest

from compress.checkpoint import Checkpoint, CheckpointWriter
from conftest import cli

pytestmark = pytest.mark.integration


def tiny(path, config_text='{"model_type": "toy",\r\n    "quantization_config": null}\r\n', metadata=None, extra=None):
    """2 layers, hidden 32: a bf16 and an fp32 matrix, a [0, 4096] tensor, a bias, with user metadata."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 32)) * 0.02).astype(np.float32)
    with CheckpointWriter(path, shard_metadata=metadata or {"license": "mit", "modelspec.title": "toy"}) as wr:
        wr.add({"layers.0.weight": ("BF16", (64, 32), (w.view(np.uint32) >> 16).astype(np.uint16))})
        wr.add({"layers.1.weight": ("F32", (64, 32), w)})
        wr.add({"layers.1.empty": ("BF16", (0, 4096), np.zeros((0, 4096), np.uint16))})
        wr.add({"layers.1.bias": ("F32", (32,), w[0])})
        if config_text is not None:
            wr.write_text("config.json", config_text)
        for rel, data in (extra or {}).items():
            wr.write_text(rel, data)
        wr.commit()
    return path


def encoded_tiny(tmp_path):
    """The tiny checkpoint and its ecf8 encoding: (src, enc)."""
    src, enc = tiny(tmp_path / "src"), tmp_path / "enc"
    assert cli("encode", "ecf8", src, "-o", enc, "-q").exit_code == 0
    return src, enc


def test_everything_round_trips_byte_for_byte(tmp_path):
    src = tiny(tmp_path / "src", extra={"2_Dense/config.json": "{}", "training_args.bin": "x", ".gitattributes": "*"})
    enc, dec = tmp_path / "enc", tmp_path / "dec"
    assert cli("encode", "ecf8", src, "-o", enc, "-q", "--verify").exit_code == 0
    assert cli("decode", enc, "-o", dec, "-q").exit_code == 0
    assert (dec / "config.json").read_bytes() == (src / "config.json").read_bytes()  # CRLF, null kept
    for rel in ("2_Dense/config.json", "training_args.bin", ".gitattributes"):
        assert (dec / rel).read_bytes() == (src / rel).read_bytes()
    a, b = Checkpoint.open(src), Checkpoint.open(dec)
    assert b.shard_metadata["model.safetensors"] == a.shard_metadata["model.safetensors"]  # user metadata kept
    assert [(n, a.info(n).shape) for n in a.names()] == [(n, b.info(n).shape) for n in b.names()]
    assert all(np.array_equal(a.read_bytes(n), b.read_bytes(n)) for n in a.names())


def test_verify_catches_any_change_to_the_encoded_folder(tmp_path):
    src, enc = encoded_tiny(tmp_path)
    assert cli("verify", src, enc).exit_code == 0

    def tampered(name, change):
        bad = tmp_path / name
        shutil.copytree(enc, bad)
        change(bad)
        return cli("verify", src, bad).exit_code

    def flip(offset):
        def change(bad):
            data = bytearray((bad / "model.safetensors").read_bytes())
            data[offset] ^= 0x01
            (bad / "model.safetensors").write_bytes(bytes(data))
        return change

    header = int.from_bytes((enc / "model.safetensors").read_bytes()[:8], "little")
    size = (enc / "model.safetensors").stat().st_size
    for offset in list(range(8, 8 + header, max(1, header // 60))) + [8 + header + 5, size - 1]:
        assert tampered(f"flip{offset}", flip(offset)) == 3, offset
    assert tampered("added", lambda d: (d / "evil.txt").write_text("x")) == 3
    assert tampered("reindented", lambda d: (d / "config.json").write_text(
        json.dumps(json.loads((d / "config.json").read_text()), indent=4))) == 3
    assert tampered("no-weights", lambda d: (d / "model.safetensors").unlink()) == 3


def test_refusals_are_one_line_usage_errors(tmp_path):
    src = tiny(tmp_path / "src")
    enc = tmp_path / "enc"
    r = cli("encode", "ecf8", src, "-o", tmp_path / "x", "--dtype", "int8")
    assert r.exit_code == 2 and "float32, float16 or bfloat16" in r.output
    assert cli("encode", "ecf8", src, "-o", enc, "-q").exit_code == 0
    r = cli("encode", "ecf8", enc, "-o", tmp_path / "again")
    assert r.exit_code == 2 and "already a compress checkpoint" in r.output
    reserved = tmp_path / "reserved"
    with CheckpointWriter(reserved) as wr:
        wr.add({"a.weight_ecf8_codes": ("F32", (4,), np.zeros(4, np.float32))})
        wr.commit()
    r = cli("encode", "ecf8", reserved, "-o", tmp_path / "r2")
    assert r.exit_code == 2 and "reserves" in r.output
    listy = tiny(tmp_path / "listy", config_text="[1, 2]")
    r = cli("encode", "ecf8", listy, "-o", tmp_path / "l2")
    assert r.exit_code == 1 and "expected a JSON object" in r.output and "internal" not in r.output


def test_an_output_that_appears_meanwhile_is_not_deleted(tmp_path):
    out = tmp_path / "out"
    from compress.errors import ConfigError

    writer = CheckpointWriter(out)
    writer.add({"a": ("F32", (1,), np.zeros(1, np.float32))})
    writer.finish()
    out.mkdir()
    (out / "thesis.txt").write_text("mine")
    with pytest.raises(ConfigError, match="appeared"):
        writer.publish()
    assert (out / "thesis.txt").read_text() == "mine" and not writer.tmp.exists()


def test_empty_config_is_kept(tmp_path):
    src = tiny(tmp_path / "src", config_text="{}")
    enc, dec = tmp_path / "enc", tmp_path / "dec"
    assert cli("encode", "ecf8", src, "-o", enc, "-q", "--verify").exit_code == 0
    assert cli("decode", enc, "-o", dec, "-q").exit_code == 0
    assert (dec / "config.json").read_text() == "{}"


def rewrite_header(path, change):
    """Rewrite a safetensors header through ``change(header_dict)``, keeping the data."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    new = json.dumps(header).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def reseal(folder):
    """Rewrite a folder's manifest to match its files, as an attacker could."""
    import xxhash

    from compress.checkpoint import MANIFEST_NAME, manifest_text

    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "xxh3_128": xxhash.xxh3_128(p.read_bytes()).hexdigest()}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_NAME}
    (folder / MANIFEST_NAME).write_text(manifest_text(files))


def test_decode_refuses_tampering_and_paths_outside_the_output(tmp_path):
    src, enc = encoded_tiny(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(enc, bad)
    (bad / "tokenizer.json").write_text("{}")  # not in the manifest
    r = cli("decode", bad, "-o", tmp_path / "d1")
    assert r.exit_code == 3 and not (tmp_path / "d1").exists()

    def escape(header):
        records = json.loads(header["__metadata__"]["compress.tensors"])
        for record in records.values():
            record["shard"] = "../PWNED.safetensors"
        header["__metadata__"]["compress.tensors"] = json.dumps(records)

    trav = tmp_path / "trav"
    shutil.copytree(enc, trav)
    rewrite_header(trav / "model.safetensors", escape)
    reseal(trav)  # a consistent manifest: only the shard-name rule stands in the way
    r = cli("decode", trav, "-o", tmp_path / "out" / "d2")
    assert r.exit_code == 1 and "malformed record" in r.output
    assert not (tmp_path / "out" / "PWNED.safetensors").exists()
    assert not (tmp_path / "PWNED.safetensors").exists()


def test_manifest_sizes_and_one_way_differences_fail_verify(tmp_path):
    src, enc = encoded_tiny(tmp_path)
    bad = tmp_path / "bad"
    shutil.copytree(enc, bad)
    manifest = json.loads((bad / "compress_manifest.json").read_text())
    manifest["files"]["config.json"]["bytes"] += 1
    from compress.checkpoint import manifest_text

    (bad / "compress_manifest.json").write_text(manifest_text(manifest["files"]))
    assert cli("verify", src, bad).exit_code == 3
    richer = tmp_path / "richer"
    shutil.copytree(src, richer)
    (richer / "EXTRA.txt").write_text("x")
    enc2 = tmp_path / "enc2"
    assert cli("encode", "ecf8", richer, "-o", enc2, "-q").exit_code == 0
    assert cli("verify", src, enc2).exit_code == 3  # it would not decode to the original
    assert cli("verify", src, tmp_path / "nowhere").exit_code == 2
    assert cli("verify", src, src).exit_code == 1  # not a compress output: a format error


def test_convert_refusals(tmp_path):
    src, enc = encoded_tiny(tmp_path)
    fp8 = tmp_path / "fp8"
    assert cli("convert", enc, "-o", tmp_path / "c").exit_code == 2
    assert cli("convert", src, "-o", fp8, "--dtype", "float8_e4m3fn", "-q").exit_code == 0
    assert cli("convert", fp8, "-o", tmp_path / "again", "--dtype", "float8_e4m3fn", "-q").exit_code == 0
    a, b = Checkpoint.open(fp8), Checkpoint.open(tmp_path / "again")  # FP8 input: nothing to do
    assert a.names() == b.names() and all(np.array_equal(a.read_bytes(n), b.read_bytes(n)) for n in a.names())
    clash = tmp_path / "clash"
    with CheckpointWriter(clash) as wr:
        wr.add({"w": ("F32", (4, 4), np.ones((4, 4), np.float32)), "w_scale_inv": ("F32", (1,), np.ones(1, np.float32))})
        wr.commit()
    r = cli("convert", clash, "-o", tmp_path / "c2", "--dtype", "float8_e4m3fn")
    assert r.exit_code == 2 and "already FP8" in r.output


def test_a_lone_shard_with_an_index_keeps_its_index(tmp_path):
    src = tiny(tmp_path / "src")
    (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00001-of-00001.safetensors" for n in Checkpoint.open(src).names()}}))
    enc, dec = tmp_path / "enc", tmp_path / "dec"
    assert cli("encode", "ecf8", src, "-o", enc, "-q", "--verify").exit_code == 0
    assert cli("decode", enc, "-o", dec, "-q").exit_code == 0
    assert (dec / "model.safetensors.index.json").exists() and (dec / "model-00001-of-00001.safetensors").exists()
