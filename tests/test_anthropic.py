"""Anthropic's Messages API on ``acb serve`` through the official ``anthropic`` package:
``messages.create``, ``messages.stream`` (the SDK assembles the final message from acb's
events), ``messages.count_tokens``, forced tool calls whose inputs validate against their
``input_schema``, stop sequences, the prefix cache in ``usage``, errors in Anthropic's shape
naming the field, and ``x-api-key`` beside ``Authorization: Bearer``."""

from __future__ import annotations

import json

import aiohttp
import pytest
from http_helpers import running_app, wait_pages_free

from acb.integrations.aiohttp import ENGINE_KEY
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

anthropic = pytest.importorskip("anthropic", reason="the anthropic client comes with acb[test]")
jsonschema = pytest.importorskip("jsonschema")

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # (the anthropic package no longer sends sampling fields: extra_body does)
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
COUNT = {"name": "count_items", "input_schema": {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 9}, "exact": {"type": "boolean"}},
    "required": ["n", "exact"], "additionalProperties": False}}
TOOLS = [WEATHER, COUNT]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
# a Hermes-style template (tools in the system turn, calls as <tool_call> blocks, results as tool turns)
TOOLS_TEMPLATE = (
    "{%- if tools %}<s>system: tools {% for t in tools %}{{ t.function.name }} {% endfor %}\n{%- endif %}"
    "{%- for m in messages %}<s>{{ m['role'] }}{% if m.get('name') %} ({{ m.name }}){% endif %}: {{ m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor %}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture
async def served():
    app = create_app(tiny_engine(), ServerConfig(model_name="tiny", api_key="k"))
    async with running_app(app, handler_cancellation=True) as url:
        client = anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0)
        yield client, app[ENGINE_KEY], url
        await client.close()


async def _stream(client, **kwargs):
    """(event types in order, the SDK's assembled final message)."""
    async with client.messages.stream(model="tiny", **kwargs) as stream:
        types = [event.type async for event in stream]
        return types, await stream.get_final_message()


async def test_create_answers_what_the_chat_route_answers(served):
    client, engine, _ = served
    message = await client.messages.create(model="tiny", max_tokens=8, messages=ASK, extra_body=GREEDY)
    chat = await engine.generate(ASK, max_new_tokens=8, temperature=0)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == chat.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 8
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(chat.prompt_token_ids)


async def test_stream_sends_anthropics_events_and_the_sdk_assembles_the_same_message(served):
    client, _, _ = served
    whole = await client.messages.create(model="tiny", max_tokens=10, messages=ASK, extra_body=GREEDY)
    types, final = await _stream(client, max_tokens=10, messages=ASK, extra_body=GREEDY)
    assert types[0] == "message_start" and types[-1] == "message_stop" and types[-2] == "message_delta"
    assert types[1] == "content_block_start" and "content_block_delta" in types and "content_block_stop" in types
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


async def test_a_repeated_prompt_reads_the_prefix_cache(served):
    client, _, _ = served
    first = await client.messages.create(model="tiny", max_tokens=2, messages=ASK * 8, extra_body=GREEDY)
    again = await client.messages.create(model="tiny", max_tokens=2, messages=ASK * 8, extra_body=GREEDY)
    assert first.usage.cache_read_input_tokens == 0
    assert again.usage.cache_read_input_tokens >= 8  # whole pages of the prompt (page_size 8)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == first.usage.input_tokens


async def test_count_tokens_counts_the_prompt_generation_runs(served):
    client, engine, _ = served
    system = [{"type": "text", "text": "Be brief."}]
    count = await client.messages.count_tokens(model="tiny", system=system, messages=ASK)
    prompt = engine.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."}, *ASK],
                                                  add_generation_prompt=True, tokenize=True)
    assert count.input_tokens == len(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    message = await client.messages.create(model="tiny", system=system, max_tokens=1, messages=ASK,
                                           tools=TOOLS, tool_choice={"type": "any"})
    with_tools = await client.messages.count_tokens(model="tiny", system=system, messages=ASK, tools=TOOLS,
                                                    tool_choice={"type": "any"})
    assert with_tools.input_tokens > count.input_tokens  # the generic format describes the tools
    assert with_tools.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def _check_tool_uses(message, *, name=None) -> None:
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    assert len({u.id for u in uses}) == len(uses) and all(u.id.startswith("toolu_") for u in uses)
    for use in uses:
        assert name is None or use.name == name
        jsonschema.validate(use.input, SCHEMAS[use.name])


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "count_items"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
async def test_a_forced_tool_call_has_inputs_valid_against_the_schema(served, choice):
    client, _, _ = served
    # greedy: a sampled tiny random model can spend all 300 tokens inside one JSON string (a max_tokens stop)
    kwargs = dict(max_tokens=300, messages=ASK, tools=TOOLS, tool_choice=choice, extra_body=GREEDY)
    whole = await client.messages.create(model="tiny", **kwargs)
    _check_tool_uses(whole, name=choice.get("name"))
    if choice.get("disable_parallel_tool_use"):
        assert len(whole.content) == 1
    types, final = await _stream(client, **kwargs)
    _check_tool_uses(final, name=choice.get("name"))
    assert "content_block_delta" in types


async def test_a_forced_call_streams_the_same_input_as_the_whole_answer(served):
    client, _, _ = served
    kwargs = dict(max_tokens=200, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                  extra_body=GREEDY)
    whole = await client.messages.create(model="tiny", **kwargs)
    _, final = await _stream(client, **kwargs)
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]


