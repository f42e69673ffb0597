"""BCQ bit-plane matmul, Triton kernel: ``y = x @ W_p^T`` read straight from packed bit-planes.

One program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y``. It walks the input one 32-bit word
(32 columns) at a time: it loads only the ``p`` planes the precision needs, turns each bit into
±1, scales it by that group's alpha (a word never straddles a group, since the group size is a
multiple of 32), adds beta, and accumulates ``x[:, 32 cols] @ w[32 cols, BLOCK_N]`` in float32.
Integer and float32 arithmetic only, so it runs under ``TRITON_INTERPRET=1`` on the CPU. Same
signature as ``reference.bcq_linear``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bcq_matmul_kernel(x_ptr, q_ptr, a_ptr, b_ptr, y_ptr, M, N, K, n_words, n_planes, plane_off, stride_xm, stride_ym,
                       GROUP_WORDS: tl.constexpr, BITS: tl.constexpr, HAS_BETA: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rt = tl.arange(0, 32)  # [32] bit index inside a word
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w in range(0, n_words):
        g = w // GROUP_WORDS
        k = w * 32 + rt  # [32] input columns of this word
        xk = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=mmask[:, None] & (k < K)[None, :],
                     other=0.0).to(tl.float32)  # [BM, 32]
        if HAS_BETA:
            beta = tl.load(b_ptr + g * N + rn, mask=nmask, other=0.0).to(tl.float32)  # [BN]
            wt = tl.zeros([32, BLOCK_N], dtype=tl.float32) + beta[None, :]
        else:
            wt = tl.zeros([32, BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(BITS):
            word = tl.load(q_ptr + (w * n_planes + plane_off + i) * N + rn, mask=nmask, other=0)  # [BN] int32
            bit = (word[None, :] >> rt[:, None]) & 1  # [32, BN]
            a = tl.load(a_ptr + (g * BITS + i) * N + rn, mask=nmask, other=0.0).to(tl.float32)  # [BN]
            wt += (bit.to(tl.float32) * 2.0 - 1.0) * a[None, :]
        acc += tl.dot(xk, wt, input_precision="ieee")  # [BM, BN]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=mmask[:, None] & nmask[None, :])


def bcq_linear(x: torch.Tensor, qweight: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor | None, *,
               group_size: int, in_features: int, plane_offset: int = 0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`compress.kernels.bcq.reference.bcq_linear` (float32 accumulation)."""
    n_words, n_planes, out = qweight.shape
    n_groups, bits, _ = alpha.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()  # [M, K]
    m = x2.shape[0]
    y = torch.empty(m, out, dtype=torch.float32, device=x.device)  # [M, N]
    alpha_c = alpha.to(torch.float32).contiguous()
    beta_c = beta.to(torch.float32).contiguous() if beta is not None else alpha_c  # dummy pointer when absent
    block_m, block_n = 16, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(out, block_n))
    _bcq_matmul_kernel[grid](x2, qweight.contiguous(), alpha_c, beta_c, y, m, out, in_features, n_words, n_planes,
                             plane_offset, x2.stride(0), y.stride(0), GROUP_WORDS=group_size // 32, BITS=bits,
                             HAS_BETA=beta is not None, BLOCK_M=block_m, BLOCK_N=block_n)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.reshape(*lead, out).to(x.dtype)
