"""AnyBCQ: BCQ math, packing, padding, kernels (Triton under TRITON_INTERPRET=1), format round trip."""

import json
from pathlib import Path

import pytest
import torch

from compress.errors import ConfigError
from compress.kernels.bcq import reference as ref
from compress.transforms.anybcq import AnyBCQConfig, bcq_fit, least_squares, relative_error, rtn_fit

#: fp32 tolerance of Triton vs the torch reference (different summation order), relative to max |y|
KERNEL_RTOL = 1e-5
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _weight(out=97, inf=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inf, generator=g) * 0.02 + torch.randn(out, 1, generator=g) * 0.005


@pytest.mark.parametrize("asymmetric", [False, True])
def test_error_never_rises_with_bits(asymmetric):
    w = _weight()
    qw = bcq_fit(w, (1, 2, 3, 4), 64, asymmetric)
    errs = [relative_error(w, qw, p) for p in (1, 2, 3, 4)]
    assert all(b <= a + 1e-7 for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < 0.15  # 4 bits: measured 0.12 on Gaussian weights
    # per group too (the expansion keeps the best fit, alpha_{p+1} = 0 being feasible)
    per = [((w - qw.dequantize(p)) ** 2).reshape(97, -1) for p in (2, 3, 4)]
    for a, b in zip(per, per[1:]):
        assert bool((b.sum(1) <= a.sum(1) + 1e-9).all())


def test_nested_planes_share_codes():
    qw = bcq_fit(_weight(), (2, 3, 4), 64)
    assert qw.codes.shape == (4, 97, 256) and qw.codes.dtype == torch.bool
    assert set(qw.plane_offset.values()) == {0}
    assert [tuple(qw.alpha[p].shape) for p in (2, 3, 4)] == [(4, 2, 97), (4, 3, 97), (4, 4, 97)]


@pytest.mark.parametrize("asymmetric", [False, True])
def test_scales_are_least_squares_optimal(asymmetric):
    """For the final codes, the stored scales equal torch.linalg.lstsq on every group."""
    w = _weight(13, 100)
    qw = bcq_fit(w, (2, 3), 32, asymmetric)
    signs = qw.codes.float() * 2 - 1  # [3, out, 128]
    for p in (2, 3):
        for n in (0, 7, 12):
            for g in range(4):
                cols = slice(32 * g, min(32 * (g + 1), 100))
                a = signs[:p, n, cols].t()  # [cols, p]
                if asymmetric:
                    a = torch.cat([a, torch.ones(a.shape[0], 1)], 1)
                sol = torch.linalg.lstsq(a.double(), w[n, cols].double().unsqueeze(1)).solution[:, 0].float()
                torch.testing.assert_close(qw.alpha[p][g, :, n], sol[:p], atol=1e-6, rtol=1e-4)
                if asymmetric:
                    torch.testing.assert_close(qw.beta[p][g, n], sol[p], atol=1e-6, rtol=1e-4)


def test_least_squares_against_lstsq_batched():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 32, generator=g)
    mask = torch.ones(5, 32)
    mask[:, 20:] = 0
    w = w * mask
    planes = (torch.randint(0, 2, (5, 3, 32), generator=g).float() * 2 - 1) * mask.unsqueeze(1)
    alpha, _ = least_squares(w, mask, planes, False)
    for i in range(5):
        sol = torch.linalg.lstsq(planes[i, :, :20].t().double(), w[i, :20].double().unsqueeze(1)).solution[:, 0]
        torch.testing.assert_close(alpha[i].double(), sol, atol=1e-6, rtol=1e-5)


def test_pack_unpack_round_trip():
    g = torch.Generator().manual_seed(2)
    codes = torch.rand(5, 7, 96, generator=g) > 0.5
    q = ref.pack_planes(codes)
    assert q.dtype == torch.int32 and q.shape == (3, 5, 7)
    assert torch.equal(ref.unpack_planes(q) > 0, codes)
    # bit t of word k = column 32k + t, LSB first
    one = torch.zeros(1, 1, 64, dtype=torch.bool)
    one[0, 0, 33] = True
    one[0, 0, 31] = True
    assert ref.pack_planes(one)[:, 0, 0].tolist() == [-(2**31), 2]


@pytest.mark.parametrize("shape", [(97, 200), (5, 33), (64, 128)])
def test_padding_shapes_never_wrong(shape):
    """in_features not a multiple of the group or the word: padded, and the result equals the dense math."""
    w = _weight(*shape)
    qw = bcq_fit(w, (2, 4), 64)
    for p in (2, 4):
        dense = qw.dequantize(p)  # [out, in]
        assert dense.shape == shape
        x = torch.randn(3, shape[1])
        y = ref.bcq_linear(x, ref.pack_planes(qw.codes), qw.alpha[p], None, group_size=64, in_features=shape[1])
        torch.testing.assert_close(y, x @ dense.t(), atol=1e-5, rtol=1e-5)
    assert not qw.codes[:, :, shape[1]:].any()  # padding bits are 0


