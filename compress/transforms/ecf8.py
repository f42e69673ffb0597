"""ECF8: lossless entropy coding of float exponents (arXiv 2510.02676, extended to BF16/FP16/FP32).

Per tensor: histogram the exponent field, build one length-limited (<= 15 bits) canonical
Huffman code by package-merge, code the exponents slice by slice, pack sign+mantissa raw. For
8-bit floats the whole byte is also tried as the symbol and the smaller wins. Tensors that do
not shrink, non-float tensors and tiny tensors are stored raw under their own name.
Format: ``docs/formats/ecf8.md`` (``compress.formats.ecf8``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from compress.formats.ecf8 import LAYOUTS, MAX_CODE_LENGTH, PAD_BYTES, CodedTensor, canonical_codes
from compress.kernels.ecf8 import slice_offsets

#: leaf names of FP8 scale tensors, always stored raw so FP8 loaders find them untouched
SCALE_LEAF = re.compile(r"(^|[._])(weight|input|activation|output)?_?scale(_inv)?$")


class ECF8Config(BaseModel):
    """Options of the ``ecf8`` transform.

    Attributes:
        slice_size: symbols per independently decodable slice (S); metadata is 16 bits per
            slice, so 16/S bits per weight.
        lanes: slices interleaved per tile (W), the lanes one GPU program decodes together.
        min_numel: tensors with fewer values are stored raw.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    slice_size: int = Field(2048, ge=8, le=4095)
    lanes: int = Field(32, ge=1, le=1024)
    min_numel: int = Field(1024, ge=0)

    @field_validator("slice_size")
    @classmethod
    def _slice_fits(cls, v: int) -> int:
        if v * MAX_CODE_LENGTH > 65535:
            raise ValueError(f"slice_size * {MAX_CODE_LENGTH} must fit in 16 bits")
        return v


def code_lengths(freq: np.ndarray, max_length: int = MAX_CODE_LENGTH) -> np.ndarray:
    """Optimal length-limited prefix code lengths.

    Plain Huffman (compiled) when its longest code fits in ``max_length``; otherwise
    package-merge (Larmore & Hirschberg 1990), optimal under the cap.

    Args:
        freq: ``ndarray[A], int64`` symbol counts.
        max_length: longest allowed code; needs ``2**max_length >= number of used symbols``.

    Returns:
        ``ndarray[A], uint8``: code length per symbol, 0 for unused symbols; a lone used
        symbol gets length 1.
    """
    freq = np.asarray(freq, dtype=np.int64)
    lengths = np.zeros(freq.size, dtype=np.uint8)
    used = np.flatnonzero(freq)
    if used.size == 0:
        return lengths
    if used.size == 1:
        lengths[used] = 1
        return lengths
    from compress.kernels.ecf8 import cpu

    unbounded = cpu.huffman_lengths(freq)
    if unbounded.max() <= max_length:
        return unbounded.astype(np.uint8)
    if used.size > (1 << max_length):
        raise ValueError(f"{used.size} symbols cannot be coded in {max_length} bits")
    return cpu.package_merge_lengths(freq, max_length).astype(np.uint8)


def _split(dtype: str, symbol: str, k: int = 0):
    """(shift, mask, alphabet) that cut the symbol out of the value bits."""
    layout = LAYOUTS[dtype]
    if symbol == "byte":
        return 0, 0xFF, 256
    width = layout.exponent_bits + k
    return layout.mantissa_bits - k, (1 << width) - 1, 1 << width


@dataclass(frozen=True)
class SymbolStats:
    """One symbol choice for a tensor: histogram, code lengths and sizes in bits.

    Attributes:
        symbol: ``"exponent"`` or ``"byte"``.
        mantissa_in_symbol: k top mantissa bits coded with the exponent.
        freq: ``ndarray[2**symbol_bits], int64`` symbol counts.
        raw_bits: bits stored raw for the whole tensor.
        entropy_bits: Shannon entropy of the symbols, in bits for the whole tensor.
    """

    symbol: str
    mantissa_in_symbol: int
    freq: np.ndarray
    raw_bits: int
    entropy_bits: float


