"""ECF8 decode, torch reference: readable, vectorized over slices, one step per symbol position.

Same signature as ``triton.decode_slices`` and ``cpu.decode_slices``; spec in
``docs/formats/ecf8.md``. Works on any device; every step is integer arithmetic on raw bits.
"""

from __future__ import annotations

import torch


def decode_slices(codes, sign_mantissa, slice_start, lut, *, numel, slice_size, lanes, bits, mantissa_bits, raw_bits):
    """Decode ECF8 value bits.

    Args:
        codes: ``Tensor[n_bytes], uint8``: coded stream, MSB-first, >= 4 bytes of padding.
        sign_mantissa: ``Tensor[m], uint8``: raw fields, ``raw_bits`` per value MSB-first, padded
            (unused when ``raw_bits == 0``).
        slice_start: ``Tensor[n_slices], int64``: start bit of each slice (``slice_offsets``).
        lut: ``Tensor[256*k], int32``: two-level decode table (``formats.ecf8.decode_table``).
        numel: number of values.
        slice_size: symbols per slice (S).
        lanes: slices per tile (W): value ``t*W*S + i*W + l`` is step ``i`` of slice ``t*W + l``.
        bits: value width T (8, 16 or 32).
        mantissa_bits: mantissa bits in the raw field (M' = raw_bits - 1).
        raw_bits: R; 0 means the symbol is the whole value.

    Returns:
        ``Tensor[numel]``: value bits as ``uint8`` / ``int16`` / ``int32`` (view as the float dtype).
    """
    device = codes.device
    n_slices = slice_start.numel()
    codes = codes.to(torch.int64)
    raw = sign_mantissa.to(torch.int64)
    lut = lut.to(torch.int64)
    pos = slice_start.clone()  # [n_slices] bit cursor of each slice
    s = torch.arange(n_slices, device=device)
    base = (s // lanes) * (lanes * slice_size) + s % lanes  # [n_slices] value index of step 0
    out = torch.zeros(numel, dtype=torch.int64, device=device)
    for i in range(slice_size):
        e = base + i * lanes  # [n_slices] value index of step i
        live = e < numel
        if not bool(live.any()):
            break
        b = pos >> 3
        window = (codes[b] << 16) | (codes[b + 1] << 8) | codes[b + 2]  # 24 bits from the cursor's byte
        w16 = (window >> (8 - (pos & 7))) & 0xFFFF  # next 16 coded bits
        entry = lut[w16 >> 8]
        second = lut[torch.where(entry < 0, -entry * 256 + (w16 & 0xFF), 0)]
        entry = torch.where(entry < 0, second, entry)
        symbol = entry & 0xFFFF
        pos = torch.where(live, pos + (entry >> 16), pos)  # finished slices stay put
        if raw_bits == 0:
            value = symbol
        else:
            rp = e.clamp(max=numel - 1) * raw_bits  # bit position of the raw field
            rb = rp >> 3
            word = (raw[rb] << 24) | (raw[rb + 1] << 16) | (raw[rb + 2] << 8) | raw[rb + 3]
            r = (word >> (32 - raw_bits - (rp & 7))) & ((1 << raw_bits) - 1)
            sign = r >> mantissa_bits
            value = (sign << (bits - 1)) | (symbol << mantissa_bits) | (r & ((1 << mantissa_bits) - 1))
        out[e[live]] = value[live]
    dtype = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[bits]
    if bits == 8:
        return out.to(dtype)
    return ((out + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))).to(dtype)  # two's-complement wrap
