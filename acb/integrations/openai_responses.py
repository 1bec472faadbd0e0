"""OpenAI's response objects: a request's completions shaped as a ``chat.completion`` /
``text_completion`` object, or chunk by chunk as the stream's (:class:`Shaper`), with usage,
finish reasons, logprobs, tool calls and reasoning in OpenAI's (and vLLM's) fields; engine
errors in OpenAI's terms (:func:`engine_error`). The requests are read by
:mod:`acb.integrations.openai_requests`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import acb

from .common import ApiError, api_error_from
from .metrics import request_metrics
from .openai_fields import WIRE_NAMES
from .openai_requests import ParsedRequest

# A request ended by its deadline (timeout_s) was cut short by a limit, as "length" is:
# OpenAI's clients know no other reason for that (vLLM reports its own limits as "length").
_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length"}


def engine_error(error: acb.AcbError, *, chat: bool, wire_names: dict[str, str] | None = None) -> ApiError:
    """An engine error in OpenAI's terms (field names as the client sent them)."""
    api = api_error_from(error)
    names = {**WIRE_NAMES, **(wire_names or {}), "prompt": "messages" if chat else "prompt"}
    if api.param in names:
        api.message = api.message.replace(api.param, names[api.param]) if api.param != "prompt" else api.message
        api.param = names[api.param]
    return api


def finish_reason(reason: str | None) -> str | None:
    return _FINISH_REASONS.get(reason, reason) if reason is not None else None


