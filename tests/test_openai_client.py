"""The official ``openai`` client against acb's server (skipped when openai is not installed)."""

from __future__ import annotations

import time

import pytest
from http_helpers import running_app

from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

openai = pytest.importorskip("openai", reason="the openai client comes with acb[test]")

CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def client():
    app = create_app(tiny_engine(), ServerConfig(model_name="tiny", api_key="k"))
    async with running_app(app, handler_cancellation=True) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        yield client
        await client.close()


async def test_models_list(client):
    assert [m.id async for m in client.models.list()] == ["tiny"]


async def test_an_unknown_model_is_the_clients_not_found_error(client):
    with pytest.raises(openai.NotFoundError) as error:
        await client.chat.completions.create(model="tiny-typo", messages=CHAT, max_tokens=2)
    assert error.value.code == "model_not_found" and error.value.param == "model"
    assert "'tiny'" in error.value.message


async def test_completion_whole_and_streamed(client):
    whole = await client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    stream = await client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == whole.choices[0].text


async def test_chat_whole_and_streamed_with_usage(client):
    whole = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                                 logprobs=True)
    assert whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].logprobs.content) == 6
    stream = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


async def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client):
    long = [{"role": "user", "content": "the same long question, asked twice " * 4}]
    first = await client.chat.completions.create(model="tiny", messages=long, max_tokens=2, temperature=0)
    again = await client.chat.completions.create(model="tiny", messages=long, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
    usage = [c async for c in again][-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every whole page (page_size 8) of the prompt but the one holding its last token
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 8 * 8 > 0
    text = await client.completions.create(model="tiny", prompt=long[0]["content"], max_tokens=1)
    assert text.usage.prompt_tokens_details.cached_tokens == 0  # (not the chat template's prefix)


async def test_errors_map_to_the_clients_exceptions(client):
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=30)
    assert bad.value.body["param"] == "top_logprobs"
    wrong_key = client.with_options(api_key="nope")
    with pytest.raises(openai.AuthenticationError):
        await wrong_key.models.list()


async def test_vllm_style_extra_body_and_unknown_fields_are_accepted(client):
    answer = await client.completions.create(
        model="tiny", prompt=["hello", "there"], max_tokens=4, temperature=0, echo=True,
        extra_body={"repetition_penalty": 1.0, "top_k": -1, "some_new_field": {"x": 1}})
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].text.startswith("hello") and answer.choices[1].text.startswith("there")
    assert 2 <= answer.usage.completion_tokens <= 8


async def test_chat_stream_with_continuous_usage(client):
    stream = await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True,
                                                            "stream_options": {"include_usage": True,
                                                                               "continuous_usage_stats": True}})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.usage.completion_tokens for c in chunks if c.choices][-1] == 5
    assert chunks[-1].usage.completion_tokens == 5


async def test_timeout_s_through_extra_body_ends_with_a_valid_finish_reason():
    def paced(step: int, stage: str) -> None:  # >= 10 ms a step: 400 tokens never fit in 0.3 s
        if stage == "forward":
            time.sleep(0.01)

    app = create_app(tiny_engine(fault_hook=paced), ServerConfig(model_name="tiny"))
    async with running_app(app, handler_cancellation=True) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
            kw = dict(model="tiny", max_tokens=400, temperature=0, extra_body={"timeout_s": 0.3, "ignore_eos": True})
            whole = await client.chat.completions.create(messages=CHAT, **kw)
            assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens < 400
            stream = await client.completions.create(prompt="hello", stream=True, **kw)
            reasons = [c.choices[0].finish_reason async for c in stream if c.choices]
            assert reasons[-1] == "length"
            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(prompt="hello", model="tiny", extra_body={"timeout_s": -2})
            assert bad.value.body["param"] == "timeout_s"
