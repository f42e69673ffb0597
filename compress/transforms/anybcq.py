"""AnyBCQ: multi-precision binary-coded quantization (arXiv 2510.10467), and an RTN baseline in the same path.

A weight group ``w`` (``group_size`` consecutive input columns of one output row) is approximated as
``w ≈ beta + sum_i alpha_i * b_i`` with sign planes ``b_i ∈ {-1, +1}``. One set of planes serves every
stored precision; each precision ``p`` has its own scales ``alpha_p`` (and offset ``beta_p``):

1. base precision ``p_L``: greedy init (``b = sign(r)``, ``alpha = mean|r|``, ``r -= alpha*b``), then
   ``rounds`` of alternating BCQ (least-squares scales for fixed codes, nearest of the ``2^p`` levels);
2. progressive expansion ``p -> p+1``: planes ``1..p`` frozen; ``rounds`` times {residual with the
   first ``p`` planes, new plane ``= sign(residual)``, all ``p+1`` scales re-fit by least squares}; the
   best fit per group is kept, starting from ``alpha_{p+1} = 0``, so the error never rises with bits;
3. block-wise reconstruction (``iters > 0``): decoder block by decoder block, codes frozen, each
   precision's scales trained with Adam on the MSE between the quantized block's output (its input:
   the quantized model's hidden states, QDrop-mixed with the full-precision ones) and the
   full-precision block's output. Only one block's weights and the current block's calibration
   hidden states are held in memory; every other tensor is streamed from and to disk.

RTN (``method="rtn"``): per-group min/max uniform rounding at each precision, written as BCQ
(``q = sum_i 2^i c_i`` gives ``alpha_i = scale * 2^(i-1)``, ``beta = zero + scale (2^p - 1)/2``); its
precisions do not nest, so each has its own planes (``plane_offsets`` in the format).

The output is the ``anybcq`` format (docs/formats/anybcq.md), read by :mod:`compress.formats.anybcq`.
"""

from __future__ import annotations

import fnmatch
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from compress.errors import ConfigError, UnsupportedError

#: model types whose decoder blocks the reconstruction can run on their own (embeddings unscaled,
#: blocks at ``model.layers``, rotary embedding at ``model.rotary_emb``)
RECONSTRUCTION_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
#: a fitting stage stops early once fewer than this fraction of codes changed in a round
CONVERGED = 1e-3


