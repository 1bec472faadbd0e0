"""Which :class:`~acb.core.config.EngineConfig` fields have no effect where the engine runs (the
CUDA-graph settings on a CPU, say): the engine warns naming each at construction, so no setting is
silently inert. Here, above the config, because the answer depends on the attention backend that
would serve the model (:func:`acb.attention.selector.resolve_backend`)."""

from __future__ import annotations

from typing import Any

import torch

from ..attention.selector import resolve_backend
from ..core.config import EngineConfig


def inactive_settings(config: EngineConfig, device: Any = None, dtype: Any = None) -> list[str]:
    """Names of the fields set to a value that has no effect on ``device`` (default:
    ``config.device``, else CUDA when available, else the CPU) with weights of ``dtype``
    (default: ``config.dtype``, else float32 on the CPU). The engine warns naming each."""
    kind = str(device if device is not None else config.device or
               ("cuda" if torch.cuda.is_available() else "cpu")).split(":")[0]
    dtype = str(dtype if dtype is not None else config.dtype or ("float32" if kind == "cpu" else "auto"))
    dtype = dtype.removeprefix("torch.")

    torch_dtype = getattr(torch, dtype, None) if dtype in ("float32", "float16", "bfloat16") else \
        (torch.float32 if kind == "cpu" else torch.bfloat16)
    try:
        backend = resolve_backend(config.attn_backend, torch.device(kind), torch_dtype, native=config.cpu_kernels)
    except ValueError:
        backend = None  # refused by name when the engine starts
    inert = []
    if config.num_blocks is not None and config.max_memory_percent != 0.5:
        inert.append("max_memory_percent")  # num_blocks sizes the cache instead
    if kind != "cuda":
        if config.use_cuda_graph:
            inert.append("use_cuda_graph")
        inert += [n for n in ("q_padding_interval_size", "kv_padding_interval_size") if getattr(config, n)]
    elif config.use_cuda_graph is False:  # graphs off: nothing is padded
        inert += [n for n in ("q_padding_interval_size", "kv_padding_interval_size") if getattr(config, n)]
    if config.scheduler != "priority" and config.priority_aging_steps != 5000:
        inert.append("priority_aging_steps")  # it ranks requests under scheduler="priority" only
    if kind != "cpu":  # the CPU kernels' switches
        inert += [n for n in ("cpu_kernels", "cpu_prepack", "cpu_fused_forward") if not getattr(config, n)]
    if not config.cpu_bf16_gemm and (kind != "cpu" or dtype != "bfloat16" or config.quantization is not None):
        inert.append("cpu_bf16_gemm")  # the GEMMs of a bf16 model's fused CPU forward (int8's are int8)
    if config.max_blocks_per_request is not None and backend not in (None, "native", "triton"):
        inert.append("max_blocks_per_request")  # it bounds the native and Triton decode kernels only
    if config.speculative_method is None:  # they tune the proposals of speculative decoding only
        inert += [n for n, default in (("num_speculative_tokens", 4), ("prompt_lookup_min", 2),
                                       ("prompt_lookup_max", 4)) if getattr(config, n) != default]
    elif config.speculative_method == "draft":  # the n-gram lookup's: a draft model proposes instead
        inert += [n for n, default in (("prompt_lookup_min", 2), ("prompt_lookup_max", 4))
                  if getattr(config, n) != default]
    return inert
