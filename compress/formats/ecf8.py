"""The ``ecf8`` on-disk format: entropy-coded float exponents, raw sign and mantissa.

Normative spec: ``docs/formats/ecf8.md``. This module is runtime code: it reads an encoded
tensor's parts and decodes them (through ``compress.kernels.ecf8``) without importing the
encoder.

A float of ``T`` bits with ``E`` exponent and ``M`` mantissa bits is split into a *symbol*
(its exponent field, or in ``byte`` mode the whole 8-bit value) and a *raw field* of
``R = 1 + M`` bits (sign, then mantissa). Symbols are coded with one canonical Huffman code per
tensor (lengths <= 15 bits, decoded with at most two lookups in 256-entry tables); the coded
stream is cut into slices of ``slice_size`` symbols, ``lanes`` slices interleaved per tile so
that lane ``l`` of tile ``t`` holds elements ``t*lanes*slice_size + i*lanes + l``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from compress.errors import FormatError

FORMAT_NAME = "ecf8"
FORMAT_VERSION = 1
MAX_CODE_LENGTH = 15  # code lengths fit a nibble in the stored codebook
PAD_BYTES = 8  # every stream ends with >= 8 zero bytes so decoders may read ahead

# Tensor name suffixes (the original leaf is kept: ``q_proj.weight`` -> ``q_proj.weight_ecf8_codes``)
CODES, SIGN_MANTISSA, CODEBOOK, SLICE_BITS = "_ecf8_codes", "_ecf8_sign_mantissa", "_ecf8_codebook", "_ecf8_slice_bits"
SUFFIXES = (CODES, SIGN_MANTISSA, CODEBOOK, SLICE_BITS)


@dataclass(frozen=True)
class FloatLayout:
    """Bit layout of a float dtype: ``T = 1 + exponent_bits + mantissa_bits``.

    Attributes:
        dtype: safetensors dtype string.
        bits: total bits T.
        exponent_bits: E.
        mantissa_bits: M.
    """

    dtype: str
    bits: int
    exponent_bits: int
    mantissa_bits: int

    @property
    def raw_bits(self) -> int:
        """R = 1 + M: the sign bit and the mantissa, stored raw."""
        return 1 + self.mantissa_bits


LAYOUTS = {
    "F32": FloatLayout("F32", 32, 8, 23),
    "BF16": FloatLayout("BF16", 16, 8, 7),
    "F16": FloatLayout("F16", 16, 5, 10),
    "F8_E4M3": FloatLayout("F8_E4M3", 8, 4, 3),
    "F8_E5M2": FloatLayout("F8_E5M2", 8, 5, 2),
}


@dataclass(frozen=True)
class CodedTensor:
    """One ECF8-coded tensor: its parts (as stored) and its record.

    Attributes:
        dtype: original safetensors dtype (a key of :data:`LAYOUTS`).
        shape: original shape.
        symbol: ``"exponent"`` (symbol = exponent field and the top ``mantissa_in_symbol``
            mantissa bits; sign and the other mantissa bits raw) or ``"byte"`` (8-bit dtypes
            only: symbol = the whole value, no raw field).
        mantissa_in_symbol: k, top mantissa bits coded with the exponent (0..2).
        slice_size: symbols per slice (S).
        lanes: slices per tile (W).
        codes: ``ndarray[n_bytes], uint8``: the coded symbol stream, tiles byte-aligned, padded.
        sign_mantissa: ``ndarray[ceil(n*R/8)+pad], uint8``: raw fields packed MSB-first, or
            empty in ``byte`` mode.
        codebook: ``ndarray[2**symbol_bits], uint8``: canonical Huffman code length per symbol
            (0 = absent), unpacked; stored packed (:func:`pack_codebook`).
        slice_bits: ``ndarray[n_tiles*lanes], uint16``: coded bits of each slice.
    """

    dtype: str
    shape: tuple[int, ...]
    symbol: str
    mantissa_in_symbol: int
    slice_size: int
    lanes: int
    codes: np.ndarray
    sign_mantissa: np.ndarray
    codebook: np.ndarray
    slice_bits: np.ndarray

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def layout(self) -> FloatLayout:
        return LAYOUTS[self.dtype]

    @property
    def raw_bits(self) -> int:
        """Bits stored raw per value: sign + the mantissa bits not in the symbol (0 in byte mode)."""
        return 0 if self.symbol == "byte" else self.layout.raw_bits - self.mantissa_in_symbol

    @property
    def symbol_bits(self) -> int:
        """Bits per symbol: the alphabet is ``2**symbol_bits``."""
        layout = self.layout
        return layout.bits if self.symbol == "byte" else layout.exponent_bits + self.mantissa_in_symbol

    @property
    def nbytes(self) -> int:
        """Stored bytes of all four parts."""
        return self.codes.nbytes + self.sign_mantissa.nbytes + pack_codebook(self.codebook).nbytes + self.slice_bits.nbytes

    def record(self) -> dict[str, Any]:
        """The JSON record stored in the shard metadata (checksum added by the caller)."""
        return {"codec": FORMAT_NAME, "dtype": self.dtype, "shape": list(self.shape), "symbol": self.symbol,
                "mantissa_in_symbol": self.mantissa_in_symbol, "slice_size": self.slice_size, "lanes": self.lanes}

    def parts(self, name: str) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
        """The stored tensors: name -> (safetensors dtype, shape, data).

        The original name holds an empty tensor of the original dtype: a loader that does not
        know ecf8 then fails on a shape mismatch instead of initializing random weights.
        """
        from compress.checkpoint import DTYPES

        out = {name: (self.dtype, (0,), np.zeros(0, DTYPES[self.dtype][1])),
               name + CODES: ("U8", (self.codes.size,), self.codes)}
        if self.symbol != "byte":
            out[name + SIGN_MANTISSA] = ("U8", (self.sign_mantissa.size,), self.sign_mantissa)
        book = pack_codebook(self.codebook)
        out[name + CODEBOOK] = ("U8", (book.size,), book)
        out[name + SLICE_BITS] = ("I16", (self.slice_bits.size,), self.slice_bits.view(np.int16))
        return out

    @classmethod
    def from_parts(cls, name: str, record: dict[str, Any], parts: dict[str, np.ndarray]) -> "CodedTensor":
        """Rebuild from stored parts (``uint8``/``int16`` arrays) and the metadata record.

        Raises:
            FormatError: a part is missing or inconsistent with the record.
        """
        try:
            dtype, shape, symbol = record["dtype"], tuple(record["shape"]), record["symbol"]
            slice_size, lanes = int(record["slice_size"]), int(record["lanes"])
            k = int(record.get("mantissa_in_symbol", 0))
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"tensor {name!r}: malformed ecf8 metadata record {record!r}") from None
        if dtype not in LAYOUTS or symbol not in ("exponent", "byte") or (symbol == "byte" and LAYOUTS[dtype].bits != 8) \
                or not 0 <= k <= (0 if symbol == "byte" else min(LAYOUTS[dtype].mantissa_bits, 2)):
            raise FormatError(f"tensor {name!r}: unsupported ecf8 dtype/symbol {dtype}/{symbol}/{k}")
        if slice_size < 1 or slice_size * MAX_CODE_LENGTH > 65535 or lanes < 1:
            raise FormatError(f"tensor {name!r}: bad slice_size {slice_size} or lanes {lanes}")
        need = [CODES, CODEBOOK, SLICE_BITS] + ([SIGN_MANTISSA] if symbol == "exponent" else [])
        missing = [name + s for s in need if name + s not in parts]
        if missing:
            raise FormatError(f"tensor {name!r}: missing parts {missing}")
        empty = np.zeros(0, np.uint8)
        bits = LAYOUTS[dtype].bits if symbol == "byte" else LAYOUTS[dtype].exponent_bits + k
        lengths = unpack_codebook(parts[name + CODEBOOK].view(np.uint8), 1 << bits, name)
        ct = cls(dtype, shape, symbol, k, slice_size, lanes, parts[name + CODES].view(np.uint8),
                 parts.get(name + SIGN_MANTISSA, empty).view(np.uint8), lengths,
                 parts[name + SLICE_BITS].view(np.uint16))
        ct.validate(name)
        return ct

    def validate(self, name: str) -> None:
        """Check part sizes against the record, so decoders never read out of bounds.

        Raises:
            FormatError: naming the tensor and the inconsistent part.
        """
        n, S, W = self.numel, self.slice_size, self.lanes
        n_tiles = -(-n // (S * W))
        alphabet = 1 << self.symbol_bits
        if self.codebook.size != alphabet or int(self.codebook.max(initial=0)) > MAX_CODE_LENGTH:
            raise FormatError(f"tensor {name!r}: codebook has {self.codebook.size} entries, expected {alphabet} "
                              f"lengths <= {MAX_CODE_LENGTH}")
        kraft = np.sum(np.ldexp(1.0, -self.codebook[self.codebook > 0].astype(np.int64)))
        if n and (kraft > 1.0 or not np.any(self.codebook)):
            raise FormatError(f"tensor {name!r}: codebook is not a prefix code (Kraft sum {kraft})")
        if self.slice_bits.size != n_tiles * W:
            raise FormatError(f"tensor {name!r}: {self.slice_bits.size} slice lengths, expected {n_tiles * W}")
        tile_bytes = (self.slice_bits.astype(np.int64).reshape(n_tiles, W).sum(1) + 7) // 8
        if self.codes.size < int(tile_bytes.sum()) + PAD_BYTES:
            raise FormatError(f"tensor {name!r}: coded stream has {self.codes.size} bytes, slices need {int(tile_bytes.sum()) + PAD_BYTES}")
        if self.raw_bits and self.sign_mantissa.size < -(-n * self.raw_bits // 8) + PAD_BYTES:
            raise FormatError(f"tensor {name!r}: sign/mantissa stream too short for {n} values")


def pack_codebook(lengths: np.ndarray) -> np.ndarray:
    """Stored form of the code lengths: ``lo`` and ``hi`` (uint16 little-endian), then the
    lengths of symbols ``lo .. hi-1`` as 4-bit nibbles, high nibble first (lengths <= 15).

    Args:
        lengths: ``ndarray[A], uint8``.

    Returns:
        ``ndarray[4 + ceil((hi - lo) / 2)], uint8``.
    """
    used = np.flatnonzero(lengths)
    lo, hi = (int(used[0]), int(used[-1]) + 1) if used.size else (0, 0)
    body = np.asarray(lengths[lo:hi], dtype=np.uint8)
    if body.size % 2:
        body = np.append(body, np.uint8(0))
    head = np.array([lo & 255, lo >> 8, hi & 255, hi >> 8], dtype=np.uint8)
    return np.concatenate([head, (body[0::2] << 4) | body[1::2]]).astype(np.uint8)


def unpack_codebook(data: np.ndarray, alphabet: int, name: str = "?") -> np.ndarray:
    """Inverse of :func:`pack_codebook`. Raises FormatError when sizes or ranges disagree."""
    if data.size < 4:
        raise FormatError(f"tensor {name!r}: codebook of {data.size} bytes is truncated")
    lo, hi = int(data[0]) | int(data[1]) << 8, int(data[2]) | int(data[3]) << 8
    if not lo <= hi <= alphabet or data.size != 4 + (hi - lo + 1) // 2:
        raise FormatError(f"tensor {name!r}: codebook range [{lo}, {hi}) or size {data.size} does not fit "
                          f"an alphabet of {alphabet}")
    nibbles = np.empty(2 * (data.size - 4), dtype=np.uint8)
    nibbles[0::2], nibbles[1::2] = data[4:] >> 4, data[4:] & 15
    lengths = np.zeros(alphabet, dtype=np.uint8)
    lengths[lo:hi] = nibbles[: hi - lo]
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical Huffman codes from code lengths (DEFLATE, RFC 1951 §3.2.2).

    Args:
        lengths: ``ndarray[A], uint8``: code length per symbol, 0 = unused.

    Returns:
        ``ndarray[A], uint32``: the code of each symbol, MSB-first, ``lengths[s]`` bits.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(lengths.size, dtype=np.uint32)
    order = np.lexsort((np.arange(lengths.size), lengths))
    order = order[lengths[order] > 0]  # used symbols by (length, symbol)
    if order.size == 0:
        return codes
    ln = lengths[order]
    # code[j] = (code[j-1] + 1) << (ln[j] - ln[j-1]): in closed form, the Kraft partial sums
    kraft = np.concatenate([[0], np.cumsum(np.ldexp(1.0, -ln[:-1]) * 2.0**16)]).astype(np.int64)  # in units of 2^-16
    codes[order] = (kraft >> (16 - ln)).astype(np.uint32)
    return codes


def decode_table(lengths: np.ndarray) -> np.ndarray:
    """Two-level byte-indexed decode table for a canonical code with lengths <= 16.

    Entry ``e`` of the first 256: ``e >= 0`` -> symbol ``e & 0xFFFF``, code length ``e >> 16``;
    ``e < 0`` -> the code is longer than 8 bits, look up the next 8 bits in the 256-entry
    block starting at ``-e * 256``, whose entries are ``(length << 16) | symbol``. Prefixes no
    code starts with hold 0 (length 0: only reachable on corrupt data).

    Args:
        lengths: ``ndarray[A <= 65536], uint8``.

    Returns:
        ``ndarray[256 * (1 + n_subtables)], int32``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = canonical_codes(lengths).astype(np.int64)
    order = np.lexsort((np.arange(lengths.size), lengths))
    order = order[lengths[order] > 0]
    ln = lengths[order]
    start = codes[order] << (16 - ln)  # each code owns [start, start + 2**(16-len)) of 16-bit windows, ascending
    end = start + (1 << (16 - ln))
    entry = (ln << 16) | order  # (length << 16) | symbol

    def lookup(windows):
        idx = np.clip(np.searchsorted(start, windows, side="right") - 1, 0, None)
        hit = (idx < start.size) & (windows < end[np.minimum(idx, start.size - 1)]) if start.size else np.zeros(windows.shape, bool)
        return np.where(hit, entry[np.minimum(idx, max(start.size - 1, 0))] if start.size else 0, 0)

    first = lookup(np.arange(256, dtype=np.int64) << 8)
    long_prefix = (first >> 16) > 8  # windows whose code is longer than 8 bits
    prefixes = np.flatnonzero(long_prefix)
    table = np.zeros(256 * (1 + prefixes.size), dtype=np.int64)
    table[:256] = first
    table[prefixes] = -np.arange(1, prefixes.size + 1)
    if prefixes.size:
        windows = (prefixes[:, None] << 8) | np.arange(256)[None, :]  # [n_sub, 256]
        table[256:] = lookup(windows.reshape(-1))
    return table.astype(np.int32)