def _usage(prompt: int, generated: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


def usage(completions: list[acb.Completion]) -> dict[str, Any]:
    """Usage over the request's prompts: each prompt counted once, every choice's tokens;
    ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache served (as
    OpenAI and vLLM report them; a prompt's first choice's count)."""
    out: dict[str, Any] = _usage(sum(len(c.prompt_token_ids) for c in completions),
                                 sum(len(choice.token_ids) for c in completions for choice in c.choices))
    cached = sum(c.metrics.num_cached_prompt_tokens for c in completions if c.metrics is not None)
    out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


@dataclass
class _Choice:
    text_offset: int = 0
    generated: int = 0
    started: bool = False
    tools: acb.tools.ToolStream | None = None  # chat with tools: the parser reading this choice's text
    calls: int = 0  # tool calls sent


class Shaper:
    """Builds one request's response objects (whole, or chunk by chunk when streaming).

    ``prompt_texts`` are the prompts' texts (for ``echo``) and ``prompt_lengths``
    their token counts, one per prompt; choice ``i`` of prompt ``p`` is index ``p * n + i``."""

    def __init__(self, request: ParsedRequest, model: str, token_text: Callable[[int], str],
                 prompt_texts: list[str] | None = None, prompt_lengths: list[int] | None = None) -> None:
        self.request = request
        self.model = model
        self.token_text = (lambda t: f"token_id:{t}") if request.tokens_as_ids else token_text
        self.prompt_texts = prompt_texts or [""] * len(request.prompts)
        self.prompt_lengths = prompt_lengths or [0] * len(request.prompts)
        self.choices: dict[int, _Choice] = {}
        self.obj = "chat.completion.chunk" if request.chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.request.id, "object": obj, "created": self.request.created, "model": self.model,
                "system_fingerprint": None}

    def _alternatives(self, top: dict[int, float]) -> list[tuple[str, float]]:
        return [(self.token_text(t), lp) for t, lp in sorted(top.items(), key=lambda kv: -kv[1])]

    @staticmethod
    def _by_text(alternatives: list[tuple[str, float]]) -> dict[str, float]:
        """The legacy ``top_logprobs`` dict: tokens whose text is the same (bytes of a split
        character) keep the most likely one's logprob."""
        out: dict[str, float] = {}
        for text, lp in alternatives:
            out.setdefault(text, lp)
        return out

    def logprobs(self, state: _Choice, token_ids: list[int], logprobs: list[float] | None,
                 top_logprobs: list[dict[int, float]] | None = None) -> dict[str, Any] | None:
        """The OpenAI ``logprobs`` object of these tokens (chat or completions shape)."""
        if not self.request.logprobs or logprobs is None:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        tops = [self._alternatives(top) for top in top_logprobs] if top_logprobs else None
        if self.request.chat:
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())}
                                  for a, alp in (tops[i] if tops else [])]}
                for i, (s, lp) in enumerate(zip(tokens, logprobs))]}
        offsets = []
        for s in tokens:
            offsets.append(state.text_offset)
            state.text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": list(logprobs),
                "top_logprobs": [self._by_text(alts) for alts in tops] if tops else None, "text_offset": offsets}

    def echo_logprobs(self, scores: acb.PromptLogprobs | None, generated: dict[str, Any] | None) -> dict | None:
        """Completions' ``echo`` with ``logprobs``: the legacy shape over the prompt's tokens
        (the first one's logprob ``null``), then the generated ones' (``generated``)."""
        if not (self.request.echo and self.request.logprobs) or scores is None:
            return generated
        k = self.request.top_logprobs
        offsets, at = [], 0
        tokens = [self.token_text(t) for t in scores.token_ids]
        for s in tokens:
            offsets.append(at)
            at += len(s)
        prompt = {"tokens": tokens, "token_logprobs": list(scores.logprobs),
                  "top_logprobs": [None if top is None else self._by_text(self._alternatives(top)[:k])
                                   for top in scores.top_logprobs] if k else None,
                  "text_offset": offsets}
        if generated is None:
            return prompt
        if k:
            prompt["top_logprobs"] += generated["top_logprobs"] or []
        for key in ("tokens", "token_logprobs", "text_offset"):
            prompt[key] += generated[key]
        return prompt

    def vllm_prompt_logprobs(self, scores: acb.PromptLogprobs | None) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token (``null`` for the first) {token id:
        {logprob, rank, decoded_token}} for the token itself and its ``prompt_logprobs``
        most likely alternatives."""
        k = self.request.prompt_logprobs
        if k is None or scores is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for p in range(1, len(scores)):
            token = scores.token_ids[p]
            entry = {str(token): {"logprob": scores.logprobs[p], "rank": scores.ranks[p],
                                  "decoded_token": self.token_text(token)}}
            alternatives = sorted(scores.top_logprobs[p].items(), key=lambda kv: -kv[1])[:k]
            for rank, (t, lp) in enumerate(alternatives, 1):
                entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)})
            out.append(entry)
        return out

    def _choice(self, index: int, text: str, reason: str | None, logprobs: dict | None,
                *, first: bool, tool_calls: list[dict[str, Any]] | None = None, called: bool = False,
                reasoning: str | None = None) -> dict[str, Any]:
        """One choice; ``tool_calls``: its calls (whole, or a stream's new entries); ``called``:
        the choice made calls (its finish reason is then ``"tool_calls"``); ``reasoning``: its
        thought (whole, or a stream's new text)."""
        choice: dict[str, Any] = {"index": index}
        if self.request.chat and self.request.stream:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text or first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        elif self.request.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.request.reasoning:
                choice["message"]["reasoning_content"] = reasoning or None
            if tool_calls:
                choice["message"].update(content=text or None, tool_calls=tool_calls)
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason(reason)
        if called and reason in ("eos", "stop"):
            choice["finish_reason"] = "tool_calls"
        return choice

    def _tool_parser(self) -> acb.tools.ToolParser:
        names = [t["function"]["name"] for t in self.request.tools]
        return acb.tools.get_parser(self.request.tool_parser, names)

    def tool_calls(self, text: str) -> tuple[str, list[acb.tools.ToolCall]]:
        """A whole chat output with tools: (content, calls)."""
        if self.request.tool_choice == "function":  # the grammar made the output the arguments
            return "", [acb.tools.ToolCall(self.request.tool_name, text.strip())]
        return self._tool_parser().parse(text)

    def _stream_tool_calls(self, state: _Choice, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """A streamed chat choice with tools: (content, new ``tool_calls`` delta entries)."""
        request = self.request
        if request.tool_choice == "function":  # the text is the arguments, streamed as they come
            if state.calls:
                return "", [{"index": 0, "function": {"arguments": text}}] if text else []
            state.calls = 1
            return "", [{"index": 0, **acb.tools.ToolCall(request.tool_name, text).to_openai()}]
        if state.tools is None:
            state.tools = self._tool_parser().stream()
        content, calls = state.tools.push(text)
        if final:
            more, last = state.tools.finish()
            content, calls = content + more, calls + last
        entries = []
        for call in calls:
            entries.append({"index": state.calls, **call.to_openai()})
            state.calls += 1
        return content, entries

    def visible(self, completions: list[acb.Completion]) -> list[acb.Completion]:
        """The completions as the client asked for them: with ``max_tokens`` 0 (echo,
        scoring only) the one token the engine sampled is not part of the answer."""
        if not self.request.scoring_only:
            return completions
        out = []
        for completion in completions:
            trimmed = [dataclasses.replace(one, token_ids=[], text="", choices=[],
                                           logprobs=[] if one.logprobs is not None else None,
                                           top_logprobs=[] if one.top_logprobs is not None else None)
                       for one in completion.choices]
            for one in trimmed:
                one.choices = trimmed
            out.append(trimmed[0])
        return out

    def response(self, completions: list[acb.Completion]) -> dict[str, Any]:
        """The non-streaming answer over every prompt's completion."""
        completions = self.visible(completions)
        choices = []
        prompt_logprobs = None
        for p, completion in enumerate(completions):
            for i, one in enumerate(completion.choices):
                state = _Choice(text_offset=len(self.prompt_texts[p]) if self.request.echo else 0)
                text = (self.prompt_texts[p] if self.request.echo else "") + one.text
                lp = self.logprobs(state, one.token_ids, one.logprobs, one.top_logprobs)
                lp = self.echo_logprobs(one.prompt_logprobs, lp)
                calls = None
                if self.request.tools:
                    text, found = self.tool_calls(text)
                    calls = [c.to_openai() for c in found]
                choice = self._choice(p * self.request.n + i, text, one.finish_reason, lp, first=False,
                                      tool_calls=calls, called=bool(calls), reasoning=one.reasoning_text)
                if self.request.prompt_logprobs is not None:
                    prompt_logprobs = self.vllm_prompt_logprobs(one.prompt_logprobs)
                    if not self.request.chat:
                        choice["prompt_logprobs"] = prompt_logprobs
                if self.request.include_metrics:
                    choice["metrics"] = request_metrics(one.metrics)
                choices.append(choice)
        obj = "chat.completion" if self.request.chat else "text_completion"
        out = {**self._head(obj), "choices": choices, "usage": usage(completions)}
        if self.request.include_metrics and len(choices) == 1:  # vLLM's place: one request, one answer
            out["metrics"] = choices[0].pop("metrics")
        if self.request.chat and self.request.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs  # vLLM: chat's is the response's (one prompt)
        return out

    def chunk(self, prompt_index: int, chunk: acb.Chunk) -> dict[str, Any] | None:
        """One engine chunk as a streaming chunk (None when it carries nothing to send).
        A choice's first chunk carries chat's role (and completions' echoed prompt):
        it goes out with the first generated token, not before prefill."""
        index = prompt_index * self.request.n + chunk.index
        state = self.choices.setdefault(index, _Choice())
        first = not state.started
        token_ids, text = chunk.token_ids, chunk.text
        if self.request.scoring_only:  # max_tokens 0: the token sampled is not sent
            token_ids, text = [], ""
        if first and self.request.echo:
            text = self.prompt_texts[prompt_index] + text
            state.text_offset = len(self.prompt_texts[prompt_index])
        state.generated += len(token_ids)
        lp = self.logprobs(state, token_ids, chunk.logprobs, chunk.top_logprobs) if token_ids else None
        if first:
            lp = self.echo_logprobs(chunk.prompt_logprobs, lp)
        calls = None
        if self.request.tools:
            text, calls = self._stream_tool_calls(state, text, chunk.finish_reason is not None)
        if not (first or text or lp or calls or chunk.reasoning_text or chunk.finish_reason):
            return None
        state.started = True
        choice = self._choice(index, text, chunk.finish_reason, lp, first=first and self.request.chat,
                              tool_calls=calls, called=state.calls > 0, reasoning=chunk.reasoning_text)
        out = {**self._head(self.obj), "choices": [choice]}
        if first and self.request.prompt_logprobs is not None:
            prompt_logprobs = self.vllm_prompt_logprobs(chunk.prompt_logprobs)
            if self.request.chat:
                out["prompt_logprobs"] = prompt_logprobs
            else:
                choice["prompt_logprobs"] = prompt_logprobs
        if self.request.include_usage:
            out["usage"] = (_usage(self.prompt_lengths[prompt_index], state.generated)
                            if self.request.continuous_usage else None)
        if self.request.include_metrics and chunk.metrics is not None:  # the choice's last chunk
            out["metrics"] = request_metrics(chunk.metrics)
        return out

    def usage_chunk(self, completions: list[acb.Completion]) -> dict[str, Any]:
        """The closing chunk of ``stream_options.include_usage``: no choices, only usage."""
        return {**self._head(self.obj), "choices": [], "usage": usage(self.visible(completions))}
