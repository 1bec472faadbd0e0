"""Tool-call parsers (acb.tools: acb.core.tool_parsers, acb.core.tools, acb.engine.tool_calls):
each format read whole, and streamed in every split of its text with the same result, no markup
ever in the content."""

from __future__ import annotations

import json
import random

import pytest

import acb
from acb.tools import check_tools, get_parser, parser_for_template, required_schema

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
CASES = [
    # (parser, output, content, [(name, arguments)])
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", {"city": "Paris", "unit": "c"})]),
    ("hermes", f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
     "Let me look.\n\n", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "UTC"})]),
    ("hermes", "No tools needed: 1 < 2 and <b>bold</b>.", "No tools needed: 1 < 2 and <b>bold</b>.", []),
    ("hermes", f"<tool_call>\n{WEATHER}", "", [("get_weather", {"city": "Paris", "unit": "c"})]),  # EOS, no close
    ("hermes", "<tool_call>{not json}</tool_call> tail", "<tool_call>{not json}</tool_call> tail", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", f'{WEATHER}; {TIME}', "", [("get_weather", {"city": "Paris", "unit": "c"}),
                                               ("get_time", {"tz": "UTC"})]),
    ("llama3_json", "The weather is {mild}.", "The weather is {mild}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", f"[TOOL_CALLS] [{WEATHER}, {TIME}]", "", [("get_weather", {"city": "Paris", "unit": "c"}),
                                                          ("get_time", {"tz": "UTC"})]),
    ("mistral", f"[{WEATHER}]", "", [("get_weather", {"city": "Paris", "unit": "c"})]),  # the control token skipped
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', "", [("get_time", {"tz": "UTC"})]),
    ("mistral", "Sure, [1, 2] are numbers.", "Sure, [1, 2] are numbers.", []),
    ("json", f"[{WEATHER}, {TIME}]", "", [("get_weather", {"city": "Paris", "unit": "c"}),
                                          ("get_time", {"tz": "UTC"})]),
    ("generic", f'{{"tool_calls": [{WEATHER}, {TIME}]}}', "", [("get_weather", {"city": "Paris", "unit": "c"}),
                                                               ("get_time", {"tz": "UTC"})]),
    ("generic", '{"response": "It is sunny, {no call}."}', "It is sunny, {no call}.", []),
    ("generic", '{"response": "quote \\" and \\u00e9 and \\\\ done"}', 'quote " and \u00e9 and \\ done', []),
    ("generic", '{"response": "cut short by max_tok', "cut short by max_tok", []),
    ("generic", '{"tool_calls": [{"name": "get_time", "argu', "", []),
    ("generic", '{"tool_calls": [{"name": "unknown", "arguments": {}}]}',
     '{"tool_calls": [{"name": "unknown", "arguments": {}}]}', []),
]
NAMES = ["get_weather", "get_time"]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output(parser, text, content, calls):
    got_content, got_calls = get_parser(parser, NAMES).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_in_any_split_equals_whole(parser, text, content, calls):
    rng = random.Random(len(text))
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if trial else \
            list(range(1, len(text)))  # trial 0: character by character
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = get_parser(parser, NAMES).stream()
        got_content, got_calls = "", []
        for piece in pieces:
            c, new = stream.push(piece)
            got_content += c
            got_calls += new
            if calls:  # markup never leaks, even before the call is complete
                assert "<tool_call" not in got_content and "[TOOL_CALLS" not in got_content
        c, new = stream.finish()
        got_content += c
        got_calls += new
        assert got_content == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, pieces


def test_unknown_function_names_stay_content():
    content, calls = get_parser("hermes", ["get_time"]).parse(f"<tool_call>{WEATHER}</tool_call>")
    assert calls == [] and "get_weather" in content


