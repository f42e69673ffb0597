"""Size reports: per-tensor bytes before/after, exponent entropy, bits per weight, bound."""

from __future__ import annotations

from compress.transforms.ecf8 import SizeReport, TensorReport, entropy_bound_bytes, exponent_entropy, size_report


def inspect_checkpoint(source, revision: str | None = None, dtype: str | None = None, progress=None) -> SizeReport:
    """Report sizes of a checkpoint.

    For an ecf8 checkpoint: stored bytes of every tensor's parts, against its original size
    and its exponent-entropy bound (read from the records; nothing is decoded). For a plain
    checkpoint: its float tensors' exponent entropy and the bound ECF8 works against
    (stored = original).

    Args:
        source: path, Hub id, ``pkg:NAME`` or GGUF file.

    Returns:
        :class:`compress.transforms.ecf8.SizeReport`.
    """
    from compress.checkpoint import DTYPES, Checkpoint
    from compress.formats.ecf8 import LAYOUTS, EncodedCheckpoint

    ck = Checkpoint.open(source, revision=revision, dtype=dtype)
    try:
        files = sum((ck.path / s).stat().st_size for s in ck.shard_metadata)
        reports = []
        if any(m.get("compress.format") for m in ck.shard_metadata.values()):
            enc = EncodedCheckpoint(ck)
            for name, r in enc.records.items():
                numel = 1
                for d in r["shape"]:
                    numel *= d
                original = numel * DTYPES[r["dtype"]][0]
                entropy = r.get("exponent_entropy")
                bound = entropy_bound_bytes(r["dtype"], numel, entropy) if entropy is not None else original
                reports.append(TensorReport(name=name, dtype=r["dtype"], shape=r["shape"], codec=r["codec"],
                                            symbol=r.get("symbol"), original_bytes=original,
                                            stored_bytes=enc.stored_bytes(name), exponent_entropy=entropy,
                                            bound_bytes=bound))
        else:
            for name in ck.names():
                dt, bits = ck.read_array(name)
                entropy = exponent_entropy(dt, bits) if dt in LAYOUTS else None
                bound = entropy_bound_bytes(dt, bits.size, entropy) if entropy is not None else bits.nbytes
                reports.append(TensorReport(name=name, dtype=dt, shape=list(bits.shape), codec="none",
                                            original_bytes=bits.nbytes, stored_bytes=bits.nbytes,
                                            exponent_entropy=entropy, bound_bytes=bound))
                if progress:
                    progress(bits.nbytes)
        return size_report(reports, files)
    finally:
        ck.close()
