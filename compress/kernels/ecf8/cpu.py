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
_BLOCK_STEPS = 16  # steps per block: a block of lanes x 16 values stays in L1


def alloc(n: int, dtype, zero: bool = False) -> np.ndarray:
    """A new array for the parallel kernels to fill, in ordinary 4 KiB pages.

    numpy asks for transparent huge pages on large arrays; when two threads then first-touch
    the same 2 MiB page they serialize on its fault, which halved decode speed here (47 MB FP32
    tensor: 540 MB/s with huge pages, 1260 MB/s without). The request is switched off around
    this allocation only.
    """
    toggle = getattr(getattr(np, "_core", np).multiarray, "_set_madvise_hugepage", None)
    previous = toggle(False) if toggle else None
    try:
        return np.zeros(n, dtype) if zero else np.empty(n, dtype)
    finally:
        if toggle:
            toggle(previous)


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
        e = t * tile
        stop = min(n, e + tile)
        while e < stop:  # step-major: values in memory order, lane = e % lanes
            for l in range(min(lanes, stop - e)):
                acc[l] += lengths[(np.int64(bits[e + l]) >> shift) & mask]
            e += lanes
        for l in range(lanes):
            out[t * lanes + l] = acc[l]
    return out


@njit(cache=True, inline="always")
def _emit(out, code_len, a, m, q):
    """Append a code (``code << 5 | length``) to a lane's accumulator; store 32 bits at a time.

    Plain stores are safe: a lane's first byte may also hold the previous lane's last bits,
    but those are OR-ed in by the final flush, which runs after every plain store of the tile.
    """
    length = code_len & 31
    a = (a << length) | (code_len >> 5)
    m += length
    if m >= 32:
        m -= 32
        v = a >> m
        out[q] = (v >> 24) & 0xFF
        out[q + 1] = (v >> 16) & 0xFF
        out[q + 2] = (v >> 8) & 0xFF
        out[q + 3] = v & 0xFF
        q += 4
    return a, m, q


@njit(cache=True, nogil=True, parallel=True)
def encode_slices(bits, shift, mask, codes, lengths, slice_size, lanes, slice_start, out):
    """Write every slice's codes MSB-first at its start bit. out: zeroed uint8 stream.

    One tile per thread (tiles start byte-aligned), in blocks of 16 steps; inside a block each
    lane's accumulator stays in a register, four lanes interleaved. Each lane's final partial
    bytes are OR-ed in at the end, because a lane's first byte may hold the previous lane's
    last bits.
    """
    n = bits.size
    tile = slice_size * lanes
    n_tiles = (n + tile - 1) // tile
    code_len = (codes.astype(np.int64) << 5) | lengths.astype(np.int64)
    for t in prange(n_tiles):
        acc = np.zeros(lanes, np.int64)
        nacc = np.empty(lanes, np.int64)
        pos = np.empty(lanes, np.int64)
        for l in range(lanes):
            p = slice_start[t * lanes + l]
            pos[l] = p >> 3
            nacc[l] = p & 7  # leading zero bits stand for what the previous lane wrote there
        e0 = t * tile
        stop = min(n, e0 + tile)
        while e0 < stop:
            cnt = min(_BLOCK_STEPS * lanes, stop - e0)
            l = 0
            if cnt == _BLOCK_STEPS * lanes:
                while l + 4 <= lanes:
                    a0, m0, q0 = acc[l], nacc[l], pos[l]
                    a1, m1, q1 = acc[l + 1], nacc[l + 1], pos[l + 1]
                    a2, m2, q2 = acc[l + 2], nacc[l + 2], pos[l + 2]
                    a3, m3, q3 = acc[l + 3], nacc[l + 3], pos[l + 3]
                    for j in range(l, cnt, lanes):
                        s0 = (np.int64(bits[e0 + j]) >> shift) & mask
                        s1 = (np.int64(bits[e0 + j + 1]) >> shift) & mask
                        s2 = (np.int64(bits[e0 + j + 2]) >> shift) & mask
                        s3 = (np.int64(bits[e0 + j + 3]) >> shift) & mask
                        a0, m0, q0 = _emit(out, code_len[s0], a0, m0, q0)
                        a1, m1, q1 = _emit(out, code_len[s1], a1, m1, q1)
                        a2, m2, q2 = _emit(out, code_len[s2], a2, m2, q2)
                        a3, m3, q3 = _emit(out, code_len[s3], a3, m3, q3)
                    acc[l], nacc[l], pos[l] = a0, m0, q0
                    acc[l + 1], nacc[l + 1], pos[l + 1] = a1, m1, q1
                    acc[l + 2], nacc[l + 2], pos[l + 2] = a2, m2, q2
                    acc[l + 3], nacc[l + 3], pos[l + 3] = a3, m3, q3
                    l += 4
            while l < min(lanes, cnt):
                a, m, q = acc[l], nacc[l], pos[l]
                for j in range(l, cnt, lanes):
                    sym = (np.int64(bits[e0 + j]) >> shift) & mask
                    a, m, q = _emit(out, code_len[sym], a, m, q)
                acc[l], nacc[l], pos[l] = a, m, q
                l += 1
            e0 += cnt
        for l in range(lanes):
            a, m, q = acc[l], nacc[l], pos[l]
            while m >= 8:
                m -= 8
                out[q] |= (a >> m) & 0xFF
                q += 1
            if m > 0:
                out[q] |= (a << (8 - m)) & 0xFF