async def test_auto_tool_choice_answers_text_or_tool_use_consistently(served):
    client, _, _ = served
    for question in ("What is the weather in Paris?", "How many?", "Hello"):  # the generic format: call or answer
        message = await client.messages.create(model="tiny", max_tokens=200, tools=TOOLS, extra_body=GREEDY,
                                               messages=[{"role": "user", "content": question}])
        kinds = {b.type for b in message.content}
        if message.stop_reason == "tool_use":
            _check_tool_uses(message)
        else:
            assert kinds <= {"text"} and message.stop_reason in ("end_turn", "max_tokens")


async def test_a_stop_sequence_ends_the_text_and_is_named(served):
    client, _, _ = served
    text = (await client.messages.create(model="tiny", max_tokens=12, messages=ASK, extra_body=GREEDY)).content[0].text
    stop = next(c for c in text[1:] if c != "\ufffd" and c.strip())
    expected = text[:text.index(stop)]
    kwargs = dict(max_tokens=12, messages=ASK, stop_sequences=["never-generated", stop], extra_body=GREEDY)
    message = await client.messages.create(model="tiny", **kwargs)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert "".join(b.text for b in message.content) == expected
    _, final = await _stream(client, **kwargs)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


async def test_output_config_json_schema_constrains_the_text(served):
    client, _, _ = served
    schema = SCHEMAS["count_items"]
    message = await client.messages.create(model="tiny", max_tokens=200, messages=ASK, extra_body=GREEDY,
                                           output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


async def test_a_history_of_tool_use_and_results_is_rendered_as_the_chat_route_renders_it(served):
    client, engine, url = served
    engine.tokenizer.chat_template = TOOLS_TEMPLATE
    history = [*ASK, {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "21 degrees"}]}, {"type": "text", "text": "And tomorrow?"}]}]
    count = await client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    openai_history = [*ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "21 degrees"},
        {"role": "user", "content": "And tomorrow?"}]
    functions = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                   "parameters": t["input_schema"]}} for t in TOOLS]
    text = engine.tokenizer.apply_chat_template(openai_history, tools=functions, add_generation_prompt=True,
                                                tokenize=False)
    assert "<tool_call>" in text and "tool (get_weather): 21 degrees" in text and "user: And tomorrow?" in text
    assert count.input_tokens == len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


BAD_INPUTS = [
    ({"messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": ASK, "top_k": -1}, "top_k"),
    ({"max_tokens": 100000, "messages": ASK}, "max_tokens"),
    ({"max_tokens": 4, "messages": ASK, "stop_sequences": "x"}, "stop_sequences"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}, "messages"),
    ({"max_tokens": 4, "messages": ASK, "system": 3}, "system"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"name": "f"}]}, "tools"),
    ({"max_tokens": 4, "messages": ASK, "tools": [{"name": "f", "type": "web_search_20250305",
                                                     "input_schema": {}}]}, "tools"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": ASK, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]},
     "mcp_servers"),
]


async def test_bad_input_is_a_400_in_anthropics_shape_naming_the_field(served):
    _, _, url = served
    async with aiohttp.ClientSession() as session:
        for body, field in BAD_INPUTS:
            async with session.post(f"{url}/v1/messages", json={"model": "tiny", **body},
                                    headers={"x-api-key": "k"}) as resp:
                assert resp.status == 400, body
                answer = await resp.json()
            assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
            assert answer["error"]["message"].startswith(f"'{field}'"), answer


