"""Compiled CPU paths of ECF8 (numba): field extraction, histogram, slice coding and decoding.

Why numba: the bit-serial loops of Huffman coding are ~20x slower as vectorized numpy/torch
(one Python-level step per symbol position); numba compiles them to machine code with
``prange`` over tiles for both cores, needs no C toolchain at install time, and caches the
compiled code on disk. Decoding is the same algorithm as ``reference.py``.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_CHUNK = 1 << 16


@njit(cache=True, nogil=True, parallel=True)
def histogram(bits, shift, mask, alphabet):
    """Counts of ``(bits >> shift) & mask``. bits: ndarray[n] unsigned ints -> int64[alphabet]."""
    n = bits.size
    n_chunks = (n + _CHUNK - 1) // _CHUNK
    hist = np.zeros((max(n_chunks, 1), alphabet), np.int64)
    for c in prange(n_chunks):
        end = min(n, (c + 1) * _CHUNK)
        for i in range(c * _CHUNK, end):
            hist[c, (np.int64(bits[i]) >> shift) & mask] += 1
    return hist.sum(axis=0)


@njit(cache=True, nogil=True, parallel=True)
def slice_lengths(bits, shift, mask, lengths, slice_size, lanes):
    """Coded bits of each slice. bits: ndarray[n]; lengths: uint8[A] -> uint16[n_tiles*lanes]."""
    n = bits.size
    tile = slice_size * lanes
    n_tiles = (n + tile - 1) // tile
    out = np.zeros(n_tiles * lanes, np.uint16)
    for t in prange(n_tiles):
        acc = np.zeros(lanes, np.int64)
        base = t * tile
        stop = min(n, base + tile)
        for e in range(base, stop):
            acc[(e - base) % lanes] += lengths[(np.int64(bits[e]) >> shift) & mask]
        for l in range(lanes):
            out[t * lanes + l] = acc[l]
    return out


@njit(cache=True, nogil=True, parallel=True)
def encode_slices(bits, shift, mask, codes, lengths, slice_size, lanes, slice_start, out):
    """Write every slice's codes MSB-first at its start bit. out: zeroed uint8 stream."""
    n = bits.size
    tile = slice_size * lanes
    n_tiles = (n + tile - 1) // tile
    for t in prange(n_tiles):
        base = t * tile
        pos = slice_start[t * lanes] >> 3  # tiles start byte-aligned
        acc = np.int64(0)
        nacc = np.int64(0)
        for l in range(lanes):
            for i in range(slice_size):
                e = base + i * lanes + l
                if e >= n:
                    break
                s = (np.int64(bits[e]) >> shift) & mask
                ln = np.int64(lengths[s])
                acc = (acc << ln) | np.int64(codes[s])
                nacc += ln
                while nacc >= 8:
                    nacc -= 8
                    out[pos] = (acc >> nacc) & 0xFF
                    pos += 1
                acc &= (np.int64(1) << nacc) - 1
        if nacc > 0:
            out[pos] = (acc << (8 - nacc)) & 0xFF


@njit(cache=True, nogil=True, parallel=True)
def pack_raw(bits, total_bits, mantissa_bits, raw_bits, out):
    """Pack sign+mantissa (R = raw_bits) of every value MSB-first at bit e*R. out: zeroed uint8."""
    n = bits.size
    n_groups = (n + 7) // 8  # 8 values = R whole bytes, so groups never share a byte
    mmask = (np.int64(1) << mantissa_bits) - 1
    for g in prange(n_groups):
        pos = g * raw_bits
        acc = np.int64(0)
        nacc = np.int64(0)
        for e in range(g * 8, min(n, g * 8 + 8)):
            v = np.int64(bits[e])
            r = ((v >> (total_bits - 1)) << mantissa_bits) | (v & mmask)
            acc = (acc << raw_bits) | r
            nacc += raw_bits
            while nacc >= 8:
                nacc -= 8
                out[pos] = (acc >> nacc) & 0xFF
                pos += 1
            acc &= (np.int64(1) << nacc) - 1
        if nacc > 0:
            out[pos] = (acc << (8 - nacc)) & 0xFF


@njit(cache=True, nogil=True, parallel=True)
def _decode(codes, raw, slice_start, lut, numel, slice_size, lanes, bits, mantissa_bits, raw_bits, out):
    # One independent slice per parallel iteration; a 64-bit bit buffer per slice so each
    # coded byte is loaded once (the reference re-reads three bytes per symbol).
    tile = slice_size * lanes
    n_slices = slice_start.size
    mmask = (np.int64(1) << mantissa_bits) - 1
    rmask = (np.int64(1) << raw_bits) - 1
    for s in prange(n_slices):
        t = s // lanes
        l = s - t * lanes
        base = t * tile + l
        pos = slice_start[s]
        byte = pos >> 3
        acc = np.int64(codes[byte])
        byte += 1
        nb = np.int64(8 - (pos & 7))  # valid bits in the low end of acc
        for i in range(slice_size):
            e = base + i * lanes
            if e >= numel:
                break
            while nb <= 48:
                acc = (acc << 8) | np.int64(codes[byte])
                byte += 1
                nb += 8
            w = (acc >> (nb - 16)) & 0xFFFF
            ent = np.int64(lut[w >> 8])
            if ent < 0:
                ent = np.int64(lut[(-ent) * 256 + (w & 0xFF)])
            sym = ent & 0xFFFF
            nb -= ent >> 16
            if raw_bits == 0:
                out[e] = sym
            else:
                if raw_bits == 8:
                    r = np.int64(raw[e])
                else:
                    rp = e * raw_bits
                    rb = rp >> 3
                    if raw_bits + (rp & 7) <= 16:
                        x = (np.int64(raw[rb]) << 8) | np.int64(raw[rb + 1])
                        r = (x >> (16 - raw_bits - (rp & 7))) & rmask
                    else:
                        x = ((np.int64(raw[rb]) << 24) | (np.int64(raw[rb + 1]) << 16)
                             | (np.int64(raw[rb + 2]) << 8) | np.int64(raw[rb + 3]))
                        r = (x >> (32 - raw_bits - (rp & 7))) & rmask
                out[e] = ((r >> mantissa_bits) << (bits - 1)) | (sym << mantissa_bits) | (r & mmask)


def decode_slices(codes, sign_mantissa, slice_start, lut, *, numel, slice_size, lanes, bits, mantissa_bits, raw_bits):
    """Decode value bits on the CPU; same contract as ``reference.decode_slices``.

    Args:
        codes: ``ndarray[n_bytes], uint8``, padded coded stream.
        sign_mantissa: ``ndarray[m], uint8``, padded raw fields (empty if ``raw_bits == 0``).
        slice_start: ``ndarray[n_slices], int64`` start bit of each slice.
        lut: ``ndarray[256*k], int32`` from ``formats.ecf8.decode_table``.

    Returns:
        ``ndarray[numel]``, ``uint8``/``uint16``/``uint32`` for 8/16/32-bit floats.
    """
    out = np.empty(numel, dtype={8: np.uint8, 16: np.uint16, 32: np.uint32}[bits])
    raw = sign_mantissa if sign_mantissa.size else np.zeros(4, np.uint8)
    _decode(codes, raw, slice_start, lut, numel, slice_size, lanes, bits, mantissa_bits, raw_bits, out)
    return out