def decode(ct: CodedTensor, backend: str = "auto", device: str | None = None):
    """Decode one coded tensor to its original value bits.

    Args:
        ct: the coded tensor.
        backend: ``"auto"`` (Triton on CUDA, compiled CPU decoder otherwise), ``"cpu"``
            (numba), ``"torch"`` (reference) or ``"triton"``.
        device: where the result lives for torch/triton (default ``cuda`` for triton).

    Returns:
        ``ndarray`` (cpu backend) or ``Tensor`` of shape ``ct.shape`` holding the raw bits
        (``uint8``/``int16``/``int32``); view it as ``ct.dtype``.
    """
    from compress.kernels import ecf8 as kernels

    return kernels.decode(ct, decode_table(ct.codebook), backend=backend, device=device)


def checksum(data: np.ndarray) -> str:
    """xxh3-128 hex digest of an array's bytes (the original tensor's little-endian bytes)."""
    import xxhash

    return xxhash.xxh3_128(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))).hexdigest()


def parts_checksum(parts: list[np.ndarray]) -> str:
    """xxh3-128 over the stored bytes of a coded tensor's parts, in stored order
    (codes, sign_mantissa, codebook, slice_bits): catches a flip in any stored byte, unused
    padding bits included."""
    import xxhash

    h = xxhash.xxh3_128()
    for part in parts:
        h.update(memoryview(np.ascontiguousarray(part).reshape(-1).view(np.uint8)))
    return h.hexdigest()