@njit(cache=True, nogil=True)
def huffman_lengths(freq):
    """Unbounded Huffman code lengths (two-queue method on sorted counts). freq: int64[A] -> int64[A]."""
    used = np.flatnonzero(freq)
    k = used.size
    lengths = np.zeros(freq.size, np.int64)
    if k == 1:
        lengths[used[0]] = 1
    if k <= 1:
        return lengths
    order = used[np.argsort(freq[used], kind="mergesort")]
    weight = np.empty(2 * k - 1, np.int64)
    parent = np.empty(2 * k - 1, np.int64)
    weight[:k] = freq[order]
    leaf, node = 0, k  # next unused leaf; next internal node to read
    for new in range(k, 2 * k - 1):
        pair = np.empty(2, np.int64)
        for c in range(2):
            if leaf < k and (node >= new or weight[leaf] <= weight[node]):
                pair[c] = leaf
                leaf += 1
            else:
                pair[c] = node
                node += 1
        weight[new] = weight[pair[0]] + weight[pair[1]]
        parent[pair[0]] = new
        parent[pair[1]] = new
    depth = np.zeros(2 * k - 1, np.int64)
    for i in range(2 * k - 3, -1, -1):
        depth[i] = depth[parent[i]] + 1
    for i in range(k):
        lengths[order[i]] = depth[i]
    return lengths


@njit(cache=True, nogil=True)
def package_merge_lengths(freq, max_length):
    """Optimal code lengths under a length cap by package-merge (Larmore & Hirschberg 1990).

    Packages are tree nodes (two children) rather than symbol-count vectors; the 2k-2 cheapest
    items of the last list are selected and their counts pushed down to the leaves.
    freq: int64[A] with k >= 2 used symbols and 2**max_length >= k -> int64[A] lengths.
    """
    used = np.flatnonzero(freq)
    k = used.size
    order = used[np.argsort(freq[used], kind="mergesort")]
    cap = k + max_length * k
    weight = np.empty(cap, np.int64)
    left = np.full(cap, -1, np.int64)
    right = np.full(cap, -1, np.int64)
    weight[:k] = freq[order]
    n_nodes = k
    cur = np.arange(k)
    for _ in range(max_length - 1):
        n_pk = cur.size // 2
        pk = np.empty(n_pk, np.int64)
        for i in range(n_pk):
            a, b = cur[2 * i], cur[2 * i + 1]
            weight[n_nodes] = weight[a] + weight[b]
            left[n_nodes] = a
            right[n_nodes] = b
            pk[i] = n_nodes
            n_nodes += 1
        merged = np.empty(k + n_pk, np.int64)
        i = j = 0
        for o in range(k + n_pk):  # merge leaves and packages by weight, leaves first on ties
            if j >= n_pk or (i < k and weight[i] <= weight[pk[j]]):
                merged[o] = i
                i += 1
            else:
                merged[o] = pk[j]
                j += 1
        cur = merged
    count = np.zeros(n_nodes, np.int64)
    for o in range(2 * k - 2):
        count[cur[o]] += 1
    for node in range(n_nodes - 1, k - 1, -1):
        if count[node]:
            count[left[node]] += count[node]
            count[right[node]] += count[node]
    lengths = np.zeros(freq.size, np.int64)
    for i in range(k):
        lengths[order[i]] = count[i]
    return lengths


