"""Golden file: the anybcq v1 checkpoint in tests/golden/anybcq_v1 keeps loading to the same outputs.

Written by ``quantize_checkpoint(AnyBCQConfig(iters=0, group_size=32, asymmetric=True))`` from a seeded
1-layer Llama (hidden 32, intermediate 80: the down projection's 80 inputs pad to 96, a partial
group); ``expected.json`` holds the first 8 logits of every position at 2, 3 and 4 bits.
"""

import json
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "anybcq_v1"


def test_anybcq_v1_golden_loads_to_the_same_logits():
    import transformers

    import compress
    from compress.checkpoint import Checkpoint
    from compress.formats.anybcq import AnyBCQLinear

    expected = json.loads((GOLDEN / "expected.json").read_text())
    ck = Checkpoint.open(GOLDEN)
    info = ck.info("model.layers.0.mlp.down_proj.qweight")
    assert info.dtype == "I32" and list(info.shape) == [3, 4, 32]  # [96/32 words, 4 planes, out 32]
    assert list(ck.info("model.layers.0.mlp.down_proj.alpha_3").shape) == [3, 3, 32]
    assert list(ck.info("model.layers.0.mlp.down_proj.beta_2").shape) == [3, 32]
    ids = torch.tensor(expected["input_ids"])
    for model in (compress.load(GOLDEN, dtype=torch.float32),
                  transformers.AutoModelForCausalLM.from_pretrained(GOLDEN, dtype=torch.float32)):
        assert isinstance(model.model.layers[0].mlp.down_proj, AnyBCQLinear)
        for p in (2, 3, 4):
            model.set_precision(p)
            with torch.no_grad():
                got = model(ids).logits[0, :, :8]
            torch.testing.assert_close(got, torch.tensor(expected[str(p)]), atol=1e-5, rtol=1e-5)
