"""Lossless verification: decode an encoded checkpoint and compare it with the original."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel


class VerifyReport(BaseModel):
    """Result of :func:`verify_checkpoint`.

    Attributes:
        ok: every tensor bit-identical and the tensor sets equal.
        tensors: tensors compared.
        bytes: original bytes compared.
        mismatches: one line per problem (first 20).
    """

    ok: bool
    tensors: int
    bytes: int
    mismatches: list[str]


def verify_checkpoint(original, encoded, *, backend: str = "auto", progress=None) -> VerifyReport:
    """Decode every tensor of ``encoded`` and compare its bytes, dtype and shape with ``original``.

    Also compares the tensor sets and the original shard of each tensor (the index). Every
    problem is collected, not only the first; a corrupt part is a mismatch, not a crash.

    Args:
        original: :class:`compress.checkpoint.Checkpoint` (cast applied, e.g. a GGUF input).
        encoded: :class:`compress.formats.ecf8.EncodedCheckpoint`.

    Returns:
        :class:`VerifyReport`; the CLI exits 3 when ``ok`` is false.
    """
    from compress.errors import CompressError
    from compress.formats.ecf8 import checksum

    problems: list[str] = []
    want, have = set(original.names()), set(encoded.records)
    problems += [f"{n}: missing from the encoded checkpoint" for n in sorted(want - have)]
    problems += [f"{n}: not in the original" for n in sorted(have - want)]
    count = total = 0
    for name in [n for n in original.names() if n in have]:
        record = encoded.records[name]
        if record.get("shard") != original.info(name).shard:
            problems.append(f"{name}: index says shard {record.get('shard')!r}, original has {original.info(name).shard!r}")
        dtype, ref = original.read_array(name)
        try:
            got_dtype, got = encoded.read_array(name, backend=backend, check=False)
        except CompressError as e:
            problems.append(f"{name}: cannot decode ({e})")
            continue
        if got_dtype != dtype or got.shape != ref.shape:
            problems.append(f"{name}: {got_dtype}{list(got.shape)} != original {dtype}{list(ref.shape)}")
        elif not np.array_equal(got.reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8)):
            diff = int(np.count_nonzero(got.reshape(-1) != ref.reshape(-1)))
            problems.append(f"{name}: {diff} of {ref.size} values differ")
        elif checksum(got) != record.get("xxh3_128"):
            problems.append(f"{name}: stored checksum does not match the decoded tensor")
        if not encoded.parts_ok(name):
            problems.append(f"{name}: stored parts do not match their checksum (file modified)")
        count += 1
        total += ref.nbytes
        if progress:
            progress(ref.nbytes)
    problems += _compare_files(original, encoded.checkpoint)
    return VerifyReport(ok=not problems, tensors=count, bytes=total, mismatches=problems[:20])


def _compare_files(original, encoded) -> list[str]:
    """Non-weight files: byte-equal, except config.json, equal as JSON once the encoder's
    quantization_config is swapped back for the original's."""
    import json

    problems = []
    want = {str(p) for p in original.extra_files()}
    have = {str(p) for p in encoded.extra_files()}
    problems += [f"file {p}: missing from the encoded checkpoint" for p in sorted(want - have)]
    for rel in sorted(want & have):
        a, b = (original.path / rel).read_bytes(), (encoded.path / rel).read_bytes()
        if rel == "config.json":
            try:
                cfg = json.loads(b)
                q = cfg.pop("quantization_config", None) or {}
                if q.get("original_quantization_config") is not None:
                    cfg["quantization_config"] = q["original_quantization_config"]
                same = json.loads(a) == cfg
            except (json.JSONDecodeError, AttributeError):
                same = False
        else:
            same = a == b
        if not same:
            problems.append(f"file {rel}: differs from the original")
    return problems
