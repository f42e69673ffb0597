"""Classic merge formulas, merge-config validation, LS-Merge chunking, VAE loss pieces and alignment."""

import math

import numpy as np
import pytest
import torch

from compress.errors import ConfigError, FormatError
from compress.transforms import lsmerge as ls
from compress.transforms import merge as mg


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- classic merges ------------------------------------------------------------------------------
def test_linear_matches_formula():
    a, b, c = rand(7, 5, seed=1), rand(7, 5, seed=2), rand(7, 5, seed=3)
    out = mg.linear([a, b, c], [0.2, 0.5, 1.3])
    torch.testing.assert_close(out, (0.2 * a + 0.5 * b + 1.3 * c) / 2.0)
    torch.testing.assert_close(mg.linear([a, b], [2.0, -1.0], normalize=False), 2 * a - b)
    with pytest.raises(ConfigError, match="sum to 0"):
        mg.linear([a, b], [1.0, -1.0])


def slerp_reference(t, v0, v1):
    """Textbook slerp on the flattened vectors (float64), the formula mergekit implements."""
    a, b = v0.double().reshape(-1).numpy(), v1.double().reshape(-1).numpy()
    dot = np.dot(a / np.linalg.norm(a), b / np.linalg.norm(b))
    th = math.acos(dot)
    return (math.sin((1 - t) * th) * a + math.sin(t * th) * b) / math.sin(th)


def test_slerp_matches_formula_and_endpoints():
    a, b = rand(16, 8, seed=4), rand(16, 8, seed=5)
    for t in (0.0, 0.3, 0.5, 1.0):
        out = mg.slerp(t, a, b)
        np.testing.assert_allclose(out.reshape(-1).numpy(), slerp_reference(t, a, b), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mg.slerp(0.0, a, b), a)
    torch.testing.assert_close(mg.slerp(1.0, a, b), b)
    # unit orthogonal vectors: the result stays on the unit circle
    e0, e1 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    torch.testing.assert_close(mg.slerp(0.5, e0, e1), torch.tensor([math.sqrt(0.5), math.sqrt(0.5)]))


def test_slerp_colinear_falls_back_to_lerp():
    a = rand(10, seed=6)
    for b in (2.5 * a, -3.0 * a, a + 1e-6 * rand(10, seed=7)):  # parallel, anti-parallel, nearly parallel
        torch.testing.assert_close(mg.slerp(0.25, a, b), 0.75 * a + 0.25 * b)


def test_slerp_zero_tensor_like_mergekit():
    # a zero vector is left unnormalized: dot = 0, theta = pi/2
    a, z = rand(6, seed=8), torch.zeros(6)
    t = 0.3
    torch.testing.assert_close(mg.slerp(t, a, z), math.cos(math.pi * t / 2) * a)


def test_task_arithmetic_matches_formula():
    base, x, y = rand(4, 4, seed=9), rand(4, 4, seed=10), rand(4, 4, seed=11)
    out = mg.task_arithmetic(base, [x, y], [0.7, 0.4], lambda_=1.5)
    torch.testing.assert_close(out, base + 1.5 * (0.7 * (x - base) + 0.4 * (y - base)))
    out = mg.task_arithmetic(base, [x, y], [0.7, 0.4], normalize=True)
    torch.testing.assert_close(out, base + (0.7 * (x - base) + 0.4 * (y - base)) / 1.1)


def test_magnitude_mask():
    d = torch.tensor([1.0, -2.0, 3.0, 0.5, -0.1, 4.0])
    torch.testing.assert_close(mg.magnitude_mask(d, 0.5), torch.tensor([0.0, -2.0, 3.0, 0.0, 0.0, 4.0]))
    torch.testing.assert_close(mg.magnitude_mask(d, 1.0), d)
    torch.testing.assert_close(mg.magnitude_mask(d, 0.1), torch.zeros(6))  # k = 0 keeps nothing


def test_ties_hand_example():
    base = torch.zeros(4)
    m1 = torch.tensor([1.0, -2.0, 3.0, 0.0])
    m2 = torch.tensor([-1.0, -1.0, 1.0, 2.0])
    # sum [0, -3, 4, 2] elects [+, -, +, +]; kept: m1 [1, -2, 3, -], m2 [-, -1, 1, 2]
    out = mg.ties(base, [m1, m2], [1.0, 1.0], [1.0, 1.0])
    torch.testing.assert_close(out, torch.tensor([1.0, -1.5, 2.0, 2.0]))
    out = mg.ties(base, [m1, m2], [1.0, 1.0], [1.0, 1.0], normalize=False)
    torch.testing.assert_close(out, torch.tensor([1.0, -3.0, 4.0, 2.0]))
    # density 0.5 trims m1 to [0, -2, 3, 0] and m2 to [0, 0, 0, 2] (ties -1/-1/1: topk picks two of them)
    base = torch.full((4,), 10.0)
    out = mg.ties(base, [base + m1, base + torch.tensor([-1.0, -5.0, 1.0, 2.0])], [1.0, 0.5], [0.5, 0.5])
    # m2 trimmed: [0, -5, 0, 2]; weighted m1 [0, -2, 3, 0], m2 [0, -2.5, 0, 1]; elected [+, -, +, +]
    # kept sums: [0, -4.5, 3, 1], divisors [1 (none -> 1), 1.5, 1, 0.5]
    torch.testing.assert_close(out, base + torch.tensor([0.0, -3.0, 3.0, 2.0]))


