"""Block scores from hidden states: entropy change (EntroDrop) and Block Influence (ShortGPT).

Entropy-based block pruning (arXiv 2504.03794): for every decoder block, X is its input residual
stream and Y its output, over a calibration set; a block whose output carries little more entropy
than its input does little and can go. Estimators of a sample's token cloud ``x (Tensor[N, d])``:

- ``knn``: Kozachenko-Leonenko with k = 25 (the paper's formula):
  ``H = d·mean(log r_k) + (d/2)·log π - lgamma(d/2 + 1) + log N - log k`` (nats), r_k the
  Euclidean distance of each token to its k-th nearest other token. With d = 576 > N = 256 the
  absolute value is far from the true entropy (the estimator needs N >> 2^d), as in the paper;
  only the difference ΔH = H(Y) - H(X) is used, in which every constant cancels and which equals
  ``d·(mean log r_k(Y) - mean log r_k(X))``: d times the log-ratio of neighbourhood radii.
- ``bucket``: per-dimension histogram (``bins`` equal-width buckets between the dimension's min
  and max), plug-in differential entropy ``-Σ p log p + log(width)`` summed over dimensions
  (a joint entropy under independent dimensions).
- ``renyi``: matrix-based Rényi entropy of order α (Giraldo, Rao & Príncipe, arXiv 1211.2459):
  ``S_α = log(Σ λ_i^α) / (1 - α)`` over the eigenvalues of ``K / N``, K a Gaussian Gram
  matrix. The kernel width is the median pairwise distance of X and is used for X and Y alike,
  so the two entropies are on one scale.

ShortGPT Block Influence (arXiv 2403.03853): ``BI = 1 - mean_t cos(x_t, y_t)``.

Hidden states are collected with forward hooks one sample at a time and reduced to a few
numbers per block at once, so memory stays at one sample's activations.
"""

from __future__ import annotations

import math
from typing import Callable

ESTIMATORS = ("knn", "bucket", "renyi")
KNN_K = 25


def sq_distances(x):
    """Pairwise squared Euclidean distances of the rows of ``x (Tensor[N, d])``: (Tensor[N, N], float64).

    Computed as ``|a|² + |b|² - 2a·b`` with one float32 matmul on mean-centred points (about 10x
    faster than float64 ``cdist`` on CPU; centring keeps the cancellation error small), clamped at 0.
    """
    x = x.float()
    x = x - x.mean(dim=0, keepdim=True)                                   # [N, d]
    sq = x.square().sum(dim=1)                                            # [N]
    return (sq[:, None] + sq[None, :] - 2 * (x @ x.T)).double().clamp_min_(0)   # [N, N]


def knn_entropy(x, k: int = KNN_K) -> float:
    """Kozachenko-Leonenko kNN differential entropy of a point cloud, in nats (arXiv 2504.03794, eq. for H).

    Args:
        x: (Tensor[N, d], float) N points in d dimensions; N >= 2. k is clipped to N - 1.
        k: neighbour rank.

    Returns:
        ``d·mean(log r_k) + (d/2)·log π - lgamma(d/2 + 1) + log N - log k``. Distances are
        clamped at 1e-12 (duplicate points, e.g. repeated tokens in an embedding layer).
    """
    n, d = x.shape
    k = max(1, min(k, n - 1))
    dist2 = sq_distances(x)                                               # [N, N]
    dist2.fill_diagonal_(float("inf"))
    r_k = dist2.kthvalue(k, dim=1).values.clamp_min(1e-24).sqrt()          # [N]
    return float(d * r_k.log().mean() + d / 2 * math.log(math.pi) - math.lgamma(d / 2 + 1) + math.log(n) - math.log(k))


def bucket_entropy(x, bins: int | None = None) -> float:
    """Per-dimension histogram entropy, summed over dimensions, in nats.

    Args:
        x: (Tensor[N, d], float) N points in d dimensions.
        bins: buckets per dimension (default ``ceil(sqrt(N))``).

    Returns:
        ``Σ_j (-Σ_b p_jb log p_jb + log w_j)``, w_j the bucket width of dimension j (clamped at 1e-12).
    """
    import torch

    x = x.double()
    n, d = x.shape
    bins = bins or max(2, math.ceil(math.sqrt(n)))
    lo, hi = x.min(dim=0).values, x.max(dim=0).values                    # [d]
    width = ((hi - lo) / bins).clamp_min(1e-12)                           # [d]
    idx = ((x - lo) / width).floor().long().clamp_(0, bins - 1)           # [N, d]
    counts = torch.zeros(d, bins, dtype=torch.float64).scatter_add_(1, idx.T, torch.ones(d, n, dtype=torch.float64))
    p = counts / n                                                        # [d, bins]
    h = -(p * p.clamp_min(1e-300).log()).sum(dim=1) + width.log()         # [d]
    return float(h.sum())


def median_distance(x) -> float:
    """Median pairwise Euclidean distance of the rows of ``x (Tensor[N, d])`` (kernel width for :func:`renyi_entropy`)."""
    import torch

    dist = sq_distances(x).sqrt()                                         # [N, N]
    n = x.shape[0]
    off = dist[~torch.eye(n, dtype=torch.bool)]
    return float(off.median().clamp_min(1e-12)) if off.numel() else 1.0