class AnyBCQConfig(BaseModel):
    """Settings of :func:`quantize_checkpoint`.

    Attributes:
        bits: stored precisions, e.g. ``(2, 3, 4)``; planes are shared, the largest sets the plane count.
        group_size: input columns per scale group; a multiple of 32 (the packing word).
        method: ``anybcq`` (greedy + alternating + progressive expansion) or ``rtn`` (round to nearest).
        asymmetric: fit an offset ``beta`` per group and precision (RTN always has one).
        rounds: alternating / expansion rounds per precision.
        iters: Adam steps of block reconstruction per block and precision; 0: calibration-free.
        samples, seq_len: calibration windows and their length in tokens.
        batch_size: windows per Adam step.
        lr: Adam learning rate of the relative scale update (``alpha = alpha0 * (1 + delta)``).
        qdrop: probability that an element of a block's input is taken from the full-precision
            hidden states instead of the quantized ones (QDrop); 0 disables.
        ignore: module-name patterns left unquantized (glob, or ``re:REGEX``); each must match a linear.
        seed: seed of calibration sampling and of the training batches.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: tuple[int, ...] = (2, 3, 4)
    group_size: int = 128
    method: Literal["anybcq", "rtn"] = "anybcq"
    asymmetric: bool = False
    rounds: int = 20
    iters: int = 10
    samples: int = 8
    seq_len: int = 128
    batch_size: int = 2
    lr: float = 5e-3
    qdrop: float = 0.5
    ignore: tuple[str, ...] = ()
    seed: int = 0

    @field_validator("bits")
    @classmethod
    def _bits(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(b < 1 or b > 8 for b in v):
            raise ValueError(f"bits must be between 1 and 8, got {list(v)}")
        if len(set(v)) != len(v):
            raise ValueError(f"bits must not repeat, got {list(v)}")
        return tuple(sorted(v))

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int) -> int:
        if v < 32 or v % 32:
            raise ValueError(f"group_size must be a positive multiple of 32 (the packing word), got {v}")
        return v

    @field_validator("rounds", "iters")
    @classmethod
    def _nonneg(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @field_validator("samples", "batch_size")
    @classmethod
    def _pos(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("seq_len")
    @classmethod
    def _seq(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"must be >= 2, got {v}")
        return v

    @field_validator("qdrop")
    @classmethod
    def _prob(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"must be in [0, 1], got {v}")
        return v


@dataclass
class QuantizedWeight:
    """The BCQ form of one linear weight.

    Attributes:
        codes (Tensor[n_planes, out, in_pad], bool): True = +1; padding columns False.
        alpha: precision p -> Tensor[n_groups, p, out] float32.
        beta: precision p -> Tensor[n_groups, out] float32 (asymmetric/RTN) or None.
        plane_offset: precision p -> first plane it reads (0 for nested AnyBCQ planes).
        in_features: columns before padding. group_size: columns per group.
    """

    codes: Any
    alpha: dict[int, Any]
    beta: dict[int, Any] | None
    plane_offset: dict[int, int]
    in_features: int
    group_size: int
    sq_err: dict[int, float] = field(default_factory=dict)  # p -> sum of squared weight errors of the fit

    def dequantize(self, bits: int):
        """Tensor[out, in_features] float32 at precision ``bits``."""
        from compress.kernels.bcq.reference import dequantize, pack_planes

        return dequantize(pack_planes(self.codes), self.alpha[bits], None if self.beta is None else self.beta[bits],
                          group_size=self.group_size, in_features=self.in_features, plane_offset=self.plane_offset[bits])


# ----------------------------------------------------------------------------------------------- BCQ math


def _grouped(w, group_size: int):
    """w (Tensor[out, in]) -> (rows Tensor[out*G, g] float32 zero-padded, mask Tensor[out*G, g] float32)."""
    import torch

    from compress.kernels.bcq.reference import padded_in

    out, inf = w.shape
    ip = padded_in(inf, group_size)
    n_groups = ip // group_size
    rows = torch.nn.functional.pad(w.to(torch.float32), (0, ip - inf)).reshape(out * n_groups, group_size)
    valid = (torch.arange(ip) < inf).to(torch.float32).reshape(1, n_groups, group_size)
    mask = valid.expand(out, n_groups, group_size).reshape(out * n_groups, group_size)  # [N, g]
    return rows, mask


def _sign(r):
    import torch

    return torch.where(r >= 0, 1.0, -1.0).to(r.dtype)


def least_squares(w, mask, planes, asymmetric: bool):
    """Least-squares scales for fixed sign planes, one small system per group.

    Args:
        w (Tensor[N, g], float32): weight groups, zero in padding columns.
        mask (Tensor[N, g], float32): 1 for real columns, 0 for padding.
        planes (Tensor[N, p, g], float32): ±1 codes, already multiplied by ``mask`` (0 in padding).
        asymmetric: also fit an offset per group.

    Returns:
        ``(alpha Tensor[N, p], beta Tensor[N] or None)``, float32: minimisers of
        ``sum_j mask_j (w_j - beta - sum_i alpha_i b_ij)^2`` (a 1e-9 ridge keeps repeated planes solvable).
    """
    import torch

    p = planes.shape[1]
    gram = planes @ planes.transpose(1, 2)  # [N, p, p]
    rhs = planes @ w.unsqueeze(-1)  # [N, p, 1]
    if asymmetric:
        s = planes @ mask.unsqueeze(-1)  # [N, p, 1]: sum_j b_ij
        count = mask.sum(1).view(-1, 1, 1)  # [N, 1, 1]
        gram = torch.cat([torch.cat([gram, s], 2), torch.cat([s.transpose(1, 2), count], 2)], 1)  # [N, p+1, p+1]
        rhs = torch.cat([rhs, w.sum(1).view(-1, 1, 1)], 1)  # [N, p+1, 1]
    k = gram.shape[-1]
    gram = gram.to(torch.float64) + 1e-9 * torch.eye(k, dtype=torch.float64)
    sol = torch.linalg.solve(gram, rhs.to(torch.float64))[..., 0].to(torch.float32)  # [N, k]
    return sol[:, :p], (sol[:, p] if asymmetric else None)


def _recon(planes, mask, alpha, beta):
    r = (alpha.unsqueeze(1) @ planes).squeeze(1)  # [N, 1, p] @ [N, p, g] -> [N, g]
    return r if beta is None else r + beta.unsqueeze(1) * mask


def _err(w, mask, planes, alpha, beta):
    return ((w - _recon(planes, mask, alpha, beta)) ** 2).sum(1)  # [N]


def _nearest_codes(w, mask, alpha, beta):
    """Codes of the nearest of the 2^p levels ``beta + sum_i alpha_i s_i`` for every weight: Tensor[N, p, g] (masked)."""
    import itertools

    import torch

    p = alpha.shape[1]
    combos = torch.tensor(list(itertools.product((-1.0, 1.0), repeat=p)))  # [2^p, p]
    levels = alpha @ combos.t()  # [N, 2^p]
    if beta is not None:
        levels = levels + beta.unsqueeze(1)
    idx = (w.unsqueeze(-1) - levels.unsqueeze(1)).abs().argmin(-1)  # [N, g]
    return combos.t()[:, idx].permute(1, 0, 2) * mask.unsqueeze(1)  # [N, p, g]


def _greedy_alternating(w, mask, p: int, asymmetric: bool, rounds: int):
    import torch

    count = mask.sum(1).clamp_min(1)  # [N]
    beta0 = w.sum(1) / count if asymmetric else torch.zeros(w.shape[0])
    r = (w - beta0.unsqueeze(1)) * mask  # [N, g]
    planes = []
    for _ in range(p):  # greedy: b = sign(r), alpha = mean |r|, r -= alpha b
        b = _sign(r) * mask
        a = r.abs().sum(1) / count
        r = r - a.unsqueeze(1) * b
        planes.append(b)
    planes = torch.stack(planes, 1)  # [N, p, g]
    alpha, beta = least_squares(w, mask, planes, asymmetric)
    for _ in range(rounds):  # alternating: nearest level for fixed scales, least squares for fixed codes
        new = _nearest_codes(w, mask, alpha, beta)
        changed = float((new != planes).any(1).float().mean())
        planes = new
        if changed == 0:
            break
        alpha, beta = least_squares(w, mask, planes, asymmetric)
        if changed < CONVERGED:
            break
    return planes, alpha, beta


def _expand(w, mask, planes, alpha, beta, asymmetric: bool, rounds: int):
    """One more plane: planes frozen, new plane = sign(residual), all scales re-fit; best per group kept.

    The frozen planes' Gram matrix is computed once; each round only adds the new plane's row, and the
    error of a least-squares fit is ``|w|^2 - sol . rhs`` (no reconstruction needed).
    """
    import torch

    n, p, g = planes.shape
    frozen = torch.cat([planes, mask.unsqueeze(1)], 1) if asymmetric else planes  # [N, k0, g]
    gram_f = (frozen @ frozen.transpose(1, 2)).to(torch.float64)  # [N, k0, k0]
    rhs_f = (frozen @ w.unsqueeze(-1)).to(torch.float64)  # [N, k0, 1]
    count = mask.sum(1).to(torch.float64).view(-1, 1, 1)  # [N, 1, 1]: b.b for a ±1 plane
    ww = (w.to(torch.float64) ** 2).sum(1)  # [N]
    k0 = frozen.shape[1]
    eye = 1e-9 * torch.eye(k0 + 1, dtype=torch.float64)
    best_err = _err(w, mask, planes, alpha, beta).to(torch.float64)  # alpha_{p+1} = 0 is feasible
    best_plane = mask.clone()
    best_sol = torch.cat([alpha, beta.unsqueeze(1)] if asymmetric else [alpha], 1).to(torch.float64)
    best_sol = torch.cat([best_sol, torch.zeros(n, 1, dtype=torch.float64)], 1)  # [N, k0+1]
    first_a, first_b, prev = alpha, beta, None
    for _ in range(max(rounds, 1)):
        new = _sign(w - _recon(planes, mask, first_a, first_b)) * mask  # [N, g]
        changed = 1.0 if prev is None else float((new != prev).float().mean())
        if changed == 0:
            break
        prev = new
        cross = (frozen @ new.unsqueeze(-1)).to(torch.float64)  # [N, k0, 1]
        gram = torch.cat([torch.cat([gram_f, cross], 2), torch.cat([cross.transpose(1, 2), count], 2)], 1)
        rhs = torch.cat([rhs_f, (new * w).sum(1).to(torch.float64).view(-1, 1, 1)], 1)  # [N, k0+1, 1]
        sol = torch.linalg.solve(gram + eye, rhs)  # [N, k0+1, 1]
        e = ww - (sol * rhs).sum((1, 2))  # [N] least-squares residual
        sol = sol[..., 0]
        better = e < best_err  # [N]
        best_err = torch.where(better, e, best_err)
        best_plane = torch.where(better.unsqueeze(1), new, best_plane)
        best_sol = torch.where(better.unsqueeze(1), sol, best_sol)
        first_a = sol[:, :p].to(torch.float32)
        first_b = sol[:, p].to(torch.float32) if asymmetric else None
        if changed < CONVERGED:
            break
    best_sol = best_sol.to(torch.float32)
    new_alpha = torch.cat([best_sol[:, :p], best_sol[:, -1:]], 1)  # [N, p+1]
    new_beta = best_sol[:, p] if asymmetric else None
    return torch.cat([planes, best_plane.unsqueeze(1)], 1), new_alpha, new_beta


def _to_storage(planes, out: int, n_groups: int, group_size: int):
    """Tensor[N, p, g] planes (±1, 0 in padding) -> codes Tensor[p, out, in_pad] bool (padding False)."""
    p = planes.shape[1]
    return (planes.reshape(out, n_groups, p, group_size).permute(2, 0, 1, 3).reshape(p, out, n_groups * group_size) > 0)


def bcq_fit(w, bits: tuple[int, ...], group_size: int, asymmetric: bool = False, rounds: int = 20) -> QuantizedWeight:
    """AnyBCQ weight fit: greedy + alternating at ``min(bits)``, then progressive expansion to ``max(bits)``.

    Args:
        w (Tensor[out, in], any float dtype): the weight.
        bits: stored precisions (sorted); intermediate precisions are fitted but not stored.
        group_size: columns per group (multiple of 32). asymmetric: fit ``beta``. rounds: iterations per stage.

    Returns:
        :class:`QuantizedWeight` with ``max(bits)`` nested planes (every plane_offset 0).
    """
    out, inf = w.shape
    rows, mask = _grouped(w, group_size)  # [N, g]
    n_groups = rows.shape[0] // out
    planes, alpha, beta = _greedy_alternating(rows, mask, bits[0], asymmetric, rounds)
    alphas, betas, sq = {}, {}, {}

    def keep(p, a, b):
        sq[p] = float(_err(rows, mask, planes, a, b).sum())
        alphas[p] = a.reshape(out, n_groups, p).permute(1, 2, 0).contiguous()  # [G, p, out]
        if b is not None:
            betas[p] = b.reshape(out, n_groups).t().contiguous()  # [G, out]

    keep(bits[0], alpha, beta)
    for p in range(bits[0] + 1, bits[-1] + 1):
        planes, alpha, beta = _expand(rows, mask, planes, alpha, beta, asymmetric, rounds)
        if p in bits:
            keep(p, alpha, beta)
    codes = _to_storage(planes, out, n_groups, group_size)
    return QuantizedWeight(codes, alphas, betas if asymmetric else None, {p: 0 for p in bits}, inf, group_size, sq)


def rtn_fit(w, bits: tuple[int, ...], group_size: int) -> QuantizedWeight:
    """Round-to-nearest baseline: per-group asymmetric min/max uniform quantization at each precision,
    expressed as BCQ planes (each precision its own planes, stacked; see ``plane_offset``).

    Args:
        w (Tensor[out, in], any float dtype); bits; group_size: as :func:`bcq_fit`.
    """
    import torch

    out, inf = w.shape
    rows, mask = _grouped(w, group_size)  # [N, g]
    n_groups = rows.shape[0] // out
    big = torch.finfo(torch.float32).max
    lo = torch.where(mask > 0, rows, big).amin(1)  # [N]
    hi = torch.where(mask > 0, rows, -big).amax(1)  # [N]
    all_codes, alphas, betas, offsets, sq, off = [], {}, {}, {}, {}, 0
    for p in bits:
        levels = 2**p - 1
        scale = ((hi - lo) / levels).clamp_min(1e-10)  # [N]
        q = torch.clamp(torch.round((rows - lo.unsqueeze(1)) / scale.unsqueeze(1)), 0, levels).to(torch.int64)  # [N, g]
        q = q * mask.to(torch.int64)
        planes = torch.stack([((q >> i) & 1).to(torch.float32) * 2 - 1 for i in range(p)], 1) * mask.unsqueeze(1)  # [N, p, g]
        alpha = torch.stack([scale * 2.0 ** (i - 1) for i in range(p)], 1)  # [N, p]
        beta = lo + scale * levels / 2  # [N]
        all_codes.append(_to_storage(planes, out, n_groups, group_size))
        alphas[p] = alpha.reshape(out, n_groups, p).permute(1, 2, 0).contiguous()
        betas[p] = beta.reshape(out, n_groups).t().contiguous()
        offsets[p] = off
        off += p
        sq[p] = float(_err(rows, mask, planes, alpha, beta).sum())
    return QuantizedWeight(torch.cat(all_codes, 0), alphas, betas, offsets, inf, group_size, sq)


def quantize_weight(w, config: AnyBCQConfig) -> QuantizedWeight:
    """The calibration-free fit of one weight (Tensor[out, in]) with ``config.method``."""
    if config.method == "rtn":
        return rtn_fit(w, config.bits, config.group_size)
    return bcq_fit(w, config.bits, config.group_size, config.asymmetric, config.rounds)


def relative_error(w, qw: QuantizedWeight, bits: int) -> float:
    """Relative Frobenius error ``||W - Q_bits(W)|| / ||W||`` of one weight (Tensor[out, in])."""
    w = w.float()
    return float((w - qw.dequantize(bits)).norm() / w.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------- checkpoint


class PrecisionStats(BaseModel):
    """Per stored precision: storage cost and error."""

    bits: int
    bytes_per_weight: float
    relative_error: float
    block_mse_before: float | None = None
    block_mse_after: float | None = None


class AnyBCQReport(BaseModel):
    """Result of :func:`quantize_checkpoint`."""

    output: str
    method: str
    bits: list[int]
    group_size: int
    asymmetric: bool
    iters: int
    samples: int
    seq_len: int
    quantized_modules: int
    quantized_weights: int
    ignored_modules: list[str]
    input_bytes: int
    output_bytes: int
    precisions: list[PrecisionStats]
    seconds: float
    peak_rss_mb: float


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MiB (VmHWM)."""
    from compress.eval.memory import peak_rss_bytes

    return peak_rss_bytes() / 2**20


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        try:
            return re.search(pattern[3:], name) is not None
        except re.error as e:
            raise ConfigError(f"--ignore {pattern!r}: not a valid regular expression ({e})") from None
    return fnmatch.fnmatchcase(name, pattern)


