"""Tool calling on /v1/chat/completions through the official ``openai`` client: ``auto``
(the model's own format parsed, here forced by a regex so a tiny random model writes it),
``required`` and a named function (forced by the grammar engine), parallel calls, the
history of calls and results rendered by the chat template, streaming deltas that
concatenate to valid arguments, and no markup in the content."""

from __future__ import annotations

import json

import pytest
from http_helpers import running_app

from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

# a Hermes-style template: tools in the system turn, calls as <tool_call> blocks, results as tool turns
TOOLS_TEMPLATE = (
    "{%- if tools %}<s>system: tools {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "<tool_call></tool_call>\n{%- endif %}"
    "{%- for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor %}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
COUNT = {"type": "function", "function": {
    "name": "count_items", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9}, "exact": {"type": "boolean"}},
        "required": ["n", "exact"], "additionalProperties": False}}}
TOOLS = [WEATHER, COUNT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'


@pytest.fixture
async def client():
    engine = tiny_engine()
    engine.tokenizer.chat_template = TOOLS_TEMPLATE
    app = create_app(engine, ServerConfig(model_name="tiny"))
    async with running_app(app, handler_cancellation=True) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        yield client, engine
        await client.close()


def check_calls(calls, *, parallel_ok=True) -> None:
    assert calls, "no tool call"
    assert parallel_ok or len(calls) == 1
    assert len({c.id for c in calls}) == len(calls)
    for c in calls:
        assert c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


async def streamed(client, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """(content, tool calls by index assembled from the deltas as OpenAI's clients do, finish reason)."""
    stream = await client.chat.completions.create(model="tiny", stream=True, **kwargs)
    content, calls, reason = "", {}, None
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "an id is sent once, with the call's first delta"
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments is not None:
                    entry["arguments"] += tc.function.arguments
            reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("prefix", ["", "Let me check. "])
async def test_auto_parses_the_models_own_format(client, prefix):
    client, _ = client
    kwargs = dict(messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                  extra_body={"guided_regex": __import__("re").escape(prefix + CALL)})
    whole = await client.chat.completions.create(model="tiny", **kwargs)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.content == (prefix or None)
    check_calls(message.tool_calls)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "c"})]
    content, calls, reason = await streamed(client, **kwargs)
    assert content == prefix and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Paris", "unit": "c"})]
    assert calls[0]["id"].startswith("call_")


async def test_auto_without_a_call_is_plain_content(client):
    client, _ = client
    whole = await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=20,
                                                 temperature=0, extra_body={"guided_regex": "It is sunny\\."})
    assert whole.choices[0].message.content == "It is sunny." and not whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("parallel", [True, False])
async def test_required_forces_calls_valid_against_their_schemas(client, parallel):
    client, _ = client
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=400,
                  temperature=0.8, seed=3)
    whole = await client.chat.completions.create(model="tiny", **kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    check_calls(whole.choices[0].message.tool_calls, parallel_ok=parallel)
    content, calls, reason = await streamed(client, **kwargs)
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]


async def test_a_named_function_streams_its_arguments(client):
    client, _ = client
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "count_items"}},
                  max_tokens=200, temperature=0.7, seed=1)
    whole = await client.chat.completions.create(model="tiny", **kwargs)
    calls = whole.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["count_items"] and whole.choices[0].finish_reason == "tool_calls"
    check_calls(calls)
    content, streamed_calls, reason = await streamed(client, **kwargs)
    assert content == "" and reason == "tool_calls"
    assert streamed_calls[0]["name"] == "count_items"
    assert json.loads(streamed_calls[0]["arguments"]) == json.loads(calls[0].function.arguments)


async def test_the_history_of_calls_and_results_is_rendered(client):
    client, engine = client
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    whole = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=3,
                                                 temperature=0)
    prompt = engine.tokenizer.apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>' in prompt
    assert "tool: 21 degrees and sunny" in prompt
    assert whole.usage.prompt_tokens == len(engine.tokenizer(prompt)["input_ids"])


async def test_tool_choice_none_renders_no_tools(client):
    client, engine = client
    with_none = await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                                     max_tokens=2, temperature=0)
    plain = await client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, temperature=0)
    assert with_none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert not with_none.choices[0].message.tool_calls


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
])
async def test_bad_tool_fields_are_400_naming_them(client, extra, param):
    client, _ = client
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="tiny", **{"messages": ASK, "max_tokens": 2, **extra})
    assert e.value.body["param"] == param


@pytest.mark.parametrize("seed", range(2))
async def test_a_template_without_tools_gets_the_generic_format(seed):
    """The tools described in the system turn, the output constrained to the generic JSON
    (a random model's answer being either form, the test takes what the grammar allows)."""
    engine = tiny_engine()  # the tiny template renders no tools
    app = create_app(engine, ServerConfig(model_name="tiny"))
    async with running_app(app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        kwargs = dict(messages=ASK, tools=[COUNT], max_tokens=300, temperature=1.0, seed=seed)
        try:
            auto = await client.chat.completions.create(model="tiny", **kwargs)
            content, calls, reason = await streamed(client, **kwargs)
            required = await client.chat.completions.create(model="tiny", **{**kwargs, "tool_choice": "required"})
            plain = await client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
            with pytest.raises(openai.BadRequestError) as e:  # auto needs the generic format's grammar
                await client.chat.completions.create(model="tiny", **kwargs, response_format={"type": "json_object"})
            assert e.value.body["param"] == "tool_choice"
        finally:
            await client.close()
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the tools are described
    message = auto.choices[0].message
    if message.tool_calls:  # the model called a tool, or answered: either is well formed
        assert auto.choices[0].finish_reason == "tool_calls" and message.content is None
        check_calls(message.tool_calls)
    else:
        assert auto.choices[0].finish_reason == "stop" and isinstance(message.content, str)
        assert not message.content.startswith('{"response"')
    assert (content or None, reason) == (message.content, auto.choices[0].finish_reason)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert required.choices[0].finish_reason == "tool_calls"
    check_calls(required.choices[0].message.tool_calls)


def test_the_cli_knows_every_parser():
    from acb.serving.cli import TOOL_CALL_PARSERS
    from acb.tools import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
