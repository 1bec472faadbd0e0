"""OpenAI request fields one at a time: the value checks every field goes through (a bad
value is an :class:`~acb.integrations.common.ApiError`, 400, naming the field), and the
sampling fields (``max_tokens``, ``temperature``, penalties, ``stop``, ``logit_bias``,
``logprobs``, the structured-output fields) as the engine's keywords.
:mod:`acb.integrations.openai_requests` assembles a whole request from them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .common import ApiError

# Engine keyword -> the wire field it came from, for errors the engine raises.
WIRE_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs": "logprobs"}
MAX_LOGPROBS = 20


def field_error(name: str, why: str) -> ApiError:
    """The 400 naming the field ``name``: ``'name' why``."""
    return ApiError(400, f"'{name}' {why}", param=name)


def int_field(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    """``body[name]``: None when unset, else an int in [lo, hi] (a bool is not one)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise field_error(name, f"must be an integer {bound}, got {value!r}")
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _float(body: dict, name: str, lo: float, hi: float = math.inf, *, open_low: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _number(value) or value > hi or value < lo or (open_low and value == lo):
        raise field_error(name, f"must be a number in {'(' if open_low else '['}{lo}, {hi}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Scalar:
    """A request field holding one number or boolean: its JSON type and range. The parser reads
    it through :func:`read` and ``GET /openapi.json`` publishes :meth:`schema`: one table, so
    the published ranges are the ones enforced."""

    type: str  # "integer", "number" or "boolean"
    lo: float | None = None
    hi: float | None = None
    open_low: bool = False  # lo itself excluded
    doc: str = ""
    only: bool | None = None  # a boolean acb honours one way only (the other is a 400 naming it)

    def schema(self) -> dict[str, Any]:
        # null: unset, as clients send optional fields they leave to the server
        out: dict[str, Any] = {"type": [self.type, "null"]}
        if self.only is not None:
            out["enum"] = [self.only, None]
        if self.lo is not None:
            out["exclusiveMinimum" if self.open_low else "minimum"] = self.lo
        if self.hi is not None and self.hi != math.inf:
            out["maximum"] = self.hi
        if self.doc:
            out["description"] = self.doc
        return out


_INT32 = 2**31 - 1
# The scalar fields of /v1/completions and /v1/chat/completions (CHAT_SCALARS: where chat differs)
SCALARS: dict[str, Scalar] = {
    "max_tokens": Scalar("integer", 0, doc="tokens to generate at most (default 16); 0 only with echo: "
                                             "the prompt scored, nothing generated"),
    "temperature": Scalar("number", 0.0, doc="0: greedy"),
    "top_p": Scalar("number", 0.0, 1.0, open_low=True),
    "top_k": Scalar("integer", -1, doc="-1 or 0: off (vLLM's extension)"),
    "min_p": Scalar("number", 0.0, 1.0, doc="vLLM's extension"),
    "seed": Scalar("integer", 0, 2**63 - 1),
    "presence_penalty": Scalar("number", -2.0, 2.0),
    "frequency_penalty": Scalar("number", -2.0, 2.0),
    "repetition_penalty": Scalar("number", 0.0, open_low=True, doc="1: off (vLLM's extension)"),
    "min_tokens": Scalar("integer", 0, doc="tokens to generate before EOS or a stop ends it (vLLM's extension)"),
    "timeout_s": Scalar("number", 0.0, open_low=True, doc="acb's own: the request ends with what it has after "
                                                          "this many seconds"),
    "priority": Scalar("integer", -_INT32 - 1, _INT32, doc="lower runs first, under acb serve --scheduler priority"),
    "n": Scalar("integer", 1, doc="choices per prompt"),
    "best_of": Scalar("integer", 1, doc="must equal n"),
    "logprobs": Scalar("integer", 0, MAX_LOGPROBS, doc="alternatives per token, with each token's log-probability"),
    "prompt_logprobs": Scalar("integer", 0, MAX_LOGPROBS, doc="the prompt's log-probabilities (vLLM's extension)"),
    **{name: Scalar("boolean") for name in (
        "stream", "echo", "ignore_eos", "return_tokens_as_token_ids", "include_metrics")},
    "use_beam_search": Scalar("boolean", only=False, doc="beam search is not supported"),
    "include_stop_str_in_output": Scalar("boolean", only=False, doc="the stop string is never included"),
    "skip_special_tokens": Scalar("boolean", only=True, doc="special tokens are always skipped in text"),
    "add_special_tokens": Scalar("boolean", only=True, doc="the tokenizer's special tokens are always added"),
}
CHAT_SCALARS: dict[str, Scalar] = {
    **SCALARS,
    "max_tokens": Scalar("integer", 1, doc="tokens to generate at most (default: the server's)"),
    "max_completion_tokens": Scalar("integer", 1, doc="max_tokens' newer name"),
    "logprobs": Scalar("boolean", doc="each generated token's log-probability"),
    "top_logprobs": Scalar("integer", 0, MAX_LOGPROBS, doc="alternatives per token (needs logprobs)"),
    "echo": Scalar("boolean", only=False, doc="echo is for completions, not chat completions"),
    "add_special_tokens": Scalar("boolean", only=False, doc="the chat template places the special tokens"),
    **{name: Scalar("boolean") for name in ("parallel_tool_calls", "add_generation_prompt",
                                            "continue_final_message")},
}


def read(body: dict, name: str, chat: bool = False) -> Any:
    """``body[name]`` checked against its :data:`SCALARS` (chat: :data:`CHAT_SCALARS`) entry:
    None when unset, else a value of its type within its range (a boolean acb honours one way
    only: that value), or a 400 naming it."""
    return read_scalar(body, name, (CHAT_SCALARS if chat else SCALARS)[name])


def read_scalar(body: dict, name: str, spec: Scalar) -> Any:
    """``body[name]`` checked against ``spec`` (another API's table: the Anthropic routes')."""
    if spec.type == "boolean":
        value = bool_field(body, name)
        if spec.only is not None and value is not None and value != spec.only:
            raise field_error(name, f"is not supported (only {spec.only}): {spec.doc}")
        return value
    if spec.type == "integer":
        return int_field(body, name, int(spec.lo), None if spec.hi is None else int(spec.hi))
    return _float(body, name, spec.lo, math.inf if spec.hi is None else spec.hi, open_low=spec.open_low)


def bool_field(body: dict, name: str) -> bool | None:
    """``body[name]``: None when unset, else a boolean."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise field_error(name, f"must be a boolean, got {value!r}")
    return value


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise field_error("stop", f"must be a string or a list of strings, got {body['stop']!r}")
    return [s for s in stop if s] or None


def _logit_bias(body: dict) -> dict[int, float] | None:
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise field_error("logit_bias", f"must be an object of token id -> bias, got {bias!r}")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise field_error("logit_bias", f"keys must be token ids, got {key!r}") from None
        if token < 0 or not _number(value):
            raise field_error("logit_bias", f"must map non-negative token ids to numbers, got {key!r}: {value!r}")
        out[token] = max(-100.0, min(100.0, float(value)))  # OpenAI's range, clamped as vLLM does
    return out or None


def _json_schema_value(name: str, value: Any) -> dict | str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise field_error(name, f"is not valid JSON: {e}") from None
        return value
    if not isinstance(value, dict):
        raise field_error(name, f"must be a JSON schema object, got {value!r}")
    return value


_ANY_JSON_OBJECT = {"type": "object", "additionalProperties": True}


def _structured(body: dict) -> tuple[str, str, Any] | None:
    """(wire field, engine keyword, value) of the one output constraint the request asks for."""
    found: list[tuple[str, str, Any]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", "json_schema", _ANY_JSON_OBJECT))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise field_error("response_format", "of type 'json_schema' needs a 'json_schema' object")
            schema = spec.get("schema", spec.get("json_schema"))
            found.append(("response_format", "json_schema",
                          _ANY_JSON_OBJECT if schema is None else _json_schema_value("response_format", schema)))
        elif kind != "text":
            raise field_error("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {fmt!r}")
    if body.get("guided_json") is not None:
        found.append(("guided_json", "json_schema", _json_schema_value("guided_json", body["guided_json"])))
    if body.get("guided_regex") is not None:
        found.append(("guided_regex", "regex", body["guided_regex"]))
    if body.get("guided_choice") is not None:
        found.append(("guided_choice", "choice", body["guided_choice"]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise field_error("structured_outputs", "must be an object like {'json': schema} or {'regex': ...}")
        for key, value in outputs.items():
            if key == "json" and value is not None:
                found.append(("structured_outputs", "json_schema", _json_schema_value("structured_outputs", value)))
            elif key == "json_object" and value:
                found.append(("structured_outputs", "json_schema", _ANY_JSON_OBJECT))
            elif key in ("regex", "choice") and value is not None:
                found.append(("structured_outputs", key, value))
            elif key in ("grammar", "structural_tag") and value is not None:
                raise field_error("structured_outputs",
                                  f"'{key}' is not supported (json, json_object, regex or choice)")
    if len(found) > 1:
        raise field_error(found[1][0], f"conflicts with '{found[0][0]}': ask for one output constraint")
    if not found:
        return None
    wire, key, value = found[0]
    if key == "regex" and not isinstance(value, str):
        raise field_error(wire, f"regex must be a string, got {value!r}")
    if key == "choice" and not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
        raise field_error(wire, f"choice must be a non-empty list of strings, got {value!r}")
    return found[0]


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(chosen-token logprobs wanted, alternatives per token)."""
    if chat:
        want = bool(read(body, "logprobs", chat))
        top = read(body, "top_logprobs", chat) or 0
        if top and not want:
            raise field_error("top_logprobs", "needs 'logprobs': true")
        return want, top
    top = read(body, "logprobs")
    return top is not None, top or 0


def sampling_keywords(body: dict, chat: bool, n: int, *,  # long: one mapping per OpenAI field
                      max_tokens_limit: int, default_max_tokens: int,
                      default_temperature: float | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The sampling keywords (only those set to something other than the neutral value,
    so a client that spells out defaults works with any engine) and their wire names."""
    limit_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    echo = not chat and bool(read(body, "echo"))
    max_tokens = read(body, limit_name, chat)
    if max_tokens == 0 and not echo:  # echo with 0: score the prompt only
        raise field_error(limit_name, "must be an integer >= 1 (0 only with 'echo'), got 0")
    if max_tokens is None:
        max_tokens = min(default_max_tokens if chat else 16, max_tokens_limit)
    elif max_tokens > max_tokens_limit:
        raise field_error(limit_name, f"is {max_tokens}, more than this server allows ({max_tokens_limit})")
    sampling: dict[str, Any] = {
        "max_new_tokens": max_tokens or 1,  # (max_tokens 0: the one token sampled is not sent)
        "temperature": read(body, "temperature"),
        "top_p": read(body, "top_p"),
        "top_k": max(read(body, "top_k") or 0, 0) or None,  # -1: vLLM's spelling of "off"
        "min_p": read(body, "min_p") or None,
        "seed": read(body, "seed"),
        "stop": _stop(body),
        "ignore_eos": read(body, "ignore_eos") or None,
        "presence_penalty": read(body, "presence_penalty") or None,
        "frequency_penalty": read(body, "frequency_penalty") or None,
        "repetition_penalty": read(body, "repetition_penalty"),
        "min_new_tokens": read(body, "min_tokens") or None,
        "logit_bias": _logit_bias(body),
        "n": n if n > 1 else None,
        "timeout_s": read(body, "timeout_s"),
        # honoured under scheduler="priority"; any other engine refuses it by name
        "priority": read(body, "priority") or None,
    }
    if (sampling["min_new_tokens"] or 0) > max_tokens:
        raise field_error("min_tokens", f"({sampling['min_new_tokens']}) must be at most {limit_name} ({max_tokens})")
    if sampling["repetition_penalty"] == 1.0:
        sampling["repetition_penalty"] = None
    want, top = _logprobs(body, chat)
    sampling["logprobs"] = want or None
    sampling["top_logprobs"] = top or None
    # the prompt's scores: vLLM's prompt_logprobs, and completions' echo with logprobs (the
    # legacy shape covers the prompt, then the completion)
    prompt_k = read(body, "prompt_logprobs")
    if echo and want:
        prompt_k = max(prompt_k or 0, top)
    sampling["prompt_logprobs"] = prompt_k
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise field_error("stop_token_ids", "must be a list of non-negative integers")
        sampling["stop_token_ids"] = ids or None
    wire = {**WIRE_NAMES, "max_new_tokens": limit_name}
    if chat:
        wire["top_logprobs"] = "top_logprobs"
    constraint = _structured(body)
    if constraint is not None:
        wire_name, key, value = constraint
        sampling[key] = value
        wire[key] = wire_name
    sampling = {k: v for k, v in sampling.items() if v is not None}
    if default_temperature is not None:
        sampling.setdefault("temperature", default_temperature)
    return sampling, wire