async def test_the_sdk_raises_its_own_errors(served):
    client, _, _ = served
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model="tiny", max_tokens=4, messages=ASK, stop_sequences="x")
    assert bad.value.body["error"]["message"].startswith("'stop_sequences'")
    with pytest.raises(anthropic.NotFoundError) as missing:
        await client.messages.create(model="not-served", max_tokens=4, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):  # count_tokens: the same checks
        await client.messages.count_tokens(model="tiny", messages=[])


async def test_x_api_key_and_bearer_both_authenticate(served):
    client, _, url = served
    assert (await client.messages.count_tokens(model="tiny", messages=ASK)).input_tokens > 0  # x-api-key
    async with anthropic.AsyncAnthropic(base_url=url, auth_token="k", max_retries=0) as bearer:
        assert (await bearer.messages.count_tokens(model="tiny", messages=ASK)).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        await client.with_options(api_key="nope").messages.count_tokens(model="tiny", messages=ASK)
    assert wrong.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": wrong.value.body["error"]["message"]}}


async def test_metadata_is_accepted_and_a_prefill_is_continued(served):
    client, engine, _ = served
    prefill = [*ASK, {"role": "assistant", "content": "It is"}]
    message = await client.messages.create(model="tiny", max_tokens=4, messages=prefill,
                                           metadata={"user_id": "u-1"}, extra_body=GREEDY)
    prompt = engine.tokenizer.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
    done = await engine.generate(prompt, max_new_tokens=4, temperature=0)
    assert message.content[0].text == done.text


async def test_leaving_a_stream_frees_its_pages(served):
    client, engine, _ = served
    async with client.messages.stream(model="tiny", max_tokens=400, messages=ASK,
                                      extra_body={"temperature": 0, "top_k": 0}) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                break
    await wait_pages_free(engine)


def test_a_thought_streams_as_a_thinking_block_before_the_text():
    from anthropic.lib.streaming._messages import accumulate_event

    import acb
    from acb.integrations.anthropic_requests import parse_messages
    from acb.integrations.anthropic_responses import MessageShaper
    from acb.integrations.openai_requests import Limits

    request = parse_messages({"max_tokens": 8, "messages": ASK}, limits=Limits())
    shaper = MessageShaper(request.parsed, "tiny", request.id, [], lambda ids: "", 5)
    chunks = [acb.Chunk("r", [1], "", reasoning_text="Hmm, "), acb.Chunk("r", [2], "", reasoning_text="Paris."),
              acb.Chunk("r", [3], "Sunny", reasoning_text=""), acb.Chunk("r", [4], ".", finish_reason="eos")]
    done = acb.Completion("r", [9] * 5, [1, 2, 3, 4], "Sunny.", None, "eos", reasoning_text="Hmm, Paris.")
    events = shaper.start() + [e for c in chunks for e in shaper.chunk(c)] + shaper.finish(done)
    snapshot = None
    for raw in events:
        head, data = raw.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs={})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in snapshot.content] == \
        [("thinking", "Hmm, Paris."), ("text", "Sunny.")]
    assert snapshot.stop_reason == "end_turn" and snapshot.usage.output_tokens == 4
    whole = MessageShaper(request.parsed, "tiny", request.id, [], lambda ids: "", 5).message(done)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]


async def test_an_unknown_route_under_messages_answers_in_anthropics_shape(served):
    _, _, url = served
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/messages/batches", json={}, headers={"x-api-key": "k"}) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["type"] == "not_found_error"
        async with session.get(f"{url}/v1/messages", headers={"x-api-key": "k"}) as resp:
            assert resp.status == 405 and (await resp.json())["type"] == "error"
        async with session.post(f"{url}/v1/messages", json={"max_tokens": 1, "messages": ASK}) as resp:
            assert resp.status == 401  # no key at all
            assert (await resp.json())["error"]["type"] == "authentication_error"


async def test_a_failure_mid_stream_is_an_error_event_the_sdk_raises():
    import acb

    def fails_on_the_third_token(input_ids, scores):  # (an engine default: every request gets it)
        if fails_on_the_third_token.calls == 2:
            raise RuntimeError("out of budget")
        fails_on_the_third_token.calls += 1
        return scores

    fails_on_the_third_token.calls = 0
    engine = tiny_engine(sampling=acb.SamplingParams(logits_processors=[fails_on_the_third_token]))
    async with running_app(create_app(engine, ServerConfig(model_name="tiny")), handler_cancellation=True) as url:
        async with anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0) as client:
            texts = []
            with pytest.raises(anthropic.APIStatusError) as error:
                async with client.messages.stream(model="tiny", max_tokens=20, messages=ASK) as stream:
                    async for text in stream.text_stream:
                        texts.append(text)
            assert "out of budget" in str(error.value) and error.value.body["type"] == "error"
            await wait_pages_free(engine)