def test_rtn_matches_uniform_rounding():
    w = _weight(8, 64)
    qw = rtn_fit(w, (2, 3), 64)
    assert qw.plane_offset == {2: 0, 3: 2} and qw.codes.shape[0] == 5
    for p in (2, 3):
        lo, hi = w.min(1, keepdim=True).values, w.max(1, keepdim=True).values
        scale = (hi - lo) / (2**p - 1)
        want = torch.clamp(torch.round((w - lo) / scale), 0, 2**p - 1) * scale + lo
        torch.testing.assert_close(qw.dequantize(p), want, atol=1e-6, rtol=1e-5)


def test_bcq_beats_rtn_at_low_bits():
    w = _weight(64, 256)
    assert relative_error(w, bcq_fit(w, (2,), 64), 2) < relative_error(w, rtn_fit(w, (2,), 64), 2)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_triton_matches_reference(m, asymmetric):
    from compress.kernels.bcq import triton as tk

    out, inf, gs = 97, 200, 64
    w = _weight(out, inf)
    qw = bcq_fit(w, (2, 3), gs, asymmetric)
    q = ref.pack_planes(qw.codes)
    x = torch.randn(m, inf, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(out)
    for p in (2, 3):
        beta = qw.beta[p] if asymmetric else None
        want = ref.bcq_linear(x, q, qw.alpha[p], beta, group_size=gs, in_features=inf, bias=bias)
        got = tk.bcq_linear(x, q, qw.alpha[p], beta, group_size=gs, in_features=inf, bias=bias)
        assert got.shape == (m, out)
        assert float((got - want).abs().max()) <= KERNEL_RTOL * float(want.abs().max())


def test_triton_reads_plane_offsets():
    from compress.kernels.bcq import triton as tk

    w = _weight(40, 96)
    qw = rtn_fit(w, (2, 3), 32)
    q = ref.pack_planes(qw.codes)
    x = torch.randn(2, 96)
    got = tk.bcq_linear(x, q, qw.alpha[3], qw.beta[3], group_size=32, in_features=96, plane_offset=2)
    want = x @ qw.dequantize(3).t()
    assert float((got - want).abs().max()) <= KERNEL_RTOL * float(want.abs().max())


def test_config_validation():
    with pytest.raises(ValueError):
        AnyBCQConfig(group_size=100)
    with pytest.raises(ValueError):
        AnyBCQConfig(bits=(2, 2))
    with pytest.raises(ValueError):
        AnyBCQConfig(unknown=1)
    assert AnyBCQConfig(bits=(4, 2)).bits == (2, 4)


def _tiny(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from compress.checkpoint import save_model

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    return save_model(model, tmp_path / "tiny"), model


def test_ignore_pattern_must_match(tmp_path):
    from compress.checkpoint import Checkpoint
    from compress.transforms.anybcq import quantize_checkpoint

    src, _ = _tiny(tmp_path)
    with Checkpoint.open(src) as ck, pytest.raises(ConfigError, match="matches no linear"):
        quantize_checkpoint(ck, tmp_path / "out", AnyBCQConfig(iters=0, ignore=("*.nothing_proj",)))
    assert not (tmp_path / "out").exists()


def test_tiny_round_trip_and_precision_switch(tmp_path):
    """Write a tiny Llama (in 32/80: padded groups), load it through from_pretrained; each precision equals
    the dense math, and set_precision switches."""
    import transformers

    import compress
    from compress.checkpoint import Checkpoint
    from compress.formats.anybcq import AnyBCQLinear
    from compress.transforms.anybcq import quantize_checkpoint

    src, model = _tiny(tmp_path)
    with Checkpoint.open(src) as ck:
        report = quantize_checkpoint(ck, tmp_path / "q", AnyBCQConfig(iters=0, group_size=64, ignore=("*.v_proj",)))
    assert report.quantized_modules == 12
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "anybcq" and qcfg["bits"] == [2, 3, 4] and qcfg["format_version"] == 1
    loaded = compress.load(tmp_path / "q")
    also = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    layer = loaded.model.layers[0].mlp.down_proj
    assert isinstance(layer, AnyBCQLinear) and isinstance(also.model.layers[1].self_attn.q_proj, AnyBCQLinear)
    assert isinstance(loaded.model.layers[0].self_attn.v_proj, torch.nn.Linear)  # ignored
    ids = torch.randint(0, 128, (2, 16))
    outs = {}
    for p in (2, 3, 4):
        assert loaded.set_precision(p) == 12
        outs[p] = loaded(ids).logits
        x = torch.randn(3, 80)
        torch.testing.assert_close(layer(x), x @ layer.dequantize(p).t(), atol=1e-5, rtol=1e-5)
    ref_logits = model(ids).logits
    errs = [float((outs[p] - ref_logits).norm()) for p in (2, 3, 4)]
    assert errs[0] > errs[1] > errs[2], errs
    with pytest.raises(ConfigError):
        loaded.set_precision(5)
