"""acb: asyncio-native continuous batching for LLM inference.

Example::

    import acb

    async with acb.Engine.from_pretrained(folder, gguf_file="model.gguf") as engine:
        async for chunk in engine.stream([{"role": "user", "content": "Name a cat breed."}], max_new_tokens=32):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use (PEP 562), so `import acb.core.scheduler` and the rest of the
# torch-free core (scheduler, KV allocator, step types, requests, configs) load
# without torch: the public names below come from their modules when first read.
_LAZY = {
    "EngineConfig": "core.config", "SamplingParams": "core.sampling_params",
    "Engine": "engine.engine",
    "EngineStats": "core.outputs", "Chunk": "core.outputs", "Completion": "core.outputs",
    "RequestMetrics": "core.outputs",
    "AcbError": "core.errors", "DeviceError": "core.errors", "EngineClosedError": "core.errors",
    "EngineOverloadedError": "core.errors", "EngineStoppedError": "core.errors", "InvalidRequestError": "core.errors",
    "RequestFailedError": "core.errors",
    "ChunkStream": "core.handle", "RequestHandle": "core.handle",
    "AllBlocksCleared": "core.kv_events", "BlockRemoved": "core.kv_events", "BlockStored": "core.kv_events",
    "KVEventBatch": "core.kv_events", "KVEventStream": "core.kv_events",
    "PromptLogprobs": "core.prompt_logprobs",
    "generate_batch": "engine.sync",
    "prefix_page_hashes": "core.kv_cache",
}
# submodules that are part of the API: acb.distributed (run_worker() for torchrun's ranks),
# acb.reasoning (the <think> split), acb.tools (OpenAI's tools checked, forced and parsed)
_SUBMODULES = ("distributed", "reasoning", "tools")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'acb' has no attribute {name!r}")
    globals()[name] = value  # the next read is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from . import distributed, reasoning, tools
    from .core.config import EngineConfig
    from .core.errors import (
        AcbError,
        DeviceError,
        EngineClosedError,
        EngineOverloadedError,
        EngineStoppedError,
        InvalidRequestError,
        RequestFailedError,
    )
    from .core.handle import ChunkStream, RequestHandle
    from .core.kv_cache import prefix_page_hashes
    from .core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventStream
    from .core.outputs import Chunk, Completion, EngineStats, RequestMetrics
    from .core.prompt_logprobs import PromptLogprobs
    from .core.sampling_params import SamplingParams
    from .engine.engine import Engine
    from .engine.sync import generate_batch

__version__ = "0.1.0"

__all__ = [
    "AcbError",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Chunk",
    "ChunkStream",
    "Completion",
    "DeviceError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineOverloadedError",
    "EngineStats",
    "EngineStoppedError",
    "InvalidRequestError",
    "KVEventBatch",
    "KVEventStream",
    "PromptLogprobs",
    "RequestFailedError",
    "RequestHandle",
    "RequestMetrics",
    "SamplingParams",
    "distributed",
    "generate_batch",
    "prefix_page_hashes",
    "reasoning",
    "tools",
]