def _entropy(freq: np.ndarray) -> float:
    n = freq.sum()
    p = freq[freq > 0] / max(n, 1)
    return float(-(p * np.log2(p)).sum() * n)


def symbol_choices(dtype: str, flat: np.ndarray) -> list[SymbolStats]:
    """Every symbol choice for one tensor, from a single histogram pass.

    The finest symbol (exponent + 2 mantissa bits, or the whole value for 8-bit floats) is
    histogrammed once; coarser symbols are sums of its bins. Index 0 is always the plain
    exponent (k = 0), whose entropy is the bound ECF8 is measured against.

    Args:
        dtype: a key of ``LAYOUTS``.
        flat: ``ndarray[n]`` raw value bits.
    """
    from compress.kernels.ecf8 import cpu

    layout = LAYOUTS[dtype]
    n = flat.size
    E, M = layout.exponent_bits, layout.mantissa_bits
    kmax = min(M, 2)
    if layout.bits == 8:
        whole = cpu.histogram(flat, 0, 0xFF, 256)
        values = np.arange(256)
        fine = np.bincount((values >> (M - kmax)) & ((1 << (E + kmax)) - 1), weights=whole,
                           minlength=1 << (E + kmax)).astype(np.int64)
    else:
        fine = cpu.histogram(flat, M - kmax, (1 << (E + kmax)) - 1, 1 << (E + kmax))
    out = []
    for k in range(kmax + 1):
        freq = fine.reshape(-1, 1 << (kmax - k)).sum(axis=1)
        out.append(SymbolStats("exponent", k, freq, n * (layout.raw_bits - k), _entropy(freq)))
    if layout.bits == 8:
        out.append(SymbolStats("byte", 0, whole, 0, _entropy(whole)))
    return out


