"""``SamplingParams``: how to sample and when to stop (the model side of a request; the
hardware side is :class:`acb.core.config.EngineConfig`). It validates at construction and
raises ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .checks import is_int, is_number
from .errors import InvalidRequestError
from .reasoning import PARSERS as REASONING_PARSERS

# What a request may leave unset (None) for the engine's default SamplingParams and then
# the model's generation_config to supply.
FROM_GENERATION_CONFIG = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "do_sample")


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """``logit_bias`` as {token id: finite bias}; JSON's string keys ("50256") are accepted."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}",
                                  param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not is_int(token) or token < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}",
                                      param="logit_bias")
        if not is_number(value) or not math.isfinite(value):
            raise InvalidRequestError(f"logit_bias[{key!r}] must be a finite number, got {value!r}",
                                      param="logit_bias")
        out[token] = float(value)
    return out or None


def _processors(processors: Any) -> tuple[Callable[[Any, Any], Any], ...]:
    """``logits_processors`` as a tuple of callables (None: none)."""
    if processors is None:
        return ()
    if callable(processors):
        processors = (processors,)
    if not isinstance(processors, (list, tuple)):
        raise InvalidRequestError(f"logits_processors must be a list of callables (input_ids, scores) -> scores, got "
                                  f"{type(processors).__name__}", param="logits_processors")
    for i, p in enumerate(processors):
        if not callable(p):
            raise InvalidRequestError(f"logits_processors[{i}] must be callable (input_ids, scores) -> scores (a "
                                      f"transformers LogitsProcessor or a function), got {type(p).__name__}",
                                      param="logits_processors")
    return tuple(processors)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample and when to stop (the model side).

    ``None`` means unset: the engine's default SamplingParams, then the model's
    ``generation_config`` fill it (see ``resolved``); ``max_new_tokens=None`` runs to the
    engine's context limit. Sampling: ``temperature`` (0 = greedy), ``do_sample``,
    ``top_k`` (0 = off), ``top_p`` (1 = off), ``min_p`` (0 = off), ``seed``. Logit
    processors, in transformers' order: ``logit_bias`` ({token id: bias} added to the
    logits), ``repetition_penalty`` (1 = off; over prompt and output, as transformers),
    ``presence_penalty`` / ``frequency_penalty`` (0 = off; over the output, as OpenAI and
    vLLM), ``min_new_tokens`` (EOS and ``stop_token_ids`` masked until then, and ``stop``
    strings not looked for in those tokens' text, as vLLM's ``min_tokens``; a structured
    output's grammar, once complete, ends the request before it). Output:
    ``logprobs`` (the chosen token's), ``top_logprobs`` (k alternatives per token), ``n``
    (choices forked from one prompt). Structured output (at most one): ``json_schema``
    (dict or JSON string), ``regex``, ``choice`` (list of strings). ``timeout_s``: a
    deadline in seconds from submission (None = no deadline); a request still running then
    ends with ``finish_reason="timeout"``, its partial output kept and its pages freed.
    ``prompt_logprobs`` (None = off; k >= 0): the logprob and rank of every prompt token
    after the first, and its k most likely alternatives, computed in the prefill steps and
    returned once (``Completion.prompt_logprobs``, the first ``Chunk`` of each choice); such
    a request does not read the prefix cache (its cached pages' logits were not kept).
    ``reasoning_parser`` (None = off; ``"think"``, ``"deepseek_r1"``, see ``acb.core.reasoning``):
    the text between ``<think>`` and ``</think>`` goes to ``Chunk.reasoning_text`` /
    ``Completion.reasoning_text`` instead of ``text``; ``Chunk.reasoning_mask`` marks its tokens.
    ``priority`` (0; lower = more urgent, vLLM's convention): the order of admission and
    preemption under ``EngineConfig(scheduler="priority")``; any other scheduler refuses a
    request that sets it (``InvalidRequestError`` naming ``priority``).
    ``adapter`` (None = the base model): the name of a LoRA adapter loaded with
    ``Engine.load_adapter``; rows with different adapters share one step (``acb.model.lora``).
    ``speculative`` (None = the engine's ``EngineConfig.speculative_method``; False: this
    request never carries proposals; see docs/speculative.md).
    ``logits_processors`` (in-process only, never on the wire): transformers ``LogitsProcessor``
    objects or plain callables ``(input_ids, scores) -> scores``, applied in order to this
    request's row alone after acb's own processors (and before a structured output's mask):
    ``input_ids`` is ``[1, prompt + output so far]`` (int64), ``scores`` ``[1, vocab]``
    (float32). One that raises or returns another shape fails this request
    (``RequestFailedError`` naming it); the others in the batch go on untouched. Such a
    request does not speculate. Cost: one Python call per processor per generated token
    (docs/streaming.md#per-request-logits-processors).

    Example::

        params = acb.SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, seed=1)
    """

    max_new_tokens: int | None = 64
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float | None = None
    min_new_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    do_sample: bool | None = None
    n: int = 1
    json_schema: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    timeout_s: float | None = None
    prompt_logprobs: int | None = None
    reasoning_parser: str | None = None
    priority: int = 0
    adapter: str | None = None
    speculative: bool | None = None
    logits_processors: tuple[Callable[[Any, Any], Any], ...] = ()

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples so params stay hashable.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError(f"stop must be a list of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise InvalidRequestError("stop must not contain an empty string")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids if self.stop_token_ids is not None else ()
        if not isinstance(ids, (list, tuple)) or not all(is_int(i) and i >= 0 for i in ids):
            raise InvalidRequestError(
                f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.max_new_tokens is not None and (not is_int(self.max_new_tokens) or self.max_new_tokens < 1):
            raise InvalidRequestError(
                f"max_new_tokens must be None (until the context limit) or an int >= 1, got {self.max_new_tokens!r}",
                param="max_new_tokens")
        self._check_number("temperature", lambda v: v >= 0, "a finite number >= 0 (0 = greedy)")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 0):
            raise InvalidRequestError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}", param="top_k")
        self._check_number("top_p", lambda v: 0 < v <= 1, "in (0, 1] (1 = off)")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}", param="seed")
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool, got {getattr(self, name)!r}", param=name)
        if self.do_sample is not None and not isinstance(self.do_sample, bool):
            raise InvalidRequestError(f"do_sample must be None or a bool, got {self.do_sample!r}", param="do_sample")
        for name, low in (("top_logprobs", 0), ("min_new_tokens", 0), ("n", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise InvalidRequestError(f"{name} must be an int >= {low}, got {value!r}", param=name)
        self._check_number("repetition_penalty", lambda v: v > 0, "a finite number > 0 (1 = off)")
        self._check_number("presence_penalty", lambda v: True, "a finite number (0 = off)")
        self._check_number("frequency_penalty", lambda v: True, "a finite number (0 = off)")
        self._check_number("min_p", lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)")
        self._check_number("timeout_s", lambda v: v > 0, "None (no deadline) or a number of seconds > 0")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise InvalidRequestError(f"reasoning_parser must be None or one of {', '.join(REASONING_PARSERS)}, got "
                                      f"{self.reasoning_parser!r}", param="reasoning_parser")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise InvalidRequestError(f"prompt_logprobs must be None (off) or an int >= 0 (alternatives per prompt "
                                      f"token), got {self.prompt_logprobs!r}", param="prompt_logprobs")
        if not is_int(self.priority) or not -(2**31) <= self.priority < 2**31:
            raise InvalidRequestError(f"priority must be an int in [-2**31, 2**31) (lower = more urgent), got "
                                      f"{self.priority!r}", param="priority")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise InvalidRequestError(f"adapter must be None (the base model) or the name of a loaded adapter, got "
                                      f"{self.adapter!r}", param="adapter")
        if self.speculative is not None and self.speculative is not False:  # (0 == False: no 0)
            raise InvalidRequestError(f"speculative must be None (the engine's EngineConfig.speculative_method) or "
                                      f"False (this request does not speculate), got {self.speculative!r}",
                                      param="speculative")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "logits_processors", _processors(self.logits_processors))
        self._check_structure()

    def _check_number(self, name: str, ok: Any, what: str) -> None:
        value = getattr(self, name)
        if value is not None and (not is_number(value) or not math.isfinite(value) or not ok(value)):
            raise InvalidRequestError(f"{name} must be {what}, got {value!r}", param=name)

    def _check_structure(self) -> None:
        """json_schema / regex / choice: at most one, each well formed."""
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one of json_schema, regex and choice, got {given}",
                                      param=given[1])
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"json_schema is not valid JSON: {e}", param="json_schema") from e
            if not isinstance(parsed, (dict, bool)):
                raise InvalidRequestError("json_schema must be a JSON object", param="json_schema")
        elif schema is not None and not isinstance(schema, dict):
            raise InvalidRequestError(f"json_schema must be a dict or a JSON string, got {type(schema).__name__}",
                                      param="json_schema")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise InvalidRequestError(f"regex must be a non-empty str, got {self.regex!r}", param="regex")
            try:
                re.compile(self.regex)
            except re.error as e:
                raise InvalidRequestError(f"regex does not compile: {e}", param="regex") from e
        if self.choice is not None:
            choice = self.choice
            if (not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise InvalidRequestError(f"choice must be a non-empty list of non-empty strings, got {choice!r}",
                                          param="choice")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def structured(self) -> bool:
        """Whether the output is constrained by json_schema, regex or choice."""
        return self.json_schema is not None or self.regex is not None or self.choice is not None

    @property
    def greedy(self) -> bool:
        """Whether this request picks the most likely token (after ``resolved``)."""
        return not self.temperature

    def resolved(self, default: SamplingParams, generation: dict[str, Any]) -> SamplingParams:
        """Fill what this request leaves unset (None) from ``default`` (the engine's
        SamplingParams), then from ``generation`` (what the model's generation_config
        sets), as transformers' ``generate`` does; the result holds concrete values.

        ``do_sample`` unset means: sample when a temperature > 0 was asked for (by the
        request or the engine's default), else follow the model's ``do_sample``."""
        values = {name: getattr(self, name) if getattr(self, name) is not None else getattr(default, name)
                  for name in FROM_GENERATION_CONFIG}
        do_sample = values["do_sample"]
        if do_sample is None:
            temperature = values["temperature"]
            do_sample = temperature > 0 if temperature is not None else bool(generation.get("do_sample"))
        for name, off in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0), ("min_p", 0.0),
                          ("repetition_penalty", 1.0)):
            if values[name] is None:
                values[name] = generation.get(name) if generation.get(name) is not None else off
        if not do_sample:
            values["temperature"] = 0.0
        elif values["temperature"] == 0:
            raise InvalidRequestError("do_sample=True needs a temperature > 0", param="temperature")
        values["do_sample"] = do_sample
        return dataclasses.replace(self, **values)

    def merged(self, overrides: dict[str, Any]) -> SamplingParams:
        """Return a copy with ``overrides`` applied; unknown keys raise ``InvalidRequestError``."""
        if not overrides:
            return self
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown keyword argument(s): {', '.join(unknown)}; "
                f"sampling keywords are: {', '.join(sorted(known))}",
                param=unknown[0],
            )
        return dataclasses.replace(self, **overrides)