@njit(cache=True, nogil=True, parallel=True)
def pack_raw(bits, total_bits, mantissa_bits, raw_bits, out):
    """Pack sign+mantissa (R = raw_bits) of every value MSB-first at bit e*R. out: zeroed uint8."""
    n = bits.size
    n_groups = (n + 7) // 8  # 8 values = R whole bytes, so groups never share a byte
    mmask = (np.int64(1) << mantissa_bits) - 1
    full = n // 8
    if raw_bits <= 8:  # a group's 8 fields fit one 64-bit word: no per-bit loop, no branches
        for g in prange(full):
            word = np.int64(0)
            for k in range(8):
                v = np.int64(bits[np.uint64(g * 8 + k)])
                word = (word << raw_bits) | ((v >> (total_bits - 1)) << mantissa_bits) | (v & mmask)
            for b in range(raw_bits):
                out[np.uint64(g * raw_bits + b)] = (word >> (8 * (raw_bits - 1 - b))) & 0xFF
        first = full
    else:
        first = 0
    for g in prange(first, n_groups):
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


@njit(cache=True, inline="always")
def _refill(codes, a, m, q):
    if m < 16:
        a = ((a << 40) | (np.int64(codes[np.uint64(q)]) << 32) | (np.int64(codes[np.uint64(q + 1)]) << 24)
             | (np.int64(codes[np.uint64(q + 2)]) << 16) | (np.int64(codes[np.uint64(q + 3)]) << 8) | np.int64(codes[np.uint64(q + 4)]))
        q += 5
        m += 40
    return a, m, q


_WIDE_BITS = 12


def wide_table(lut: np.ndarray) -> np.ndarray:
    """CPU-only single-lookup table over the next 12 bits, derived from the format's two-level
    byte-indexed table: ``(length << 16) | symbol`` for codes of <= 12 bits, 0 for longer codes
    (then the two-level table is used). Fewer unpredictable branches on 8-bit alphabets.

    Args:
        lut: ``ndarray[256*k], int32`` from ``formats.ecf8.decode_table``.

    Returns:
        ``ndarray[4096], int32``.
    """
    w16 = np.arange(1 << _WIDE_BITS, dtype=np.int64) << (16 - _WIDE_BITS)
    ent = lut[w16 >> 8].astype(np.int64)
    second = lut[np.where(ent < 0, -ent * 256 + (w16 & 0xFF), 0)].astype(np.int64)
    ent = np.where(ent < 0, second, ent)
    return np.where((ent >> 16) <= _WIDE_BITS, ent, 0).astype(np.int32)


@njit(cache=True, inline="always")
def _one(codes, lut, wide, a, m, q):
    """One symbol: (bit buffer, valid bits, next byte) -> (..., symbol)."""
    a, m, q = _refill(codes, a, m, q)
    ent = np.int64(wide[np.uint64((a >> (m - 12)) & 0xFFF)])
    if ent == 0:
        w = (a >> (m - 16)) & 0xFFFF
        ent = np.int64(lut[np.uint64(w >> 8)])
        if ent < 0:
            ent = np.int64(lut[np.uint64((-ent) * 256 + (w & 0xFF))])
    return a, m - (ent >> 16), q, ent & 0xFFFF


