"""What ``None`` means in an ``EngineConfig``, decided in one place.

``resolve(config, model=None, layout=None)`` returns the config with every "None: choose"
field replaced by what the engine will use, and the environment overrides applied. It is
called as the engine is put together, each time knowing more (see ``acb.engine.engine``):

- with the config alone: the environment overrides (``ACB_CPU_KERNEL=0``,
  ``ACB_CPU_PREPACK=0``, ``ACB_CPU_FUSED=0``, ``ACB_CPU_BF16_GEMM=0`` turn the matching ``cpu_*`` field off; they
  only turn things off, for A/B measurements and bisecting; ``ACB_DEBUG_CHECKS=1`` turns ``debug_checks``
  on, as the test suite does), ``page_size`` (16),
  ``max_requests_per_batch`` (256), ``safety_margin`` (0.15; 0 under ``prefill_first``),
  ``varlen_compile_level`` / ``decode_compile_level`` (``compile_level``);
- with the placed model: ``device`` and ``dtype`` (where it ended; a tensor-parallel engine
  keeps the device kind its ranks share);
- with the cache's layout (``acb.worker.sizing.layout``, which sizes the cache from the model and
  memory): ``num_blocks``, ``max_batch_tokens`` and ``max_waiting_requests`` (four times
  the requests per batch) and ``max_embedding_tokens`` (``max_batch_tokens`` / 32).

Resolving twice changes nothing. What stays ``None`` on purpose: ``use_cuda_graph`` (on
CUDA once a start-up self-check passes: decided by the fast paths when the check runs),
``max_blocks_per_request`` (no bound), ``cpu_offload_space`` (the cap, 80 % of available
RAM), ``grammar_compile_timeout_s`` (no bound) and the other plain values that mean
"none". The dtype a checkpoint loads in (``Engine.from_pretrained``) is decided before
any model exists, by ``acb.engine.assembly.resolve_load``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from .config import EngineConfig

log = logging.getLogger("acb")

# environment variable -> the EngineConfig field it turns off when set to "0"
ENV_OVERRIDES = {"ACB_CPU_KERNEL": "cpu_kernels", "ACB_CPU_PREPACK": "cpu_prepack",
                 "ACB_CPU_FUSED": "cpu_fused_forward", "ACB_CPU_BF16_GEMM": "cpu_bf16_gemm"}
# set to "1", it turns EngineConfig.debug_checks on (the test suite does, for every engine it builds)
DEBUG_CHECKS_ENV = "ACB_DEBUG_CHECKS"
PAGE_SIZE = 16
MAX_REQUESTS = 256
WAITING_PER_RUNNING = 4
EMBEDDING_SHARE = 32  # max_embedding_tokens: 64 of the CPU's 2048 tokens a step (docs/embeddings.md measures it)
DTYPES = ("float32", "bfloat16", "float16")  # what EngineConfig.dtype can name


def resolve(config: EngineConfig, model: Any = None, layout: Any = None,
            environ: Mapping[str, str] = os.environ) -> EngineConfig:
    """``config`` with what it leaves to the engine decided (see the module's text)."""
    changes: dict[str, Any] = {}
    for var, name in ENV_OVERRIDES.items():
        if environ.get(var) == "0" and getattr(config, name):
            log.info("acb: %s=0 in the environment turns EngineConfig.%s off", var, name)
            changes[name] = False
    if environ.get(DEBUG_CHECKS_ENV) == "1" and not config.debug_checks:
        changes["debug_checks"] = True  # the test suite's engines (tests/conftest.py)
    if config.page_size is None:
        changes["page_size"] = PAGE_SIZE
    if config.max_requests_per_batch is None:
        changes["max_requests_per_batch"] = MAX_REQUESTS
    if config.safety_margin is None:
        changes["safety_margin"] = 0.0 if config.scheduler == "prefill_first" else 0.15
    for name in ("varlen_compile_level", "decode_compile_level"):
        if getattr(config, name) is None:
            changes[name] = config.compile_level
    if model is not None:
        param = next(model.parameters())
        if config.tensor_parallel_size == 1:
            changes["device"] = str(param.device)
        dtype = str(param.dtype).removeprefix("torch.")
        if config.dtype in (None, "auto") and config.tensor_parallel_size == 1 and dtype in DTYPES:
            changes["dtype"] = dtype  # (a float64 model keeps None: it runs as it is, on the torch path)
    if layout is not None:
        changes.update(num_blocks=layout.num_pages, max_batch_tokens=layout.max_batch_tokens)
        if config.max_embedding_tokens is None:
            changes["max_embedding_tokens"] = max(1, layout.max_batch_tokens // EMBEDDING_SHARE)
        if config.max_waiting_requests is None:
            changes["max_waiting_requests"] = WAITING_PER_RUNNING * layout.max_requests
    changes = {k: v for k, v in changes.items() if getattr(config, k) != v}
    return dataclasses.replace(config, **changes) if changes else config
