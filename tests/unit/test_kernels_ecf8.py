"""Triton kernel (under TRITON_INTERPRET=1), torch reference and compiled CPU decoder agree bit
for bit on real MiniLM tensors (fp32, bf16, fp8) and on awkward sizes."""

import numpy as np
import pytest
import torch

from compress.checkpoint import Checkpoint
from compress.formats.ecf8 import decode
from compress.transforms.cast import quantize_fp8
from compress.transforms.ecf8 import ECF8Config, encode_array

NAMES = ["encoder.layer.0.attention.self.query.weight", "encoder.layer.3.output.dense.weight",
         "embeddings.word_embeddings.weight"]


def real_tensors(minilm_fp32):
    ck = Checkpoint.open(minilm_fp32)
    for name, size in zip(NAMES, [40000, 100000 - 13, 33333]):
        w = ck.get(name).reshape(-1)[:size]
        yield name, "F32", w.view(torch.int32).numpy().view(np.uint32)
        yield name, "BF16", w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        yield name, "F16", w.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
        q, _ = quantize_fp8(w)
        yield name, "F8_E4M3", q.view(torch.uint8).numpy()
        yield name, "F8_E5M2", w.to(torch.float8_e5m2).view(torch.uint8).numpy()


def as_numpy(x):
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


def test_triton_reference_and_cpu_agree_on_real_tensors(minilm_fp32):
    seen = set()
    for name, dtype, bits in real_tensors(minilm_fp32):
        ct = encode_array(dtype, bits, ECF8Config(slice_size=512, lanes=32))
        assert ct is not None, (name, dtype)
        seen.add((ct.symbol, ct.mantissa_in_symbol))
        ref = as_numpy(decode(ct, backend="torch", device="cpu"))
        tri = as_numpy(decode(ct, backend="triton", device="cpu"))
        cpu = as_numpy(decode(ct, backend="cpu"))
        np.testing.assert_array_equal(tri, ref, err_msg=f"{name} {dtype}: triton != reference")
        np.testing.assert_array_equal(cpu.view(ref.dtype), ref, err_msg=f"{name} {dtype}: cpu != reference")
        np.testing.assert_array_equal(ref.view(bits.dtype), bits, err_msg=f"{name} {dtype}: not lossless")
    assert len(seen) >= 2  # several symbol layouts were exercised


@pytest.mark.parametrize("numel,slice_size,lanes", [(1, 8, 1), (63, 16, 4), (1823 * 7, 64, 32), (4097, 32, 128)])
def test_triton_awkward_sizes(numel, slice_size, lanes):
    rng = np.random.default_rng(numel)
    bits = (rng.standard_normal(numel) * 0.02).astype(np.float32).view(np.uint32)
    bits[::97] = 0x7FC12345  # NaN payloads
    bits[1::89] = 0x80000000  # -0
    ct = encode_array("F32", bits, ECF8Config(slice_size=slice_size, lanes=lanes), force=True)
    tri = as_numpy(decode(ct, backend="triton", device="cpu"))
    np.testing.assert_array_equal(tri.view(np.uint32), bits)
