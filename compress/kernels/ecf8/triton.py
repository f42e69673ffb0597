"""ECF8 decode, Triton kernel: one program decodes ``BLOCK`` slices in parallel lanes.

Lanes of one tile write neighbouring values at each step (coalesced stores). Only integer
arithmetic on raw bits, so it runs exactly under ``TRITON_INTERPRET=1`` on the CPU. Same
signature as ``reference.decode_slices``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ecf8_decode_kernel(codes_ptr, raw_ptr, start_ptr, lut_ptr, out_ptr, numel, n_slices,
                        S: tl.constexpr, W: tl.constexpr, T: tl.constexpr, M: tl.constexpr, R: tl.constexpr,
                        BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    s = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] slice ids
    smask = s < n_slices
    pos = tl.load(start_ptr + s, mask=smask, other=0)  # [BLOCK] int64 bit cursors
    base = (s // W).to(tl.int64) * (W * S) + (s % W)  # value index of step 0
    for i in range(S):
        e = base + i * W
        m = smask & (e < numel)
        b = pos >> 3
        b0 = tl.load(codes_ptr + b, mask=m, other=0).to(tl.int64)
        b1 = tl.load(codes_ptr + b + 1, mask=m, other=0).to(tl.int64)
        b2 = tl.load(codes_ptr + b + 2, mask=m, other=0).to(tl.int64)
        w16 = (((b0 << 16) | (b1 << 8) | b2) >> (8 - (pos & 7))) & 0xFFFF
        entry = tl.load(lut_ptr + (w16 >> 8), mask=m, other=0).to(tl.int64)
        long_code = entry < 0
        second = tl.load(lut_ptr + (-entry * 256 + (w16 & 0xFF)), mask=m & long_code, other=0).to(tl.int64)
        entry = tl.where(long_code, second, entry)
        sym = entry & 0xFFFF
        pos = tl.where(m, pos + (entry >> 16), pos)
        if R == 0:
            value = sym
        else:
            rp = e * R
            rb = rp >> 3
            r0 = tl.load(raw_ptr + rb, mask=m, other=0).to(tl.int64)
            r1 = tl.load(raw_ptr + rb + 1, mask=m, other=0).to(tl.int64)
            r2 = tl.load(raw_ptr + rb + 2, mask=m, other=0).to(tl.int64)
            r3 = tl.load(raw_ptr + rb + 3, mask=m, other=0).to(tl.int64)
            word = (r0 << 24) | (r1 << 16) | (r2 << 8) | r3
            r = (word >> (32 - R - (rp & 7))) & ((1 << R) - 1)
            value = ((r >> M) << (T - 1)) | (sym << M) | (r & ((1 << M) - 1))
        if T == 8:
            tl.store(out_ptr + e, value.to(tl.uint8), mask=m)
        elif T == 16:
            tl.store(out_ptr + e, value.to(tl.int16), mask=m)
        else:
            tl.store(out_ptr + e, value.to(tl.int32), mask=m)


def decode_slices(codes, sign_mantissa, slice_start, lut, *, numel, slice_size, lanes, bits, mantissa_bits, raw_bits,
                  block: int = 128):
    """Decode ECF8 value bits with the Triton kernel; arguments as ``reference.decode_slices``.

    Returns:
        ``Tensor[numel]`` on the inputs' device: ``uint8`` / ``int16`` / ``int32`` value bits.
    """
    dtype = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[bits]
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    raw = sign_mantissa if sign_mantissa.numel() else torch.zeros(4, dtype=torch.uint8, device=codes.device)
    n_slices = slice_start.numel()
    if numel == 0 or n_slices == 0:
        return out
    grid = (triton.cdiv(n_slices, block),)
    _ecf8_decode_kernel[grid](codes, raw, slice_start, lut, out, numel, n_slices, S=slice_size, W=lanes, T=bits,
                              M=mantissa_bits, R=raw_bits, BLOCK=block)
    return out
