"""``Engine.embed``'s two ends: its inputs checked into token ids (``embedding_prompts``) and
a complete pooled sum made a vector (``vector``). The requests between them are prefill-only
requests through the engine's own scheduler (``acb.core.pooling`` draws their path)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

import anyio
import torch

from ..core.errors import InvalidRequestError
from ..core.pooling import POOLINGS, PoolSink
from .inputs import OFF_LOOP_CHARS, tokenize


def check_pooling(pooling: Any, normalize: Any) -> None:
    """InvalidRequestError naming ``pooling`` or ``normalize`` when either is not one the engine knows."""
    if pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling must be one of {', '.join(map(repr, POOLINGS))}, got {pooling!r}",
                                  param="pooling")
    if not isinstance(normalize, bool):
        raise InvalidRequestError(f"normalize must be a bool, got {normalize!r}", param="normalize")


def _items(inputs: Any) -> list[Any]:
    """``inputs`` as a list of single inputs (a text, or a list of token ids)."""
    if isinstance(inputs, str):
        return [inputs]
    if isinstance(inputs, torch.Tensor):
        inputs = inputs.tolist() if inputs.dim() == 2 else [inputs.tolist()]
    if not isinstance(inputs, (list, tuple)):
        raise InvalidRequestError(f"inputs must be a string, a list of strings or token-id lists, got "
                                  f"{type(inputs).__name__}", param="inputs")
    if not inputs:
        raise InvalidRequestError("inputs is empty: pass a string, a list of strings or token-id lists",
                                  param="inputs")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
        return [list(inputs)]  # one prompt of token ids
    for i, item in enumerate(inputs):
        if not isinstance(item, str) and not (isinstance(item, SequenceABC) and not isinstance(item, dict)
                                              and all(isinstance(t, int) for t in item)):
            raise InvalidRequestError(f"inputs[{i}] must be a string or a list of token ids, got "
                                      f"{type(item).__name__}", param="inputs")
    return list(inputs)


def _tokenized(items: list[Any], tokenizer: Any, vocab_size: int, max_model_len: int) -> list[list[int]]:
    out = []
    for i, item in enumerate(items):
        try:
            ids = tokenize(item, tokenizer, vocab_size)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"inputs[{i}]: {e}", param="inputs") from e
        if len(ids) > max_model_len:
            raise InvalidRequestError(f"inputs[{i}] is {len(ids)} tokens, more than this engine can hold "
                                      f"({max_model_len}: the model's context, or EngineConfig.num_blocks)",
                                      param="inputs")
        out.append(ids)
    return out


async def embedding_prompts(inputs: Any, pooling: str, tokenizer: Any, vocab_size: int,
                            max_model_len: int) -> list[list[int]]:
    """The token ids each input runs as (a batch of texts tokenized on a worker thread, off the
    event loop that streams other requests), or InvalidRequestError naming ``inputs[i]``.
    ``cls`` pools the first position, which in a causal decoder sees the first token only:
    that token is the prompt it runs."""
    items = _items(inputs)
    chars = sum(len(t) if isinstance(t, str) else len(t) // 4 for t in items)
    if chars > OFF_LOOP_CHARS or len(items) > 8:
        prompts = await anyio.to_thread.run_sync(_tokenized, items, tokenizer, vocab_size, max_model_len,
                                                 abandon_on_cancel=True)
    else:
        prompts = _tokenized(items, tokenizer, vocab_size, max_model_len)
    return [ids[:1] for ids in prompts] if pooling == "cls" else prompts


def vector(sink: PoolSink) -> list[float]:
    """A complete sink's embedding: its summed hidden states over their count (mean; one
    position for ``last`` and ``cls``), L2-normalized when asked."""
    v = sink.total / sink.count
    if sink.normalize:
        v = torch.nn.functional.normalize(v, dim=0)
    return v.tolist()
