"""Dtype conversion of whole checkpoints (``compress convert``), FP8 E4M3 with per-tensor scales."""

from __future__ import annotations


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(weight):
    """Per-tensor FP8 E4M3 quantization: ``q = weight / s`` with ``s = amax / 448``.

    Args:
        weight: ``Tensor[...]``, any float dtype.

    Returns:
        ``(q Tensor[...] float8_e4m3fn, scale_inv Tensor[1] float32)``; ``weight ≈ q * scale_inv``
        (the ``weight_scale_inv`` convention of FP8 checkpoints such as DeepSeek-V3).
    """
    import torch

    w = weight.float()
    scale = (w.abs().max() / FP8_MAX).clamp(min=1e-12)
    return (w / scale).to(torch.float8_e4m3fn), scale.reshape(1)


def convert_checkpoint(source, output_dir, *, fp8: bool = False, max_shard_size="5GB", overwrite=False, progress=None) -> dict:
    """Write ``source`` (cast applied on read) as a plain safetensors checkpoint.

    Args:
        source: an open :class:`compress.checkpoint.Checkpoint`.
        fp8: store every float tensor of 2+ dimensions as FP8 E4M3 plus a ``<name>_scale_inv``
            float32 tensor (per-tensor scale); 1-d tensors keep their dtype.

    Returns:
        ``{"output": str, "tensors": int}``.
    """
    import torch

    from compress.checkpoint import CheckpointWriter
    from compress.errors import ConfigError

    if any(m.get("compress.format") for m in source.shard_metadata.values()):
        raise ConfigError(f"{source.source} is a compress checkpoint; `compress decode` it first")
    names = set(source.names())
    with CheckpointWriter(output_dir, max_shard_size=max_shard_size, overwrite=overwrite, inputs=(source.path,)) as writer:
        count = 0
        for name in source.names():
            info = source.info(name)
            if fp8 and info.dtype in ("F32", "F16", "BF16", "F64") and len(info.shape) >= 2 and info.numel:
                if f"{name}_scale_inv" in names:
                    raise ConfigError(f"tensor {name!r} already has a {name}_scale_inv tensor; the input is already FP8")
                q, scale = quantize_fp8(source.get(name))
                writer.add({name: ("F8_E4M3", tuple(q.shape), q.view(torch.uint8).numpy()),
                            f"{name}_scale_inv": ("F32", (1,), scale.numpy())})
                count += 2
            else:
                dt, bits = source.read_array(name)
                writer.add({name: (dt, tuple(bits.shape), bits)})
                count += 1
            if progress:
                progress(source.info(name).nbytes)
        writer.copy_files(source.path, list(source.extra_files()))
        out = writer.commit()
    return {"output": str(out), "tensors": count}
