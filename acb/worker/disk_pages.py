"""The device side of the prefix cache's disk tier (``acb.core.kv_disk``): a page's bytes out of
the KV tensors and back in, and the fingerprint that salts the tier's keys.

A page's bytes are its K and V in every layer, ``[layers, k/v, kv heads, page_size * row]``
in the cache's dtype (int8 pages carry their scales in the row: ``acb.attention.kv_quant``),
the same layout as a CPU offload slot (``acb.worker.offload``).

The fingerprint is SHA-256 over everything that changes the KV values a page holds: the
model's class and config, a digest of its weights (per tensor its name, dtype, shape, a
float64 sum and an evenly strided sample: cheap, and different for any other checkpoint,
seed, fine-tune or quantization), the weights' and the cache's dtypes and shapes, the page
size, the device type, the attention backend and forward path that computed them, the CPU
kernel settings, ``quantization`` and ``kv_cache_dtype``, and the tensor-parallel rank.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ..attention import kv_quant
from ..core.model_shape import ModelShape

_SAMPLE = 2048  # elements of each weight tensor hashed as they are
_CHUNK_BYTES = 8 << 20  # pages loaded per copy: temporaries this small are reused, not faulted in afresh


def page_bytes(model: torch.nn.Module, kv_cache_dtype: str | None, page_size: int) -> int:
    """Bytes of one page's K and V over every layer (a disk page file's payload)."""
    shape = ModelShape.of(model.config)
    dtype = kv_quant.cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
    return kv_quant.bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, dtype) * page_size


def weights_digest(model: torch.nn.Module) -> bytes:
    """A digest of the model's weights and buffers (see the module's text)."""
    sha = hashlib.sha256()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            sha.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            if t.numel() == 0:
                continue
            flat = t.detach().reshape(-1)
            sha.update(repr(float(flat.sum(dtype=torch.float64) if t.dtype.is_floating_point
                                  else flat.to(torch.float64).sum())).encode())
            step = max(1, flat.numel() // _SAMPLE)
            sample = flat[::step][:_SAMPLE].contiguous().cpu()
            sha.update(sample.view(torch.uint8).numpy().tobytes() if sample.dtype != torch.bool
                       else sample.numpy().tobytes())
    return sha.digest()


def fingerprint(model: torch.nn.Module, config, k_cache: list[torch.Tensor], attn_backend: str,
                forward_path: str, rank: int = 0) -> bytes:
    """The fingerprint of the KV values ``model`` writes into a cache like ``k_cache`` (its K
    tensors, one per layer) under the engine config ``config`` (an ``acb.EngineConfig``)."""
    model_config = {k: v for k, v in model.config.to_dict().items()
                    if not k.startswith("_") and k != "transformers_version"}
    identity = {
        "format": "acb-kv-disk-1",
        "class": type(model).__name__,
        "config": json.dumps(model_config, sort_keys=True, default=str),
        "dtype": str(next(model.parameters()).dtype),
        "cache": [str(k_cache[0].dtype), len(k_cache), k_cache[0].shape[0], k_cache[0].shape[2]],
        "page_size": config.page_size,
        "device": k_cache[0].device.type,
        "attention": attn_backend,
        "forward": forward_path,
        "settings": [config.quantization, config.kv_cache_dtype, config.cpu_kernels, config.cpu_prepack,
                     config.cpu_fused_forward, config.cpu_bf16_gemm],
        "rank": [rank, config.tensor_parallel_size],
    }
    sha = hashlib.sha256(json.dumps(identity, sort_keys=True).encode())
    sha.update(weights_digest(model))
    return sha.digest()


def _views(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], page_size: int) -> list[torch.Tensor]:
    """Per layer K then V, viewed as [kv heads, pages, page_size * row]."""
    return [c.view(c.shape[0], c.shape[1] // page_size, page_size * c.shape[2])
            for k, v in zip(k_cache, v_cache, strict=True) for c in (k, v)]


def read_pages(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], page_size: int,
               pages: list[int]) -> list:
    """The bytes of each of ``pages`` (a host buffer per page, safe to keep after the pages
    are reused). Run on the step thread, ordered before any step that could write them."""
    views = _views(k_cache, v_cache, page_size)
    kvh, width = views[0].shape[0], views[0].shape[2]
    out = torch.empty((len(pages), len(views), kvh, width), dtype=views[0].dtype)  # one block per page
    idx = torch.tensor(pages, device=views[0].device)
    for i, view in enumerate(views):
        # a small temporary per view, reused by the allocator (a fresh buffer's first touch costs
        # more than the copy: ~1 GB/s against ~6 GB/s here)
        out[:, i].copy_(view.index_select(1, idx).transpose(0, 1))
    raw = out.view(torch.uint8).view(len(pages), -1)
    return [raw[j].numpy() for j in range(len(pages))]


def write_pages(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], page_size: int, pages: list[int],
                payloads: list) -> None:
    """Copy each payload (``read_pages``' bytes, from a file) into its page of ``pages``, a few
    pages at a time (small temporaries, reused: see ``read_pages``)."""
    views = _views(k_cache, v_cache, page_size)
    kvh, width = views[0].shape[0], views[0].shape[2]
    dtype, device = views[0].dtype, views[0].device
    step = max(1, _CHUNK_BYTES // max(1, len(payloads[0])))
    for first in range(0, len(pages), step):
        chunk = payloads[first : first + step]
        raw = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for p in chunk])
        per_view = raw.view(dtype).view(len(chunk), len(views), kvh, width).to(device).permute(1, 2, 0, 3)
        idx = torch.tensor(pages[first : first + step], device=device)
        for i, view in enumerate(views):
            view.index_copy_(1, idx, per_view[i])