def test_ties_weighted_matches_direct_formula():
    base = rand(50, seed=12)
    ms = [base + rand(50, seed=13 + i) for i in range(3)]
    ws, ds = [0.5, 1.0, 0.8], [0.3, 0.6, 1.0]
    out = mg.ties(base, ms, ws, ds, lambda_=0.9)
    deltas = []
    for m, d in zip(ms, ds):
        delta = (m - base).numpy()
        k = int(d * delta.size)
        keep = np.argsort(-np.abs(delta))[:k]
        trimmed = np.zeros_like(delta)
        trimmed[keep] = delta[keep]
        deltas.append(trimmed)
    wd = np.stack(deltas) * np.array(ws)[:, None]
    sign = np.where(wd.sum(0) >= 0, 1.0, -1.0)
    keep = np.sign(wd) == sign
    div = (np.array(ws)[:, None] * keep).sum(0)
    div[div == 0] = 1
    ref = base.numpy() + 0.9 * (wd * keep).sum(0) / div
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)


# -- merge config -----------------------------------------------------------------------------------
def write(tmp_path, text):
    p = tmp_path / "m.yaml"
    p.write_text(text)
    return p


def test_config_yaml_valid(tmp_path):
    cfg = mg.load_merge_config(write(tmp_path, """
merge_method: ties
base_model: base
models:
  - model: a
    parameters: {weight: 1.0, density: 0.5}
  - model: b
parameters: {lambda: 0.8, density: 0.7}
dtype: bfloat16
"""))
    assert [e.model for e in cfg.parents()] == ["base", "a", "b"]
    assert cfg.density(cfg.models[0]) == 0.5 and cfg.density(cfg.models[1]) == 0.7
    assert cfg.parameters.lambda_ == 0.8 and cfg.normalize() is True
    cfg = mg.load_merge_config(write(tmp_path, "merge_method: task-arithmetic\nbase_model: x\nmodels: [x, y]\n"))
    assert cfg.merge_method == "task_arithmetic" and cfg.normalize() is False
    assert [e.model for e in cfg.parents()] == ["x", "y"]


