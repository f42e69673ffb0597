"""``compress distill`` end to end on the real SmolLM2 (teacher) and a layer-dropped SmolLM2 (student); bad inputs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CALIB

pytestmark = pytest.mark.integration

_REPO = Path(__file__).resolve().parents[2]
DATA = CALIB


def cli(*args: str):
    return subprocess.run([sys.executable, "-m", "compress", *args], capture_output=True, text=True, cwd=_REPO,
                          env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def dropped_student(smollm2_bf16, tmp_path_factory) -> Path:
    """SmolLM2 with layers 20-25 removed (plain layer dropping), bf16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress.checkpoint import save_model
    from compress.transforms.distill import drop_layers

    model = AutoModelForCausalLM.from_pretrained(smollm2_bf16, dtype=torch.bfloat16)
    drop_layers(model, range(20, 26))
    return save_model(model, tmp_path_factory.mktemp("student") / "drop6", tokenizer=AutoTokenizer.from_pretrained(smollm2_bf16))


def test_distill_real_smollm2(smollm2_bf16, dropped_student, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "healed"
    r = cli("distill", str(dropped_student), "--teacher", str(smollm2_bf16), "-o", str(out), "--data", str(DATA),
            "--loss", "csd", "--steps", "2", "--seq-len", "32", "--batch-size", "1", "--lr", "1e-4",
            "--train-from-layer", "18", "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["steps"] == 2 and result["vocab"] == 49152 and result["monitored"] == "½Var_p(s-t)"
    assert all(math.isfinite(h["loss"]) and h["loss"] > 0 for h in result["history"])
    assert result["tokens_per_step"] == 32 and result["peak_rss_bytes"] > 0
    # a plain checkpoint: plain transformers loads it, 24 layers, bf16 like the student, no compress metadata
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 24 and "quantization_config" not in model.config.to_dict()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    report = json.loads((out / "distill_report.json").read_text())
    assert report["loss"] == "csd" and report["weighting"] == "ss"
    before, after = load_file(str(dropped_student / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".layers." in k or k == "model.norm.weight" for k in changed)
    assert not any(k.startswith("model.layers.5.") for k in changed)          # frozen below --train-from-layer 18
    ids = torch.tensor([[1, 504, 3458, 314]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)


def test_bad_inputs(smollm2_bf16, dropped_student, tmp_path):
    base = [str(dropped_student), "--teacher", str(smollm2_bf16), "--steps", "1", "--seq-len", "8", "--batch-size", "1"]
    # missing data file
    r = cli("distill", *base, "-o", str(tmp_path / "a"), "--data", str(tmp_path / "none.txt"))
    assert r.returncode == 2 and "no such text file" in r.stderr
    # existing output refused before any work
    (tmp_path / "exists").mkdir()
    r = cli("distill", *base, "-o", str(tmp_path / "exists"), "--data", str(DATA), "--json")
    assert r.returncode == 2 and "already exists" in json.loads(r.stdout)["error"]
    # unknown loss, out-of-range fraction, bad skew
    for extra, needle in ((["--loss", "kl"], "--loss"), (["--on-policy", "1.5"], "--on-policy"), (["--skew-alpha", "1"], "skew-alpha")):
        r = cli("distill", *base, "-o", str(tmp_path / "b"), "--data", str(DATA), *extra)
        assert r.returncode == 2 and needle in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    # cross-tokenizer pair: a teacher whose tokenizer has one more token
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other_teacher"
    shutil.copytree(smollm2_bf16, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra-token>"])
    tok.save_pretrained(other)
    r = cli("distill", str(dropped_student), "--teacher", str(other), "-o", str(tmp_path / "c"), "--data", str(DATA),
            "--steps", "1", "--seq-len", "8")
    assert r.returncode == 2 and "tokenizers differ" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "c").exists()
    # resume from a folder that is not a saved state
    r = cli("distill", *base, "-o", str(tmp_path / "d"), "--data", str(DATA), "--resume", str(tmp_path))
    assert r.returncode == 2 and "distill_state.json" in r.stderr
    # --save-every without a state folder
    r = cli("distill", *base, "-o", str(tmp_path / "e"), "--data", str(DATA), "--save-every", "1")
    assert r.returncode == 2 and "--save-state" in r.stderr
    assert not any((tmp_path / n).exists() for n in "abde")