def encode_array(dtype: str, bits: np.ndarray, config: ECF8Config = ECF8Config(), force: bool = False,
                 choices: list[SymbolStats] | None = None) -> CodedTensor | None:
    """Encode one float tensor's value bits.

    Args:
        dtype: safetensors dtype string, a key of ``LAYOUTS`` (F32, BF16, F16, F8_E4M3, F8_E5M2).
        bits: ``ndarray[...]`` of the raw value bits (``uint32``/``uint16``/``uint8``), any shape.
        config: slicing options.
        force: code it even when that does not make it smaller (for tests of the codec).
        choices: :func:`symbol_choices` of ``bits`` if already computed.

    Returns:
        The :class:`CodedTensor`, or None when coding would not make the tensor smaller or it
        has fewer than ``config.min_numel`` values (the caller stores it raw).
    """
    from compress.kernels.ecf8 import cpu

    shape = tuple(bits.shape)
    flat = np.ascontiguousarray(bits).reshape(-1)
    n = flat.size
    if n == 0 or (n < config.min_numel and not force):
        return None
    layout = LAYOUTS[dtype]
    choices = choices or symbol_choices(dtype, flat)
    best = min(choices, key=lambda c: c.entropy_bits + c.raw_bits)  # Huffman is within 1 bit/symbol of this
    lengths = code_lengths(best.freq)
    coded_bits = int((best.freq * lengths).sum())
    S, W = config.slice_size, config.lanes
    n_tiles = -(-n // (S * W))
    overhead = 8 * (n_tiles * W * 2 + 4 + lengths.size // 2 + 2 * PAD_BYTES + n_tiles)
    if coded_bits + best.raw_bits + overhead >= n * layout.bits and not force:
        return None
    shift, mask, _ = _split(dtype, best.symbol, best.mantissa_in_symbol)
    slice_bits = cpu.slice_lengths(flat, shift, mask, lengths, S, W)
    starts, total = slice_offsets(slice_bits, W)
    codes = cpu.alloc(total + PAD_BYTES + (-(total + PAD_BYTES) % 8), np.uint8, zero=True)
    cpu.encode_slices(flat, shift, mask, canonical_codes(lengths), lengths, S, W, starts, codes)
    if best.symbol == "byte":
        raw = np.zeros(0, np.uint8)
    else:
        R = layout.raw_bits - best.mantissa_in_symbol
        size = -(-n * R // 8) + PAD_BYTES
        raw = cpu.alloc(size + (-size % 8), np.uint8, zero=True)
        cpu.pack_raw(flat, layout.bits, R - 1, R, raw)
    return CodedTensor(dtype, shape, best.symbol, best.mantissa_in_symbol, S, W, codes, raw, lengths, slice_bits)


def exponent_entropy(dtype: str, bits: np.ndarray) -> float:
    """Shannon entropy of the exponent field in bits per value (``bits``: ndarray of value bits)."""
    return symbol_choices(dtype, np.ascontiguousarray(bits).reshape(-1))[0].entropy_bits / max(bits.size, 1)


def entropy_bound_bytes(dtype: str, numel: int, entropy: float) -> float:
    """Bytes of the per-tensor bound: exponent at its entropy, sign and mantissa raw."""
    return numel * (entropy + LAYOUTS[dtype].raw_bits) / 8


class TensorReport(BaseModel):
    """One tensor of an encode or inspect report. Sizes in bytes, entropy in bits per value."""

    name: str
    dtype: str
    shape: list[int]
    codec: str
    symbol: str | None = None
    original_bytes: int
    stored_bytes: int
    exponent_entropy: float | None = None
    bound_bytes: float

    @property
    def bits_per_weight(self) -> float:
        numel = max(int(np.prod(self.shape)) if self.shape else 1, 1)
        return 8 * self.stored_bytes / numel


class SizeReport(BaseModel):
    """Totals over a checkpoint: sizes in bytes, ``ratio`` = stored/original."""

    tensors: list[TensorReport]
    original_bytes: int
    stored_bytes: int
    file_bytes: int
    bound_bytes: float
    ratio: float
    bound_ratio: float


def size_report(tensors: list[TensorReport], file_bytes: int) -> SizeReport:
    """Sum per-tensor reports; ``file_bytes`` is what the checkpoint's weight files take on disk."""
    original = sum(t.original_bytes for t in tensors)
    bound = sum(t.bound_bytes for t in tensors)
    stored = sum(t.stored_bytes for t in tensors)
    return SizeReport(tensors=tensors, original_bytes=original, stored_bytes=stored, file_bytes=file_bytes,
                      bound_bytes=bound, ratio=file_bytes / max(original, 1), bound_ratio=bound / max(original, 1))


def encode_checkpoint(source, output_dir, config: ECF8Config = ECF8Config(), *, max_shard_size: str | int = "5GB",
                      overwrite: bool = False, verify: bool = False, progress=None):
    """Encode every tensor of a checkpoint with ECF8 and write the ``ecf8`` format.

    Streams tensor by tensor: peak memory is one tensor plus its coded parts. Everything needed
    to give the original back is kept: original shard names and their metadata, the index's
    metadata, ``config.json``'s exact text, every other file.

    Args:
        source: an open :class:`compress.checkpoint.Checkpoint`.
        output_dir: the folder to create (atomically).
        config: :class:`ECF8Config`.
        max_shard_size: shard size limit of the output.
        overwrite: replace an existing output folder.
        verify: decode the finished output and compare it with ``source`` before it is moved
            into place; on a mismatch nothing is published (an old output stays).
        progress: optional ``callable(bytes_done)`` called after each tensor.

    Returns:
        ``(SizeReport, VerifyReport | None)``: sizes of the written checkpoint (``file_bytes`` =
        its shard files) and the verification, if asked for.

    Raises:
        ConfigError: output exists or is inside the input, or the input is already encoded.
        UnsupportedError: a tensor name ends in a suffix the format reserves.
        FormatError: unreadable input.
    """
    import json

    from compress import __version__
    from compress.checkpoint import CheckpointWriter
    from compress.errors import ConfigError, UnsupportedError
    from compress.formats.ecf8 import FORMAT_NAME, FORMAT_VERSION, SUFFIXES, checksum, parts_checksum

    if any(m.get("compress.format") for m in source.shard_metadata.values()):
        raise ConfigError(f"{source.source} is already a compress checkpoint "
                          f"({next(iter(source.shard_metadata.values())).get('compress.format')}); decode it first")
    reserved = [n for n in source.names() if n.endswith(SUFFIXES)]
    if reserved:
        raise UnsupportedError(f"tensor {reserved[0]!r} ends in a suffix the ecf8 format reserves ({', '.join(SUFFIXES)})")
    config_path = source.path / "config.json"
    meta = {"compress.format": FORMAT_NAME, "compress.format_version": str(FORMAT_VERSION),
            "compress.version": __version__,
            "compress.source": json.dumps({"source": source.source, "dtype": source.cast}),
            "compress.recipe": json.dumps([{"ecf8": config.model_dump()}]),
            "compress.source_shard_metadata": json.dumps(source.shard_metadata, sort_keys=True),
            "compress.source_index": json.dumps((source.index.get("metadata") or {}) if source.index is not None else None)}
    if config_path.exists():
        source.config()  # a JSON object, or FormatError
        meta["compress.source_config"] = config_path.read_bytes().decode("utf-8")
    reports: list[TensorReport] = []
    with CheckpointWriter(output_dir, max_shard_size=max_shard_size, overwrite=overwrite,
                          inputs=(source.path,), shard_metadata=meta, manifest=True) as writer:
        for name in source.names():
            info = source.info(name)
            dtype, bits = source.read_array(name)
            record = {"dtype": dtype, "shape": list(bits.shape), "shard": info.shard, "xxh3_128": checksum(bits)}
            coded = None
            entropy = None
            leaf = name.rsplit(".", 1)[-1]
            if dtype in LAYOUTS and not SCALE_LEAF.search(leaf):
                choices = symbol_choices(dtype, bits.reshape(-1))
                entropy = choices[0].entropy_bits / max(bits.size, 1)
                coded = encode_array(dtype, bits, config, choices=choices)
            if entropy is not None:
                record["exponent_entropy"] = entropy
            if coded is None:
                record["codec"] = "raw"
                writer.add({name: (dtype, tuple(bits.shape), bits)}, {name: record})
                stored = bits.nbytes
            else:
                parts = coded.parts(name)
                record.update(coded.record(),
                              parts_xxh3_128=parts_checksum([data for part, (_, _, data) in parts.items() if part != name]))
                writer.add(parts, {name: record})
                stored = coded.nbytes
            bound = entropy_bound_bytes(dtype, bits.size, entropy) if entropy is not None else bits.nbytes
            reports.append(TensorReport(name=name, dtype=dtype, shape=list(bits.shape), codec=record["codec"],
                                        symbol=coded.symbol if coded else None, original_bytes=bits.nbytes,
                                        stored_bytes=stored, exponent_entropy=entropy, bound_bytes=bound))
            del bits, coded
            if progress:
                progress(info.nbytes)
        if config_path.exists():
            config_json = source.config()
            config_json["quantization_config"] = {"quant_method": FORMAT_NAME, "format_version": FORMAT_VERSION,
                                                  "original_quantization_config": config_json.get("quantization_config")}
            writer.write_text("config.json", json.dumps(config_json, indent=2, sort_keys=True) + "\n")
        writer.copy_files(source.path, list(source.extra_files()), skip={"config.json"})
        tmp = writer.finish()
        files = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        checked = None
        if verify:
            from compress.checkpoint import Checkpoint
            from compress.eval.verify import verify_checkpoint
            from compress.formats.ecf8 import EncodedCheckpoint

            checked = verify_checkpoint(source, EncodedCheckpoint(Checkpoint(tmp, str(output_dir))))
            if not checked.ok:
                writer.abort()
                return size_report(reports, files), checked
        writer.publish()
    return size_report(reports, files), checked


def _apply(source, output_dir, config: ECF8Config, overwrite: bool):
    """Recipe step: encode ``source`` into ``output_dir`` (see :func:`encode_checkpoint`)."""
    from compress.checkpoint import Checkpoint

    with Checkpoint.open(source) as ckpt:
        return encode_checkpoint(ckpt, output_dir, config, overwrite=overwrite)[0]


def _recipe_steps():
    from compress.recipe import TransformSpec

    return [TransformSpec(name="ecf8", config=ECF8Config, apply=_apply, lossless=True)]


RECIPE_STEPS = _recipe_steps()