@pytest.mark.parametrize("text,match", [
    ("merge_method: linear\nmodels: [a, b]\nmerge_kit: 1\n", r"merge_kit: Extra inputs are not permitted"),
    ("merge_method: linear\nmodels:\n  - model: a\n    parameters: {wieght: 1}\n  - b\n", r"models\.0\.parameters\.wieght"),
    ("merge_method: slerp\nmodels: [a, b]\n", "slerp needs parameters.t"),
    ("merge_method: slerp\nmodels: [a, b, c]\nparameters: {t: 0.5}\n", "exactly two models"),
    ("merge_method: ties\nmodels: [a, b]\n", "needs base_model"),
    ("merge_method: linear\nmodels: [a, b]\nparameters: {density: 0.5}\n", "density is for ties only"),
    ("merge_method: ties\nbase_model: a\nmodels:\n  - model: b\n    parameters: {density: 1.5}\n", "less than or equal to 1"),
    ("merge_method: dare\nmodels: [a, b]\n", r"merge_method: Input should be 'linear'"),
    ("merge_method: linear\nmodels: [a]\n", "at least two models"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_config_yaml_errors(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        mg.load_merge_config(write(tmp_path, text))


# -- chunking ----------------------------------------------------------------------------------------
def test_chunks_never_cross_tensors_and_round_trip():
    from safetensors.torch import save_file

    from compress.checkpoint import Checkpoint

    tensors = {"a.weight": rand(3, 7, seed=1), "a.norm.weight": rand(7, seed=2), "b.weight": rand(5, 4, seed=3),
               "b.bias": rand(5, seed=4), "c.weight": rand(2, 16, seed=5)}
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_file(tensors, f"{d}/model.safetensors")
        layout = ls.ChunkLayout(Checkpoint.open(d), chunk_size=8)
    assert [s.name for s in layout.spans] == ["a.weight", "b.weight", "c.weight"]  # norms and biases carried
    assert set(layout.carried) == {"a.norm.weight", "b.bias"}
    assert [(s.start, s.count) for s in layout.spans] == [(0, 3), (3, 3), (6, 4)]  # 21 -> 3, 20 -> 3, 32 -> 4
    assert layout.total == 10
    for name in ("a.weight", "b.weight", "c.weight"):
        w = tensors[name]
        chunks = ls.chunk_tensor(w, 8, 0.025)
        assert chunks.shape == (ls.n_chunks(w.numel(), 8), 8)
        flat = chunks.reshape(-1)
        torch.testing.assert_close(flat[: w.numel()], w.reshape(-1) / 0.025)
        assert torch.all(flat[w.numel():] == 0)  # per-tensor zero padding, nothing from the next tensor
        torch.testing.assert_close(ls.unchunk_tensor(chunks, tuple(w.shape), 0.025), w)


def test_encodable():
    assert ls.encodable("model.layers.0.mlp.up_proj.weight", (64, 32), "BF16")
    assert not ls.encodable("model.layers.0.input_layernorm.weight", (32,), "BF16")
    assert not ls.encodable("model.layers.0.q_proj.bias", (32, 1), "F32")
    assert not ls.encodable("position_ids", (1, 64), "I64")


# -- VAE loss pieces -------------------------------------------------------------------------------
def test_mmd_and_kl():
    z = rand(64, 8, seed=1)
    assert abs(float(ls.mmd_rbf(z, z))) < 1e-6
    assert float(ls.mmd_rbf(z + 3.0, rand(64, 8, seed=2))) > 0.3 > float(ls.mmd_rbf(z, rand(64, 8, seed=2)))
    # kernel by hand on two points
    a, b = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    k = math.exp(-2.0 / 2.0)
    assert float(ls.mmd_rbf(a, b)) == pytest.approx(2 - 2 * k, rel=1e-5)
    assert float(ls.kl_standard_normal(torch.zeros(3, 4), torch.zeros(3, 4))) == 0.0
    mu, lv = torch.full((2,), 1.0), torch.full((2,), math.log(2.0))
    assert float(ls.kl_standard_normal(mu, lv)) == pytest.approx(-0.5 * (1 + math.log(2.0) - 1 - 2.0))


def test_vae_loss_is_the_weighted_sum():
    cfg = ls.VAEConfig(chunk_size=64, tokens=4, width=16, layers=1, heads=2, code_dim=4)
    tc = ls.VAETrainConfig()
    x, x_hat = rand(3, 64, seed=1), rand(3, 64, seed=2)
    mu, lv, z = rand(3, 4, 16, seed=3), rand(3, 4, 16, seed=4) * 0.1, rand(3, 4, 16, seed=5)
    parts = ls.vae_loss(x, x_hat, mu, lv, z, tc, generator=torch.Generator().manual_seed(0))
    assert float(parts["huber"]) == pytest.approx(float(torch.nn.functional.huber_loss(x_hat, x)))
    assert float(parts["kl"]) == pytest.approx(float(ls.kl_standard_normal(mu, lv)))
    total = 1000 * parts["huber"] + 10 * parts["mmd"] + 1e-4 * parts["kl"]
    assert float(parts["loss"]) == pytest.approx(float(total), rel=1e-6)
    assert cfg.token_dim == 16 and cfg.latent == 16


def test_vae_shapes_and_save_load(tmp_path):
    cfg = ls.VAEConfig(chunk_size=96, tokens=4, width=16, layers=1, heads=2, code_dim=3)
    model = ls.build_vae(cfg).eval()
    x = rand(5, 96)
    mu, lv = model.encode(x)
    assert mu.shape == (5, 4, 24) and lv.shape == (5, 4, 24)
    assert model.decode(mu).shape == (5, 96)
    assert model.to_code(mu).shape == (5, 4, 3)
    ls.save_vae(model, cfg, tmp_path / "vae", overwrite=False, info={})
    loaded, cfg2, doc = ls.load_vae(tmp_path / "vae")
    assert cfg2 == cfg and doc["format"] == "lsmerge-vae"
    torch.testing.assert_close(loaded.decode(mu), model.decode(mu))
    (tmp_path / "vae" / "vae_config.json").write_text('{"format": "lsmerge-vae", "format_version": 99, "vae": {}}')
    with pytest.raises(FormatError, match="newer"):
        ls.load_vae(tmp_path / "vae")
    with pytest.raises(ConfigError, match="no such folder"):
        ls.load_vae(tmp_path / "nope")
    with pytest.raises(ValueError, match="not a multiple of tokens"):
        ls.VAEConfig(chunk_size=100, tokens=16)


# -- alignment -------------------------------------------------------------------------------------
def test_alignments_and_projection():
    assert ls.depth_alignment(3, 5) == {0: 0, 1: 2, 2: 4}
    cost = np.array([[5.0, 0.0, 9.0, 9.0], [9.0, 9.0, 9.0, 0.0], [0.0, 9.0, 9.0, 9.0]])
    assert ls.ot_alignment(cost) == {0: 1, 1: 3, 2: 0}
    # more target layers than source layers: each target layer still gets one
    m = ls.ot_alignment(np.array([[0.0, 1.0], [1.0, 0.0], [0.0, 2.0]]))
    assert m == {0: 0, 1: 1, 2: 0}
    w = rand(6, 4)
    assert ls.project(w, (6, 4)) is w
    p = ls.project(w, (11, 7))
    assert p.shape == (11, 7)
    torch.testing.assert_close(p[0, 0], w[0, 0])
    torch.testing.assert_close(p[-1, -1], w[-1, -1])
    assert ls.split_layer("model.layers.12.mlp.up_proj.weight") == ("model.layers.", 12, ".mlp.up_proj.weight")
    assert ls.split_layer("model.embed_tokens.weight") is None