def renyi_entropy(x, sigma: float, alpha: float = 2.0) -> float:
    """Matrix-based Rényi α-entropy of a point cloud, in nats (Giraldo et al., arXiv 1211.2459).

    Args:
        x: (Tensor[N, d], float) N points.
        sigma: Gaussian kernel width, same units as x.
        alpha: order, > 0 and != 1.

    Returns:
        ``log(Σ λ_i^α) / (1 - α)``, λ the eigenvalues of ``K/N``, ``K_ij = exp(-|x_i - x_j|² / (2σ²))``.
        0 for identical points, log N for points much farther apart than sigma.
    """
    import torch

    n = x.shape[0]
    gram = torch.exp(-sq_distances(x) / (2 * sigma * sigma)) / n   # [N, N], trace 1
    if alpha == 2.0:
        power_sum = gram.square().sum()                                   # Σλ² = ||A||_F² for symmetric A
    else:
        lam = torch.linalg.eigvalsh(gram).clamp_min(0)                    # [N]
        power_sum = lam.pow(alpha).sum()
    return float(power_sum.log() / (1 - alpha))


def block_influence(x, y) -> float:
    """ShortGPT Block Influence ``1 - mean_t cos(x_t, y_t)`` of one sample (arXiv 2403.03853).

    Args:
        x, y: (Tensor[N, d], float) a block's input and output hidden states.
    """
    import torch

    return float(1 - torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=-1).mean())


def pair_scores(x, y, metrics: tuple[str, ...], bins: int | None = None, k: int = KNN_K) -> dict[str, float]:
    """Every requested score of one sample's (input, output) pair.

    Args:
        x, y: (Tensor[N, d], float) hidden states before and after the block.
        metrics: names among ``knn``, ``bucket``, ``renyi`` (ΔH = H(Y) - H(X)) and ``cosine`` (Block Influence).

    Returns:
        metric -> value.
    """
    out = {}
    for m in metrics:
        if m == "knn":
            out[m] = knn_entropy(y, k) - knn_entropy(x, k)
        elif m == "bucket":
            out[m] = bucket_entropy(y, bins) - bucket_entropy(x, bins)
        elif m == "renyi":
            sigma = median_distance(x)
            out[m] = renyi_entropy(y, sigma) - renyi_entropy(x, sigma)
        elif m == "cosine":
            out[m] = block_influence(x, y)
        else:
            raise ValueError(f"unknown metric {m!r}")
    return out


def collect_scores(model, layers, input_ids, metrics: tuple[str, ...], scope: str = "layer",
                   progress: Callable[[int], None] | None = None, bins: int | None = None) -> dict[str, list[float]]:
    """Mean per-block scores over a calibration set, one forward pass per sample.

    Forward hooks on each decoder layer catch its input X and output Y (``scope="layer"``) or,
    with ``scope="attention"``, X and ``X + self_attn(norm(X))`` (the residual stream right
    after the attention sub-block). Each pair is reduced to its scores inside the hook.

    Args:
        model: a transformers causal LM (any device; computed in its dtype, scored in float64).
        layers: its decoder layer ``nn.ModuleList``.
        input_ids: (Tensor[S, L], int64) calibration samples.
        metrics: see :func:`pair_scores`.
        scope: ``"layer"`` or ``"attention"`` (the layer must have a ``self_attn`` child).

    Returns:
        metric -> per-layer mean score (list of len(layers) floats).
    """
    import torch

    n = len(layers)
    sums = {m: [0.0] * n for m in metrics}
    current: dict[int, torch.Tensor] = {}
    handles = []

    def first(t):
        return t[0] if isinstance(t, (tuple, list)) else t

    def add(i, x, y):
        # Small matrices: one thread is ~30x faster than several on a busy CPU (no spin-waiting).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for m, v in pair_scores(x[0].float().cpu(), y[0].float().cpu(), metrics, bins).items():   # [L, d] each
                sums[m][i] += v
        finally:
            torch.set_num_threads(threads)

    for i, layer in enumerate(layers):
        def pre(mod, args, kwargs, i=i):
            current[i] = args[0] if args else kwargs["hidden_states"]     # [1, L, d]

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        if scope == "attention":
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                raise ValueError(f"layer {i} ({type(layer).__name__}) has no self_attn sub-block")

            def post_attn(mod, args, output, i=i):
                add(i, current[i], current[i] + first(output))

            handles.append(attn.register_forward_hook(post_attn))
        else:
            def post(mod, args, output, i=i):
                add(i, current.pop(i), first(output))

            handles.append(layer.register_forward_hook(post))
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for s in range(input_ids.shape[0]):
                model(input_ids=input_ids[s: s + 1].to(device), use_cache=False)
                current.clear()
                if progress is not None:
                    progress(1)
    finally:
        for h in handles:
            h.remove()
    return {m: [v / input_ids.shape[0] for v in vals] for m, vals in sums.items()}


def choose_lowest(scores: list[float], k: int, protect_first: int = 2, protect_last: int = 1) -> list[int]:
    """Indices of the ``k`` lowest scores among the unprotected layers, ascending by index.

    Raises:
        ValueError: ``k`` exceeds the number of removable layers.
    """
    n = len(scores)
    candidates = [i for i in range(protect_first, n - protect_last)]
    if k > len(candidates):
        raise ValueError(f"cannot remove {k} of {n} layers: the first {protect_first} and the last {protect_last} are kept, "
                         f"so at most {len(candidates)} can go")
    ranked = sorted(candidates, key=lambda i: (scores[i], i))
    return sorted(ranked[:k])
