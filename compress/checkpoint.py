"""Lazy, sharded, atomic reading and writing of Hugging Face checkpoints.

Reading: a local folder, a Hub id (``org/name`` with ``revision``), an installed model package
(``pkg:NAME``), or a GGUF file (dequantized through transformers' loader). Single-file or
sharded safetensors with ``model.safetensors.index.json``; the index is checked against the
shard headers both ways. Tensors are read one at a time, as raw bytes, straight from the file
(safetensors spec: 8-byte little-endian header length, JSON header, data buffer).

Writing: :class:`CheckpointWriter` streams tensors into per-shard data files inside a temporary
folder beside the output, then writes each shard's header, the index, the non-weight files and
renames the folder into place. Peak memory is the tensors of one ``add`` call.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from pydantic import BaseModel

from compress.errors import ConfigError, FormatError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024

#: safetensors dtype string -> (bytes per element, numpy dtype used to hold the raw bits)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "<u8"), "F32": (4, "<u4"), "F16": (2, "<u2"), "BF16": (2, "<u2"),
    "F8_E4M3": (1, "u1"), "F8_E5M2": (1, "u1"), "F8_E8M0": (1, "u1"),
    "I64": (8, "<i8"), "I32": (4, "<i4"), "I16": (2, "<i2"), "I8": (1, "i1"),
    "U64": (8, "<u8"), "U32": (4, "<u4"), "U16": (2, "<u2"), "U8": (1, "u1"), "BOOL": (1, "u1"),
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}

# Top-level files that hold the same weights in another format (PyTorch pickles, TF, Flax,
# GGUF, consolidated copies): not carried into an output of the transformed weights.
_ALT_WEIGHTS = re.compile(r"(pytorch_model|tf_model|flax_model|model|consolidated)([-.].*)?\.(bin|h5|msgpack|pth|pt|ckpt|gguf|safetensors)$"
                          r"|.*\.gguf$|.*\.(bin|safetensors)\.index\.json$")
MANIFEST_NAME = "compress_manifest.json"


def torch_dtype(dtype: str):
    """The torch dtype for a safetensors dtype string (``"BF16"`` -> ``torch.bfloat16``)."""
    import torch

    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
        "U8": torch.uint8, "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    }
    if dtype not in table:
        raise FormatError(f"dtype {dtype} has no torch equivalent")
    return table[dtype]


def dtype_name(dtype) -> str:
    """The safetensors dtype string of a torch dtype or a user string (``bfloat16``, ``bf16``)."""
    if not isinstance(dtype, str):
        dtype = str(dtype).removeprefix("torch.")
    key = dtype.lower()
    names = {
        "float64": "F64", "float32": "F32", "fp32": "F32", "f32": "F32", "float": "F32",
        "float16": "F16", "fp16": "F16", "f16": "F16", "half": "F16",
        "bfloat16": "BF16", "bf16": "BF16",
        "float8_e4m3fn": "F8_E4M3", "fp8": "F8_E4M3", "f8_e4m3": "F8_E4M3", "float8_e5m2": "F8_E5M2", "f8_e5m2": "F8_E5M2",
        "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
        "uint16": "U16", "uint32": "U32", "uint64": "U64",
    }
    if key in names:
        return names[key]
    if dtype.upper() in DTYPES:
        return dtype.upper()
    raise ConfigError(f"unknown dtype {dtype!r} (use one of bfloat16, float16, float32, float8_e4m3fn)")


def parse_size(size: str | int) -> int:
    """Bytes in a size like ``"5GB"``, ``"500MiB"`` or ``1000``. Raises ConfigError on junk."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if not m:
        raise ConfigError(f"bad size {size!r}: expected a number with an optional unit, e.g. 5GB or 500MiB")
    unit = m.group(2).rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit.rstrip("I")]
    value = int(float(m.group(1)) * base**power)
    if value <= 0:
        raise ConfigError(f"size {size!r} must be positive")
    return value


