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
            got_dtype, got = encoded.read_array(name, backend=backend)  # parts and result checksums too
        except CompressError as e:
            problems.append(f"{name}: cannot decode ({e})")
            continue
        if got_dtype != dtype or got.shape != ref.shape:
            problems.append(f"{name}: {got_dtype}{list(got.shape)} != original {dtype}{list(ref.shape)}")
        elif not np.array_equal(got.reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8)):
            diff = int(np.count_nonzero(got.reshape(-1) != ref.reshape(-1)))
            problems.append(f"{name}: {diff} of {ref.size} values differ")
        count += 1
        total += ref.nbytes
        if progress:
            progress(ref.nbytes)
    problems += _compare_files(original, encoded.checkpoint)
    problems += check_manifest(encoded.checkpoint.path)
    return VerifyReport(ok=not problems, tensors=count, bytes=total, mismatches=problems[:20])


def check_manifest(folder) -> list[str]:
    """Every file of ``folder`` against ``compress_manifest.json``: same set of files, sizes and
    xxh3-128, and the manifest itself in canonical form. Returns one line per problem."""
    import json
    from pathlib import Path

    import xxhash

    from compress.checkpoint import MANIFEST_NAME, manifest_text

    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not path.exists():
        return [f"{MANIFEST_NAME}: missing, so the files cannot be checked"]
    try:
        text = path.read_bytes().decode("utf-8")
        files = json.loads(text)["files"]
        if text != manifest_text(files):
            return [f"{MANIFEST_NAME}: modified (not in canonical form)"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return [f"{MANIFEST_NAME}: unreadable"]
    problems = []
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if (p.is_file() or p.is_symlink()) and p != path}
    problems += [f"file {p}: not in the manifest (added after encoding)" for p in sorted(present - set(files))]
    problems += [f"file {p}: missing" for p in sorted(set(files) - present)]
    for rel in sorted(present & set(files)):
        h = xxhash.xxh3_128()
        try:
            with open(folder / rel, "rb") as f:
                while chunk := f.read(16 << 20):
                    h.update(chunk)
        except OSError as e:
            problems.append(f"file {rel}: unreadable ({e.strerror})")
            continue
        entry = files[rel]
        if (not isinstance(entry, dict) or h.hexdigest() != entry.get("xxh3_128")
                or entry.get("bytes") != (folder / rel).stat().st_size):
            problems.append(f"file {rel}: modified after encoding (or its manifest entry was)")
    return problems


def _compare_files(original, encoded) -> list[str]:
    """Non-weight files: byte-equal; config.json equal to the original once the encoder's
    quantization_config is taken out, and the original text kept in the metadata byte-equal."""
    import json

    problems = []
    meta = next(iter(encoded.shard_metadata.values()), {})
    if (original.path / "config.json").exists() != ("compress.source_config" in meta):
        problems.append("file config.json: present in only one of original and encoded metadata")
    elif "compress.source_config" in meta:
        if (original.path / "config.json").read_bytes() != meta["compress.source_config"].encode("utf-8"):
            problems.append("file config.json: the original kept in the encoded checkpoint differs")
    try:
        kept_shards = json.loads(meta.get("compress.source_shard_metadata", "null"))
        kept_index = json.loads(meta.get("compress.source_index", "null"))
    except json.JSONDecodeError:
        kept_shards = kept_index = "unreadable"
    if kept_shards != original.shard_metadata:
        problems.append("shard metadata: what the encoded checkpoint restores differs from the original's")
    if kept_index != ((original.index.get("metadata") or {}) if original.index is not None else None):
        problems.append("index: the metadata the encoded checkpoint restores differs from the original's")
    want = {str(p) for p in original.extra_files()}
    have = {str(p) for p in encoded.extra_files()}
    problems += [f"file {p}: missing from the encoded checkpoint" for p in sorted(want - have)]
    problems += [f"file {p}: not in the original" for p in sorted(have - want)]
    for rel in sorted(want & have):
        a, b = (original.path / rel).read_bytes(), (encoded.path / rel).read_bytes()
        if rel == "config.json":
            try:
                orig, cfg = json.loads(a), json.loads(b)
                q = cfg.pop("quantization_config", None)
                same = (isinstance(q, dict) and q.get("quant_method") == "ecf8"
                        and q.get("original_quantization_config") == orig.pop("quantization_config", None) and cfg == orig)
            except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
                same = False
        else:
            same = a == b
        if not same:
            problems.append(f"file {rel}: differs from the original")
    return problems
