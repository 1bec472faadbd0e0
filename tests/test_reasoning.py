"""Reasoning split (``reasoning_parser``): the thought between ``<think>`` and ``</think>``
apart from the answer, in the engine's chunks (text, per-token mask) and completions, and
through ``acb serve`` as ``reasoning_content``, streamed and whole."""

from __future__ import annotations

import json
import random
import re

import pytest

import acb
from acb.core.reasoning import ReasoningSplitter, parser_for_template
from acb.testing import tiny_engine

THINKING_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% if enable_thinking is not defined or enable_thinking %}"
    "<think>{% endif %}{% endif %}"
)


@pytest.mark.parametrize(("parser", "opened", "text", "reasoning", "answer"), [
    ("think", False, "<think>a plan</think>The answer.", "a plan", "The answer."),
    ("think", False, "\n<think>\nstep 1\nstep 2\n</think>\n\nDone", "\nstep 1\nstep 2\n", "\n\nDone"),
    ("think", False, "No thought here, 1 < 2.", "", "No thought here, 1 < 2."),
    ("think", True, "thinking already</think>answer", "thinking already", "answer"),
    ("think", True, "cut short by max_tokens", "cut short by max_tokens", ""),
    ("deepseek_r1", False, "r1 thinks</think>ok", "r1 thinks", "ok"),
    ("deepseek_r1", False, "<think>r1 thinks</think>ok", "r1 thinks", "ok"),
])
def test_split_whole_and_in_any_pieces(parser, opened, text, reasoning, answer):
    rng = random.Random(len(text))
    for trial in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if trial else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        splitter = ReasoningSplitter(parser, opened)
        got_r, got_a = "", ""
        for piece in pieces:
            r, a = splitter.push(piece)
            assert "<think>" not in r + a and "</think>" not in r + a
            got_r, got_a = got_r + r, got_a + a
        r, a = splitter.flush()
        assert (got_r + r, got_a + a) == (reasoning, answer), pieces


def test_parser_from_the_template():
    assert parser_for_template(THINKING_TEMPLATE) == "think"
    assert parser_for_template("{{ messages }}") is None
    with pytest.raises(acb.InvalidRequestError) as e:
        acb.SamplingParams(reasoning_parser="nope")
    assert e.value.param == "reasoning_parser"


async def test_engine_chunks_carry_the_split_and_a_per_token_mask():
    forced = "<think>I think so</think>Yes."
    async with tiny_engine() as engine:
        chunks = [c async for c in engine.stream("Q?", max_new_tokens=60, regex=re.escape(forced),
                                                 reasoning_parser="think")]
        done = await engine.generate("Q?", max_new_tokens=60, regex=re.escape(forced), reasoning_parser="think")
        plain = await engine.generate("Q?", max_new_tokens=60, regex=re.escape(forced))
    assert "".join(c.reasoning_text for c in chunks) == "I think so" == done.reasoning_text
    assert "".join(c.text for c in chunks) == "Yes." == done.text
    assert plain.text == forced and plain.reasoning_text is None
    ids = [t for c in chunks for t in c.token_ids]
    mask = [m for c in chunks for m in c.reasoning_mask]
    assert len(mask) == len(ids)
    texts = [engine.tokenizer.decode([t]) for t in ids]
    split = "".join(texts).index("</think>") + len("</think>")
    # every token up to the end of </think> is the thought's, every later one the answer's
    assert mask == [len("".join(texts[: i + 1])) <= split for i in range(len(ids))]


async def test_a_prompt_that_opens_the_thought():
    engine = tiny_engine()
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    async with engine:
        done = await engine.generate([{"role": "user", "content": "Q?"}], max_new_tokens=40,
                                     regex=re.escape("hmm</think>42"), reasoning_parser="think")
    assert (done.reasoning_text, done.text) == ("hmm", "42")


# ---------------------------------------------------------------------------- acb serve
ASK = [{"role": "user", "content": "Why?"}]
TOOLS_AND_THINKING = THINKING_TEMPLATE.replace(
    "{% for m in messages %}", "{% if tools %}<s>system: tools <tool_call></tool_call>\n{% endif %}"
    "{% for m in messages %}")


@pytest.fixture
async def client():
    openai = pytest.importorskip("openai", reason="the official openai client")  # (the tests above need none)
    from http_helpers import running_app

    from acb.serving.server import ServerConfig, create_app

    engine = tiny_engine()
    engine.tokenizer.chat_template = TOOLS_AND_THINKING  # shows <think>: the server splits by itself
    async with running_app(create_app(engine, ServerConfig(model_name="tiny"))) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        yield client
        await client.close()


async def test_reasoning_content_whole_and_streamed(client):
    kwargs = dict(model="tiny", messages=ASK, max_tokens=60, temperature=0,
                  extra_body={"guided_regex": re.escape("because</think>Answer.")})
    whole = await client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("because", "Answer.")
    # max_tokens and usage count both parts (and the EOS that ends the grammar)
    assert whole.usage.completion_tokens == len("because</think>Answer.") + 1
    stream = await client.chat.completions.create(stream=True, **kwargs)
    reasoning, content = "", ""
    async for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == ("because", "Answer.")


async def test_thinking_off_in_the_template_is_all_content(client):
    whole = await client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=20, temperature=0,
        extra_body={"guided_regex": "Answer\\.", "chat_template_kwargs": {"enable_thinking": False}})
    assert whole.choices[0].message.content == "Answer."
    assert whole.choices[0].message.model_extra["reasoning_content"] is None


async def test_a_tool_call_after_the_thought_is_parsed_and_the_thought_kept_apart(client):
    forced = 'plan</think><tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for stream in (False, True):
        answer = await client.chat.completions.create(model="tiny", messages=ASK, tools=tools, max_tokens=120,
                                                      temperature=0, stream=stream,
                                                      extra_body={"guided_regex": re.escape(forced)})
        if stream:
            reasoning, content, args, reason = "", "", "", None
            async for chunk in answer:
                delta = chunk.choices[0].delta
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
                args += "".join(tc.function.arguments or "" for tc in delta.tool_calls or [])
                reason = chunk.choices[0].finish_reason or reason
        else:
            message = answer.choices[0].message
            reasoning, content = message.model_extra["reasoning_content"], message.content or ""
            args, reason = message.tool_calls[0].function.arguments, answer.choices[0].finish_reason
        assert (reasoning, content, reason) == ("plan", "", "tool_calls")
        assert json.loads(args) == {"x": 1}


def test_the_cli_and_server_config_know_the_parsers():
    from acb.serving.cli import REASONING_PARSERS, build_parser
    from acb.serving.server import ServerConfig

    assert REASONING_PARSERS == acb.core.reasoning.PARSERS
    args = build_parser().parse_args(["serve", "--tiny", "--reasoning-parser", "none", "--tool-call-parser", "mistral"])
    assert (args.reasoning_parser, args.tool_call_parser) == ("none", "mistral")
    for field in ("reasoning_parser", "tool_call_parser"):
        with pytest.raises(ValueError, match=field):
            ServerConfig(**{field: "nope"})
