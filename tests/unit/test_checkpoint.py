"""Checkpoint I/O: hostile headers, stale indexes, atomic writes, sharding."""

import json
import struct

import numpy as np
import pytest

from compress.checkpoint import Checkpoint, CheckpointWriter, parse_size, read_header
from compress.errors import ConfigError, FormatError


def write_raw(path, header: dict, data: bytes):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def make(tmp_path, n_shards=1, **kw):
    out = tmp_path / "ck"
    with CheckpointWriter(out, max_shard_size=kw.get("max_shard_size", "5GB")) as w:
        for i in range(4):
            w.add({f"layer.{i}.weight": ("F32", (8, 4), np.full((8, 4), i, np.float32))})
        w.write_text("config.json", json.dumps({"model_type": "toy"}))
        w.commit()
    return out


def test_round_trip_single_and_sharded(tmp_path):
    single = make(tmp_path)
    assert (single / "model.safetensors").exists() and not (single / "model.safetensors.index.json").exists()
    ck = Checkpoint.open(single)
    assert ck.names() == [f"layer.{i}.weight" for i in range(4)]
    np.testing.assert_array_equal(ck.read_array("layer.2.weight")[1].view(np.float32), np.full((8, 4), 2, np.float32))
    sharded = tmp_path / "sh"
    with CheckpointWriter(sharded, max_shard_size=300) as w:
        for i in range(4):
            w.add({f"t{i}": ("F32", (8, 4), np.zeros((8, 4), np.float32))})
        w.commit()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2 and index["metadata"]["total_size"] == 4 * 128
    from safetensors import safe_open  # the reference reader accepts our files

    with safe_open(str(sharded / index["weight_map"]["t3"]), "pt") as f:
        assert f.metadata()["format"] == "pt" and list(f.get_tensor("t3").shape) == [8, 4]


def test_hostile_headers(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(FormatError, match="truncated"):
        read_header(p)
    p.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(FormatError, match="header length"):
        read_header(p)
    p.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(FormatError, match="JSON"):
        read_header(p)
    write_raw(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)
    with pytest.raises(FormatError, match="hole or overlap"):
        read_header(p)
    write_raw(p, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(FormatError, match="truncated"):
        read_header(p)
    write_raw(p, {"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(FormatError, match="unknown dtype"):
        read_header(p)


def test_stale_index_is_refused_both_ways(tmp_path):
    out = tmp_path / "sh"
    with CheckpointWriter(out, max_shard_size=300) as w:  # two tensors per shard
        for i in range(3):
            w.add({f"t{i}": ("F32", (8, 4), np.zeros((8, 4), np.float32))})
        w.commit()
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    stale = dict(index, weight_map={**index["weight_map"], "ghost": index["weight_map"]["t0"]})
    index_path.write_text(json.dumps(stale))
    with pytest.raises(FormatError, match="ghost"):
        Checkpoint.open(out)
    missing = dict(index, weight_map={k: v for k, v in index["weight_map"].items() if k != "t1"})
    index_path.write_text(json.dumps(missing))
    with pytest.raises(FormatError, match="missing from the index"):
        Checkpoint.open(out)


def test_writer_is_atomic_and_refuses_existing_or_nested_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with CheckpointWriter(out) as w:
            w.add({"a": ("F32", (1,), np.zeros(1, np.float32))})
            raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no output, no temp folder left
    make(tmp_path)
    with pytest.raises(ConfigError, match="already exists"):
        CheckpointWriter(tmp_path / "ck")
    with pytest.raises(ConfigError, match="inside the input"):
        CheckpointWriter(tmp_path / "ck" / "sub", inputs=(tmp_path / "ck",))
    with CheckpointWriter(tmp_path / "ck", overwrite=True) as w:
        w.add({"z": ("F32", (1,), np.ones(1, np.float32))})
        w.commit()
    assert Checkpoint.open(tmp_path / "ck").names() == ["z"]


def test_sizes_and_sources(tmp_path):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(100) == 100
    with pytest.raises(ConfigError):
        parse_size("lots")
    with pytest.raises(ConfigError, match="no such file"):
        Checkpoint.open(tmp_path / "nope")
    with pytest.raises(ConfigError, match="Hub"):
        Checkpoint.open("some-org/some-model-that-is-not-cached")
    with pytest.raises(ConfigError, match="no installed package"):
        Checkpoint.open("pkg:not_a_package_xyz")
