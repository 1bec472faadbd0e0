"""How big the engine's parts are, decided once from the model and the EngineConfig:
KV pages, token budget, request cap, longest request, sliding windows, prefix
caching, the CPU offload pool, and which token ids end a request."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..attention.kv_quant import bytes_per_token, cache_dtype
from ..core.config import EngineConfig
from ..core.defaults import resolve
from ..core.model_shape import ModelShape, text_config
from .cuda_graphs import graph_memory_reserve

log = logging.getLogger("acb")


@dataclass(frozen=True, slots=True)
class Layout:
    page_size: int
    num_pages: int
    max_batch_tokens: int
    max_requests: int
    max_model_len: int  # the longest prompt + max_new_tokens the engine can ever hold
    sliding_window: int | None  # set only when *every* layer slides (pages are then recycled)
    prefix_caching: bool
    host_pages: int  # CPU offload pool (0: preemption recomputes)
    # Hybrid models (sliding and full layers): the sliding layers' own page pool, sized
    # for the windows of the running requests, not their whole history (0: no such pool)
    swa_pages: int = 0
    swa_layers: frozenset[int] = frozenset()


def layout(model: torch.nn.Module, config: EngineConfig, draft: torch.nn.Module | None = None) -> Layout:
    config = resolve(config)  # the plain defaults (page size, requests per batch): acb.core.defaults
    text = text_config(model.config)
    param = next(model.parameters())
    page_size = config.page_size
    shape = ModelShape.of(model.config)
    # int8 pages (kv_cache_dtype="int8") count their per-row scales: acb.attention.kv_quant
    per_page = bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim,
                               cache_dtype(config.kv_cache_dtype, param.dtype)) * page_size
    if draft is not None:  # a draft model's cache has a page for each of the model's (acb.worker.draft): budgeted too
        per_page += ModelShape.of(draft.config).kv_bytes_per_token(param.dtype) * page_size
    window = getattr(text, "sliding_window", None)
    layer_types = list(getattr(text, "layer_types", None) or [])
    swa_layers = frozenset(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    hybrid = window is not None and 0 < len(swa_layers) < len(layer_types)
    max_requests = config.max_requests_per_batch
    swa_cap = 0
    if hybrid:
        # every running request holds at most its window's pages plus the chunk it computes
        chunk = config.max_batch_tokens or (2048 if param.device.type == "cpu" else 8192)
        swa_cap = max_requests * (-(-window // page_size) + 1) + -(-chunk // page_size) + 1
    if config.num_blocks is not None:
        num_pages = config.num_blocks
        swa_pages = min(num_pages, swa_cap)
    else:
        num_pages, swa_pages = _cache_pages(model, config, param, per_page, len(swa_layers) if hybrid else 0,
                                            swa_cap)
    positions = getattr(text, "max_position_embeddings", None) or 1 << 30
    max_model_len = min(positions, num_pages * page_size)
    # CPU: 2048 measured best on the standard workload (1024: -8 %, 4096: -12 %);
    # a bigger chunk makes fewer steps, each carrying every running decode.
    default_tokens = 2048 if param.device.type == "cpu" else 8192
    max_batch_tokens = config.max_batch_tokens or max(256, min(default_tokens, num_pages * page_size))
    sliding = window is not None and any(t == "sliding_attention" for t in (layer_types or ["sliding_attention"]))
    all_sliding = bool(sliding and (not layer_types or all(t == "sliding_attention" for t in layer_types)))
    if all_sliding and num_pages * page_size >= window + max_batch_tokens + 2 * page_size:
        # every layer slides: pages behind the window are recycled, so a request's
        # memory is bounded by the window, not by its length
        max_model_len = positions
    if config.allow_prefix_sharing and sliding:
        log.info("prefix caching is off: the model has sliding-window layers")
    return Layout(
        page_size=page_size, num_pages=num_pages, max_batch_tokens=max_batch_tokens,
        max_requests=max_requests, max_model_len=max_model_len,
        sliding_window=window if all_sliding or hybrid else None,
        prefix_caching=config.allow_prefix_sharing and not sliding,
        host_pages=_host_pages(config, per_page),
        swa_pages=swa_pages if hybrid else 0, swa_layers=swa_layers if hybrid else frozenset(),
    )


def _cache_pages(model, config: EngineConfig, param: torch.Tensor, per_page: int, swa_layers: int = 0,
                 swa_cap: int = 0) -> tuple[int, int]:
    """(pages of the full-attention pool, pages of the sliding layers' pool) that fit the
    memory budget. ``per_page`` covers every layer; the sliding pool, when there is one,
    gets what its layers need at most (``swa_cap``) and the rest goes to the other."""
    if param.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(param.device)
        free -= graph_memory_reserve(model.config, param.dtype, config, cuda=True)
    else:
        import psutil

        free = psutil.virtual_memory().available
    budget = int(free * config.max_memory_percent)
    pages = max(16, budget // per_page)
    if not swa_layers or pages <= swa_cap:
        return pages, min(pages, swa_cap)
    layers = ModelShape.of(model.config).layers
    per_layer_page = per_page // layers
    full = (budget - swa_cap * swa_layers * per_layer_page) // (per_layer_page * (layers - swa_layers))
    return max(16, full), swa_cap


def _host_pages(config: EngineConfig, per_page: int) -> int:
    """Pages of the CPU offload pool: ``cpu_offload_space`` GiB (None: as much as
    allowed), never more than 80 % of the RAM available now."""
    space = config.cpu_offload_space
    if space == 0:
        return 0
    import psutil

    cap = 0.8 * psutil.virtual_memory().available
    wanted = cap if space is None else min(space * 2**30, cap)
    if space is not None and space * 2**30 > cap:
        log.warning("acb: cpu_offload_space=%s GiB is more than 80%% of available RAM; using %.2f GiB",
                    space, cap / 2**30)
    pages = int(wanted // per_page)
    log.info("acb: CPU offload pool of %d pages (%.2f GiB)", pages, pages * per_page / 2**30)
    return pages


def eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(e) for e in eos)
    return frozenset(ids)
