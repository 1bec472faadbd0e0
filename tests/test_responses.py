"""OpenAI's Responses API (``POST /v1/responses``, stateless) through the official ``openai``
client: ``responses.create`` whole and streamed (``responses.stream`` assembles the same
response), function tools forced by ``tool_choice`` with arguments valid against their
schemas, a history of calls and their outputs rendered as the chat route renders it,
``text.format`` structured outputs, and the stateful fields refused by name."""

from __future__ import annotations

import json

import aiohttp
import pytest
from http_helpers import running_app, sse_events, wait_pages_free

import acb
from acb.integrations.aiohttp import ENGINE_KEY
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
COUNT = {"type": "function", "name": "count_items", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}}
TOOLS = [WEATHER, COUNT]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
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
    app = create_app(tiny_engine(), ServerConfig(model_name="tiny"))
    async with running_app(app, handler_cancellation=True) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        yield client, app[ENGINE_KEY], url
        await client.close()


async def test_create_answers_what_the_engine_answers_for_the_same_conversation(served):
    client, engine, _ = served
    answer = await client.responses.create(model="tiny", instructions="Be brief.", input="hello there",
                                           max_output_tokens=8, temperature=0)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    done = await engine.generate(chat, max_new_tokens=8, temperature=0)
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert answer.output_text == done.text and [o.type for o in answer.output] == ["message"]
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.input_tokens == len(done.prompt_token_ids) and answer.usage.output_tokens == 8
    assert answer.usage.input_tokens_details.cached_tokens == 0
    again = await client.responses.create(model="tiny", instructions="Be brief.", input="hello there",
                                          max_output_tokens=8, temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0  # the prefix cache, reported


async def test_streamed_events_assemble_the_same_response(served):
    client, _, _ = served
    kwargs = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                  max_output_tokens=10, temperature=0)
    whole = await client.responses.create(**kwargs)
    events = [e async for e in await client.responses.create(stream=True, **kwargs)]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text  # (cut short: response.incomplete, as OpenAI's)
    # a response that completes (its grammar does): the client's helper assembles it
    kwargs.update(max_output_tokens=100, text={"format": {"type": "json_schema", "name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}})
    whole = await client.responses.create(**kwargs)
    async with client.responses.stream(**kwargs) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert whole.status == final.status == "completed"
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "count_items"}])
async def test_a_forced_function_call_has_arguments_valid_against_the_schema(served, choice):
    client, _, _ = served
    kwargs = dict(model="tiny", input="What is the weather in Paris?", tools=TOOLS, tool_choice=choice,
                  max_output_tokens=300, temperature=0)  # greedy: never a sampled run out of tokens mid-JSON
    for answer in (await client.responses.create(**kwargs), None):
        if answer is None:
            async with client.responses.stream(**kwargs) as stream:
                types = [e.type async for e in stream]
                answer = await stream.get_final_response()
            assert "response.function_call_arguments.delta" in types
        calls = [o for o in answer.output if o.type == "function_call"]
        assert calls and answer.status == "completed"
        for call in calls:
            assert isinstance(choice, str) or call.name == choice["name"]
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


async def test_calls_and_their_outputs_are_rendered_as_the_chat_route_renders_them(served):
    client, engine, _ = served
    engine.tokenizer.chat_template = TOOLS_TEMPLATE
    history = [{"role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "c"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees"}]
    answer = await client.responses.create(model="tiny", input=history, tools=TOOLS, max_output_tokens=2,
                                           temperature=0)
    chat = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 degrees"}]
    functions = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
                 for t in TOOLS]
    text = engine.tokenizer.apply_chat_template(chat, tools=functions, add_generation_prompt=True, tokenize=False)
    assert "<tool_call>" in text and "tool (get_weather): 21 degrees" in text
    assert answer.usage.input_tokens == len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


async def test_text_format_json_schema_constrains_the_output(served):
    client, _, _ = served
    schema = SCHEMAS["count_items"]
    answer = await client.responses.create(model="tiny", input="How many?", max_output_tokens=100, text={
        "format": {"type": "json_schema", "name": "count", "schema": schema}})
    jsonschema.validate(json.loads(answer.output_text), schema)
    assert answer.status == "completed"


BAD_INPUTS = [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "background": True}, "background"),
    ({}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
]


async def test_bad_input_is_a_400_naming_the_field(served):
    _, _, url = served
    async with aiohttp.ClientSession() as session:
        for body, field in BAD_INPUTS:
            async with session.post(f"{url}/v1/responses", json={"model": "tiny", **body}) as resp:
                assert resp.status == 400, body
                answer = await resp.json()
            assert answer["error"]["param"] == field and f"'{field}'" in answer["error"]["message"], answer


async def test_a_failure_mid_stream_is_an_error_event():
    calls = []

    def fails_on_the_third_token(input_ids, scores):  # (an engine default: every request gets it)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of budget")
        return scores

    engine = tiny_engine(sampling=acb.SamplingParams(logits_processors=[fails_on_the_third_token]))
    async with running_app(create_app(engine, ServerConfig(model_name="tiny")), handler_cancellation=True) as url:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{url}/v1/responses", json={"input": "hi", "stream": True,
                                                                  "max_output_tokens": 20}) as resp:
                events = [(name, json.loads(data)) async for name, data in sse_events(resp)]
        await wait_pages_free(engine)
    names = [name for name, _ in events]
    assert names[0] == "response.created" and names[-2:] == ["error", "response.failed"]
    assert "out of budget" in events[-2][1]["message"]
    assert events[-1][1]["response"]["status"] == "failed"