def test_parser_from_the_chat_template():
    assert parser_for_template("{% if tools %}...<tool_call>...{% endif %}") == "hermes"
    assert parser_for_template("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert parser_for_template("{%- if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


@pytest.mark.parametrize("tools", [[], "x", [{"type": "function"}], [{"type": "function", "function": {"name": "a b"}}],
                                   [{"type": "function", "function": {"name": "f", "parameters": []}}],
                                   [{"type": "function", "function": {"name": "f"}}] * 2,
                                   [{"type": "retrieval", "function": {"name": "f"}}]])
def test_bad_tools_are_refused_naming_the_field(tools):
    with pytest.raises(acb.InvalidRequestError) as e:
        check_tools(tools)
    assert e.value.param == "tools"


def test_generic_messages_describe_the_tools_and_write_earlier_calls_as_json():
    from acb.tools import generic_messages, generic_schema

    tools = [{"type": "function", "function": {"name": "f", "description": "does f",
                                               "parameters": {"type": "object"}}}]
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out = generic_messages(history, tools)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and "does f" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
    assert "tool_calls" not in out[2] and out[3] == history[3]
    assert "tool_calls" in history[2]  # the caller's messages are left as they were
    assert generic_messages(history[1:], tools, answer=False)[0]["role"] == "system"
    assert len(generic_schema(tools)["anyOf"]) == 2 and "anyOf" not in generic_schema(tools, answer=False)


def test_required_schema_limits_parallel_calls():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert required_schema(tools, parallel=False)["maxItems"] == 1
    assert "maxItems" not in required_schema(tools)


# ---------------------------------------------------------------------------- engine-side helpers
ENGINE_TEMPLATE = (
    "{%- if tools %}<s>system: tools {% for t in tools %}{{ t.function.name }} {% endfor %}<tool_call>\n{%- endif %}"
    "{%- for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:{% endif %}"
)
ENGINE_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "Weather?"}]


def tool_engine():
    from acb.testing import tiny_engine

    engine = tiny_engine()
    engine.tokenizer.chat_template = ENGINE_TEMPLATE
    return engine


async def test_engine_helpers_parse_the_models_calls():
    import re

    from acb.tools import generate_with_tools, stream_with_tools

    forced = "Checking. " + f"<tool_call>{WEATHER}</tool_call>"
    async with tool_engine() as engine:
        done = await generate_with_tools(engine, ASK, ENGINE_TOOLS, max_new_tokens=120, regex=re.escape(forced))
        deltas = [d async for d in stream_with_tools(engine, ASK, ENGINE_TOOLS, max_new_tokens=120,
                                                     regex=re.escape(forced))]
    assert done.content == "Checking. "
    assert [(c.name, c.parsed_arguments()) for c in done.tool_calls] == [("get_weather", {"city": "Paris",
                                                                                           "unit": "c"})]
    assert "".join(d.content for d in deltas) == "Checking. "
    assert all("<" not in d.content for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.name, c.parsed_arguments()) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]
    assert deltas[-1].chunk.finish_reason is not None


async def test_engine_helpers_force_required_and_named_calls():
    jsonschema = pytest.importorskip("jsonschema")
    from acb.tools import generate_with_tools

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in ENGINE_TOOLS}
    async with tool_engine() as engine:
        required = await generate_with_tools(engine, ASK, ENGINE_TOOLS, tool_choice="required", max_new_tokens=200,
                                             temperature=0.8, seed=2)
        named = await generate_with_tools(engine, ASK, ENGINE_TOOLS, tool_choice="get_time", max_new_tokens=200,
                                          temperature=0.8, seed=2)
        with pytest.raises(acb.InvalidRequestError) as e:
            await generate_with_tools(engine, ASK, ENGINE_TOOLS, tool_choice="nope")
    assert e.value.param == "tool_choice"
    assert required.tool_calls and required.content == ""
    for call in required.tool_calls:
        jsonschema.validate(call.parsed_arguments(), schemas[call.name])
    assert [c.name for c in named.tool_calls] == ["get_time"]
    jsonschema.validate(named.tool_calls[0].parsed_arguments(), schemas["get_time"])


async def test_engine_helpers_use_the_generic_format_when_the_template_knows_no_tools():
    from acb.testing import tiny_engine
    from acb.tools import generate_with_tools

    async with tiny_engine() as engine:  # the tiny template renders no tools
        done = await generate_with_tools(engine, ASK, ENGINE_TOOLS[1:], max_new_tokens=300, temperature=1.0, seed=0)
    assert "get_time" in engine.tokenizer.decode(done.completion.prompt_token_ids)  # described in the prompt
    assert done.completion.finish_reason in ("eos", "stop")  # the grammar completed
    assert done.tool_calls or done.content  # the grammar allows a call or an answer, nothing else
    assert all(c.name == "get_time" and c.parsed_arguments()["tz"] in ("UTC", "CET") for c in done.tool_calls)
