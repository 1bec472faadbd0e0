"""OpenAI's Agents SDK (``openai-agents``) against ``acb serve``'s ``/v1/responses``: a
two-turn tool-using agent (``Agent``, ``Runner.run``, a ``function_tool``) through
``OpenAIResponsesModel`` runs to completion. An extras test (CI's extras step installs the package:
scripts/setup.sh --extras); skipped elsewhere where it is not installed (``pip install 'acb[agents]'``),
never under CI."""

from __future__ import annotations

import os
from typing import Literal

import pytest
from http_helpers import running_app

import acb
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

pytestmark = pytest.mark.extras


def _agents():
    """The SDK, imported when the test runs (collection runs in every step; only extras install it). CI
    must run it: there a missing package fails the test instead of skipping it."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("agents", reason="openai-agents is not installed (pip install 'acb[agents]')")
    import agents

    return agents

# a template that renders tools (turn 2's "auto" output is read by the hermes parser: plain text here)
TOOLS_TEMPLATE = (
    "{%- if tools %}<s>system: tools {% for t in tools %}{{ t.function.name }} {% endfor %}\n{%- endif %}"
    "{%- for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}</tool_call>{%- endfor %}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<s>assistant:{% endif %}"
)


async def test_a_tool_using_agent_runs_to_completion():
    import openai

    agents = _agents()
    agents.set_tracing_disabled(True)  # (no traces sent anywhere)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    # the tiny random model ends its free text at its first broken character (an engine default stop)
    engine = tiny_engine(sampling=acb.SamplingParams(stop=["\ufffd"]))
    engine.tokenizer.chat_template = TOOLS_TEMPLATE
    async with running_app(create_app(engine, ServerConfig(model_name="tiny")), handler_cancellation=True) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        agent = agents.Agent(
            name="weather", instructions="Use the tool, then answer.", tools=[get_weather],
            model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
            # turn 1 must call (the SDK resets tool_choice to auto after a call: turn 2 answers)
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                max_tokens=200))
        result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        await client.close()
    assert calls == ["Paris"]
    assert len(result.raw_responses) == 2  # turn 1: the call; turn 2 (with its output in the input): the answer
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and set(kinds[2:]) <= {"MessageOutputItem"}
    assert isinstance(result.final_output, str)  # (what a random model says: maybe nothing before its stop)
