"""``acb.generate_batch`` for scripts without an event loop."""

from __future__ import annotations

import asyncio
from typing import Any

from ..core.config import EngineConfig
from ..core.outputs import Completion
from ..core.sampling_params import SamplingParams


def generate_batch(model_or_path: Any, prompts: list[Any], *, tokenizer: Any = None,
                   config: EngineConfig | None = None, sampling: SamplingParams | None = None,
                   gguf_file: str | None = None, progress: bool = False, **kwargs: Any) -> list[Completion]:
    """Run ``prompts`` through a fresh engine and return completions in input order.
    ``progress=True`` shows a tqdm bar on stderr (requests done, generated tokens/s).

    Example::

        chats = [[{"role": "user", "content": "Hi!"}], [{"role": "user", "content": "Name a cat."}]]
        results = acb.generate_batch("/models/smollm2", chats, max_new_tokens=16, progress=True)
    """
    from ..core.progress import check_progress
    from .engine import Engine

    check_progress(progress)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("acb.generate_batch is for code without a running event loop; "
                           "use `await engine.generate_batch(...)` instead")
    if isinstance(model_or_path, Engine):
        raise TypeError("pass a model or a path; with an Engine use `await engine.generate_batch(...)`")
    if hasattr(model_or_path, "config") and hasattr(model_or_path, "forward"):
        engine = Engine(model_or_path, tokenizer=tokenizer, config=config, sampling=sampling)
    else:
        engine = Engine.from_pretrained(str(model_or_path), gguf_file=gguf_file, config=config, sampling=sampling)

    async def run() -> list[Completion]:
        async with engine:
            return await engine.generate_batch(prompts, progress=progress, **kwargs)

    return asyncio.run(run())