def _meta_model(config_dict: dict):
    """The model skeleton on the meta device (no memory), for module names and block structure."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(**config_dict) if "model_type" in config_dict else None
    if cfg is None:
        raise UnsupportedError("config.json has no model_type; cannot tell which tensors are linear weights")
    arch = (config_dict.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    cls = cls or transformers.AutoModelForCausalLM
    with torch.device("meta"):
        try:
            model = cls(cfg) if hasattr(cls, "config_class") and cls is not transformers.AutoModelForCausalLM \
                else cls.from_config(cfg)
        except Exception as e:
            raise UnsupportedError(f"cannot build {arch or cfg.model_type} to find its linear layers ({e})") from None
    return model, cfg


@dataclass
class _Plan:
    targets: dict[str, str]  # checkpoint weight name -> model module name
    ckpt_module: dict[str, str]  # model module name -> module path in the checkpoint
    ignored: list[str]
    shapes: dict[str, tuple[int, int]] = field(default_factory=dict)


def plan_modules(model, names: set[str], ignore: tuple[str, ...]) -> _Plan:
    """Which linears to quantize: every ``nn.Linear`` except the output embedding and ignored ones.

    Raises:
        ConfigError: an ignore pattern matches no linear module.
    """
    import torch

    prefix = getattr(model, "base_model_prefix", "") or ""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for pattern in ignore:
        if not any(_matches(n, pattern) for n, _ in linears):
            some = ", ".join(n for n, _ in linears[:3])
            raise ConfigError(f"--ignore {pattern!r} matches no linear module (e.g. {some}); use a glob such as "
                              "'*.mlp.down_proj' or 're:REGEX'")
    plan = _Plan({}, {}, [])
    for n, m in linears:
        if m is out_emb or any(_matches(n, p) for p in ignore):
            plan.ignored.append(n)
            continue
        for cand in (n, f"{prefix}.{n}", n.removeprefix(f"{prefix}.")):
            if f"{cand}.weight" in names:
                plan.targets[f"{cand}.weight"] = n
                plan.ckpt_module[n] = cand
                plan.shapes[n] = (m.out_features, m.in_features)
                break
        else:  # e.g. a tied lm_head: nothing stored under its name
            plan.ignored.append(n)
    if not plan.targets:
        raise UnsupportedError("no linear weight to quantize in this checkpoint")
    return plan


def _read_float(src, name: str):
    """Tensor ``name`` of the checkpoint as float32 (the stored float dtype upcast exactly)."""
    import torch

    if src.info(name).dtype not in ("F32", "F16", "BF16", "F64"):
        raise UnsupportedError(f"{name}: dtype {src.info(name).dtype} cannot be quantized (expected a float weight)")
    t = src.get(name)
    return t.clone() if t.dtype == torch.float32 else t.to(torch.float32)  # never a view of the read buffer


def _raw(src, name: str):
    info = src.info(name)
    return info.dtype, tuple(info.shape), src.read_bytes(name)


class _Stats:
    def __init__(self, bits):
        self.err_num = {p: 0.0 for p in bits}
        self.err_den = 0.0
        self.bytes = {p: 0.0 for p in bits}
        self.weights = 0
        self.mse_before = {p: [] for p in bits}
        self.mse_after = {p: [] for p in bits}

    def add(self, w, qw: QuantizedWeight, bits, asymmetric: bool):
        from compress.formats.anybcq import bytes_for_precision

        w = w.float()
        self.err_den += float((w**2).sum())
        for p in bits:
            self.err_num[p] += qw.sq_err[p]
            self.bytes[p] += bytes_for_precision(w.shape[0], w.shape[1], qw.group_size, p, qw.beta is not None)
        self.weights += w.numel()


def quantize_checkpoint(source, output_dir, config: AnyBCQConfig = AnyBCQConfig(), *, calib_text: str | None = None,
                        overwrite: bool = False, max_shard_size: str | int = "5GB",
                        log: Callable[[str], None] | None = None) -> AnyBCQReport:
    """Quantize every linear of a checkpoint to the ``anybcq`` format, streaming.

    Args:
        source: an open :class:`compress.checkpoint.Checkpoint` (never modified).
        output_dir: folder to create (atomic; refused if it exists unless ``overwrite``).
        config: :class:`AnyBCQConfig`.
        calib_text: calibration text; required when ``config.iters > 0`` and ``method == "anybcq"``.
        log: progress callback (one line per block), or None.

    Returns:
        :class:`AnyBCQReport`.

    Raises:
        ConfigError: bad ignore pattern, missing calibration text, existing output.
        UnsupportedError: no linear to quantize; reconstruction on an unsupported architecture.
    """
    import torch

    from compress.checkpoint import CheckpointWriter
    from compress.formats.anybcq import quantization_config, tensors_for

    start = time.perf_counter()
    torch.manual_seed(config.seed)
    cfg_json = source.config()
    model, hf_cfg = _meta_model(cfg_json)
    if "quantization_config" in cfg_json:
        raise UnsupportedError(f"{source.source}: already quantized "
                               f"({cfg_json['quantization_config'].get('quant_method')}); quantize a float checkpoint")
    names = set(source.names())
    plan = plan_modules(model, names, config.ignore)
    reconstruct = config.iters > 0 and config.method == "anybcq"
    if reconstruct:
        if calib_text is None:
            raise ConfigError("--iters > 0 needs calibration text (--calib FILE); --iters 0 is calibration-free")
        if cfg_json.get("model_type") not in RECONSTRUCTION_MODEL_TYPES:
            raise UnsupportedError(f"block reconstruction supports {', '.join(RECONSTRUCTION_MODEL_TYPES)} models, not "
                                   f"{cfg_json.get('model_type')!r}; use --iters 0")
    stats = _Stats(config.bits)
    fits: dict[str, QuantizedWeight] = {}
    with CheckpointWriter(output_dir, overwrite=overwrite, inputs=(source.path,), max_shard_size=max_shard_size) as writer:
        def write_module_group(tensor_names: list[str]):
            group = {}
            for name in tensor_names:
                if name in plan.targets:
                    module = plan.targets[name]
                    group.update(tensors_for(plan.ckpt_module[module], fits.pop(module)))
                else:
                    group[name] = _raw(source, name)
            writer.add(group)

        if reconstruct:
            _reconstruct(source, model, hf_cfg, plan, config, calib_text, stats, fits, write_module_group, log)
        else:
            for name in source.names():
                if name in plan.targets:
                    w = _read_float(source, name)  # [out, in]
                    qw = quantize_weight(w, config)
                    stats.add(w, qw, config.bits, config.asymmetric)
                    fits[plan.targets[name]] = qw
                    if log:
                        log(f"{name}: {list(w.shape)}")
                write_module_group([name])
        qcfg = quantization_config(config.bits, config.group_size, config.method,
                                   config.asymmetric or config.method == "rtn",
                                   {m: plan.shapes[m] for m in plan.ckpt_module}, config.model_dump(mode="json"))
        cfg_json = {**cfg_json, "quantization_config": qcfg}
        writer.write_text("config.json", json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
        writer.copy_files(source.path, list(source.extra_files()), skip={"config.json"})
        out = writer.commit()
    out_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    in_bytes = sum(i.nbytes for i in source.tensors.values())
    precisions = []
    for p in config.bits:
        before, after = stats.mse_before[p], stats.mse_after[p]
        precisions.append(PrecisionStats(
            bits=p, bytes_per_weight=stats.bytes[p] / max(stats.weights, 1),
            relative_error=(stats.err_num[p] / max(stats.err_den, 1e-30)) ** 0.5,
            block_mse_before=sum(before) / len(before) if before else None,
            block_mse_after=sum(after) / len(after) if after else None))
    return AnyBCQReport(output=str(out), method=config.method, bits=list(config.bits), group_size=config.group_size,
                        asymmetric=config.asymmetric or config.method == "rtn", iters=config.iters if reconstruct else 0,
                        samples=config.samples if reconstruct else 0, seq_len=config.seq_len if reconstruct else 0,
                        quantized_modules=len(plan.ckpt_module), quantized_weights=stats.weights,
                        ignored_modules=plan.ignored, input_bytes=in_bytes, output_bytes=out_bytes,
                        precisions=precisions, seconds=time.perf_counter() - start, peak_rss_mb=peak_rss_mb())


# ------------------------------------------------------------------------------------ block reconstruction


class _TrainableBCQ:
    """A linear whose weight is rebuilt from frozen sign planes and trainable scales (one precision)."""

    def __new__(cls, qw: QuantizedWeight, bits: int, bias):
        import torch

        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                off = qw.plane_offset[bits]
                n_groups = qw.alpha[bits].shape[0]
                planes = qw.codes[off: off + bits].to(torch.float32) * 2 - 1  # [p, out, in_pad]
                out = planes.shape[1]
                self.register_buffer("signs", planes.reshape(bits, out, n_groups, qw.group_size), persistent=False)
                self.register_buffer("alpha0", qw.alpha[bits].permute(1, 2, 0).contiguous(), persistent=False)  # [p, out, G]
                self.delta = torch.nn.Parameter(torch.zeros_like(self.alpha0))
                b = qw.beta[bits].t().contiguous() if qw.beta is not None else None  # [out, G]
                self.beta = torch.nn.Parameter(b) if b is not None else None
                self.bias = bias
                self.out, self.inf = out, qw.in_features

            def alpha(self):  # [G, p, out]
                return (self.alpha0 * (1 + self.delta)).detach().permute(2, 0, 1).contiguous()

            def forward(self, x):
                a = self.alpha0 * (1 + self.delta)  # [p, out, G]
                w = (self.signs * a.unsqueeze(-1)).sum(0)  # [out, G, g]
                if self.beta is not None:
                    w = w + self.beta.unsqueeze(-1)
                w = w.reshape(self.out, -1)[:, : self.inf]  # [out, in]
                return torch.nn.functional.linear(x, w, self.bias)

        return Module()


def _set_submodule(root, name: str, module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _run_block(block, x, pos, chunk: int = 4):
    import torch

    outs = []
    for i in range(0, x.shape[0], chunk):
        y = block(x[i: i + chunk], attention_mask=None, position_embeddings=pos)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return torch.cat(outs)


def _reconstruct(source, model, hf_cfg, plan: _Plan, config: AnyBCQConfig, calib_text: str, stats: _Stats,
                 fits: dict, write_group, log) -> None:
    """Block-wise reconstruction (AnyBCQ §3.3): one decoder block in memory at a time."""
    import torch
    import transformers

    from compress.eval.text import calibration_batches

    tokenizer = transformers.AutoTokenizer.from_pretrained(source.path)
    ids = calibration_batches(tokenizer, calib_text, config.samples, config.seq_len, config.seed)  # [S, L]
    inner = model.model
    prefix = "model."
    layers_prefix = f"{prefix}layers."
    names = source.names()
    emb_name = f"{prefix}embed_tokens.weight"
    if emb_name not in names:
        raise UnsupportedError(f"{emb_name} not in the checkpoint; block reconstruction cannot embed the calibration text")
    with torch.no_grad():
        x_fp = _read_float(source, emb_name)[ids]  # [S, L, H]
    rotary = type(inner.rotary_emb)(config=hf_cfg)
    pos_ids = torch.arange(config.seq_len).unsqueeze(0)  # [1, L]
    pos = rotary(x_fp[:1], pos_ids)  # (cos, sin) [1, L, d]
    x_q = {p: x_fp.clone() for p in config.bits}  # quantized model's hidden states, per precision
    gen = torch.Generator().manual_seed(config.seed)
    outside = [n for n in names if not n.startswith(layers_prefix)]
    for n in outside:
        write_group([n])
    for li, block in enumerate(inner.layers):
        t0 = time.perf_counter()
        bp = f"{layers_prefix}{li}."
        block_names = [n for n in names if n.startswith(bp)]
        block = block.to_empty(device="cpu")
        state = {n[len(bp):]: _read_float(source, n) for n in block_names}  # fp32 (bf16-rounded where stored so)
        missing, unexpected = block.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if not m.endswith("inv_freq")]:
            raise UnsupportedError(f"block {li}: checkpoint tensors do not fit the model ({(missing + unexpected)[:3]})")
        block.eval().requires_grad_(False)
        with torch.no_grad():
            y_fp = _run_block(block, x_fp, pos)  # [S, L, H] target
        mods = {m: m.removeprefix(bp) for m in plan.ckpt_module if m.startswith(bp)}
        originals = {m: block.get_submodule(rel) for m, rel in mods.items()}
        local = {}
        for m, rel in mods.items():
            w = originals[m].weight.detach()
            local[m] = quantize_weight(w, config)
            stats.add(w, local[m], config.bits, config.asymmetric)
        line = []
        for p in config.bits if not mods else ():  # nothing quantized here: carry every chain through the block
            with torch.no_grad():
                x_q[p] = _run_block(block, x_q[p], pos)
        for p in config.bits if mods else ():
            trainables = {m: _TrainableBCQ(local[m], p, originals[m].bias) for m in mods}
            for m, rel in mods.items():
                _set_submodule(block, rel, trainables[m])
            check = slice(0, min(4, config.samples))
            with torch.no_grad():
                before = float(torch.nn.functional.mse_loss(_run_block(block, x_q[p][check], pos), y_fp[check]))
            params = [t for tr in trainables.values() for t in (tr.delta, tr.beta) if t is not None]
            opt = torch.optim.Adam(params, lr=config.lr)
            for _ in range(config.iters):
                idx = torch.randint(0, config.samples, (config.batch_size,), generator=gen)
                xin = x_q[p][idx]
                if config.qdrop > 0:
                    keep_fp = torch.rand(xin.shape, generator=gen) < config.qdrop
                    xin = torch.where(keep_fp, x_fp[idx], xin)
                y = block(xin, attention_mask=None, position_embeddings=pos)
                loss = torch.nn.functional.mse_loss(y[0] if isinstance(y, tuple) else y, y_fp[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            with torch.no_grad():
                after = float(torch.nn.functional.mse_loss(_run_block(block, x_q[p][check], pos), y_fp[check]))
                if after > before:  # training made it worse on the check windows (also training windows): keep the weight fit
                    for tr in trainables.values():
                        tr.delta.zero_()
                    if local[next(iter(mods))].beta is not None:
                        for m, tr in trainables.items():
                            tr.beta.copy_(local[m].beta[p].t())
                    after = before
                for m, tr in trainables.items():
                    local[m].alpha[p] = tr.alpha()
                    if tr.beta is not None:
                        local[m].beta[p] = tr.beta.detach().t().contiguous()
                x_q[p] = _run_block(block, x_q[p], pos)
            stats.mse_before[p].append(before)
            stats.mse_after[p].append(after)
            line.append(f"{p}b mse {before:.3g}->{after:.3g}")
        for m, rel in mods.items():
            _set_submodule(block, rel, originals[m])
        fits.update(local)
        write_group(block_names)
        x_fp = y_fp
        inner.layers[li] = block.to("meta")  # free this block's weights
        del state, block
        if log:
            log(f"block {li}: {', '.join(line)} ({time.perf_counter() - t0:.1f}s, peak RSS {peak_rss_mb():.0f} MiB)")


class AnyBCQStep(AnyBCQConfig):
    """Recipe step ``anybcq``: :class:`AnyBCQConfig` plus ``calib``, the calibration text file
    (required when ``iters > 0`` with ``method: anybcq``)."""

    calib: Path | None = None


def _apply(source, output_dir, config: AnyBCQStep, overwrite: bool) -> AnyBCQReport:
    """Recipe step: :func:`quantize_checkpoint` on ``source``."""
    from compress.checkpoint import Checkpoint
    from compress.eval.text import read_text

    text = read_text(config.calib) if config.calib is not None else None
    base = AnyBCQConfig(**config.model_dump(exclude={"calib"}))
    with Checkpoint.open(source) as ckpt:
        return quantize_checkpoint(ckpt, output_dir, base, calib_text=text, overwrite=overwrite)


def _recipe_steps():
    from compress.recipe import TransformSpec

    return [TransformSpec(name="anybcq", config=AnyBCQStep, apply=_apply)]


RECIPE_STEPS = _recipe_steps()
