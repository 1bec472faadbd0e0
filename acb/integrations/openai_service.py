"""The OpenAI routes over one engine, independent of the web framework.

:class:`OpenAIService` turns a parsed JSON body into either a whole response object
or a stream of server-sent events (bytes, ending with ``data: [DONE]``), and answers
``/v1/models``, ``/health`` and ``/metrics``. Frameworks only move bytes: ``acb
serve`` (:mod:`acb.serving.server`, aiohttp) and the Ray Serve deployment
(:mod:`acb.integrations.ray`, Starlette) both wrap this one class, so parsing,
shaping, errors and metrics are the same everywhere. Failures raise
:class:`~acb.integrations.aiohttp.ApiError`.

Example::

    service = OpenAIService(engine, model_name="smollm2")
    answer = await service.generate(body, chat=True)
    if isinstance(answer, dict):
        send_json(answer)
    else:
        async for event in answer:  # bytes, one SSE event each
            send(event)
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio

import acb

from .common import SSE_HEADERS, ApiError, sse_event
from .metrics import ServerMetrics
from .openai_requests import Limits, ParsedRequest, long_prompt, parse_request, prompt_token_ids
from .openai_responses import Shaper, engine_error
from .openapi import openapi_document


def route_error(status: int, method: str, path: str, allowed: str | None = None) -> ApiError:
    """The OpenAI-style answer to an unknown route (404) or a wrong method (405)."""
    if status == 404:
        return ApiError(404, f"no such route: {method} {path}")
    return ApiError(405, f"method {method} is not allowed on {path} (allowed: {allowed})")


async def _merged(handles: list[acb.RequestHandle]) -> AsyncGenerator[tuple[int, acb.Chunk], None]:
    """(prompt index, chunk) from every handle as they come; closing it early cancels them all."""
    if len(handles) == 1:
        async for chunk in handles[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: acb.RequestHandle) -> None:
        try:
            async for chunk in handle:
                queue.put_nowait((i, chunk, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        live = len(tasks)
        while live:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                live -= 1
            else:
                yield i, chunk
    finally:
        for task in tasks:
            task.cancel()


def _token_text(engine: acb.Engine) -> Callable[[int], str]:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return str
    return lambda token: tokenizer.decode([token])


def _field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"'{name}' must be a non-empty string", param=name)
    return value


class OpenAIService:
    """The OpenAI-compatible API of one engine: what every route answers.

    Example::

        service = OpenAIService(engine, model_name="smollm2", limits=Limits(max_tokens_limit=1024))
        service.check_api_key(headers.get("Authorization"))
        card = service.models()
    """

    def __init__(self, engine: acb.Engine, *, model_name: str = "acb", limits: Limits | None = None,
                 api_key: str | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = "auto", per_request_metrics: bool = False,
                 allow_unknown_model: bool = False) -> None:
        if tool_call_parser is not None:
            acb.tools.get_parser(tool_call_parser)  # ValueError naming the parsers there are
        self.tool_call_parser = tool_call_parser  # None: from the chat template
        if reasoning_parser == "auto":  # from the chat template: one that shows <think> gets "think"
            template = getattr(engine.tokenizer, "chat_template", None) if engine.tokenizer is not None else None
            reasoning_parser = acb.reasoning.parser_for_template(template)
        elif reasoning_parser not in (None, *acb.reasoning.PARSERS):
            raise ValueError(f"reasoning_parser must be 'auto', None or one of {', '.join(acb.reasoning.PARSERS)}, "
                             f"got {reasoning_parser!r}")
        self.reasoning_parser = reasoning_parser  # chat completions: reasoning_content apart from content
        self.engine = engine
        # every answer carries its per-request ``metrics`` (else only those that ask: include_metrics)
        self.per_request_metrics = per_request_metrics
        self.model_name = model_name
        # a request naming a model this service does not serve runs the served one (else 404)
        self.allow_unknown_model = allow_unknown_model
        self.limits = limits or Limits()
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.started = int(time.time())
        self.adapter_paths: dict[str, str] = {}  # adapters loaded through this service -> their folders

    def check_api_key(self, authorization: str | None, x_api_key: str | None = None) -> None:
        """Raise 401 unless ``authorization`` is ``Bearer <api_key>`` or ``x_api_key`` (the
        ``x-api-key`` header, as Anthropic's clients send it) is the key (no-op without a key)."""
        if self.api_key is None:
            return
        key = self.api_key.encode()
        if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), key):
            return
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' or 'x-api-key: "
                           "<key>'", code="invalid_api_key")

    async def generate(self, body: dict[str, Any], *, chat: bool) -> dict[str, Any] | AsyncGenerator[bytes, None]:
        """Answer a ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body:
        the response object, or for ``stream: true`` an async generator of SSE events.
        Closing that generator early (a client that went away) cancels the request."""
        model = self.served_model(body.get("model"))
        parsed = parse_request(body, chat=chat, limits=self.limits, default_temperature=self.default_temperature())
        handles, prompts = await self.submit(parsed, model)
        token_text = _token_text(self.engine)
        texts = [self._prompt_text(p, ids) for p, ids in zip(parsed.prompts, prompts)] if parsed.echo else None
        shaper = Shaper(parsed, model, token_text, texts, [len(ids) for ids in prompts])
        if parsed.stream:
            return self._events(handles, shaper)
        try:
            completions = list(await asyncio.gather(*handles))
        except acb.AcbError as e:
            raise engine_error(e, chat=chat, wire_names=parsed.wire_names) from None
        finally:
            for handle in handles:
                handle.cancel()  # a no-op once finished; a failed or abandoned request frees its pages
        for completion in completions:
            self.metrics.observe(completion)
        return shaper.response(completions)

    async def completion(self, handle: acb.RequestHandle, parsed: ParsedRequest) -> acb.Completion:
        """One request's whole answer, counted in the metrics: an engine error raised as the chat
        route's API error, the request's pages freed either way (the Anthropic and Responses routes)."""
        try:
            completion = await handle
        except acb.AcbError as e:
            raise engine_error(e, chat=True, wire_names=parsed.wire_names) from None
        finally:
            handle.cancel()  # a no-op once finished; a failed or abandoned request frees its pages
        self.metrics.observe(completion)
        return completion

    async def submit(self, parsed: ParsedRequest, model: str) -> tuple[list[acb.RequestHandle], list[list[int]]]:
        """Run a parsed request on ``model`` (the served one or a loaded adapter): its tools
        formatted for the chat template, chat's thought split off by the reasoning parser; the
        engine handles and each prompt's token ids. The Anthropic routes submit through it too."""
        if model != self.model_name:  # a loaded LoRA adapter, named as the model (as vLLM does)
            parsed.sampling["adapter"] = model
        if parsed.tools:
            self.tool_format(parsed)
        if parsed.chat and self.reasoning_parser is not None and parsed.tool_choice not in ("required", "function") \
                and parsed.tool_parser != "generic":  # (a forced call, or the generic JSON, is all answer)
            parsed.sampling["reasoning_parser"] = self.reasoning_parser
            parsed.reasoning = True
        parsed.include_metrics = parsed.include_metrics or self.per_request_metrics
        return await self._submit_all(parsed)

    def tool_format(self, parsed: ParsedRequest) -> None:
        """How a request with tools reaches the model and comes back. A chat template that
        renders tools (and ``--tool-call-parser`` other than ``generic``) gets them natively;
        ``"auto"`` output is read by the parser of the template's format. Otherwise the
        generic format: the tools described in the system turn and the output constrained to
        ``{"tool_calls": [...]}`` (or, with ``"auto"``, ``{"response": ...}``)."""
        template = getattr(self.engine.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: transformers renders tools with "tool_use"
            template = template.get("tool_use") or template.get("default")
        if self.tool_call_parser != "generic" and acb.tools.template_supports_tools(template):
            if parsed.tool_choice == "auto":
                parsed.tool_parser = self._auto_tool_parser(template)
            return
        choice = parsed.tool_choice
        parsed.prompts = [acb.tools.generic_messages(parsed.prompts[0], parsed.tools, answer=choice == "auto")]
        if choice == "function":
            return  # the grammar makes the output the named function's arguments
        if choice == "auto":
            for key in ("json_schema", "regex", "choice"):
                if key in parsed.sampling:
                    raise ApiError(400, f"'tool_choice' 'auto' with a chat template that renders no tools constrains "
                                   f"the output to acb's generic tool-call JSON: it conflicts with "
                                   f"'{parsed.wire_names.get(key, key)}'", param="tool_choice")
        parsed.sampling["json_schema"] = acb.tools.generic_schema(parsed.tools, parsed.parallel_tool_calls,
                                                                  answer=choice == "auto")
        parsed.wire_names["json_schema"] = "tools"
        parsed.tool_parser = "generic"

    def _auto_tool_parser(self, template: str) -> str:
        """The parser reading ``tool_choice: "auto"`` output: ``--tool-call-parser``, else the
        one the chat template's tool-call format names; a 400 when no parser is known."""
        name = self.tool_call_parser or acb.tools.parser_for_template(template)
        if name is None:
            raise ApiError(400, "'tools': no tool-call parser is known for this model's chat template; start acb "
                           f"serve with --tool-call-parser ({', '.join(sorted(acb.tools.PARSERS))})", param="tools")
        return name

    def default_temperature(self) -> float | None:
        """OpenAI's 1.0 for a request without ``temperature``, unless the model's
        generation_config says how to sample (as vLLM: then the engine applies it)."""
        model = self.engine.generation_defaults
        return None if ("temperature" in model or "do_sample" in model) else 1.0

    async def _submit_all(self, parsed: ParsedRequest) -> tuple[list[acb.RequestHandle], list[list[int]]]:
        """One engine request per prompt, all or none (a refused one cancels those before it).
        Nothing heavy on the event loop: a long prompt is templated and tokenized, and a
        grammar compiled (``engine.asubmit``), on worker threads."""
        handles: list[acb.RequestHandle] = []
        prompts: list[list[int]] = []
        try:
            for prompt in parsed.prompts:
                if long_prompt(prompt):
                    ids = await anyio.to_thread.run_sync(prompt_token_ids, parsed, prompt, self.engine,
                                                         abandon_on_cancel=True)
                else:
                    ids = prompt_token_ids(parsed, prompt, self.engine)
                prompts.append(ids)
                handles.append(await self.engine.asubmit(ids, **parsed.sampling))
        except BaseException as e:  # a refused prompt, or the client gone while one was prepared
            for handle in handles:
                handle.cancel()
            if isinstance(e, acb.AcbError):
                raise engine_error(e, chat=parsed.chat, wire_names=parsed.wire_names) from None
            raise
        return handles, prompts

    def _prompt_text(self, prompt: Any, ids: list[int]) -> str:
        """A completions prompt as text, for ``echo`` (token ids are decoded)."""
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(ids) if tokenizer is not None else ""

    async def _events(self, handles: list[acb.RequestHandle], shaper: Shaper) -> AsyncGenerator[bytes, None]:
        parsed = shaper.request
        try:
            async for i, chunk in _merged(handles):
                event = shaper.chunk(i, chunk)
                if event is not None:
                    yield sse_event(event)
            completions = [await handle for handle in handles]
        except acb.AcbError as e:  # mid-stream: the status line is gone, so the error travels as an event
            yield sse_event(engine_error(e, chat=parsed.chat, wire_names=parsed.wire_names).body())
            yield sse_event("[DONE]")
            return
        finally:
            for handle in handles:
                handle.cancel()  # a no-op once finished; frees the pages of an abandoned stream at once
        for completion in completions:
            self.metrics.observe(completion)
        if parsed.include_usage:
            yield sse_event(shaper.usage_chunk(completions))
        yield sse_event("[DONE]")

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /tokenize`` (vLLM's extension): ``{"prompt": str}`` or ``{"messages": [...]}``
        (with ``add_special_tokens``, ``add_generation_prompt``) to token ids; a ``model`` it
        names must be served (404)."""
        self.model_field(body)
        tokenizer = self._tokenizer()
        try:
            if "messages" in body and "prompt" in body:
                raise ApiError(400, "send 'prompt' or 'messages', not both", param="prompt")
            if "messages" in body:
                parsed = parse_request({**body, "max_tokens": 1}, chat=True, limits=self.limits)
                ids = prompt_token_ids(parsed, parsed.prompts[0], self.engine)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise ApiError(400, "'prompt' must be a string (or send 'messages')", param="prompt")
                special = body.get("add_special_tokens")
                special = True if special is None else special
                if not isinstance(special, bool):
                    raise ApiError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
                ids = list(tokenizer(prompt, add_special_tokens=special)["input_ids"])
        except acb.InvalidRequestError as e:
            raise engine_error(e, chat="messages" in body) from None
        except (TypeError, ValueError) as e:  # what the tokenizer itself refuses
            raise ApiError(400, f"could not tokenize: {e}", param="prompt") from None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": None}

    def detokenize(self, body: dict[str, Any]) -> dict[str, str]:
        """``POST /detokenize`` (vLLM's extension): ``{"tokens": [ids]}`` to ``{"prompt": text}``;
        a ``model`` it names must be served (404)."""
        self.model_field(body)
        tokens = body.get("tokens")
        vocab = self.engine.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": self._tokenizer().decode(tokens)}

    def model_field(self, body: dict[str, Any]) -> str:
        """The served model a body names (404 for another; 400 for a non-string)."""
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise ApiError(400, "'model' must be a string", param="model")
        return self.served_model(body.get("model"))

    def _tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer")
        return self.engine.tokenizer

    def served_model(self, model: Any) -> str:
        """The model a request runs: the served model's name (also for a request that names
        none, as vLLM does), or a loaded adapter's when ``model`` names one. Any other name
        is a 404 (``model_not_found``, naming the served ids, as OpenAI and vLLM answer),
        unless ``allow_unknown_model``: then it runs the served model. (A ``model`` that is
        not a string is left to the request's parsing: a 400.)"""
        if not isinstance(model, str) or not model or model == self.model_name:
            return self.model_name
        adapters = self.engine.adapters()
        if model in adapters:
            return model
        if self.allow_unknown_model:
            return self.model_name
        served = ", ".join(repr(name) for name in (self.model_name, *adapters))
        raise ApiError(404, f"The model {model!r} does not exist: this server serves {served}", param="model",
                       code="model_not_found")

    def models(self, model: str | None = None) -> dict[str, Any]:
        """``GET /v1/models`` (``model=None``) or ``GET /v1/models/{model}``: the served
        model, then each loaded LoRA adapter (``parent``: the served model, as vLLM lists them)."""
        card = {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "acb",
                "root": self.model_name, "parent": None}
        cards = [card] + [{"id": name, "object": "model", "created": self.started, "owned_by": "acb",
                           "root": self.adapter_paths.get(name, name), "parent": self.model_name}
                          for name in self.engine.adapters()]
        if model is None:
            return {"object": "list", "data": cards}
        for card in cards:
            if card["id"] == model:
                return card
        served = ", ".join(repr(card["id"]) for card in cards)
        raise ApiError(404, f"The model {model!r} does not exist: this server serves {served}", param="model",
                       code="model_not_found")

    async def load_lora_adapter(self, body: dict[str, Any]) -> str:
        """``POST /v1/load_lora_adapter`` (vLLM's body ``{"lora_name", "lora_path"}``): load a
        PEFT adapter folder on this server's machine; requests then name it as ``model``."""
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name == self.model_name:
            raise ApiError(400, f"lora_name {name!r} is the served model's name", param="lora_name")
        try:
            await self.engine.load_adapter(path, name)
        except acb.InvalidRequestError as e:
            raise ApiError(400, str(e), param="lora_path" if "folder" in str(e) else "lora_name") from None
        except ValueError as e:  # this engine cannot run adapters (the setting is named)
            raise ApiError(400, str(e), param="lora_name") from None
        self.adapter_paths[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, body: dict[str, Any]) -> str:
        """``POST /v1/unload_lora_adapter`` (vLLM's body ``{"lora_name"}``): new requests for it
        are refused at once; it answers once the requests already running it have ended."""
        name = _field(body, "lora_name")
        if name not in self.engine.adapters():
            raise ApiError(404, f"LoRA adapter {name!r} is not loaded", param="lora_name", code="model_not_found")
        try:
            await self.engine.unload_adapter(name)
        except acb.InvalidRequestError as e:  # another unload of it came first
            raise ApiError(404, str(e), param="lora_name", code="model_not_found") from None
        self.adapter_paths.pop(name, None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def health(self) -> tuple[int, dict[str, str]]:
        """``GET /health``: (200, ok) while the engine takes requests, else (503, unavailable)."""
        if self.engine.is_running:
            return 200, {"status": "ok"}
        return 503, {"status": "unavailable"}

    def kv_events(self) -> AsyncGenerator[bytes, None]:
        """``GET /v1/kv_events``: the engine's KV-cache event batches as server-sent events,
        one ``data: {"ts", "events": [{"type": "BlockStored", ...}], "dropped", "resync"}``
        each, starting with a resync; 400 unless the engine was built with ``kv_events=True``.
        The stream ends when the engine stops (a server's shutdown drains it) or the client leaves."""
        try:
            stream = self.engine.kv_events()
        except ValueError as e:
            raise ApiError(400, f"{e} (acb serve --kv-events)", param="kv_events") from None
        return self._kv_event_source(stream)

    async def _kv_event_source(self, stream: acb.KVEventStream) -> AsyncGenerator[bytes, None]:
        try:
            async for batch in stream:
                yield sse_event({"ts": batch.ts, "dropped": batch.dropped, "resync": batch.resync,
                                 "events": [{"type": type(e).__name__, **dataclasses.asdict(e)} for e in batch.events]})
        finally:
            stream.close()

    def openapi(self) -> dict[str, Any]:
        """``GET /openapi.json``: the OpenAPI 3.1 document of this server's routes, with its limits
        (:func:`acb.integrations.openapi.openapi_document`)."""
        return openapi_document(self.limits, model_name=self.model_name, api_key=self.api_key is not None)

    def metrics_text(self) -> str:
        """``GET /metrics``: Prometheus text exposition (content type ``metrics.CONTENT_TYPE``)."""
        return self.metrics.render(self.engine.stats())


__all__ = ["SSE_HEADERS", "OpenAIService", "route_error", "sse_event"]
