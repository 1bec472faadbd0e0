"""OpenAI's embeddings API over one engine: ``POST /v1/embeddings`` (``acb serve``, the Ray Serve
app, ``acb run-batch`` lines) answers ``{"object": "list", "data": [{"object": "embedding", "index",
"embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}`` from ``Engine.embed``.

The body: ``input`` (a string, a list of strings, a list of token ids, or a list of token-id lists;
required, nothing empty), ``model`` (the served model, as the other routes), ``encoding_format``
(``"float"``, the default, or ``"base64"``: each vector's little-endian float32 bytes in base64, as
OpenAI sends them), ``user`` (accepted, without effect), and acb's extensions ``pooling``
(``"last"``, the default, ``"mean"`` or ``"cls"``) and ``normalize`` (true by default: unit vectors).
``dimensions`` is refused by name (400): these models have no reduced-dimension embeddings. So is
``truncate_prompt_tokens`` (vLLM's) unless null, and ``add_special_tokens`` false; other unknown fields
are ignored and logged once, as on the other OpenAI routes. Every error is OpenAI's 400 naming the
field (an input past the engine's context: ``input``).

Example::

    embeddings = EmbeddingsService(OpenAIService(engine, model_name="smollm2"))
    answer = await embeddings.create({"input": ["a cat", "a dog"], "encoding_format": "base64"})
"""

from __future__ import annotations

import base64
import struct
from typing import Any

import anyio

import acb

from .common import ApiError
from .openai_fields import field_error
from .openai_requests import IGNORED_FIELDS, note_unknown
from .openai_responses import engine_error
from .openai_service import OpenAIService

KNOWN_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user", "pooling", "normalize",
                          "truncate_prompt_tokens", "add_special_tokens"}) | IGNORED_FIELDS
ENCODINGS = ("float", "base64")
POOLINGS = ("last", "mean", "cls")  # acb.core.pooling.POOLINGS, as the wire spells them


def _item_error(i: int, why: str) -> ApiError:
    return ApiError(400, f"'input[{i}]' {why}", param="input")


def _inputs(body: dict[str, Any]) -> list[str | list[int]]:
    """``input`` as a list of single inputs (texts or token-id lists), or the 400 naming it."""
    value = body.get("input")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]  # one prompt of token ids
    if not isinstance(value, list) or not value:
        raise field_error("input", "must be a non-empty string, a list of strings, a list of token ids or a list of "
                          f"token-id lists, got {value!r}"[:300])
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise _item_error(i, "is an empty string")
        elif not isinstance(item, list) or not item or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in item):
            raise _item_error(i, "must be a non-empty string or a non-empty list of token ids")
    return value


def _options(body: dict[str, Any]) -> tuple[str, str, bool]:
    """(encoding_format, pooling, normalize) of ``body``; a 400 naming a field acb cannot honour."""
    # identity checks, never ``in``/``or``: 0 == False and 1 == True, "" is falsy, and a JSON 0 is no boolean
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if not isinstance(encoding, str) or encoding not in ENCODINGS:
        raise field_error("encoding_format", f"must be 'float' or 'base64', got {encoding!r}")
    if body.get("dimensions") is not None:
        raise field_error("dimensions", "is not supported: this model's embeddings have one size (its hidden size); "
                          "leave it out")
    if body.get("truncate_prompt_tokens") is not None:
        raise field_error("truncate_prompt_tokens", "is not supported: send inputs that fit the model's context")
    if body.get("add_special_tokens") is not None and body["add_special_tokens"] is not True:
        raise field_error("add_special_tokens", "must be true: texts are tokenized as the model's tokenizer does")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise field_error("user", "must be a string")
    pooling = body.get("pooling")
    pooling = "last" if pooling is None else pooling
    if not isinstance(pooling, str) or pooling not in POOLINGS:
        raise field_error("pooling", f"must be 'last', 'mean' or 'cls', got {pooling!r}")
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise field_error("normalize", f"must be a boolean, got {normalize!r}")
    return encoding, pooling, normalize is not False


def _token_ids(engine: acb.Engine, inputs: list[str | list[int]]) -> list[list[int]]:
    """Each input's token ids as the engine runs them (on a worker thread for a batch)."""
    out = []
    for i, item in enumerate(inputs):
        try:
            out.append(engine.tokenize(item))
        except acb.InvalidRequestError as e:
            raise _item_error(i, f"cannot be embedded: {e}") from None
    return out


def encoded(vector: list[float], encoding: str) -> list[float] | str:
    """A vector as the response carries it: floats, or base64 of its little-endian float32 bytes."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingsService:
    """``POST /v1/embeddings`` over the engine of an :class:`OpenAIService` (its model names and API key)."""

    def __init__(self, service: OpenAIService) -> None:
        self.service = service
        self.engine = service.engine

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """The embeddings response of ``body``, or an :class:`ApiError` (400 naming the field)."""
        model = self.service.model_field(body)
        if model != self.service.model_name:
            raise field_error("model", f"names the LoRA adapter {model!r}: embeddings come from the served model "
                              f"{self.service.model_name!r}")
        note_unknown(body, KNOWN_FIELDS, "/v1/embeddings")
        inputs = _inputs(body)
        encoding, pooling, normalize = _options(body)
        if len(inputs) > 8 or sum(len(t) for t in inputs) > 2048:
            prompts = await anyio.to_thread.run_sync(_token_ids, self.engine, inputs, abandon_on_cancel=True)
        else:
            prompts = _token_ids(self.engine, inputs)
        try:
            vectors = await self.engine.embed(prompts, pooling=pooling, normalize=normalize)
        except acb.InvalidRequestError as e:
            raise ApiError(400, str(e).replace("inputs", "input"), param="input") from None
        except acb.AcbError as e:
            raise engine_error(e, chat=False) from None
        tokens = sum(len(ids) for ids in prompts)
        return {"object": "list", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, "embedding": encoded(v, encoding)}
                         for i, v in enumerate(vectors)]}


__all__ = ["EmbeddingsService", "encoded"]
