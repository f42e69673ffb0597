"""ECF8 codec: code construction, bit-exact round trips of every bit pattern, awkward sizes."""

import heapq

import numpy as np
import pytest

from compress.formats.ecf8 import LAYOUTS, CodedTensor, canonical_codes, decode, decode_table
from compress.transforms.ecf8 import ECF8Config, code_lengths, encode_array

NP = {"F32": np.uint32, "BF16": np.uint16, "F16": np.uint16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}


def huffman_cost(freq):
    heap = [f for f in freq if f > 0]
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


@pytest.mark.parametrize("seed", range(5))
def test_package_merge_is_optimal_when_unconstrained(seed):
    rng = np.random.default_rng(seed)
    freq = rng.integers(0, 1000, size=40) * (rng.random(40) < 0.7)
    lengths = code_lengths(freq, max_length=16)
    assert (freq * lengths).sum() == huffman_cost(freq)
    assert np.sum(np.ldexp(1.0, -lengths[lengths > 0].astype(int))) <= 1.0
    assert np.all((lengths > 0) == (freq > 0))


def test_package_merge_respects_the_cap():
    freq = np.array([2**i for i in range(30)], dtype=np.int64)  # Huffman would need 29-bit codes
    lengths = code_lengths(freq, max_length=15)
    assert lengths.max() == 15
    assert np.sum(np.ldexp(1.0, -lengths.astype(int))) <= 1.0
    assert code_lengths(np.array([0, 5, 0]))[1] == 1  # a lone symbol still gets one bit


def test_codebook_packing_round_trips():
    from compress.formats.ecf8 import pack_codebook, unpack_codebook

    lengths = np.zeros(1024, np.uint8)
    lengths[300:341] = np.arange(41) % 15 + 1
    packed = pack_codebook(lengths)
    assert packed.size == 4 + 21  # the used range only, two lengths a byte
    np.testing.assert_array_equal(unpack_codebook(packed, 1024), lengths)
    assert unpack_codebook(pack_codebook(np.zeros(16, np.uint8)), 16).sum() == 0


def test_decode_table_two_levels():
    freq = np.array([2**i for i in range(20)], dtype=np.int64)
    lengths = code_lengths(freq)
    codes = canonical_codes(lengths)
    table = decode_table(lengths)
    assert table.size > 256 and table.min() < 0  # long codes live in second-level tables
    for s in range(20):
        ln, c = int(lengths[s]), int(codes[s])
        w16 = c << (16 - ln)
        e = int(table[w16 >> 8])
        if e < 0:
            e = int(table[-e * 256 + (w16 & 255)])
        assert (e & 0xFFFF, e >> 16) == (s, ln)


def roundtrip(dtype, bits, backend="cpu", **cfg):
    ct = encode_array(dtype, bits, ECF8Config(**cfg), force=True)
    assert ct is not None
    out = decode(ct, backend=backend)
    out = out if isinstance(out, np.ndarray) else out.numpy()
    assert out.view(bits.dtype).shape == bits.shape
    np.testing.assert_array_equal(out.view(bits.dtype), bits)
    return ct


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_every_16_bit_pattern_round_trips(dtype):
    rng = np.random.default_rng(0)
    # all 65536 patterns (NaN payloads, ±0, ±Inf, subnormals), mixed into a realistic tensor
    bits = np.concatenate([np.arange(65536, dtype=np.uint16),
                           (rng.standard_normal(70000) * 0.02).astype(np.float32).view(np.uint32).__rshift__(16).astype(np.uint16)])
    rng.shuffle(bits)
    roundtrip(dtype, bits)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2"])
def test_every_8_bit_pattern_round_trips(dtype):
    rng = np.random.default_rng(1)
    bits = np.concatenate([np.arange(256, dtype=np.uint8), rng.integers(0, 256, 5000, dtype=np.uint8) & 0x3F])
    roundtrip(dtype, bits)


def test_fp32_special_values_round_trip():
    rng = np.random.default_rng(2)
    specials = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FA5A5A5, 0xFFFFFFFF,
                         0x00000001, 0x807FFFFF, 0x7F7FFFFF], dtype=np.uint32)
    bits = np.concatenate([specials, rng.integers(0, 2**32, 20000, dtype=np.uint32),
                           (rng.standard_normal(50000) * 0.05).astype(np.float32).view(np.uint32)])
    roundtrip("F32", bits)


@pytest.mark.parametrize("shape", [(1,), (7,), (1823, 781), (3, 5, 7), (2048 * 32 + 1,)])
def test_awkward_shapes(shape):
    rng = np.random.default_rng(3)
    bits = (rng.standard_normal(shape) * 0.02).astype(np.float32).view(np.uint32)
    ct = roundtrip("F32", bits, slice_size=64, lanes=4)
    assert ct.shape == shape


def test_tiny_and_incompressible_tensors_are_left_raw():
    rng = np.random.default_rng(4)
    assert encode_array("BF16", np.zeros(10, np.uint16)) is None  # below min_numel
    noise = rng.integers(0, 2**16, 100000, dtype=np.uint16)  # uniform bits do not shrink
    assert encode_array("BF16", noise) is None


def test_compression_is_within_the_entropy_bound():
    rng = np.random.default_rng(5)
    w = (rng.standard_normal(500000) * 0.02).astype(np.float32)
    bits16 = (w.view(np.uint32) >> 16).astype(np.uint16)
    ct = encode_array("BF16", bits16)
    e = (bits16 >> 7) & 0xFF
    p = np.bincount(e, minlength=256) / e.size
    h = -(p[p > 0] * np.log2(p[p > 0])).sum()
    bound = e.size * (h + 8) / 8
    assert ct.nbytes <= 1.005 * bound
    assert ct.slice_bits.nbytes * 8 / ct.numel < 0.01  # random-access metadata: < 0.01 bits/weight


def test_corrupt_parts_are_refused():
    rng = np.random.default_rng(6)
    bits = (rng.standard_normal(10000) * 0.02).astype(np.float32).view(np.uint32)
    ct = encode_array("F32", bits)
    parts = {k: v for k, (_, _, v) in ct.parts("w").items()}
    from compress.errors import FormatError

    short = dict(parts, **{"w_ecf8_codes": parts["w_ecf8_codes"][:10]})
    with pytest.raises(FormatError, match="coded stream"):
        CodedTensor.from_parts("w", ct.record(), short)
    with pytest.raises(FormatError, match="missing parts"):
        CodedTensor.from_parts("w", ct.record(), {"w_ecf8_codes": parts["w_ecf8_codes"]})
    from compress.formats.ecf8 import pack_codebook

    bad_book = dict(parts, **{"w_ecf8_codebook": pack_codebook(np.ones_like(ct.codebook))})
    with pytest.raises(FormatError, match="Kraft"):
        CodedTensor.from_parts("w", ct.record(), bad_book)


def test_layouts_cover_the_issue_dtypes():
    assert {"F32", "BF16", "F16", "F8_E4M3", "F8_E5M2"} <= set(LAYOUTS)
    for layout in LAYOUTS.values():
        assert 1 + layout.exponent_bits + layout.mantissa_bits == layout.bits
