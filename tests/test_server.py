"""acb.serving.server: the OpenAI-compatible HTTP API, served for real on 127.0.0.1."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from http_helpers import running_app, sse_json, wait_pages_free

from acb.integrations.aiohttp import ENGINE_KEY
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

CHAT = [{"role": "user", "content": "hello there"}]
LONG = {"max_tokens": 1000, "ignore_eos": True}  # far longer than any test waits for


async def start(config: ServerConfig | None = None):
    app = create_app(tiny_engine(), config or ServerConfig(model_name="tiny", max_body_bytes=4096))
    return app, running_app(app, handler_cancellation=True)


@pytest.fixture
async def server():
    """(base_url, session, engine) of a server over the tiny model."""
    app, serving = await start()
    async with serving as url, aiohttp.ClientSession(base_url=url) as session:
        yield url, session, app[ENGINE_KEY]


async def post(session: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, dict]:
    async with session.post(path, json=body) as resp:
        return resp.status, await resp.json()


def text_of(chunks: list, chat: bool) -> str:
    key = (lambda c: c["choices"][0]["delta"].get("content", "")) if chat else (lambda c: c["choices"][0]["text"])
    return "".join(key(c) for c in chunks[:-1] if c["choices"])


# ---------------------------------------------------------------- completions and chat
async def test_completion_has_openai_fields_and_usage(server):
    _, session, engine = server
    status, body = await post(session, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 7,
                                                           "temperature": 0})
    assert status == 200
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == "tiny"
    choice = body["choices"][0]
    expected = await engine.generate("hello", max_new_tokens=7)
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, expected.text, "length")
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # (no whole page to share)


async def test_completion_stream_adds_up_and_ends_with_done(server):
    _, session, _ = server
    request = {"prompt": [40, 41, 42], "max_tokens": 9, "seed": 5}
    _, whole = await post(session, "/v1/completions", request)
    async with session.post("/v1/completions", json={**request, "stream": True}) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        chunks = await sse_json(resp)
    assert chunks[-1] == "[DONE]"
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks[:-1])
    assert text_of(chunks, chat=False) == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_chat_completion_answers_with_an_assistant_message(server):
    _, session, engine = server
    status, body = await post(session, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 6,
                                                                "temperature": 0})
    assert status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    expected = await engine.generate(CHAT, max_new_tokens=6)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    assert body["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == 6


async def test_chat_stream_sends_role_with_the_first_token_then_content_then_usage(server):
    _, session, _ = server
    request = {"messages": CHAT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True}
    _, whole = await post(session, "/v1/chat/completions", request)
    async with session.post("/v1/chat/completions", json={**request, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as resp:
        chunks = await sse_json(resp)
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and chunks[0]["choices"][0]["logprobs"]["content"]  # with the 1st token
    assert whole["choices"][0]["message"]["content"].startswith(first["content"])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert all(c["usage"] is None for c in chunks[:-2])
    assert text_of(chunks, chat=True) == whole["choices"][0]["message"]["content"]
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-2]["usage"]
    assert chunks[-2]["choices"] == [] and usage == {**whole["usage"], "prompt_tokens_details": {
        "cached_tokens": usage["prompt_tokens"] // 8 * 8}}  # the same prompt's whole pages (page_size 8), cached
    assert chunks[-1] == "[DONE]"


@pytest.mark.parametrize("as_list", [False, True])
async def test_stop_string_cuts_the_text_before_it(server, as_list):
    _, session, _ = server
    _, free = await post(session, "/v1/completions", {"prompt": "stop here", "max_tokens": 24, "temperature": 0})
    text = free["choices"][0]["text"]
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    body = {"prompt": "stop here", "max_tokens": 24, "temperature": 0, "stop": [stop, "never"] if as_list else stop}
    _, cut = await post(session, "/v1/completions", body)
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


async def test_same_seed_gives_the_same_text(server):
    _, session, _ = server
    texts = []
    for seed in (7, 7, 8):
        _, body = await post(session, "/v1/completions", {"prompt": "dice", "max_tokens": 20, "temperature": 1.0,
                                                          "seed": seed})
        texts.append(body["choices"][0]["text"])
    assert texts[0] == texts[1] != texts[2]


async def test_completion_logprobs_one_per_token(server):
    _, session, _ = server
    _, body = await post(session, "/v1/completions", {"prompt": "hi", "max_tokens": 5, "logprobs": 0,
                                                       "ignore_eos": True})
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == 5
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])


async def test_chat_logprobs_streamed_and_whole_agree(server):
    _, session, _ = server
    request = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True}
    _, whole = await post(session, "/v1/chat/completions", request)
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(set(c) == {"token", "logprob", "bytes", "top_logprobs"} for c in content)
    async with session.post("/v1/chat/completions", json={**request, "stream": True}) as resp:
        chunks = await sse_json(resp)
    streamed = [c for ch in chunks[:-1] if ch["choices"][0]["logprobs"]
                for c in ch["choices"][0]["logprobs"]["content"]]
    assert [c["logprob"] for c in streamed] == pytest.approx([c["logprob"] for c in content], abs=1e-5)


# ---------------------------------------------------------------- other routes
async def test_models_health_and_metrics(server):
    _, session, _ = server
    async with session.get("/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    async with session.get("/v1/models/tiny") as resp:
        assert (await resp.json())["object"] == "model"
    async with session.get("/v1/models/gpt-9") as resp:
        assert resp.status == 404
    async with session.get("/health") as resp:
        assert resp.status == 200
    await post(session, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
    async with session.get("/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    for name in ("acb_kv_total_blocks", "acb_kv_free_blocks", "acb_kv_cached_blocks", "acb_requests_running",
                 "acb_requests_waiting", "acb_generated_tokens_total", "acb_preemptions_total",
                 "acb_kv_offloaded_blocks", "acb_offloads_total", "acb_restores_total", "acb_device_seconds_total"):
        assert f"\n{name} " in text
    assert 'acb_time_to_first_token_seconds_bucket{le="+Inf"} 1' in text
    assert "acb_time_to_first_token_seconds_count 1" in text


async def test_health_is_503_and_requests_503_when_the_engine_is_stopped(server):
    _, session, engine = server
    await engine.stop()
    async with session.get("/health") as resp:
        assert resp.status == 503
    status, body = await post(session, "/v1/completions", {"prompt": "hi"})
    assert status == 503 and body["error"]["type"] == "server_error"


# ---------------------------------------------------------------- bad requests
async def test_malformed_json_is_400_in_openai_shape(server):
    _, session, _ = server
    async with session.post("/v1/completions", data=b'{"prompt": "hi",') as resp:
        assert resp.status == 400
        body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]


BAD_FIELDS = [  # (route, field, a value it refuses)
    ("/v1/completions", "max_tokens", "ten"),
    ("/v1/completions", "max_tokens", True),
    ("/v1/completions", "temperature", "hot"),
    ("/v1/completions", "temperature", -0.5),
    ("/v1/completions", "top_p", 0),
    ("/v1/completions", "seed", -1),
    ("/v1/completions", "stop", 5),
    ("/v1/completions", "stream", "yes"),
    ("/v1/completions", "prompt", 5),
    ("/v1/completions", "prompt", ["a", 5]),
    ("/v1/completions", "n", 0),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "logprobs", 21),
    ("/v1/completions", "presence_penalty", 2.5),
    ("/v1/completions", "repetition_penalty", 0),
    ("/v1/completions", "min_p", 1.5),
    ("/v1/completions", "logit_bias", {"x": 1}),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "include_stop_str_in_output", True),
    ("/v1/completions", "prompt_logprobs", 21),
    ("/v1/completions", "suffix", "tail"),
    ("/v1/completions", "guided_grammar", "root ::= 'a'"),
    ("/v1/completions", "structured_outputs", {"grammar": "root ::= 'a'"}),
    ("/v1/completions", "response_format", {"type": "xml"}),
    ("/v1/completions", "stream_options", 5),
    ("/v1/chat/completions", "messages", "hi"),
    ("/v1/chat/completions", "messages", [{"content": "no role"}]),
    ("/v1/chat/completions", "logprobs", 3),
    ("/v1/chat/completions", "top_logprobs", 21),
    ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "not a name"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "modalities", ["audio"]),
]


async def test_bad_field_is_400_naming_it_and_the_server_goes_on(server):
    """Each bad field: a 400 naming it, then the same body without it is served (one server for all)."""
    _, session, _ = server
    wrong = []
    for path, field, value in BAD_FIELDS:
        body = {"prompt": "hi"} if "chat" not in path else {"messages": CHAT}
        body.update(max_tokens=2, ignore_eos=True)
        status, error = await post(session, path, {**body, field: value})
        if status != 400 or error["error"]["param"] != field or field not in error["error"]["message"]:
            wrong.append((path, field, value, status, error))
        status, ok = await post(session, path, body)
        assert status == 200 and ok["usage"]["completion_tokens"] == 2, (path, field, value)
    assert not wrong, wrong


async def test_huge_max_tokens_is_400(server):
    _, session, _ = server
    status, body = await post(session, "/v1/completions", {"prompt": "hi", "max_tokens": 10**9})
    assert status == 400 and body["error"]["param"] == "max_tokens"


async def test_max_tokens_beyond_what_the_engine_holds_is_400():
    _, serving = await start(ServerConfig(max_tokens_limit=10**6))
    async with serving as url, aiohttp.ClientSession(base_url=url) as session:
        status, body = await post(session, "/v1/completions", {"prompt": "hi", "max_tokens": 100_000})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert "max_tokens" in body["error"]["message"]


async def test_oversized_body_is_413(server):
    _, session, _ = server
    status, body = await post(session, "/v1/completions", {"prompt": "x" * 10_000})
    assert status == 413 and "error" in body
    assert (await post(session, "/v1/completions", {"prompt": "hi", "max_tokens": 1}))[0] == 200


async def test_unknown_route_and_method_get_json_errors(server):
    _, session, _ = server
    async with session.get("/v1/nothing") as resp:
        assert resp.status == 404 and "error" in await resp.json()
    async with session.get("/v1/completions") as resp:
        assert resp.status == 405 and "POST" in (await resp.json())["error"]["message"]


MODEL_ROUTES = {"/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/v1/completions ": {"prompt": "hi",
                 "max_tokens": 2, "stream": True}, "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
                 "/v1/chat/completions ": {"messages": CHAT, "max_tokens": 2, "stream": True},
                 "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [40, 41]}}  # every route that takes model


async def test_an_unknown_model_is_a_404_naming_the_served_ids(server):
    """As OpenAI and vLLM answer it: a mistyped model (or adapter) id is not answered by
    another model. The served id, or none at all (as vLLM), runs the served model."""
    _, session, _ = server
    for path, body in MODEL_ROUTES.items():
        status, answer = await post(session, path.strip(), {**body, "model": "tiny-typo"})
        assert (status, answer) == (404, {"error": {
            "message": "The model 'tiny-typo' does not exist: this server serves 'tiny'",
            "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}), path
        for named in ({"model": "tiny"}, {}, {"model": None}):
            async with session.post(path.strip(), json={**body, **named}) as resp:
                assert resp.status == 200, (path, named, await resp.text())
                await resp.read()
    status, answer = await post(session, "/v1/completions", {"prompt": "hi", "model": 7})
    assert status == 400 and answer["error"]["param"] == "model"


async def test_allow_unknown_model_runs_the_served_model_for_any_id():
    app, serving = await start(ServerConfig(model_name="tiny", allow_unknown_model=True))
    async with serving as url, aiohttp.ClientSession(base_url=url) as session:
        for path, body in MODEL_ROUTES.items():
            async with session.post(path.strip(), json={**body, "model": "gpt-placeholder"}) as resp:
                assert resp.status == 200, (path, await resp.text())
                answer = await resp.read()
                if path == "/v1/completions":
                    assert b'"model": "tiny"' in answer


async def test_api_key_is_required_on_v1_only():
    _, serving = await start(ServerConfig(api_key="s3cret"))
    async with serving as url, aiohttp.ClientSession(base_url=url) as session:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            async with session.get("/v1/models", headers=headers) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
        async with session.get("/v1/models", headers={"Authorization": "Bearer s3cret"}) as resp:
            assert resp.status == 200
        async with session.get("/health") as resp:
            assert resp.status == 200


# ---------------------------------------------------------------- disconnects
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_client_leaving_a_stream_frees_its_pages(server, path):
    _, session, engine = server
    body = {"prompt": "hi"} if "chat" not in path else {"messages": CHAT}
    resp = await session.post(path, json={**body, **LONG, "stream": True})
    await resp.content.readline()
    resp.close()
    await wait_pages_free(engine)
    assert engine.stats().generated_tokens < 1000
    async with session.get("/health") as health:
        assert health.status == 200
    assert (await post(session, path, {**body, "max_tokens": 2}))[0] == 200


async def test_client_leaving_a_whole_request_frees_its_pages(server):
    _, session, engine = server
    with pytest.raises(asyncio.TimeoutError):
        await session.post("/v1/completions", json={"prompt": "hi", **LONG},
                           timeout=aiohttp.ClientTimeout(total=0.3))
    await wait_pages_free(engine)
    assert engine.stats().generated_tokens < 1000


# ---------------------------------------------------------------- the real model
@pytest.mark.slow
async def test_smollm2_answers_a_chat_over_http():
    """In float32, where acb's greedy tokens are transformers' own: bf16's greedy text is a
    different sample of the model, which on this question (docs/performance.md) need not name Paris."""
    import acb
    from acb.model.loading import smollm2

    folder, gguf_file = smollm2()
    engine = acb.Engine.from_pretrained(folder, gguf_file=gguf_file,
                                        config=acb.EngineConfig(num_blocks=128, dtype="float32"))
    serving = running_app(create_app(engine, ServerConfig(model_name="smollm2")), handler_cancellation=True)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    async with serving as url, aiohttp.ClientSession(base_url=url) as session:
        status, body = await post(session, "/v1/chat/completions", {"messages": question, "max_tokens": 24,
                                                                    "temperature": 0})
    assert status == 200
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_a_request_aiohttp_cannot_parse_is_one_info_line_not_a_traceback():
    """A client's malformed request (schemathesis sends a NUL in a header) is answered 400 by
    aiohttp, which logged it as an ERROR with a traceback; acb serve's filter makes it one line."""
    import logging

    from aiohttp.http_exceptions import BadHttpMessage

    from acb.serving import server

    try:
        raise BadHttpMessage("Invalid header value char:\n\n    b'X-Probe: \\x00'")
    except BadHttpMessage:
        import sys

        record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                   ("127.0.0.1",), sys.exc_info())
    assert server._MALFORMED.filter(record)
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage().startswith("Error handling request from 127.0.0.1: answered 400 (400, message: Invalid")
    other = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "boom", (),
                              (ValueError, ValueError(), None))
    assert server._MALFORMED.filter(other) and other.levelno == logging.ERROR and other.exc_info is not None
