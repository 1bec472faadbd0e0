"""Checking what a caller submits: prompts into token ids, sampling keywords into
``SamplingParams``. Every problem is an ``InvalidRequestError`` naming its field."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Container
from collections.abc import Sequence as SequenceABC
from typing import Any

import anyio
import torch

from ..core.errors import InvalidRequestError
from ..core.sampling_params import FROM_GENERATION_CONFIG, SamplingParams


def tokenize(prompt: Any, tokenizer: Any, vocab_size: int) -> list[int]:
    """A prompt (text, token ids, chat messages or a one-row tensor) as checked token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids instead", param="prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        try:
            ids = tokenizer(prompt)["input_ids"]
        except Exception as e:  # e.g. a lone surrogate the tokenizer cannot encode
            raise InvalidRequestError(f"prompt could not be tokenized: {e}", param="prompt") from e
    elif isinstance(prompt, SequenceABC) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None:
            raise InvalidRequestError("a chat prompt needs a tokenizer with a chat template", param="prompt")
        for i, m in enumerate(prompt):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequestError(f"chat message {i} needs string 'role' and 'content'", param="prompt")
        try:
            out = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        except Exception as e:
            raise InvalidRequestError(f"chat prompt could not be templated: {e}", param="prompt") from e
        ids = out["input_ids"] if hasattr(out, "keys") else out
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int):
                raise InvalidRequestError(f"prompt token ids must be ints, got {t!r}")
            if not 0 <= t < vocab_size:
                raise InvalidRequestError(f"prompt token id {t} is out of the vocabulary (0..{vocab_size - 1})")
        ids = list(prompt)
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise InvalidRequestError(
                f"a tensor prompt must be one row of integer token ids, got shape {tuple(prompt.shape)} "
                f"and dtype {prompt.dtype}", param="prompt")
        return tokenize(prompt.tolist(), tokenizer, vocab_size)
    else:
        raise InvalidRequestError(
            f"prompt must be a str, a list of token ids or a list of chat messages, got {type(prompt).__name__}",
            param="prompt",
        )
    if not ids:
        raise InvalidRequestError("prompt is empty after tokenization")
    return list(ids)


# Prompts up to this many characters (text, or a chat's message contents together) are
# tokenized on the caller's thread, longer ones on a worker thread in the async paths.
# Measured with SmolLM2's fast tokenizer (scripts in docs/serving.md): 1,000 characters take
# 0.7 ms inline against 1.8 ms through a worker (the hop costs ~1 ms), 4,000 take 3.5 ms;
# 120k tokens take 0.5 s. At 2,048 an inline tokenization holds the loop ~2 ms at most.
OFF_LOOP_CHARS = 2048
# Token-id prompts: checking each id is a Python loop (~65 ns an id); past this many a
# worker thread checks them (~1 ms inline).
OFF_LOOP_IDS = 16384


def _heavy(prompt: Any) -> bool:
    """Whether tokenizing / checking ``prompt`` is worth a worker thread (see OFF_LOOP_CHARS)."""
    if isinstance(prompt, str):
        return len(prompt) > OFF_LOOP_CHARS
    if isinstance(prompt, (list, tuple)) and prompt:
        if isinstance(prompt[0], dict):
            return sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0
                       for m in prompt if isinstance(m, dict)) > OFF_LOOP_CHARS
        return len(prompt) > OFF_LOOP_IDS
    return False


async def tokenize_off_loop(prompt: Any, tokenizer: Any, vocab_size: int) -> list[int] | None:
    """``tokenize`` on a worker thread when ``prompt`` is long (HF fast tokenizers release
    the GIL while they encode); None for a short one, left to the caller's thread."""
    if not _heavy(prompt):
        return None
    # a cancelled caller (a client gone) does not wait for the thread, which ends on its own
    return await anyio.to_thread.run_sync(tokenize, prompt, tokenizer, vocab_size, abandon_on_cancel=True)


def generation_defaults(model: Any) -> dict[str, Any]:
    """What the model's ``generation_config`` sets among the sampling fields a request
    may leave unset (``do_sample``, ``temperature``, ``top_k``, ...)."""
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return {}
    # transformers 5 leaves unset fields None; older versions hold their defaults, so
    # only what differs from a fresh GenerationConfig counts as the model's choice
    values = gen.to_diff_dict() if hasattr(gen, "to_diff_dict") else vars(gen)
    return {name: values[name] for name in FROM_GENERATION_CONFIG if values.get(name) is not None}


def sampling_params(default: SamplingParams, sampling: SamplingParams | None,
                    overrides: dict[str, Any], generation: dict[str, Any] | None = None) -> SamplingParams:
    """``sampling`` (or the engine's ``default``) with keyword ``overrides`` applied, and
    what is still unset taken from ``default`` and then from ``generation`` (the model's
    generation_config)."""
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise InvalidRequestError(f"sampling must be an acb.SamplingParams, got {type(sampling).__name__}")
    base = sampling or default
    try:
        return base.merged(overrides).resolved(default, generation or {})
    except InvalidRequestError:
        raise
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(str(e), param=getattr(e, "param", None)) from e


def prepare(prompt: Any, request_id: str | None, params: SamplingParams, tokenizer: Any, vocab_size: int,
            max_model_len: int, live: Container[str], ids: list[int] | None = None
            ) -> tuple[str, list[int], SamplingParams]:
    """Check one request against the engine: (request id, token ids, sampling params).
    ``ids``: ``prompt`` already through ``tokenize`` (on a worker thread)."""
    if ids is None:
        ids = tokenize(prompt, tokenizer, vocab_size)
    if params.reasoning_parser is not None and tokenizer is None:
        raise InvalidRequestError("reasoning_parser needs a tokenizer (it splits the text)", param="reasoning_parser")
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids instead", param="stop")
    for t in params.stop_token_ids:
        if t >= vocab_size:
            raise InvalidRequestError(f"stop_token_ids: {t} is out of the vocabulary", param="stop_token_ids")
    for t in params.logit_bias or ():
        if t >= vocab_size:
            raise InvalidRequestError(f"logit_bias: token id {t} is out of the vocabulary (0..{vocab_size - 1})",
                                      param="logit_bias")
    if params.top_logprobs > vocab_size:
        raise InvalidRequestError(f"top_logprobs ({params.top_logprobs}) exceeds the vocabulary ({vocab_size})",
                                  param="top_logprobs")
    if (params.prompt_logprobs or 0) > vocab_size:
        raise InvalidRequestError(f"prompt_logprobs ({params.prompt_logprobs}) exceeds the vocabulary ({vocab_size})",
                                  param="prompt_logprobs")
    if params.max_new_tokens is None:  # until the context limit
        if len(ids) >= max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) leaves no room to generate: this engine holds {max_model_len}",
                param="prompt")
        params = dataclasses.replace(params, max_new_tokens=max_model_len - len(ids))
    total = len(ids) + params.max_new_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) is {total} tokens, "
            f"more than this engine can ever hold ({max_model_len}: see EngineConfig.num_blocks, "
            f"page_size and the model's max_position_embeddings)",
            param="max_new_tokens",
        )
    if request_id is None:
        request_id = uuid.uuid4().hex
    elif not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
    if request_id in live:
        raise InvalidRequestError(f"request_id {request_id!r} is already in use by a live request")
    return request_id, ids, params
