"""Latent-space model merging (LS-Merge, ICLR 2026, OpenReview VSDV0SWwOC; reference code sorobedio/ls-merge).

A transformer VAE learns the weights of one model family, cut into chunks; two parents are
merged by interpolating their chunk latents and decoding.

* **Chunking** (:func:`chunk_tensor`, :class:`ChunkLayout`): every float tensor with two or more
  dimensions is flattened, divided by ``scale`` (0.025), zero-padded *per tensor* to a multiple
  of ``chunk_size`` (10240) and cut into chunks, so no chunk crosses a tensor boundary. 1-d
  tensors (norms, biases) never enter the VAE; they are carried over (interpolated directly in
  a merge, copied in a reconstruction).
* **VAE** (:class:`WeightVAE`): a chunk is ``tokens`` tokens of ``chunk_size / tokens`` values
  (16 x 640). Encoder: Linear(token -> width) + learned positions, pre-norm transformer blocks,
  Linear(width -> 2 x latent) giving per-token mean and log-variance. Decoder: the mirror image.
  Loss (:func:`vae_loss`): ``1000 * Huber + 0.1 * 100 * MMD(z, N(0, I)) + 1e-4 * KL``.
* **Two-stage curriculum** (:func:`train_vae`): stage 1 trains the full-capacity latent (latent
  width = token width, so a chunk's latent has as many numbers as the chunk); stage 2 freezes
  encoder and decoder and trains a neck (per-token Linear(latent -> code_dim) and back) to a
  compact code, with the same reconstruction loss through the frozen decoder.
* **Latent merge** (:func:`latent_merge`): ``z = (1 - t) z_A + t T(z_B)`` decoded into the
  target's shapes; same architecture: chunks matched by position. Different depth: layers are
  paired by an assignment on chunk latents (``scipy.optimize.linear_sum_assignment``, the
  discrete optimal transport between equal-mass layer sets) or by relative depth; different
  width: the other parent's tensor is resampled to the target's shape (bilinear) before encoding,
  so its chunks line up with the target's. ``corrected`` adds back the interpolated
  reconstruction residuals: ``lerp(W_A, W_B) + Dec(z_t) - lerp(Dec(z_A), Dec(z_B))``, which is
  exact at t = 0 and t = 1 whatever the VAE's reconstruction error.

See docs/formats/lsmerge-vae.md for the VAE file layout and the alignment design.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compress.errors import ConfigError, FormatError

VAE_FORMAT = "lsmerge-vae"
VAE_FORMAT_VERSION = 1
VAE_CONFIG_NAME = "vae_config.json"
LAYER_RE = re.compile(r"^(?P<pre>.*\.layers\.)(?P<idx>\d+)(?P<post>\..+)$")


class VAEConfig(BaseModel):
    """Shape of the weight VAE.

    ``chunk_size`` values per chunk, ``tokens`` tokens per chunk (token width
    ``chunk_size // tokens``), transformer ``width``, ``layers`` encoder blocks and as many
    decoder blocks, ``heads`` attention heads, ``latent_dim`` per token (default: the token
    width: the full-capacity latent), ``code_dim`` per token of the stage-2 compact code,
    ``scale``: weights are divided by it before chunking (LS-Merge: 0.025).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    chunk_size: int = Field(10240, ge=16)
    tokens: int = Field(16, ge=1)
    width: int = Field(768, ge=8)
    layers: int = Field(4, ge=1, le=64)
    heads: int = Field(4, ge=1)
    latent_dim: Optional[int] = Field(None, ge=1)
    code_dim: int = Field(64, ge=1)
    scale: float = Field(0.025, gt=0)

    @model_validator(mode="after")
    def _shapes(self) -> "VAEConfig":
        if self.chunk_size % self.tokens:
            raise ValueError(f"chunk_size {self.chunk_size} is not a multiple of tokens {self.tokens}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")
        return self

    @property
    def token_dim(self) -> int:
        return self.chunk_size // self.tokens

    @property
    def latent(self) -> int:
        return self.latent_dim or self.token_dim


class VAETrainConfig(BaseModel):
    """Training of the weight VAE: ``steps`` (stage 1) and ``neck_steps`` (stage 2) AdamW steps
    of ``batch_size`` chunks at ``lr`` (cosine decay); ``max_chunks`` chunks sampled per model
    (None: all); loss weights as in LS-Merge."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    steps: int = Field(2000, ge=1)
    neck_steps: int = Field(500, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-4, gt=0)
    max_chunks: Optional[int] = Field(None, ge=1)
    seed: int = 0
    huber_weight: float = 1000.0
    mmd_weight: float = 0.1 * 100.0
    kl_weight: float = 1e-4
    huber_delta: float = Field(1.0, gt=0)


class LatentMergeConfig(BaseModel):
    """A latent merge: ``t`` (0 = A, 1 = B), ``target`` (whose architecture the output has),
    ``corrected`` (add back interpolated residuals), ``align`` (``ot`` or ``depth``, for
    different depths), ``space`` (``full`` latent or ``compact`` code), chunks per pass, output dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    t: float = 0.5
    target: Literal["A", "B"] = "A"
    corrected: bool = False
    align: Literal["ot", "depth"] = "ot"
    space: Literal["full", "compact"] = "full"
    batch_size: int = Field(256, ge=1)
    dtype: Optional[str] = None
    align_chunks: int = Field(8, ge=1)


# -- chunking ----------------------------------------------------------------------------------
def encodable(name: str, shape: tuple[int, ...], dtype: str) -> bool:
    """True for tensors the VAE encodes: float, two or more dimensions (norms and biases are 1-d and carried over)."""
    return dtype in ("F32", "F16", "BF16", "F64") and len(shape) >= 2 and not name.endswith(".bias")


def n_chunks(numel: int, chunk_size: int) -> int:
    """Chunks of one tensor (its own zero padding at the end)."""
    return -(-numel // chunk_size)


def chunk_tensor(tensor, chunk_size: int, scale: float):
    """Cut one tensor into scaled, zero-padded chunks; no chunk holds values of another tensor.

    Args:
        tensor: Tensor[*shape], any float dtype.
        chunk_size: values per chunk.
        scale: divisor (LS-Merge: 0.025).

    Returns:
        Tensor[n_chunks, chunk_size], float32.
    """
    import torch.nn.functional as F

    flat = tensor.reshape(-1).float() / scale                                          # [numel]
    pad = n_chunks(flat.numel(), chunk_size) * chunk_size - flat.numel()
    return F.pad(flat, (0, pad)).view(-1, chunk_size)                                  # [n, chunk]


def unchunk_tensor(chunks, shape: tuple[int, ...], scale: float):
    """Inverse of :func:`chunk_tensor`: drop the padding, multiply by ``scale``, reshape.

    Args:
        chunks: Tensor[n_chunks, chunk_size], float32.

    Returns:
        Tensor[*shape], float32.
    """
    numel = math.prod(shape)
    return (chunks.reshape(-1)[:numel] * scale).view(shape)


@dataclass(frozen=True)
class ChunkSpan:
    """Where one tensor's chunks sit in a model's chunk sequence."""

    name: str
    shape: tuple[int, ...]
    start: int
    count: int


class ChunkLayout:
    """The layer-aware chunk layout of a checkpoint: encodable tensors in stored order.

    Attributes:
        spans: one :class:`ChunkSpan` per encodable tensor.
        carried: names of tensors kept out of the VAE (norms, biases, non-float).
        total: chunks in all.
    """

    def __init__(self, ckpt, chunk_size: int):
        self.spans: list[ChunkSpan] = []
        self.carried: list[str] = []
        start = 0
        for name in ckpt.names():
            info = ckpt.tensors[name]
            if encodable(name, info.shape, info.dtype):
                count = n_chunks(info.numel, chunk_size)
                self.spans.append(ChunkSpan(name, tuple(info.shape), start, count))
                start += count
            else:
                self.carried.append(name)
        self.total = start


# -- the VAE --------------------------------------------------------------------------------
def _build_vae_class():
    import torch
    from torch import nn

    class WeightVAE(nn.Module):
        """Transformer VAE over weight chunks (LS-Merge).

        Args:
            cfg: :class:`VAEConfig`.
        """

        def __init__(self, cfg: VAEConfig):
            super().__init__()
            self.cfg = cfg
            T, d, W, L = cfg.tokens, cfg.token_dim, cfg.width, cfg.latent

            def blocks():
                layer = nn.TransformerEncoderLayer(W, cfg.heads, 4 * W, dropout=0.0, activation="gelu",
                                                   batch_first=True, norm_first=True)
                return nn.TransformerEncoder(layer, cfg.layers, norm=nn.LayerNorm(W), enable_nested_tensor=False)

            self.enc_in = nn.Linear(d, W)
            self.enc_pos = nn.Parameter(torch.zeros(T, W))
            self.encoder = blocks()
            self.enc_out = nn.Linear(W, 2 * L)
            self.dec_in = nn.Linear(L, W)
            self.dec_pos = nn.Parameter(torch.zeros(T, W))
            self.decoder = blocks()
            self.dec_out = nn.Linear(W, d)
            self.neck_down = nn.Linear(L, cfg.code_dim)
            self.neck_up = nn.Linear(cfg.code_dim, L)

        def encode(self, x):
            """x (Tensor[B, chunk_size], float32, scaled) -> (mu, logvar), each Tensor[B, tokens, latent]."""
            B = x.shape[0]
            h = self.enc_in(x.view(B, self.cfg.tokens, self.cfg.token_dim)) + self.enc_pos   # [B, T, W]
            h = self.encoder(h)                                                                # [B, T, W]
            mu, logvar = self.enc_out(h).chunk(2, dim=-1)                                      # 2 x [B, T, L]
            return mu, logvar.clamp(-30.0, 20.0)

        def decode(self, z):
            """z (Tensor[B, tokens, latent], float32) -> Tensor[B, chunk_size] (scaled weights)."""
            h = self.dec_in(z) + self.dec_pos                                                  # [B, T, W]
            h = self.decoder(h)                                                                # [B, T, W]
            return self.dec_out(h).reshape(z.shape[0], -1)                                     # [B, chunk]

        def to_code(self, z):
            """Full latent (Tensor[B, T, L]) -> compact code (Tensor[B, T, code_dim])."""
            return self.neck_down(z)

        def from_code(self, c):
            """Compact code (Tensor[B, T, code_dim]) -> full latent (Tensor[B, T, L])."""
            return self.neck_up(c)

        def forward(self, x, stage: int = 1):
            mu, logvar = self.encode(x)
            z = mu + torch.randn_like(mu) * (0.5 * logvar).exp() if self.training else mu      # [B, T, L]
            if stage == 2:
                z = self.from_code(self.to_code(z))
            return self.decode(z), mu, logvar, z

    return WeightVAE


_VAE_CLASS = None


def build_vae(cfg: VAEConfig):
    """A fresh :class:`WeightVAE` for ``cfg`` (the class is built lazily so importing this module needs no torch)."""
    global _VAE_CLASS
    if _VAE_CLASS is None:
        _VAE_CLASS = _build_vae_class()
    return _VAE_CLASS(cfg)


def mmd_rbf(z, prior, bandwidth: Optional[float] = None):
    """Maximum mean discrepancy (biased V-statistic) between two samples, Gaussian kernel.

    ``k(a, b) = exp(-|a - b|^2 / bandwidth)``, bandwidth defaulting to the dimension (InfoVAE).

    Args:
        z: Tensor[n, D], float32. prior: Tensor[m, D], float32.

    Returns:
        Tensor[], float32 (>= 0 up to rounding; 0 for identical samples).
    """
    import torch

    bw = float(bandwidth or z.shape[1])

    def k(a, b):
        return torch.exp(-torch.cdist(a, b).pow(2) / bw)                                      # [n, m]

    return k(z, z).mean() + k(prior, prior).mean() - 2 * k(z, prior).mean()


def kl_standard_normal(mu, logvar):
    """Mean over elements of KL(N(mu, exp(logvar)) || N(0, 1)). mu, logvar: Tensor[...], float32."""
    return -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).mean()


def vae_loss(x, x_hat, mu, logvar, z, train: VAETrainConfig, mmd_samples: int = 512, generator=None) -> dict[str, Any]:
    """LS-Merge loss: ``huber_weight * Huber(x_hat, x) + mmd_weight * MMD(z, N(0, I)) + kl_weight * KL``.

    Args:
        x, x_hat: Tensor[B, chunk_size], float32 (scaled weights and their reconstruction).
        mu, logvar, z: Tensor[B, tokens, latent], float32.
        mmd_samples: latent tokens (rows of z) used for the MMD estimate.

    Returns:
        ``{"loss", "huber", "mmd", "kl"}`` (scalar tensors; ``loss`` carries the gradient).
    """
    import torch
    import torch.nn.functional as F

    huber = F.huber_loss(x_hat, x, delta=train.huber_delta)
    flat = z.reshape(-1, z.shape[-1])                                                         # [B*T, L]
    if flat.shape[0] > mmd_samples:
        flat = flat[torch.randperm(flat.shape[0], generator=generator, device="cpu")[:mmd_samples].to(flat.device)]
    prior = torch.randn(flat.shape, generator=generator, device="cpu").to(flat.device)         # [n, L]
    mmd = mmd_rbf(flat, prior)
    kl = kl_standard_normal(mu, logvar)
    loss = train.huber_weight * huber + train.mmd_weight * mmd + train.kl_weight * kl
    return {"loss": loss, "huber": huber, "mmd": mmd, "kl": kl}


# -- saving and loading ------------------------------------------------------------------------------
def save_vae(model, vae_cfg: VAEConfig, output_dir, *, overwrite: bool, info: dict[str, Any]) -> Path:
    """Write the VAE atomically: ``model.safetensors`` (float32 state dict) + ``vae_config.json``.

    Raises:
        ConfigError: the output exists (without ``overwrite``).
    """
    from compress.checkpoint import CheckpointWriter
    from compress.transforms.merge import to_array

    meta = {"compress.vae": VAE_FORMAT, "compress.vae_version": str(VAE_FORMAT_VERSION)}
    with CheckpointWriter(output_dir, overwrite=overwrite, shard_metadata=meta) as writer:
        for name, tensor in model.state_dict().items():
            writer.add({name: ("F32", tuple(tensor.shape), to_array(tensor, "F32"))})
        doc = {"format": VAE_FORMAT, "format_version": VAE_FORMAT_VERSION, "vae": vae_cfg.model_dump(), **info}
        writer.write_text(VAE_CONFIG_NAME, json.dumps(doc, indent=2) + "\n")
        return writer.commit()


def load_vae(vae_dir):
    """Load a VAE written by :func:`save_vae`.

    Returns:
        ``(model, VAEConfig, config_json)``; the model is in eval mode on the CPU.

    Raises:
        ConfigError: the folder does not exist.
        FormatError: missing/invalid config, unknown version, or tensors that do not fit the config.
    """
    from compress.checkpoint import Checkpoint

    path = Path(vae_dir)
    cfg_path = path / VAE_CONFIG_NAME
    if not path.is_dir():
        raise ConfigError(f"--vae {path}: no such folder (train one with `compress merge train-vae`)")
    if not cfg_path.exists():
        raise FormatError(f"{path}: no {VAE_CONFIG_NAME}; not a VAE from `compress merge train-vae`")
    try:
        doc = json.loads(cfg_path.read_text())
        if doc.get("format") != VAE_FORMAT:
            raise FormatError(f"{cfg_path}: format {doc.get('format')!r} is not {VAE_FORMAT!r}")
        if int(doc.get("format_version", 0)) > VAE_FORMAT_VERSION:
            raise FormatError(f"{cfg_path}: VAE format version {doc['format_version']} is newer than this compress "
                              f"supports ({VAE_FORMAT_VERSION}); upgrade compress")
        cfg = VAEConfig(**doc["vae"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{cfg_path}: invalid VAE config ({str(e).splitlines()[0]})") from None
    model = build_vae(cfg)
    with Checkpoint.open(path) as ck:
        state = {n: ck.get(n).float() for n in ck.names()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise FormatError(f"{path}: VAE tensors do not fit {VAE_CONFIG_NAME} ({str(e).splitlines()[0][:200]})") from None
    model.eval()
    return model, cfg, doc


# -- training -------------------------------------------------------------------------------------
class VAETrainResult(BaseModel):
    """What ``train-vae`` did. Losses are the mean of the last 10% of each stage's steps;
    relative errors are ``|Dec(Enc(x)) - x| / |x|`` over held-in sample chunks (full latent /
    compact code)."""

    output: str
    models: list[str]
    parameters: int
    train_chunks: int
    total_chunks: int
    steps: int
    neck_steps: int
    stage1_loss: float
    stage2_loss: float
    stage1_huber: float
    relative_error: float
    relative_error_compact: float
    seconds: float
    peak_rss_bytes: int
    device: str


def sample_chunks(ckpts: list, cfg: VAEConfig, max_chunks: Optional[int], seed: int):
    """The training pool: up to ``max_chunks`` chunks per model, sampled uniformly, read tensor by tensor.

    Returns:
        Tensor[N, chunk_size], float32 (scaled), and the total number of chunks available.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    pool, total = [], 0
    for ck in ckpts:
        layout = ChunkLayout(ck, cfg.chunk_size)
        total += layout.total
        keep = None
        if max_chunks is not None and max_chunks < layout.total:
            keep = torch.zeros(layout.total, dtype=torch.bool)
            keep[torch.randperm(layout.total, generator=g)[:max_chunks]] = True
        for span in layout.spans:
            chunks = chunk_tensor(ck.get(span.name), cfg.chunk_size, cfg.scale)                # [n, chunk]
            if keep is not None:
                chunks = chunks[keep[span.start: span.start + span.count]]
            if chunks.shape[0]:
                pool.append(chunks.clone())
    if not pool:
        raise ConfigError("no tensor with two or more dimensions to train the VAE on")
    return torch.cat(pool), total


def train_vae(models: list[str], output_dir, vae_cfg: VAEConfig, train: VAETrainConfig, *, overwrite: bool = False,
              log: bool = False) -> VAETrainResult:
    """Train the LS-Merge weight VAE on the parents' weights (two stages) and save it.

    Runs through ``accelerate`` (``Accelerator``), so the same call uses a GPU or several
    processes under ``accelerate launch``. Stage 1 trains encoder and decoder with the full
    loss; stage 2 freezes them and trains the compact-code neck with the same loss through the
    frozen decoder (plus the latent it reconstructs, MSE).

    Args:
        models: checkpoints of one family (unquantized).
        output_dir: VAE folder to create.

    Returns:
        :class:`VAETrainResult`.

    Raises:
        ConfigError: output exists, no models, or bad parents; UnsupportedError: quantized parents.
    """
    import torch
    from accelerate import Accelerator

    from compress.transforms.merge import open_parents, peak_rss

    if not models:
        raise ConfigError("train-vae needs at least one model")
    out = Path(output_dir)
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} already exists; pass --overwrite to replace it")
    start = time.perf_counter()
    torch.manual_seed(train.seed)
    ckpts, _ = open_parents(list(dict.fromkeys(models)))
    resolved = out.resolve()
    for c in ckpts:  # refuse before training, not after: an output inside (or equal to) a parent
        src = Path(c.path).resolve()
        if resolved == src or src in resolved.parents or (overwrite and resolved in src.parents):
            for c2 in ckpts:
                c2.close()
            raise ConfigError(f"output {resolved} is, holds or is inside the parent {c.source}; choose another --output-dir")
    try:
        pool, total = sample_chunks(ckpts, vae_cfg, train.max_chunks, train.seed)            # [N, chunk]
    finally:
        for c in ckpts:
            c.close()
    acc = Accelerator()
    model = build_vae(vae_cfg)
    g = torch.Generator().manual_seed(train.seed + 1)

    def batches(n_steps):
        for _ in range(n_steps):
            yield pool[torch.randint(0, pool.shape[0], (train.batch_size,), generator=g)].to(acc.device)

    def run_stage(stage: int, n_steps: int, params) -> tuple[float, float]:
        if n_steps == 0:
            return float("nan"), float("nan")
        opt = torch.optim.AdamW(params, lr=train.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / n_steps)))
        m, opt_, sched_ = acc.prepare(model, opt, sched)
        m.train()
        tail, tail_huber = [], []
        for step, x in enumerate(batches(n_steps)):
            x_hat, mu, logvar, z = m(x, stage=stage)
            parts = vae_loss(x, x_hat, mu, logvar, z, train, generator=g)
            loss = parts["loss"]
            if stage == 2:  # the neck also learns to give back the latent it was handed
                loss = loss + (z - mu.detach()).pow(2).mean()
            opt_.zero_grad(set_to_none=True)
            acc.backward(loss)
            acc.clip_grad_norm_(params, 1.0)
            opt_.step()
            sched_.step()
            if step >= min(n_steps - 1, int(n_steps * 0.9)):
                tail.append(float(loss.detach()))
                tail_huber.append(float(parts["huber"].detach()))
            if log and acc.is_main_process and (step % max(1, n_steps // 10) == 0 or step == n_steps - 1):
                print(f"stage {stage} step {step + 1}/{n_steps}: loss {float(loss.detach()):.4f} "
                          f"huber {float(parts['huber'].detach()):.5f} mmd {float(parts['mmd'].detach()):.4f} "
                          f"kl {float(parts['kl'].detach()):.3f}", file=sys.stderr, flush=True)
        return sum(tail) / len(tail), sum(tail_huber) / len(tail_huber)

    core = [p for n, p in model.named_parameters() if not n.startswith("neck_")]
    loss1, huber1 = run_stage(1, train.steps, core)
    for p in core:
        p.requires_grad_(False)
    neck = [p for n, p in model.named_parameters() if n.startswith("neck_")]
    loss2, _ = run_stage(2, train.neck_steps, neck)
    for p in core:
        p.requires_grad_(True)
    model = acc.unwrap_model(model).cpu().eval()
    sample = pool[torch.randperm(pool.shape[0], generator=g)[: min(512, pool.shape[0])]]       # [S, chunk]
    with torch.no_grad():
        mu, _ = model.encode(sample)
        rel = float((model.decode(mu) - sample).norm() / sample.norm())
        rel_c = float((model.decode(model.from_code(model.to_code(mu))) - sample).norm() / sample.norm())
    n_params = sum(p.numel() for p in model.parameters())
    info = {"trained_on": list(models), "train": train.model_dump(), "train_chunks": int(pool.shape[0]),
            "stage1_loss": loss1, "stage2_loss": loss2, "relative_error": rel, "relative_error_compact": rel_c}
    if acc.is_main_process:
        save_vae(model, vae_cfg, out, overwrite=overwrite, info=info)
    return VAETrainResult(output=str(out), models=list(models), parameters=n_params, train_chunks=int(pool.shape[0]),
                          total_chunks=total, steps=train.steps, neck_steps=train.neck_steps, stage1_loss=loss1,
                          stage2_loss=loss2, stage1_huber=huber1, relative_error=rel, relative_error_compact=rel_c,
                          seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss(), device=str(acc.device))


# -- encoding, decoding ---------------------------------------------------------------------------------
class Codec:
    """Encode/decode whole tensors with a trained VAE, in batches of chunks, without gradients.

    Args:
        model: the :class:`WeightVAE`. cfg: its :class:`VAEConfig`.
        space: ``full`` (latent Tensor[n, T, L]) or ``compact`` (code Tensor[n, T, code_dim]).
        batch_size: chunks per pass.
    """

    def __init__(self, model, cfg: VAEConfig, space: str = "full", batch_size: int = 256):
        self.model, self.cfg, self.space, self.batch_size = model, cfg, space, batch_size

    def encode(self, tensor):
        """Tensor[*shape] -> latents Tensor[n_chunks, T, L or code_dim], float32 (the posterior mean)."""
        import torch

        chunks = chunk_tensor(tensor, self.cfg.chunk_size, self.cfg.scale)                   # [n, chunk]
        out = []
        with torch.no_grad():
            for i in range(0, chunks.shape[0], self.batch_size):
                mu, _ = self.model.encode(chunks[i: i + self.batch_size])                    # [b, T, L]
                out.append(self.model.to_code(mu) if self.space == "compact" else mu)
        return torch.cat(out)

    def decode(self, z, shape: tuple[int, ...]):
        """Latents Tensor[n_chunks, T, *] -> Tensor[*shape], float32."""
        import torch

        out = []
        with torch.no_grad():
            for i in range(0, z.shape[0], self.batch_size):
                zb = z[i: i + self.batch_size]
                out.append(self.model.decode(self.model.from_code(zb) if self.space == "compact" else zb))
        return unchunk_tensor(torch.cat(out), shape, self.cfg.scale)


def relative_error(x, y) -> float:
    """``|x - y| / |x|`` over all elements (float64 accumulation)."""
    return float((x.double() - y.double()).norm() / x.double().norm().clamp_min(1e-30))


class ReconstructResult(BaseModel):
    """A model decoded from its own latents: per-tensor relative errors ``|Dec(Enc(W)) - W| / |W|``."""

    output: str
    tensor_errors: dict[str, float]
    mean_error: float
    max_error: float
    seconds: float


def reconstruct(model_path: str, vae_dir, output_dir, *, space: str = "full", batch_size: int = 256,
                overwrite: bool = False) -> ReconstructResult:
    """Write ``Dec(Enc(W))`` for every encodable tensor of a model (others copied): the VAE's own
    reconstruction, no merge. The output is a plain HF checkpoint.

    Raises:
        ConfigError, FormatError, UnsupportedError: see :func:`load_vae` and :func:`compress.transforms.merge.open_parents`.
    """
    from compress.checkpoint import CheckpointWriter
    from compress.transforms.merge import model_card, open_parents, to_array, write_output

    start = time.perf_counter()
    vae, cfg, _ = load_vae(vae_dir)
    codec = Codec(vae, cfg, space, batch_size)
    (ck,), _ = open_parents([model_path])
    errors: dict[str, float] = {}
    try:
        with CheckpointWriter(output_dir, overwrite=overwrite, inputs=(ck.path,)) as writer:
            for name in ck.names():
                info = ck.tensors[name]
                if encodable(name, info.shape, info.dtype):
                    w = ck.get(name).float()
                    rec = codec.decode(codec.encode(w), info.shape)
                    errors[name] = relative_error(w, rec)
                    writer.add({name: (info.dtype, info.shape, to_array(rec, info.dtype))})
                else:
                    dt, bits = ck.read_array(name)
                    writer.add({name: (dt, info.shape, bits)})
            write_output(writer, ck, model_card("vae-reconstruction", [model_path], None, {"vae": str(vae_dir), "space": space}))
            out = writer.commit()
    finally:
        ck.close()
    vals = list(errors.values())
    return ReconstructResult(output=str(out), tensor_errors=errors, mean_error=sum(vals) / max(1, len(vals)),
                             max_error=max(vals, default=0.0), seconds=time.perf_counter() - start)


# -- latent merge --------------------------------------------------------------------------------------
class LatentMergeResult(BaseModel):
    """What ``merge latent`` wrote: ``layer_map`` (target layer -> the other parent's layer,
    only for different depths), tensors through the VAE and carried (interpolated directly),
    chunks encoded per parent."""

    output: str
    t: float
    target: str
    corrected: bool
    space: str
    align: str
    layer_map: dict[int, int]
    encoded_tensors: int
    carried_tensors: int
    chunks: int
    seconds: float
    peak_rss_bytes: int
    notes: list[str]


def split_layer(name: str) -> Optional[tuple[str, int, str]]:
    """``model.layers.3.mlp.up_proj.weight`` -> (``model.layers.``, 3, ``.mlp.up_proj.weight``); None outside layers."""
    m = LAYER_RE.match(name)
    return (m["pre"], int(m["idx"]), m["post"]) if m else None


def layer_count(ckpt) -> int:
    idx = [p[1] for p in (split_layer(n) for n in ckpt.names()) if p]
    return max(idx) + 1 if idx else 0


def depth_alignment(n_target: int, n_other: int) -> dict[int, int]:
    """Pair target layer j with the other parent's layer at the same relative depth: round(j (n_o - 1) / (n_t - 1))."""
    if n_target == 1:
        return {0: 0}
    return {j: int(round(j * (n_other - 1) / (n_target - 1))) for j in range(n_target)}


def ot_alignment(cost) -> dict[int, int]:
    """Pair target layers (rows) with the other parent's layers (columns) by minimum-cost assignment.

    With uniform masses on both layer sets, discrete optimal transport between them reduces to
    this assignment (``scipy.optimize.linear_sum_assignment``). When the target has more layers
    than the other parent, the other's layers are repeated ``ceil(n_t / n_o)`` times so every
    target layer is paired (a layer may then be used more than once).

    Args:
        cost: ndarray[n_target, n_other], float64.

    Returns:
        target layer -> other layer.
    """
    import numpy as np

    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        from compress.errors import UnsupportedError

        raise UnsupportedError("--align ot needs scipy (pip install scipy), or use --align depth") from None
    n_t, n_o = cost.shape
    reps = -(-n_t // n_o)
    tiled = np.tile(cost, (1, reps))                                                         # [n_t, n_o * reps]
    rows, cols = linear_sum_assignment(tiled)
    return {int(r): int(c) % n_o for r, c in zip(rows, cols)}


def project(tensor, shape: tuple[int, ...]):
    """Resample a tensor to ``shape`` (width mismatch): bilinear over the last two dims for
    matrices, linear for vectors; identity when the shapes already agree.

    Args:
        tensor: Tensor[*src_shape], float32. shape: target shape with the same number of dims.

    Returns:
        Tensor[*shape], float32.
    """
    import torch.nn.functional as F

    if tuple(tensor.shape) == tuple(shape):
        return tensor
    if tensor.dim() != len(shape):
        raise ConfigError(f"cannot project a {tensor.dim()}-d tensor onto shape {list(shape)}")
    if tensor.dim() == 1:
        return F.interpolate(tensor.view(1, 1, -1), size=shape[0], mode="linear", align_corners=True).view(shape)
    if tensor.dim() == 2:
        return F.interpolate(tensor[None, None], size=tuple(shape), mode="bilinear", align_corners=True)[0, 0]
    raise ConfigError(f"cannot project a {tensor.dim()}-d tensor of shape {list(tensor.shape)} onto {list(shape)}")


def _pair_names(target, other, layer_map: dict[int, int]) -> dict[str, Optional[str]]:
    """Target tensor name -> the other parent's tensor it is merged with (None: no partner; copied)."""
    from compress.transforms.merge import source_name, tied

    pairs: dict[str, Optional[str]] = {}
    for name in target.names():
        parts = split_layer(name)
        if parts is not None and layer_map:
            pre, j, post = parts
            cand = f"{pre}{layer_map[j]}{post}"
            pairs[name] = cand if cand in other.tensors else None
        else:
            pairs[name] = source_name(other, name, tied(target))
    return pairs


def _alignment_cost(target, other, codec: Codec, n_t: int, n_o: int, k: int):
    """Cost[j, i]: mean squared distance between the latents of the first ``k`` chunks of every
    tensor of target layer j and other layer i (tensors projected to the target's shapes)."""
    import numpy as np
    import torch

    posts: dict[str, tuple[int, ...]] = {}
    for name in target.names():
        p = split_layer(name)
        if p and p[1] == 0 and encodable(name, target.tensors[name].shape, target.tensors[name].dtype):
            posts[p[2]] = target.tensors[name].shape
    pre = next(split_layer(n)[0] for n in target.names() if split_layer(n))
    pre_o = next(split_layer(n)[0] for n in other.names() if split_layer(n))

    def latents(ck, prefix, n_layers):
        out = []
        for i in range(n_layers):
            zs = []
            for post, shape in posts.items():
                name = f"{prefix}{i}{post}"
                if name not in ck.tensors:
                    raise ConfigError(f"{ck.source}: layer {i} lacks {post.lstrip('.')}; the parents' layers differ in structure")
                w = project(ck.get(name).float(), shape)
                head = w.reshape(-1)[: k * codec.cfg.chunk_size]
                zs.append(codec.encode(head).reshape(-1))
            out.append(torch.cat(zs))
        return torch.stack(out).double()                                                      # [n_layers, D]

    zt, zo = latents(target, pre, n_t), latents(other, pre_o, n_o)
    return (torch.cdist(zt, zo).pow(2) / zt.shape[1]).numpy().astype(np.float64)             # [n_t, n_o]


def latent_merge(model_a: str, model_b: str, vae_dir, output_dir, cfg: LatentMergeConfig, *,
                 overwrite: bool = False) -> LatentMergeResult:
    """Merge two parents in the VAE's latent space and decode into the target's architecture.

    Per target tensor W_T with partner W_O (aligned layer; resampled to W_T's shape if widths
    differ): ``z = (1 - t) z_A + t z_B`` with ``z_X = Enc(chunks(W_X))`` (posterior means),
    output ``Dec(z)``, or with ``corrected``: ``lerp(W_A, W_B) + Dec(z) - lerp(Dec(z_A), Dec(z_B))``.
    1-d tensors (norms, biases): ``lerp(W_A, W_B)``; non-float tensors and tensors without a
    partner: the target's. Config and tokenizer come from the target.

    Args:
        model_a, model_b: the parents (t = 0 is A).
        vae_dir: a VAE from :func:`train_vae`.
        output_dir: folder to create.
        cfg: :class:`LatentMergeConfig`.

    Returns:
        :class:`LatentMergeResult`.

    Raises:
        ConfigError: output exists, parents with different tokenizers or layer structure, bad VAE path.
        FormatError: a broken VAE folder. UnsupportedError: quantized parents.
    """
    return latent_merge_sweep(model_a, model_b, vae_dir, {(cfg.t, cfg.corrected): output_dir}, cfg, overwrite=overwrite)[0]


def latent_merge_sweep(model_a: str, model_b: str, vae_dir, outputs: dict[tuple[float, bool], Any], cfg: LatentMergeConfig,
                       *, overwrite: bool = False) -> list[LatentMergeResult]:
    """Several latent merges of one pair in one pass: every tensor is encoded once per parent and
    each parent's latents decoded once, whatever the number of outputs.

    Args:
        outputs: ``(t, corrected)`` -> output folder; ``cfg.t`` and ``cfg.corrected`` are ignored.

    Returns:
        One :class:`LatentMergeResult` per output, in ``outputs`` order.

    Raises:
        See :func:`latent_merge`.
    """
    import contextlib

    from compress.checkpoint import CheckpointWriter, dtype_name
    from compress.transforms.merge import model_card, open_parents, peak_rss, to_array, write_output

    start = time.perf_counter()
    for out in outputs.values():
        if Path(out).exists() and not overwrite:
            raise ConfigError(f"{out} already exists; pass --overwrite to replace it")
    if model_a == model_b:
        raise ConfigError("merge latent needs two different parents")
    out_dtype = dtype_name(cfg.dtype) if cfg.dtype else None
    if out_dtype is not None and out_dtype not in ("F32", "F16", "BF16"):
        raise ConfigError(f"--dtype {cfg.dtype}: a merge is written in float32, float16 or bfloat16")
    vae, vcfg, _ = load_vae(vae_dir)
    codec = Codec(vae, vcfg, cfg.space, cfg.batch_size)
    (ck_a, ck_b), notes = open_parents([model_a, model_b])
    try:
        target, other = (ck_a, ck_b) if cfg.target == "A" else (ck_b, ck_a)
        n_t, n_o = layer_count(target), layer_count(other)
        layer_map: dict[int, int] = {}
        if n_t != n_o:
            if n_t == 0 or n_o == 0:
                raise ConfigError("parents of different depth must both have numbered `.layers.N.` tensors")
            if cfg.align == "depth":
                layer_map = depth_alignment(n_t, n_o)
            else:
                layer_map = ot_alignment(_alignment_cost(target, other, codec, n_t, n_o, cfg.align_chunks))
            notes.append(f"depths differ ({n_t} vs {n_o} layers): layers paired by {cfg.align}")
        pairs = _pair_names(target, other, layer_map)
        encoded = carried = chunks = 0
        widths = False
        jobs = list(outputs.items())
        with contextlib.ExitStack() as stack:
            writers = [stack.enter_context(CheckpointWriter(out, overwrite=overwrite, inputs=(ck_a.path, ck_b.path)))
                       for _, out in jobs]
            for name, partner in pairs.items():
                info = target.tensors[name]
                dtype = out_dtype if (out_dtype and info.dtype in ("F32", "F16", "BF16")) else info.dtype
                if partner is None or info.dtype not in ("F32", "F16", "BF16", "F64"):
                    dt, bits = target.read_array(name)
                    for w in writers:
                        w.add({name: (dt, info.shape, bits)})
                    if partner is None:
                        notes.append(f"{name}: no partner in the other parent; copied from the target")
                    continue
                w_t = target.get(name).float()                                                   # [*shape]
                w_o = other.get(partner).float()
                if w_o.shape != w_t.shape:
                    widths = True
                    w_o = project(w_o, info.shape)                                               # [*shape]
                w_a, w_b = (w_t, w_o) if cfg.target == "A" else (w_o, w_t)
                enc = encodable(name, info.shape, info.dtype)
                if enc:
                    z_a, z_b = codec.encode(w_a), codec.encode(w_b)                              # [n, T, L]
                    ends: dict[float, Any] = {}  # Dec(z_A), Dec(z_B), decoded once when needed

                    def end(t_end):
                        if t_end not in ends:
                            ends[t_end] = codec.decode(z_a if t_end == 0.0 else z_b, info.shape)  # [*shape]
                        return ends[t_end]
                    encoded += 1
                    chunks += z_a.shape[0]
                else:
                    carried += 1
                for ((t, corrected), _), writer in zip(jobs, writers):
                    lerp = (1 - t) * w_a + t * w_b                                               # [*shape]
                    if enc:
                        if t in (0.0, 1.0):
                            merged = end(t)
                        else:
                            merged = codec.decode((1 - t) * z_a + t * z_b, info.shape)           # [*shape]
                        if corrected:
                            merged = lerp + merged - ((1 - t) * end(0.0) + t * end(1.0))
                    else:
                        merged = lerp
                    writer.add({name: (dtype, info.shape, to_array(merged, dtype))})
                    del lerp, merged
                del w_t, w_o, w_a, w_b
            if widths:
                notes.append("widths differ: the other parent's tensors were resampled (bilinear) to the target's shapes")
            paths = []
            for ((t, corrected), _), writer in zip(jobs, writers):
                details = {"method": "latent (LS-Merge)", "t": t, "target": cfg.target, "corrected": corrected,
                           "space": cfg.space, "align": cfg.align, "vae": str(vae_dir), "layer_map": layer_map}
                write_output(writer, target, model_card("latent", [model_a, model_b], None, details))
                paths.append(writer.commit())
    finally:
        ck_a.close()
        ck_b.close()
    seconds = time.perf_counter() - start
    return [LatentMergeResult(output=str(path), t=t, target=cfg.target, corrected=corrected, space=cfg.space,
                              align=cfg.align, layer_map=layer_map, encoded_tensors=encoded, carried_tensors=carried,
                              chunks=chunks, seconds=seconds, peak_rss_bytes=peak_rss(), notes=notes)
            for ((t, corrected), _), path in zip(jobs, paths)]


def layerwise_merge(model_a: str, model_b: str, output_dir, *, t: float = 0.5, target: str = "A",
                    layer_map: Optional[dict[int, int]] = None, overwrite: bool = False) -> LatentMergeResult:
    """Weight-space baseline for parents of different depth: ``(1 - t) W_A + t W_B`` per tensor of
    the target, the other parent's layer chosen by ``layer_map`` (default: relative depth,
    :func:`depth_alignment`), other-width tensors resampled to the target's shape.

    Returns:
        :class:`LatentMergeResult` (``encoded_tensors`` = 0).

    Raises:
        ConfigError: output exists; the parents differ in tokenizer or layer structure.
    """
    from compress.checkpoint import CheckpointWriter
    from compress.transforms.merge import model_card, open_parents, peak_rss, to_array, write_output

    start = time.perf_counter()
    if Path(output_dir).exists() and not overwrite:
        raise ConfigError(f"{output_dir} already exists; pass --overwrite to replace it")
    (ck_a, ck_b), notes = open_parents([model_a, model_b])
    try:
        tgt, oth = (ck_a, ck_b) if target == "A" else (ck_b, ck_a)
        n_t, n_o = layer_count(tgt), layer_count(oth)
        if layer_map is None:
            layer_map = depth_alignment(n_t, n_o) if n_t != n_o else {}
        pairs = _pair_names(tgt, oth, layer_map)
        count = 0
        with CheckpointWriter(output_dir, overwrite=overwrite, inputs=(ck_a.path, ck_b.path)) as writer:
            for name, partner in pairs.items():
                info = tgt.tensors[name]
                if partner is None or info.dtype not in ("F32", "F16", "BF16", "F64"):
                    dt, bits = tgt.read_array(name)
                    writer.add({name: (dt, info.shape, bits)})
                    continue
                w_t = tgt.get(name).float()                                                      # [*shape]
                w_o = project(oth.get(partner).float(), info.shape)                              # [*shape]
                w_a, w_b = (w_t, w_o) if target == "A" else (w_o, w_t)
                writer.add({name: (info.dtype, info.shape, to_array((1 - t) * w_a + t * w_b, info.dtype))})
                count += 1
            details = {"method": "layer-wise weight average", "t": t, "target": target, "layer_map": layer_map}
            write_output(writer, tgt, model_card("layerwise", [model_a, model_b], None, details))
            path = writer.commit()
    finally:
        ck_a.close()
        ck_b.close()
    return LatentMergeResult(output=str(path), t=t, target=target, corrected=False, space="weights", align="given",
                             layer_map=layer_map, encoded_tensors=0, carried_tensors=count, chunks=0,
                             seconds=time.perf_counter() - start, peak_rss_bytes=peak_rss(), notes=notes)