_SHARD_NAME = re.compile(r"[A-Za-z0-9_][\w.\-]*\.safetensors")


def _check_record(where, name: str, record: Any) -> None:
    """A record's fields have the types the spec gives; shard names are plain file names
    (never a path, so decoding cannot write outside its output folder). Raises FormatError."""
    from compress.checkpoint import DTYPES

    ok = (isinstance(record, dict) and record.get("codec") in ("raw", FORMAT_NAME) and record.get("dtype") in DTYPES
          and isinstance(record.get("shape"), list)
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in record["shape"])
          and isinstance(record.get("shard"), str) and _SHARD_NAME.fullmatch(record["shard"]) is not None
          and isinstance(record.get("xxh3_128"), str))
    if not ok:
        raise FormatError(f"{where}: malformed record for tensor {name!r} (codec, dtype, shape, shard or checksum)")


class EncodedCheckpoint:
    """Reads a checkpoint written by ``compress encode ecf8`` and decodes it tensor by tensor.

    Attributes:
        checkpoint: the underlying :class:`compress.checkpoint.Checkpoint`.
        records: original tensor name -> its metadata record, in stored order.
        source: provenance written by the encoder (source, cast dtype), or {}.

    Raises:
        FormatError: the checkpoint is not ecf8, is of a newer version, or a record is broken.
    """

    def __init__(self, checkpoint):
        import json

        self.checkpoint = checkpoint
        self.records: dict[str, dict[str, Any]] = {}
        self.source: dict[str, Any] = {}
        self._parts: dict[str, list[str]] = {}
        for shard, meta in checkpoint.shard_metadata.items():
            if meta.get("compress.format") != FORMAT_NAME:
                raise FormatError(f"{checkpoint.path / shard}: not an ecf8 checkpoint (metadata compress.format="
                                  f"{meta.get('compress.format')!r}); encode it with `compress encode ecf8`")
            version_text = meta.get("compress.format_version", "0")
            if not version_text.isdigit():
                raise FormatError(f"{checkpoint.path / shard}: bad compress.format_version {version_text!r}")
            version = int(version_text)
            if version > FORMAT_VERSION:
                raise FormatError(f"{checkpoint.path / shard}: ecf8 format version {version} is newer than this "
                                  f"compress supports ({FORMAT_VERSION}); upgrade compress")
            try:
                records = json.loads(meta.get("compress.tensors", "{}"))
                source = json.loads(meta.get("compress.source", "{}"))
            except json.JSONDecodeError:
                raise FormatError(f"{checkpoint.path / shard}: compress.tensors metadata is not valid JSON") from None
            if not isinstance(records, dict) or not isinstance(source, dict):
                raise FormatError(f"{checkpoint.path / shard}: compress.tensors / compress.source must be JSON objects")
            for name, record in records.items():
                _check_record(checkpoint.path / shard, name, record)
            self.records.update(records)
            self.source = source or self.source
        stored = set(checkpoint.tensors)
        order = {}
        for name in checkpoint.names():
            base = name
            for suffix in SUFFIXES:
                if name.endswith(suffix):
                    base = name[: -len(suffix)]
            order.setdefault(base, len(order))
            self._parts.setdefault(base, []).append(name)
        for name, record in self.records.items():
            want = [name] if record.get("codec") == "raw" else None
            if want and name not in stored:
                raise FormatError(f"{checkpoint.source}: raw tensor {name!r} is in the metadata but not stored")
            if not want and name not in self._parts:
                raise FormatError(f"{checkpoint.source}: coded tensor {name!r} has no stored parts")
        extra = [n for n in self._parts if n not in self.records]
        if extra:
            raise FormatError(f"{checkpoint.source}: stored tensors {extra[:3]} have no metadata record")
        self.records = dict(sorted(self.records.items(), key=lambda kv: order.get(kv[0], 0)))

    @classmethod
    def open(cls, source, revision: str | None = None) -> "EncodedCheckpoint":
        """Open an encoded checkpoint by path or Hub id (see ``Checkpoint.open``)."""
        from compress.checkpoint import Checkpoint

        return cls(Checkpoint.open(source, revision=revision))

    def coded(self, name: str, check: bool = False) -> CodedTensor | None:
        """The :class:`CodedTensor` of ``name``, or None if it is stored raw.

        Raises:
            VerificationError: with ``check``, the parts do not hash to ``parts_xxh3_128``.
        """
        record = self.records[name]
        if record.get("codec") == "raw":
            return None
        parts = {p: self.checkpoint.read_bytes(p) for p in self._parts[name]}
        if check and parts_checksum([parts[name + s] for s in SUFFIXES if name + s in parts]) != record.get("parts_xxh3_128"):
            from compress.errors import VerificationError

            raise VerificationError(f"tensor {name!r}: stored parts do not match their checksum (file modified)")
        return CodedTensor.from_parts(name, record, parts)

    def stored_bytes(self, name: str) -> int:
        """Bytes this tensor takes in the encoded checkpoint (all its parts)."""
        return sum(self.checkpoint.tensors[p].nbytes for p in self._parts[name])

    def read_array(self, name: str, backend: str = "auto", check: bool = True) -> tuple[str, np.ndarray]:
        """Decode one original tensor: ``(dtype, bits)`` like ``Checkpoint.read_array``.

        Args:
            name: original tensor name.
            backend: decode backend (see :func:`decode`); GPU results are copied to the CPU.
            check: compare the stored parts and the result with their xxh3-128 checksums.

        Raises:
            VerificationError: a checksum does not match (corrupt file).
        """
        from compress.checkpoint import DTYPES
        from compress.errors import VerificationError

        record = self.records[name]
        ct = self.coded(name, check=check)
        if ct is None:
            dtype, bits = self.checkpoint.read_array(name)
        else:
            dtype = ct.dtype
            bits = decode(ct, backend=backend)
            if not isinstance(bits, np.ndarray):
                bits = bits.cpu().numpy()
            bits = bits.view(np.dtype(DTYPES[dtype][1])).reshape(ct.shape)
        if check and checksum(bits) != record.get("xxh3_128"):
            raise VerificationError(f"tensor {name!r}: decoded bytes do not match the stored checksum (file corrupt)")
        return dtype, bits


