"""acb: asyncio-native continuous batching for LLM inference.

Example::

    import acb

    async with acb.Engine.from_pretrained(folder, gguf_file="model.gguf") as engine:
        async for chunk in engine.stream([{"role": "user", "content": "Name a cat breed."}], max_new_tokens=32):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

from . import (
    distributed,  # tensor parallelism: acb.distributed.run_worker() for torchrun's ranks
    reasoning,  # the <think> split: reasoning apart from the answer
    tools,  # tool calls: OpenAI's tools checked, forced and parsed
)
from .config import EngineConfig, SamplingParams
from .engine import Engine, EngineStats
from .errors import (
    AcbError,
    DeviceError,
    EngineClosedError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    RequestFailedError,
)
from .handle import ChunkStream, RequestHandle
from .kv_cache import prefix_page_hashes
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventStream
from .prompt_logprobs import PromptLogprobs
from .request import Chunk, Completion, RequestMetrics
from .sync import generate_batch

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
