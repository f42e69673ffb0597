"""Distillation losses against exact references; tokenizer and vocab checks; training on a tiny model (resume, LoRA, on-policy)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from compress.errors import ConfigError
from compress.transforms.distill import (DistillConfig, TeacherCache, check_tokenizers, distill, distill_loss, drop_layers,
                                         shared_vocab)

from conftest import CALIB as DATA


# ------------------------------------------------------------------------------------------- losses

def _pairwise(s, t, w1, w2):
    """¼ Σ_{u,v} w1_u w2_v [(s_v - s_u) - (t_v - t_u)]², per row, in O(V²)."""
    ds = s[:, None, :] - s[:, :, None]                                   # [N, u, v] = s_v - s_u
    dt = t[:, None, :] - t[:, :, None]
    return 0.25 * (w1[:, :, None] * w2[:, None, :] * (ds - dt).square()).sum((1, 2))


def _weights(s, t, weighting, tau):
    ps = torch.softmax(s.detach() / tau, -1)
    if weighting == "ss":
        return ps, ps
    if weighting == "ts":
        return torch.softmax(t / tau, -1), ps
    return torch.full_like(ps, 1 / ps.shape[-1]), ps


@pytest.mark.parametrize("weighting", ["ss", "ts", "us"])
@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_csd_gradient_equals_pairwise_gradient(weighting, tau):
    gen = torch.Generator().manual_seed(0)
    s = (3 * torch.randn(7, 53, generator=gen, dtype=torch.float64)).requires_grad_()
    t = 3 * torch.randn(7, 53, generator=gen, dtype=torch.float64)
    ours = distill_loss(s, t, "csd", weighting=weighting, temperature=tau)
    (g_ours,) = torch.autograd.grad(ours, s)
    w1, w2 = _weights(s, t, weighting, tau)
    ref = _pairwise(s, t, w1, w2).mean()
    (g_ref,) = torch.autograd.grad(ref, s)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-13)
    # closed form of the gradient: ½[w1_k (d_k - E_w2 d) + w2_k (d_k - E_w1 d)] / N
    d = (s - t).detach()
    mu1, mu2 = (w1 * d).sum(-1, keepdim=True), (w2 * d).sum(-1, keepdim=True)
    torch.testing.assert_close(g_ours, 0.5 * (w1 * (d - mu2) + w2 * (d - mu1)) / s.shape[0], rtol=1e-12, atol=1e-13)


def test_csd_ss_is_half_weighted_variance():
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(4, 11, 300, generator=gen, dtype=torch.float64)
    t = torch.randn(4, 11, 300, generator=gen, dtype=torch.float64)
    p = torch.softmax(s, -1)
    d = s - t
    var = (p * d.square()).sum(-1) - (p * d).sum(-1).square()
    torch.testing.assert_close(distill_loss(s, t, "csd"), 0.5 * var.mean(), rtol=1e-12, atol=1e-14)
    # invariant to a per-position shift of either logit vector (only differences matter)
    shifted = distill_loss(s + torch.randn(4, 11, 1, dtype=torch.float64), t - 5.0, "csd")
    torch.testing.assert_close(shifted, 0.5 * var.mean(), rtol=1e-10, atol=1e-12)
    assert float(distill_loss(t + 3.0, t, "csd")) == pytest.approx(0.0, abs=1e-20)


def test_csd_ss_at_unit_temperature_has_the_reverse_kl_gradient():
    """∂KL(p_s‖p_t)/∂s_k = p_k (d_k - E_p d): CSD(ss, τ=1) and reverse KL give the same gradient (different values)."""
    gen = torch.Generator().manual_seed(5)
    s = (2 * torch.randn(9, 61, generator=gen, dtype=torch.float64)).requires_grad_()
    t = 2 * torch.randn(9, 61, generator=gen, dtype=torch.float64)
    g_csd, = torch.autograd.grad(distill_loss(s, t, "csd"), s)
    g_rkl, = torch.autograd.grad(distill_loss(s, t, "rkl"), s)
    torch.testing.assert_close(g_csd, g_rkl, rtol=1e-12, atol=1e-14)
    assert float(distill_loss(s, t, "csd")) != pytest.approx(float(distill_loss(s, t, "rkl")), rel=1e-3)
    for kw in ({"temperature": 2.0}, {"weighting": "ts"}, {"weighting": "us"}):   # these differ from reverse KL
        g, = torch.autograd.grad(distill_loss(s, t, "csd", **kw), s)
        assert (g - g_rkl).abs().max() > 1e-4


def _ref_divergence(s, t, loss, a=0.1, b=0.5, tau=1.0):
    """Probability-space references in float64 (torch.kl_div and explicit mixtures)."""
    ls, lt = F.log_softmax(s / tau, -1), F.log_softmax(t / tau, -1)
    ps, pt = ls.exp(), lt.exp()
    if loss == "fkl":
        return F.kl_div(ls, lt, log_target=True, reduction="none").sum(-1)
    if loss == "rkl":
        return F.kl_div(lt, ls, log_target=True, reduction="none").sum(-1)
    if loss == "skl":
        return (pt * (pt.log() - torch.log(a * pt + (1 - a) * ps))).sum(-1)
    if loss == "srkl":
        return (ps * (ps.log() - torch.log(a * ps + (1 - a) * pt))).sum(-1)
    m = b * pt + (1 - b) * ps
    return b * (pt * (pt / m).log()).sum(-1) + (1 - b) * (ps * (ps / m).log()).sum(-1)


@pytest.mark.parametrize("loss", ["fkl", "rkl", "skl", "srkl", "jsd"])
def test_kl_family_matches_references(loss):
    gen = torch.Generator().manual_seed(2)
    s = (2 * torch.randn(3, 5, 97, generator=gen, dtype=torch.float64)).requires_grad_()
    t = 2 * torch.randn(3, 5, 97, generator=gen, dtype=torch.float64)
    for kw in ({}, {"skew_alpha": 0.3, "jsd_beta": 0.2, "temperature": 2.0}):
        ours = distill_loss(s, t, loss, **kw)
        ref = _ref_divergence(s, t, loss, kw.get("skew_alpha", 0.1), kw.get("jsd_beta", 0.5), kw.get("temperature", 1.0)).mean()
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
        g1, = torch.autograd.grad(ours, s)
        g2, = torch.autograd.grad(ref, s)
        torch.testing.assert_close(g1, g2, rtol=1e-8, atol=1e-12)
    assert float(distill_loss(t, t, loss)) == pytest.approx(0.0, abs=1e-12)  # zero at the teacher


def test_jsd_limits_and_skew_limits():
    gen = torch.Generator().manual_seed(3)
    s, t = torch.randn(6, 40, generator=gen, dtype=torch.float64), torch.randn(6, 40, generator=gen, dtype=torch.float64)
    # skew with α → 0 is the plain KL
    assert float(distill_loss(s, t, "skl", skew_alpha=1e-9)) == pytest.approx(float(distill_loss(s, t, "fkl")), rel=1e-6)
    assert float(distill_loss(s, t, "srkl", skew_alpha=1e-9)) == pytest.approx(float(distill_loss(s, t, "rkl")), rel=1e-6)
    # symmetric JSD (β = ½) is symmetric in the two distributions
    assert float(distill_loss(s, t, "jsd")) == pytest.approx(float(distill_loss(t, s, "jsd")), rel=1e-12)


def test_losses_computed_in_float32_and_mask():
    gen = torch.Generator().manual_seed(4)
    s = torch.randn(2, 6, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    t = torch.randn(2, 6, 64, generator=gen).to(torch.bfloat16)
    for loss in ("csd", "fkl", "jsd"):
        value = distill_loss(s, t, loss)
        assert value.dtype == torch.float32
        mask = torch.zeros(2, 6, dtype=torch.bool)
        mask[:, 3:] = True
        masked = distill_loss(s, t, loss, mask=mask)
        torch.testing.assert_close(masked, distill_loss(s[:, 3:], t[:, 3:], loss))
    with pytest.raises(ConfigError, match="differ"):
        distill_loss(s, t[..., :10], "csd")


# ------------------------------------------------------------------------------------------- tiny models

@pytest.fixture(scope="module")
def tokenizer(smollm2_bf16):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_bf16)


def _tiny(tokenizer, path, layers=2, extra_rows=0, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer) + extra_rows, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_pair(tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    teacher = _tiny(tokenizer, root / "teacher", layers=3, extra_rows=64, seed=0)   # padded vocab rows
    student = _tiny(tokenizer, root / "student", layers=2, seed=1)
    return student, teacher


def _config(student, teacher, out, **kw):
    base = dict(student=str(student), teacher=str(teacher), output_dir=str(out), data=str(DATA), steps=4, seq_len=16,
                batch_size=2, lr=1e-3, dtype="float32", seed=3)
    base.update(kw)
    return DistillConfig(**base)


def _weights_of(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_tokenizer_mismatch_is_a_config_error(tokenizer, smollm2_bf16):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(smollm2_bf16)
    check_tokenizers(tokenizer, other)
    other.add_tokens(["<not-in-the-student>"])
    with pytest.raises(ConfigError, match="tokenizers differ.*cross-tokenizer"):
        check_tokenizers(tokenizer, other)
    special = AutoTokenizer.from_pretrained(smollm2_bf16)
    special.pad_token = special.bos_token if special.pad_token != special.bos_token else special.eos_token
    with pytest.raises(ConfigError, match="special tokens"):
        check_tokenizers(tokenizer, special)


def test_vocab_sliced_to_shared_real_vocabulary(tokenizer, tiny_pair):
    from transformers import AutoModelForCausalLM

    student, teacher = (AutoModelForCausalLM.from_pretrained(p) for p in tiny_pair)
    assert teacher.get_output_embeddings().weight.shape[0] == len(tokenizer) + 64
    assert shared_vocab(tokenizer, student, teacher) == len(tokenizer)
    student.resize_token_embeddings(len(tokenizer) - 1)
    with pytest.raises(ConfigError, match="rows but the tokenizer has"):
        shared_vocab(tokenizer, student, teacher)


def test_drop_layers_renumbers(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_tiny(tokenizer, tmp_path / "m", layers=4))
    kept = [model.model.layers[i] for i in (0, 3)]
    drop_layers(model, [1, 2])
    assert model.config.num_hidden_layers == 2 and list(model.model.layers) == kept
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1]
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)  # the KV cache finds every layer
    with pytest.raises(ConfigError):
        drop_layers(model, [0, 1])


def test_training_lowers_the_loss_and_resume_is_exact(tiny_pair, tmp_path):
    student, teacher = tiny_pair
    full = distill(_config(student, teacher, tmp_path / "full", steps=6))
    assert full.steps == 6 and full.output and full.vocab == 49152
    assert full.history[-1].loss < full.history[0].loss
    # interrupted after 3 steps (state saved), then resumed: same weights as the uninterrupted run
    state = tmp_path / "state"
    part = distill(_config(student, teacher, tmp_path / "resumed", steps=6, state_dir=str(state)), stop_after=3)
    assert part.output is None and part.steps == 3 and not (tmp_path / "resumed").exists()
    assert json.loads((state / "distill_state.json").read_text())["step"] == 3
    rest = distill(_config(student, teacher, tmp_path / "resumed", steps=6, resume=str(state)))
    assert rest.start_step == 3 and rest.steps == 6
    assert [h.loss for h in part.history + rest.history] == pytest.approx([h.loss for h in full.history], rel=1e-6)
    a, b = _weights_of(tmp_path / "full"), _weights_of(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7)
    with pytest.raises(ConfigError, match="other options"):
        distill(_config(student, teacher, tmp_path / "x", steps=6, lr=5e-4, resume=str(state)))
    with pytest.raises(ConfigError, match="already exists"):
        distill(_config(student, teacher, tmp_path / "full", steps=6))


def test_lora_on_policy_and_weightings(tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    student, teacher = tiny_pair
    r = distill(_config(student, teacher, tmp_path / "lora", steps=2, lora=True, lora_rank=4, on_policy=1.0,
                        weighting="ts"))
    assert [h.on_policy for h in r.history] == [1, 1]
    assert r.trainable_params < 20_000
    weights = _weights_of(tmp_path / "lora")
    assert not any("lora" in k for k in weights)              # merged into plain weights
    before = _weights_of(student)
    changed = [k for k in before if k in weights and not torch.equal(before[k], weights[k])]
    assert any("q_proj" in k for k in changed)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lora")
    assert model.config.num_hidden_layers == 2
    for loss, weighting in (("csd", "us"), ("srkl", "ss")):
        r = distill(_config(student, teacher, tmp_path / f"{loss}{weighting}", steps=1, weighting=weighting, loss=loss,
                            on_policy=1.0, on_policy_mode="greedy"))
        assert math.isfinite(r.history[0].loss) and r.history[0].loss > 0


def test_teacher_cache_gives_identical_training(tiny_pair, tmp_path):
    student, teacher = tiny_pair
    cache = TeacherCache()
    a = distill(_config(student, teacher, tmp_path / "a", steps=2, loss="fkl"), teacher_cache=cache)
    b = distill(_config(student, teacher, tmp_path / "b", steps=2, loss="fkl"), teacher_cache=cache)
    c = distill(_config(student, teacher, tmp_path / "c", steps=2, loss="fkl"))
    assert cache.hits == 2
    assert [h.loss for h in a.history] == [h.loss for h in b.history] == pytest.approx([h.loss for h in c.history], rel=1e-5)


def test_config_rejects_bad_options(tiny_pair, tmp_path):
    student, teacher = tiny_pair
    with pytest.raises(ValueError):
        _config(student, teacher, tmp_path / "o", loss="kl")
    with pytest.raises(ValueError):
        _config(student, teacher, tmp_path / "o", on_policy=1.5)
    with pytest.raises(ValueError):
        _config(student, teacher, tmp_path / "o", skew_alpha=1.0)
    with pytest.raises(ConfigError, match="no such text file"):
        distill(_config(student, teacher, tmp_path / "o", data=str(tmp_path / "missing.txt")))
    with pytest.raises(ConfigError, match="distill_state.json"):
        distill(_config(student, teacher, tmp_path / "o", resume=str(tmp_path)))


def test_ecf8_student_trains_and_saves_plain(tiny_pair, tmp_path):
    """An ECF8 checkpoint decodes to exact plain weights at load: it can be a student; the output is plain."""
    from compress.checkpoint import Checkpoint
    from compress.transforms.ecf8 import ECF8Config, encode_checkpoint

    student, teacher = tiny_pair
    with Checkpoint.open(student) as src:
        encode_checkpoint(src, tmp_path / "ecf8", ECF8Config(min_numel=0))
    assert json.loads((tmp_path / "ecf8" / "config.json").read_text())["quantization_config"]["quant_method"] == "ecf8"
    plain = distill(_config(student, teacher, tmp_path / "from_plain", steps=2))
    coded = distill(_config(tmp_path / "ecf8", teacher, tmp_path / "from_ecf8", steps=2))
    assert [h.loss for h in coded.history] == pytest.approx([h.loss for h in plain.history], rel=1e-6)
    assert "quantization_config" not in json.loads((tmp_path / "from_ecf8" / "config.json").read_text())
    a, b = _weights_of(tmp_path / "from_plain"), _weights_of(tmp_path / "from_ecf8")
    for k in a:
        torch.testing.assert_close(a[k], b[k])