def decode_checkpoint(encoded: EncodedCheckpoint, output_dir, *, overwrite: bool = False, backend: str = "auto",
                      progress=None) -> dict[str, Any]:
    """Write the original checkpoint back: every tensor bit-identical under its original shard
    name, each shard's original metadata, the index's metadata, ``config.json``'s original text
    and every other file.

    Args:
        encoded: the opened encoded checkpoint.
        output_dir: folder to create atomically.
        overwrite: replace an existing folder.
        backend: decode backend.
        progress: optional ``callable(bytes_done)``.

    Returns:
        ``{"output": str, "tensors": int, "bytes": int}``.

    Raises:
        VerificationError: a file differs from the manifest, or a decoded tensor fails its
            checksum (nothing is written).
    """
    import json

    from compress.checkpoint import CheckpointWriter

    from compress.errors import VerificationError
    from compress.eval.verify import check_manifest

    ck = encoded.checkpoint
    problems = check_manifest(ck.path)
    if problems:
        raise VerificationError(f"{ck.source}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    meta = next(iter(ck.shard_metadata.values()), {})
    try:
        shard_meta = json.loads(meta.get("compress.source_shard_metadata", "{}"))
        index_meta = json.loads(meta.get("compress.source_index", "null"))
    except json.JSONDecodeError:
        raise FormatError(f"{ck.source}: compress.source_* metadata is not valid JSON") from None
    if not (isinstance(shard_meta, dict) and all(_SHARD_NAME.fullmatch(k) and isinstance(v, dict) for k, v in shard_meta.items())
            and (index_meta is None or isinstance(index_meta, dict))):
        raise FormatError(f"{ck.source}: compress.source_shard_metadata / compress.source_index are malformed")
    total = 0
    with CheckpointWriter(output_dir, overwrite=overwrite, inputs=(ck.path,)) as writer:
        writer.shard_metadata = {name: {str(k): str(v) for k, v in m.items()} for name, m in shard_meta.items()}
        for name, record in encoded.records.items():
            dtype, bits = encoded.read_array(name, backend=backend)
            writer.add({name: (dtype, tuple(bits.shape), bits)}, shard=record["shard"])
            total += bits.nbytes
            if progress:
                progress(bits.nbytes)
        if "compress.source_config" in meta:
            writer.write_text("config.json", meta["compress.source_config"])
        elif (ck.path / "config.json").exists():
            config = ck.config()
            q = config.pop("quantization_config", None) or {}
            if q.get("original_quantization_config") is not None:
                config["quantization_config"] = q["original_quantization_config"]
            writer.write_text("config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        writer.copy_files(ck.path, list(ck.extra_files()), skip={"config.json"})
        out = writer.commit(index_metadata=index_meta if isinstance(index_meta, dict) else None)
    return {"output": str(out), "tensors": len(encoded.records), "bytes": total}