@njit(cache=True, nogil=True, parallel=True)
def _decode(codes, raw, slice_start, lut, wide, numel, slice_size, lanes, bits, mantissa_bits, raw_bits, out):
    # Indices are cast to uint64 in the hot loops: numba then skips its negative-index
    # wraparound check (about 8% of the time here).
    # One tile per thread, in blocks of _BLOCK_STEPS steps. Phase 1 decodes the block's symbols
    # four lanes at a time (independent bit buffers in registers, so their lookups overlap)
    # into a small buffer laid out like the output. Phase 2 walks
    # the block in memory order, joins each symbol with its raw field, writes contiguously.
    tile = slice_size * lanes
    n_tiles = slice_start.size // lanes
    mmask = (np.int64(1) << mantissa_bits) - 1
    rmask = (np.int64(1) << raw_bits) - 1
    for t in prange(n_tiles):
        acc = np.empty(lanes, np.int64)
        nb = np.empty(lanes, np.int64)
        nxt = np.empty(lanes, np.int64)
        symbuf = np.empty(_BLOCK_STEPS * lanes, np.int64)
        for l in range(lanes):
            p = slice_start[t * lanes + l]
            acc[l] = np.int64(codes[p >> 3])
            nxt[l] = (p >> 3) + 1
            nb[l] = 8 - (p & 7)
        e0 = t * tile
        stop = min(numel, e0 + tile)
        while e0 < stop:
            cnt = min(_BLOCK_STEPS * lanes, stop - e0)
            l = 0
            if cnt == _BLOCK_STEPS * lanes:
                while l + 4 <= lanes:
                    a0, m0, q0 = acc[l], nb[l], nxt[l]
                    a1, m1, q1 = acc[l + 1], nb[l + 1], nxt[l + 1]
                    a2, m2, q2 = acc[l + 2], nb[l + 2], nxt[l + 2]
                    a3, m3, q3 = acc[l + 3], nb[l + 3], nxt[l + 3]
                    for j in range(l, cnt, lanes):
                        a0, m0, q0, s0 = _one(codes, lut, wide, a0, m0, q0)
                        a1, m1, q1, s1 = _one(codes, lut, wide, a1, m1, q1)
                        a2, m2, q2, s2 = _one(codes, lut, wide, a2, m2, q2)
                        a3, m3, q3, s3 = _one(codes, lut, wide, a3, m3, q3)
                        symbuf[np.uint64(j)] = s0
                        symbuf[np.uint64(j + 1)] = s1
                        symbuf[np.uint64(j + 2)] = s2
                        symbuf[np.uint64(j + 3)] = s3
                    acc[l], nb[l], nxt[l] = a0, m0, q0
                    acc[l + 1], nb[l + 1], nxt[l + 1] = a1, m1, q1
                    acc[l + 2], nb[l + 2], nxt[l + 2] = a2, m2, q2
                    acc[l + 3], nb[l + 3], nxt[l + 3] = a3, m3, q3
                    l += 4
            while l < min(lanes, cnt):
                a, m, q = acc[l], nb[l], nxt[l]
                for j in range(l, cnt, lanes):
                    a, m, q, sym = _one(codes, lut, wide, a, m, q)
                    symbuf[j] = sym
                acc[l], nb[l], nxt[l] = a, m, q
                l += 1
            _join(raw, symbuf, e0, cnt, bits, mantissa_bits, raw_bits, mmask, rmask, out)
            e0 += cnt


@njit(cache=True, inline="always")
def _join(raw, symbuf, e0, cnt, bits, mantissa_bits, raw_bits, mmask, rmask, out):
    """out[e0:e0+cnt] = values from symbols and raw fields (e0 is a multiple of 8)."""
    top = bits - 1
    if raw_bits == 0:
        for j in range(cnt):
            out[e0 + j] = symbuf[j]
        return
    j = 0
    if raw_bits <= 8:  # 8 values' raw fields are raw_bits whole bytes: one 64-bit word
        while j + 8 <= cnt:
            rb = ((e0 + j) >> 3) * raw_bits
            word = np.int64(0)
            for k in range(raw_bits):
                word = (word << 8) | np.int64(raw[rb + k])
            for k in range(8):
                r = (word >> (raw_bits * (7 - k))) & rmask
                out[e0 + j + k] = ((r >> mantissa_bits) << top) | (symbuf[j + k] << mantissa_bits) | (r & mmask)
            j += 8
    while j < cnt:
        rp = (e0 + j) * raw_bits
        rb = rp >> 3
        x = ((np.int64(raw[rb]) << 24) | (np.int64(raw[rb + 1]) << 16)
             | (np.int64(raw[rb + 2]) << 8) | np.int64(raw[rb + 3]))
        r = (x >> (32 - raw_bits - (rp & 7))) & rmask
        out[e0 + j] = ((r >> mantissa_bits) << top) | (symbuf[j] << mantissa_bits) | (r & mmask)
        j += 1


def decode_slices(codes, sign_mantissa, slice_start, lut, *, numel, slice_size, lanes, bits, mantissa_bits, raw_bits,
                  out=None):
    """Decode value bits on the CPU; same contract as ``reference.decode_slices``.

    Args:
        codes: ``ndarray[n_bytes], uint8``, padded coded stream.
        sign_mantissa: ``ndarray[m], uint8``, padded raw fields (empty if ``raw_bits == 0``).
        slice_start: ``ndarray[n_slices], int64`` start bit of each slice.
        lut: ``ndarray[256*k], int32`` from ``formats.ecf8.decode_table``.
        out: optional ``ndarray[numel]`` of the result dtype to decode into.

    Returns:
        ``ndarray[numel]``, ``uint8``/``uint16``/``uint32`` for 8/16/32-bit floats.
    """
    if out is None:
        out = alloc(numel, {8: np.uint8, 16: np.uint16, 32: np.uint32}[bits])
    raw = sign_mantissa if sign_mantissa.size else np.zeros(8, np.uint8)
    _decode(codes, raw, slice_start, lut, wide_table(lut), numel, slice_size, lanes, bits, mantissa_bits, raw_bits, out)
    return out
