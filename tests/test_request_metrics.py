"""Per-request metrics: ``Completion.metrics``, the last ``Chunk.metrics``, and the
``metrics`` object ``acb serve`` answers with (vLLM's names), read through the ``openai`` client."""

from __future__ import annotations

import asyncio

import pytest
from http_helpers import running_app

import acb
from acb.serving.server import ServerConfig, create_app
from acb.testing import tiny_engine

VLLM_FIELDS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


def _check_consistent(m: acb.RequestMetrics, generated: int) -> None:
    assert m.num_generated_tokens == generated
    assert m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.last_token_time <= m.finish_time
    assert m.ttft_s == pytest.approx(m.queue_time_s + m.prefill_time_s)
    assert m.generation_time_s == pytest.approx(m.prefill_time_s + m.decode_time_s)
    assert m.mean_itl_s == pytest.approx(m.decode_time_s / (generated - 1))
    assert m.tokens_per_s == pytest.approx(generated / m.generation_time_s)


async def test_completion_metrics_split_queue_prefill_and_decode():
    async with tiny_engine() as engine:
        done = await engine.generate([1, 2, 3, 4], max_new_tokens=6, ignore_eos=True)
    _check_consistent(done.metrics, 6)
    assert done.metrics.num_prompt_tokens == 4 and done.metrics.num_preemptions == 0


async def test_a_queued_request_reports_its_wait():
    """One row per step: the second request leaves the queue only once the first has
    produced its tokens, and its queue time says so."""
    async with tiny_engine(max_requests_per_batch=1) as engine:
        first = engine.submit([1, 2, 3], max_new_tokens=8, ignore_eos=True)
        second = engine.submit([4, 5, 6], max_new_tokens=2, ignore_eos=True)
        a, b = await asyncio.gather(first, second)
    assert b.metrics.scheduled_time > a.metrics.first_token_time
    assert b.metrics.queue_time_s > a.metrics.queue_time_s
    assert b.metrics.queue_time_s >= a.metrics.decode_time_s * 0.5


async def test_only_the_last_chunk_carries_the_metrics():
    async with tiny_engine() as engine:
        handle = engine.submit([1, 2, 3], max_new_tokens=5, ignore_eos=True)
        chunks = [c async for c in handle]
        done = await handle
    assert all(c.metrics is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == "length" and chunks[-1].metrics is done.metrics
    _check_consistent(chunks[-1].metrics, 5)


async def test_prefix_hits_and_preemptions_are_counted_per_request():
    prompt = list(range(3, 40))
    async with tiny_engine(num_blocks=10, page_size=8) as engine:
        first = await engine.generate(prompt, max_new_tokens=2)
        second = await engine.generate(prompt, max_new_tokens=2)
        crowd = await engine.generate_batch([[i] * 30 for i in range(3, 7)], max_new_tokens=20, ignore_eos=True)
        stats = engine.stats()
    assert first.metrics.num_cached_prompt_tokens == 0 and second.metrics.num_cached_prompt_tokens == 32
    assert stats.preemptions > 0
    assert sum(c.metrics.num_preemptions for c in crowd) == stats.preemptions


# -- acb serve through the openai client --------------------------------------------------
openai = pytest.importorskip("openai")
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def served(request):
    app = create_app(tiny_engine(), ServerConfig(model_name="tiny", **getattr(request, "param", {})))
    async with running_app(app, handler_cancellation=True) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        yield client
        await client.close()


def _metrics(obj) -> dict:
    return (obj.model_extra or {}).get("metrics")


async def test_include_metrics_returns_vllms_metrics_object(served):
    plain = await served.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0)
    assert _metrics(plain) is None
    answer = await served.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0,
                                                  extra_body={"include_metrics": True, "ignore_eos": True})
    m = _metrics(answer)
    assert VLLM_FIELDS <= set(m)
    assert m["completion_tokens"] == answer.usage.completion_tokens == 5
    assert m["time_to_first_token_ms"] == pytest.approx(m["queue_time_ms"] + m["prefill_time_ms"], abs=0.01)
    assert m["generation_time_ms"] == pytest.approx(m["prefill_time_ms"] + m["decode_time_ms"], abs=0.01)
    # each value is rounded to the microsecond on its own, so a quotient of two may differ by one
    assert m["mean_itl_ms"] == pytest.approx(m["decode_time_ms"] / 4, rel=1e-3, abs=1e-3)
    assert m["tokens_per_second"] == pytest.approx(5000 / m["generation_time_ms"], rel=1e-3)
    assert m["num_preemptions"] == 0 and m["cached_prompt_tokens"] >= 0


async def test_streams_carry_metrics_on_each_choices_last_chunk(served):
    stream = await served.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, n=2,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True,
                                                         "stream_options": {"include_usage": True,
                                                                            "include_metrics": True}})
    chunks = [c async for c in stream]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(c.choices[0].index for c in finals) == [0, 1]
    assert all(VLLM_FIELDS <= set(_metrics(c)) and _metrics(c)["completion_tokens"] == 4 for c in finals)
    assert all(_metrics(c) is None for c in chunks if c not in finals)


async def test_several_choices_get_a_metrics_object_each(served):
    answer = await served.completions.create(model="tiny", prompt=["hello", "there"], max_tokens=3,
                                             temperature=0, extra_body={"include_metrics": True})
    assert _metrics(answer) is None
    assert all(VLLM_FIELDS <= set(c.model_extra["metrics"]) for c in answer.choices)


@pytest.mark.parametrize("served", [{"enable_per_request_metrics": True}], indirect=True)
async def test_the_server_flag_puts_metrics_in_every_answer(served):
    answer = await served.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert VLLM_FIELDS <= set(_metrics(answer))


async def test_include_metrics_must_be_a_boolean(served):
    with pytest.raises(openai.BadRequestError) as bad:
        await served.completions.create(model="tiny", prompt="hello", max_tokens=3,
                                        extra_body={"include_metrics": "yes"})
    assert bad.value.body["param"] == "include_metrics"