@dataclass(frozen=True)
class TensorInfo:
    """Where one stored tensor lives.

    Attributes:
        name: tensor name in the checkpoint.
        dtype: safetensors dtype string.
        shape: tensor shape.
        shard: file name of the shard, relative to the checkpoint folder.
        start: absolute byte offset of the data in the shard file.
        nbytes: byte length of the data.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    start: int
    nbytes: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header without reading tensor data.

    Checks (safetensors spec): header length within the file and < 100 MiB, valid JSON object,
    known dtypes, ``prod(shape) * itemsize == end - begin``, offsets inside the file, and the
    data buffer covered exactly once with no holes or overlaps.

    Returns:
        ``(tensors, metadata)``: tensor name -> :class:`TensorInfo`, and the string metadata.

    Raises:
        FormatError: naming the file and what is wrong with it.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise FormatError(f"{path}: header length {n} does not fit a {size}-byte file (truncated or not safetensors)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            ok = isinstance(begin, int) and isinstance(end, int) and all(isinstance(d, int) and d >= 0 for d in shape)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise FormatError(f"{path}: tensor {name!r} has a malformed header entry")
        if dtype not in DTYPES:
            raise FormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][0] if shape else DTYPES[dtype][0]
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise FormatError(
                f"{path}: tensor {name!r} offsets [{begin}, {end}] do not match shape {list(shape)} {dtype} "
                f"or run past the end of the file (truncated?)"
            )
        spans.append((begin, end))
        tensors[name] = TensorInfo(name, dtype, shape, path.name, data_start + begin, nbytes)
    spans.sort()
    cursor = 0
    for begin, end in spans:
        if begin != cursor:
            raise FormatError(f"{path}: data buffer has a hole or overlap at byte {cursor}")
        cursor = end
    if data_start + cursor != size:
        raise FormatError(f"{path}: {size - data_start - cursor} trailing bytes after the last tensor")
    return tensors, metadata


def _is_hub_id(source: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", source))


def _resolve_package(spec: str) -> Path:
    """Path of the model an installed Python package carries: ``pkg:NAME`` -> its model folder or GGUF."""
    import importlib.util

    name = spec.removeprefix("pkg:")
    found = importlib.util.find_spec(name) if re.fullmatch(r"[A-Za-z_][\w.]*", name) else None
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"no installed package {name!r}: pip install {name.replace('_', '-')}")
    root = Path(list(found.submodule_search_locations)[0])
    for candidate in [root / "model", root]:
        if (candidate / "config.json").exists():
            return candidate
    ggufs = sorted(root.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ConfigError(f"package {name!r} at {root} holds no model folder and no single .gguf file")


def _resolve_hub(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=None))
    except Exception as e:  # offline, unknown repo, auth: all one line for the user
        kind = type(e).__name__
        raise ConfigError(
            f"cannot fetch {repo_id!r} (revision {revision or 'main'}) from the Hub: {kind}; "
            "check the id and your connection, or pass a local folder"
        ) from None


def convert_gguf(path: Path, out_dir: Path, dtype: str = "BF16") -> Path:
    """Dequantize a GGUF file through transformers' loader and save it as a safetensors checkpoint.

    Args:
        path: the ``.gguf`` file.
        out_dir: folder to write (must not exist).
        dtype: safetensors dtype string of the dequantized float weights.

    Returns:
        ``out_dir``.

    Raises:
        UnsupportedError: transformers cannot load this GGUF architecture.
    """
    from compress.errors import UnsupportedError

    try:
        import torch  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - dependencies are required
        raise UnsupportedError(f"reading GGUF needs transformers and gguf: {e}") from None
    import functools

    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    folder, name = str(path.parent), path.name
    verbosity, bars, gguf_tqdm = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(), gguf_utils.tqdm
    hf_logging.set_verbosity_error()  # an internal step: no advice about matmul dtypes, no tqdm bars
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)  # its GGUF bar ignores the switch above
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype(dtype))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    except Exception as e:
        raise UnsupportedError(f"{path}: transformers could not convert this GGUF file ({type(e).__name__}: {e})") from None
    finally:
        gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return out_dir


class Checkpoint:
    """A read-only view of a Hugging Face checkpoint, read lazily tensor by tensor.

    Use :meth:`open`; close it (or use ``with``) to remove the temporary folder a GGUF input
    is dequantized into.

    Attributes:
        path: the local checkpoint folder.
        source: what the user named (path, Hub id, ``pkg:NAME``).
        tensors: stored tensor name -> :class:`TensorInfo`, in shard order.
        shard_metadata: shard file name -> its string metadata.
        cast: safetensors dtype that float tensors are cast to on read, or None.
    """

    def __init__(self, path: Path, source: str, cast: str | None = None, tmp: tempfile.TemporaryDirectory | None = None):
        self.path = path
        self.source = source
        self.cast = cast
        self._tmp = tmp
        self.tensors: dict[str, TensorInfo] = {}
        self.shard_metadata: dict[str, dict[str, str]] = {}
        self.index: dict[str, Any] | None = None
        self._load_layout()

    @classmethod
    def open(cls, source: str | os.PathLike, revision: str | None = None, dtype: str | None = None) -> "Checkpoint":
        """Open a checkpoint by path, Hub id, ``pkg:NAME`` or GGUF file.

        Args:
            source: local folder, ``.gguf`` file, ``org/name`` Hub id or ``pkg:NAME``.
            revision: Hub revision (branch, tag or commit); only for Hub ids.
            dtype: for GGUF input, the dtype to dequantize to (default bfloat16); for safetensors
                input, float tensors are cast to it on read (default: as stored).

        Raises:
            ConfigError: the source does not exist or cannot be fetched.
            FormatError: a shard or the index is malformed or inconsistent.
        """
        text = os.fspath(source)
        cast = dtype_name(dtype) if dtype else None
        if cast is not None and cast not in ("F32", "F16", "BF16"):
            raise ConfigError(f"--dtype {dtype}: reading can cast float tensors to float32, float16 or bfloat16 only "
                              "(FP8 with scales: `compress convert --dtype float8_e4m3fn`)")
        if text.startswith("pkg:"):
            path = _resolve_package(text)
        elif Path(text).exists():
            path = Path(text)
        elif _is_hub_id(text):
            path = _resolve_hub(text, revision)
        else:
            raise ConfigError(f"{text}: no such file or folder (and not a Hub id of the form org/name)")
        if path.is_dir() and not any(path.glob("*.safetensors")):
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                path = ggufs[0]
        if path.is_file() and path.suffix == ".gguf":
            tmp = tempfile.TemporaryDirectory(prefix="compress-gguf-")
            convert_gguf(path, Path(tmp.name) / "model", cast or "BF16")
            return cls(Path(tmp.name) / "model", text, None, tmp)
        if not path.is_dir():
            raise ConfigError(f"{text}: expected a checkpoint folder, a .gguf file or a Hub id")
        return cls(path.resolve(), text, cast)

    def _load_layout(self) -> None:
        index_path = self.path / INDEX_NAME
        if index_path.exists():
            try:
                self.index = json.loads(index_path.read_text())
                weight_map = self.index["weight_map"]
                assert isinstance(weight_map, dict) and all(isinstance(v, str) and "/" not in v and v not in ("", ".", "..")
                                                            for v in weight_map.values())
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AssertionError, TypeError):
                raise FormatError(f"{index_path}: not a valid index (needs a 'weight_map' object of shard file names)") from None
            shards = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_NAME).exists():
            weight_map, shards = None, [SINGLE_NAME]
        else:
            shards = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shards:
                raise ConfigError(f"{self.path}: no safetensors weights (model.safetensors or an index) found")
            if len(shards) > 1:
                raise FormatError(f"{self.path}: {len(shards)} safetensors files but no {INDEX_NAME}")
            weight_map = None
        for shard in shards:
            file = self.path / shard
            if not file.exists():
                raise FormatError(f"{index_path}: names shard {shard!r}, which does not exist")
            infos, meta = read_header(file)
            self.shard_metadata[shard] = meta
            for name, info in infos.items():
                if name in self.tensors:
                    raise FormatError(f"{self.path}: tensor {name!r} is stored in two shards")
                self.tensors[name] = info
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in self.tensors or self.tensors[name].shard != shard:
                    raise FormatError(f"{index_path}: index says {name!r} is in {shard!r}, but that shard's header lacks it")
            for name, info in self.tensors.items():
                if weight_map.get(name) != info.shard:
                    raise FormatError(f"{index_path}: tensor {name!r} in shard {info.shard!r} is missing from the index")

    # -- reading ---------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Stored tensor names, shard by shard in file order."""
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of ``name``; raises ConfigError if absent."""
        if name not in self.tensors:
            raise ConfigError(f"{self.source}: no tensor named {name!r}")
        return self.tensors[name]

    def read_bytes(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor, exactly as on disk.

        Returns:
            ``ndarray[nbytes], uint8``, a private copy.
        """
        info = self.info(name)
        with open(self.path / info.shard, "rb") as f:
            f.seek(info.start)
            buf = np.empty(info.nbytes, dtype=np.uint8)
            if f.readinto(memoryview(buf)) != info.nbytes:
                raise FormatError(f"{self.path / info.shard}: truncated while reading {name!r}")
        return buf

    def read_array(self, name: str) -> tuple[str, np.ndarray]:
        """One tensor as ``(dtype, bits)``: ``bits`` is the raw little-endian value array
        (``uint16`` for BF16/F16, ``uint32`` for F32, ``uint8`` for FP8, ...) in the tensor's
        shape, after the optional cast. Bit-exact for every pattern (NaN payloads, ±0, ±Inf)."""
        info = self.info(name)
        arr = self.read_bytes(name).view(np.dtype(DTYPES[info.dtype][1])).reshape(info.shape)
        if self.cast and info.dtype in FLOAT_DTYPES and info.dtype != self.cast:
            import torch

            t = torch.from_numpy(arr).view(torch_dtype(info.dtype)).to(torch_dtype(self.cast))
            arr = t.view(_int_torch(self.cast)).numpy().view(np.dtype(DTYPES[self.cast][1]))
            return self.cast, arr
        return info.dtype, arr

    def get(self, name: str):
        """One tensor as a torch tensor (after the optional cast)."""
        import torch

        dtype, arr = self.read_array(name)
        return torch.from_numpy(arr.view(_np_signed(dtype))).view(torch_dtype(dtype))

    def config(self) -> dict[str, Any]:
        """``config.json`` as a dict ({} when absent)."""
        path = self.path / "config.json"
        if not path.exists():
            return {}
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FormatError(f"{path}: invalid JSON ({e})") from None
        if not isinstance(config, dict):
            raise FormatError(f"{path}: expected a JSON object, found {type(config).__name__}")
        return config

    def extra_files(self) -> Iterator[Path]:
        """Files an output carries over unchanged, as relative paths: everything except the
        shards and index read here, other top-level copies of the weights (``pytorch_model.bin``,
        ``tf_model.h5``, ...: see :meth:`skipped_files`), hidden folders (``.cache``, ``.git``),
        dangling links and compress's own manifest. Subfolders (e.g. sentence-transformers
        modules with their own weights) are carried as they are."""
        for rel in self._other_files():
            if not (len(rel.parts) == 1 and _ALT_WEIGHTS.fullmatch(rel.name)):
                yield rel

    def skipped_files(self) -> list[str]:
        """Top-level files holding the weights in another format, which outputs do not carry."""
        return [str(rel) for rel in self._other_files() if len(rel.parts) == 1 and _ALT_WEIGHTS.fullmatch(rel.name)]

    def _other_files(self) -> Iterator[Path]:
        own = set(self.shard_metadata) | {INDEX_NAME, MANIFEST_NAME}
        found, seen = [], set()
        for root, dirs, files in os.walk(self.path, followlinks=True):
            real = os.path.realpath(root)
            if real in seen:  # a link cycle
                dirs.clear()
                continue
            seen.add(real)
            dirs[:] = [d for d in dirs if d not in (".git", ".cache", ".huggingface")]
            for name in files:
                p = Path(root) / name
                rel = p.relative_to(self.path)
                if p.is_file() and not (len(rel.parts) == 1 and rel.name in own):
                    found.append(rel)
        yield from sorted(found)

    def close(self) -> None:
        """Remove the temporary folder of a dequantized GGUF input, if any."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _np_signed(dtype: str) -> np.dtype:
    # torch.from_numpy lacks uint16/uint32 on older builds: reinterpret through signed ints.
    size = DTYPES[dtype][0]
    return np.dtype({1: "u1", 2: "<i2", 4: "<i4", 8: "<i8"}[size]) if dtype not in ("BOOL",) else np.dtype("?")


def _int_torch(dtype: str):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[DTYPES[dtype][0]]


def manifest_text(files: dict[str, dict[str, Any]]) -> str:
    """Canonical text of a manifest: a verifier re-renders it and compares bytes."""
    return json.dumps({"files": files}, indent=1, sort_keys=True) + "\n"


def _header_bytes(entries: dict[str, dict], metadata: dict[str, str]) -> bytes:
    header = dict(entries)
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


@dataclass
class _Shard:
    data_path: Path
    file: Any
    entries: dict[str, dict]
    size: int = 0


class CheckpointWriter:
    """Atomic, streaming writer of a sharded safetensors checkpoint.

    Tensors go straight to per-shard data files in a temporary folder beside ``output_dir``;
    :meth:`commit` writes headers, index and non-weight files and renames the folder into place.
    On an exception inside ``with`` the temporary folder is removed and nothing is left.

    Args:
        output_dir: final folder. Refused if it exists (unless ``overwrite``) or lies inside
            one of ``inputs``.
        max_shard_size: bytes per shard before a new one starts (a group is never split).
        overwrite: replace an existing ``output_dir`` (only after the new one is complete).
        inputs: input folders the output must not be inside of, nor equal to.
        shard_metadata: string metadata written into every shard (``format: pt`` is added).
        manifest: also write ``compress_manifest.json`` (every file's size and xxh3-128).

    Raises:
        ConfigError: output exists, or is inside an input.
    """

    def __init__(self, output_dir: str | os.PathLike, *, max_shard_size: int | str = "5GB", overwrite: bool = False,
                 inputs: tuple[Path, ...] = (), shard_metadata: dict[str, str] | None = None, manifest: bool = False):
        if not os.fspath(output_dir).strip():
            raise ConfigError("empty --output-dir")
        self.output_dir = Path(output_dir).resolve()
        if self.output_dir == Path.cwd().resolve() or self.output_dir in Path.cwd().resolve().parents:
            raise ConfigError(f"output {self.output_dir} is the working folder or holds it; choose another --output-dir")
        self.max_shard_size = parse_size(max_shard_size)
        self.overwrite = overwrite
        for src in inputs:
            src = Path(src).resolve()
            if self.output_dir == src or src in self.output_dir.parents:
                raise ConfigError(f"output {self.output_dir} is inside the input {src}; choose another --output-dir")
            if self.output_dir in src.parents and overwrite:
                raise ConfigError(f"--overwrite of {self.output_dir} would delete the input {src}")
        if self.output_dir.exists() and not overwrite:
            raise ConfigError(f"{self.output_dir} already exists; pass --overwrite to replace it")
        self.output_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.output_dir.name}.tmp-", dir=self.output_dir.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the output is an ordinary folder
        self.metadata = {"format": "pt", **(shard_metadata or {})}
        self.manifest = manifest
        self.shard_metadata: dict[str, dict[str, str]] = {}  # shard file name -> metadata replacing the default
        self.shards: dict[str, _Shard] = {}
        self.shard_entries_meta: dict[str, dict[str, Any]] = {}
        self._auto: list[str] = []

    def _open_shard(self, key: str) -> _Shard:
        path = self.tmp / f".data-{len(self.shards)}"
        shard = _Shard(path, open(path, "wb"), {})
        self.shards[key] = shard
        self.shard_entries_meta[key] = {}
        return shard

    def add(self, tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]], meta: dict[str, Any] | None = None,
            shard: str | None = None) -> None:
        """Append a group of tensors that stay in one shard.

        Args:
            tensors: name -> ``(dtype, shape, data)``; ``data`` is any C-contiguous ndarray
                whose bytes are the tensor's little-endian bytes.
            meta: JSON-able per-tensor records for this shard's ``compress.tensors`` metadata.
            shard: put the group in this named shard (keeps an original layout); by default
                shards are filled in order up to ``max_shard_size``.
        """
        size = sum(d.nbytes for _, _, d in tensors.values())
        if shard is None:
            key = self._auto[-1] if self._auto else None
            if key is None or (self.shards[key].size and self.shards[key].size + size > self.max_shard_size):
                key = f"auto-{len(self._auto)}"
                self._auto.append(key)
                self._open_shard(key)
        else:
            key = shard
            if not re.fullmatch(r"[A-Za-z0-9_][\w.\-]*\.safetensors", key):
                raise FormatError(f"shard name {key!r} is not a plain .safetensors file name")
            if key not in self.shards:
                self._open_shard(key)
        target = self.shards[key]
        for name, (dtype, shape, data) in tensors.items():
            if dtype not in DTYPES:
                raise FormatError(f"cannot write tensor {name!r}: unknown dtype {dtype}")
            expected = (int(np.prod(shape, dtype=np.int64)) if shape else 1) * DTYPES[dtype][0]
            if data.nbytes != expected:
                raise FormatError(f"tensor {name!r}: {data.nbytes} bytes do not match shape {list(shape)} {dtype}")
            target.entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [target.size, target.size + data.nbytes]}
            target.file.write(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))
            target.size += data.nbytes
        if meta:
            self.shard_entries_meta[key].update(meta)

    def write_text(self, relpath: str, text: str) -> None:
        """Write a non-weight text file (e.g. a merged ``config.json``) into the output."""
        path = self.tmp / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))  # byte for byte: no newline translation

    def copy_files(self, src_dir: Path, relpaths: list[Path], skip: set[str] = frozenset()) -> None:
        """Copy non-weight files from ``src_dir`` (never modifying them), except ``skip``."""
        for rel in relpaths:
            if str(rel) in skip:
                continue
            dst = self.tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src_dir / rel, dst)

    def finish(self, index_metadata: dict[str, Any] | None = None, meta_key: str = "compress.tensors") -> Path:
        """Write every shard's header, the index and the manifest into the temporary folder.

        Shard files are named ``model.safetensors`` (one auto shard) or
        ``model-0000k-of-0000N.safetensors``; named shards keep their names. The manifest
        (``compress_manifest.json``) lists every file with its size and xxh3-128, so a verifier
        can tell that no byte of the output changed, and nothing was added or removed.

        Returns:
            The temporary folder, complete; :meth:`publish` moves it into place.
        """
        import xxhash

        names: dict[str, str] = {}
        for key in self.shards:
            if key.startswith("auto-"):
                k, n = self._auto.index(key) + 1, len(self._auto)
                names[key] = SINGLE_NAME if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
            else:
                names[key] = key
        if not self.shards:
            key = "auto-0"
            self._auto.append(key)
            self._open_shard(key)
            names[key] = SINGLE_NAME
        weight_map: dict[str, str] = {}
        total = 0
        for key, shard in self.shards.items():
            shard.file.close()
            meta = dict(self.shard_metadata.get(names[key], self.metadata))
            if self.shard_entries_meta[key]:
                meta[meta_key] = json.dumps(self.shard_entries_meta[key], separators=(",", ":"), sort_keys=True)
            header = _header_bytes(shard.entries, meta)
            final = self.tmp / names[key]
            with open(final, "wb") as out, open(shard.data_path, "rb") as data:
                out.write(struct.pack("<Q", len(header)))
                out.write(header)
                shutil.copyfileobj(data, out, 16 << 20)
            shard.data_path.unlink()
            for name in shard.entries:
                weight_map[name] = names[key]
            total += shard.size
        if len(self.shards) > 1 or index_metadata is not None:
            index = {"metadata": {"total_size": total, **(index_metadata or {})}, "weight_map": dict(sorted(weight_map.items()))}
            (self.tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        if self.manifest:
            files = {}
            for p in sorted(self.tmp.rglob("*")):
                if p.is_file():
                    h = xxhash.xxh3_128()
                    with open(p, "rb") as f:
                        while chunk := f.read(16 << 20):
                            h.update(chunk)
                    files[str(p.relative_to(self.tmp))] = {"bytes": p.stat().st_size, "xxh3_128": h.hexdigest()}
            (self.tmp / MANIFEST_NAME).write_text(manifest_text(files))
        return self.tmp

    def publish(self) -> Path:
        """Rename the finished temporary folder into place (replacing the old output only with
        ``overwrite``; an output that appeared meanwhile is refused, not deleted).

        Raises:
            ConfigError: the output exists and ``overwrite`` is off.
        """
        import signal

        if self.output_dir.exists() or self.output_dir.is_symlink():
            if not self.overwrite:
                self.abort()
                raise ConfigError(f"{self.output_dir} appeared while writing; pass --overwrite to replace it")
            old = self.output_dir.with_name(f".{self.output_dir.name}.old-{os.getpid()}")
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            try:  # swap and clean up without being interrupted half way
                os.rename(self.output_dir, old)
                os.rename(self.tmp, self.output_dir)
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    old.unlink()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        else:
            os.rename(self.tmp, self.output_dir)
        return self.output_dir

    def commit(self, index_metadata: dict[str, Any] | None = None, meta_key: str = "compress.tensors") -> Path:
        """:meth:`finish`, then :meth:`publish`. Returns the output folder."""
        self.finish(index_metadata, meta_key)
        return self.publish()

    def abort(self) -> None:
        """Close and remove everything written so far (the previous output, if any, stays)."""
        for shard in self.shards.values():
            try:
                shard.file.close()
            except OSError:  # e.g. a full disk failing the last flush: the folder goes anyway
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or self.tmp.exists():  # an error, or finished but never published
            self.abort()


def save_model(model, output_dir: str | os.PathLike, *, tokenizer=None, overwrite: bool = False,
               inputs: tuple[Path, ...] = (), text_files: dict[str, str] | None = None,
               max_shard_size: int | str = "5GB") -> Path:
    """Save an in-memory transformers model as a plain HF checkpoint, atomically.

    For transforms whose result is a model in memory (pruning, distillation, fingerprint
    insertion, merging): ``save_pretrained`` writes into a temporary folder beside
    ``output_dir``, which is renamed into place only when complete (same rules as
    :class:`CheckpointWriter`: an existing output is refused unless ``overwrite``; an output
    inside an input is refused).

    Args:
        model: a ``PreTrainedModel``.
        output_dir: the folder to create.
        tokenizer: saved beside the weights when given.
        overwrite: replace an existing ``output_dir``.
        inputs: input folders the output must not be inside of.
        text_files: extra files to write, relative path -> UTF-8 text (e.g. a report JSON, README.md).
        max_shard_size: largest shard, e.g. ``"5GB"``.

    Returns:
        ``output_dir``, resolved.

    Raises:
        ConfigError: the output exists (without ``overwrite``) or is inside an input.
    """
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with CheckpointWriter(output_dir, overwrite=overwrite, inputs=inputs) as writer:
            model.save_pretrained(writer.tmp, safe_serialization=True, max_shard_size=parse_size(max_shard_size))
            if tokenizer is not None:
                tokenizer.save_pretrained(writer.tmp)
            for rel, text in (text_files or {}).items():
                writer.write_text(rel, text)
            return writer.publish()
    finally:
        if bars:
            hf_logging.enable_progress_bar()


class UploadReport(BaseModel):
    """What :func:`push_to_hub` sent (or would send, with ``dry_run``)."""

    repo_id: str
    revision: str | None
    files: list[str]
    bytes: int
    manifest_checked: bool
    generated_card: bool
    dry_run: bool
    url: str | None = None


def model_card(folder: Path, repo_id: str) -> str:
    """A minimal model card for a folder without README.md: the format it is in and how to load it."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    method = (config.get("quantization_config") or {}).get("quant_method")
    lines = ["---", "library_name: transformers", "tags:", "- compress"] + ([f"- {method}"] if method else []) + ["---", "",
             f"# {repo_id.split('/')[-1]}", ""]
    if method:
        lines += [f"Stored in the `{method}` format of [compress](https://pypi.org/project/compress/). Load it with:", "",
                  "```python", "import compress  # registers the format with transformers",
                  "from transformers import AutoModelForCausalLM",
                  f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")', "```", ""]
    else:
        lines += ["A plain Hugging Face checkpoint written by compress.", ""]
    return "\n".join(lines)


def push_to_hub(folder: str | os.PathLike, repo_id: str, *, revision: str | None = None, private: bool = False,
                commit_message: str | None = None, dry_run: bool = False, token: str | None = None) -> UploadReport:
    """Upload a checkpoint folder to the Hugging Face Hub in one commit (``huggingface_hub``).

    A folder with ``compress_manifest.json`` is checked against it first, so a damaged output is
    never published. A folder without ``README.md`` gets a generated model card (the folder itself
    is not modified). Files in hidden folders (``.git``, ``.cache``) are not sent.

    Args:
        folder: the checkpoint folder.
        repo_id: ``org/name`` of the model repository (created if missing).
        revision: branch to commit to (default: main).
        private: create the repository private.
        dry_run: list what would be sent; contact nothing.
        token: Hub token (default: the logged-in one, or ``HF_TOKEN``).

    Returns:
        :class:`UploadReport`.

    Raises:
        ConfigError: the folder is missing or holds no weights, the id is malformed, or the Hub
            refuses (offline, no token, no permission).
        VerificationError: a file differs from the folder's manifest.
    """
    from compress.errors import VerificationError

    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"{path}: no such folder")
    if not _is_hub_id(repo_id):
        raise ConfigError(f"{repo_id!r}: expected a Hub model id of the form org/name")
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*")  # hidden folders (.git, .cache) are not sent
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts[:-1]))
    if not any(f.endswith((".safetensors", ".gguf")) for f in files):
        raise ConfigError(f"{path}: holds no .safetensors weights; nothing to upload")
    checked = (path / MANIFEST_NAME).exists()
    if checked:
        from compress.eval.verify import check_manifest

        problems = check_manifest(path)
        if problems:
            raise VerificationError(f"{path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                                    + "; not uploaded")
    card = None if "README.md" in files else model_card(path, repo_id)
    report = UploadReport(repo_id=repo_id, revision=revision, files=files + (["README.md"] if card else []),
                          bytes=sum((path / f).stat().st_size for f in files) + len(card or ""),
                          manifest_checked=checked, generated_card=card is not None, dry_run=dry_run)
    if dry_run:
        return report
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(path / f)) for f in files]
    if card:
        ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode("utf-8")))
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.create_commit(repo_id, ops, commit_message=commit_message or f"Upload {path.name} with compress",
                                 revision=revision)
    except Exception as e:  # offline, no token, no permission: one line for the user
        first = (str(e).splitlines() or [""])[0][:200]
        raise ConfigError(f"upload to {repo_id} failed: {type(e).__name__}: {first}; check `hf auth login` "
                          "(or HF_TOKEN) and your connection") from None
    report.url = getattr(info, "commit_url", None) or str(info)
    return report
