"""Prefix caching, schedulers, safety margin and a starved cache, end to end."""

from __future__ import annotations

import asyncio
import random

import pytest

import acb
from acb.testing import random_prompts, reference_greedy, runner_of, tiny_model

SYSTEM = random_prompts(1, 40, 40, seed=123)[0]  # 40 tokens = 5 full pages of 8


async def test_shared_prefix_hits_cache_and_keeps_parity():
    model = tiny_model()
    tails = random_prompts(6, 3, 12, seed=5)
    prompts = [SYSTEM + t for t in tails]
    expected = [reference_greedy(model, p, 10) for p in prompts]
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=128, page_size=8)) as engine:
        first = await engine.generate(prompts[0], max_new_tokens=10, ignore_eos=True)
        rest = [await engine.generate(p, max_new_tokens=10, ignore_eos=True) for p in prompts[1:]]
        stats = engine.stats()
    assert first.metrics.num_cached_prompt_tokens == 0
    assert all(r.metrics.num_cached_prompt_tokens == 40 for r in rest)
    assert [r.token_ids for r in [first, *rest]] == expected
    assert stats.cached_blocks > 0
    assert 0 < stats.prefix_hit_rate < 1


async def test_identical_prompt_recomputes_its_last_page_only():
    model = tiny_model()
    prompt = SYSTEM[:32]  # exactly 4 pages
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=8)) as engine:
        a = await engine.generate(prompt, max_new_tokens=6, ignore_eos=True)
        b = await engine.generate(prompt, max_new_tokens=6, ignore_eos=True)
    assert b.metrics.num_cached_prompt_tokens == 24
    assert a.token_ids == b.token_ids == reference_greedy(model, prompt, 6)


async def test_prefix_sharing_can_be_turned_off():
    config = acb.EngineConfig(num_blocks=64, page_size=8, allow_prefix_sharing=False)
    async with acb.Engine(tiny_model(), config=config) as engine:
        await engine.generate(SYSTEM + [5], max_new_tokens=2)
        again = await engine.generate(SYSTEM + [6], max_new_tokens=2)
        assert again.metrics.num_cached_prompt_tokens == 0
        assert engine.stats().cached_blocks == 0


async def test_sliding_window_models_do_not_share_prefixes():
    async with acb.Engine(tiny_model("mistral"), config=acb.EngineConfig(num_blocks=64, page_size=8)) as engine:
        await engine.generate(SYSTEM + [5], max_new_tokens=2)
        again = await engine.generate(SYSTEM + [6], max_new_tokens=2)
    assert again.metrics.num_cached_prompt_tokens == 0


async def test_generate_batch_groups_shared_prefixes_and_keeps_input_order():
    model = tiny_model()
    other = random_prompts(1, 40, 40, seed=77)[0]
    tails = random_prompts(8, 2, 6, seed=9)
    prompts = [(SYSTEM if i % 2 else other) + t for i, t in enumerate(tails)]  # the two prefixes alternate
    # One request at a time, in a cache that holds one request's pages: a prefix stays cached
    # only until a request with the other prefix runs. Submitted in input order, every
    # request would evict the one before and none would hit; grouped by prefix, all but
    # the first of each group hit its 40 tokens.
    config = acb.EngineConfig(num_blocks=8, page_size=8, max_requests_per_batch=1, safety_margin=0.0)
    async with acb.Engine(model, config=config) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=4, ignore_eos=True)
    assert [r.prompt_token_ids for r in results] == prompts
    assert [r.token_ids for r in results] == [reference_greedy(model, p, 4) for p in prompts]
    assert sorted(r.metrics.num_cached_prompt_tokens for r in results) == [0, 0] + [40] * 6


@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first"])
async def test_both_schedulers_keep_parity(scheduler):
    model = tiny_model("qwen3")
    prompts = random_prompts(8, 4, 30, seed=2)
    expected = [reference_greedy(model, p, 12) for p in prompts]
    config = acb.EngineConfig(num_blocks=40, page_size=4, max_batch_tokens=32, scheduler=scheduler)
    async with acb.Engine(model, config=config) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in results] == expected


async def test_a_thousand_requests_through_a_cache_too_small_for_a_tenth():
    model = tiny_model()
    rng = random.Random(0)
    distinct = random_prompts(20, 4, 16, seed=31)
    expected = [reference_greedy(model, p, 8) for p in distinct]
    # 24 pages of 4 tokens hold ~4 of these requests at once: far below 100.
    config = acb.EngineConfig(num_blocks=24, page_size=4, max_batch_tokens=64, max_requests_per_batch=16,
                              debug_checks=True)
    picks = [rng.randrange(len(distinct)) for _ in range(1000)]
    async with acb.Engine(model, config=config) as engine:
        results = await asyncio.wait_for(
            engine.generate_batch([distinct[i] for i in picks], max_new_tokens=8, ignore_eos=True), 240)
        stats = engine.stats()
        engine.check_integrity()
    assert all(r.token_ids == expected[i] for r, i in zip(results, picks))
    assert stats.free_blocks == stats.total_blocks and stats.running == stats.waiting == 0


async def test_request_that_can_never_fit_names_the_field():
    async with acb.Engine(tiny_model(), config=acb.EngineConfig(num_blocks=4, page_size=4)) as engine:
        with pytest.raises(acb.InvalidRequestError, match="max_new_tokens"):
            engine.submit(list(range(3, 15)), max_new_tokens=8)
        done = await engine.generate(list(range(3, 11)), max_new_tokens=8, ignore_eos=True)
        assert len(done.token_ids) == 8


async def test_all_sliding_model_generates_past_the_cache_size_without_preemption():
    """Mistral-style: every layer slides (window 8), so pages behind the window are
    recycled; 20 pages of 4 tokens (80 slots) serve 3 requests of 150 tokens each."""
    model = tiny_model("mistral")
    prompts = random_prompts(3, 10, 20, seed=4)
    expected = [reference_greedy(model, p, 130) for p in prompts]
    config = acb.EngineConfig(num_blocks=20, page_size=4, max_batch_tokens=16, debug_checks=True)
    async with acb.Engine(model, config=config) as engine:
        assert engine.max_model_len > 20 * 4
        results = await engine.generate_batch(prompts, max_new_tokens=130, ignore_eos=True)
        stats = engine.stats()
        engine.check_integrity()
    assert [r.token_ids for r in results] == expected
    assert stats.preemptions == 0
    assert stats.free_blocks == stats.total_blocks


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
@pytest.mark.parametrize("async_batching", [True, False])
async def test_hybrid_model_sliding_layers_keep_only_the_window(arch, async_batching):
    """Gemma 2/3: the sliding layers (window 8) get their own page pool, sized for the
    running requests' windows: 17 pages of 4 tokens serve 3 requests of ~150 tokens
    (114 pages of history each layer would otherwise need), with no preemption."""
    model = tiny_model(arch)
    prompts = random_prompts(3, 10, 20, seed=4)
    expected = [reference_greedy(model, p, 130) for p in prompts]
    config = acb.EngineConfig(num_blocks=120, page_size=4, max_batch_tokens=16, max_requests_per_batch=4,
                              async_batching=async_batching, debug_checks=True)
    async with acb.Engine(model, config=config) as engine:
        stats = engine.stats()
        assert stats.sliding_total_blocks == 4 * (2 + 1) + 4 + 1 < stats.total_blocks
        runner = runner_of(engine)
        sliding = sorted(engine.layout.swa_layers)
        assert sliding and all(runner.kv.k_cache[i].shape[1] == 18 * 4 for i in sliding)
        results = await engine.generate_batch(prompts, max_new_tokens=130, ignore_eos=True)
        stats = engine.stats()
        engine.check_integrity()
    assert [r.token_ids for r in results] == expected
    assert stats.preemptions == 0
    assert stats.free_blocks == stats.total_blocks and stats.sliding_free_blocks == stats.sliding_total_blocks


async def test_hybrid_sliding_model_keeps_every_page():
    async with acb.Engine(tiny_model("gemma3"), config=acb.EngineConfig(num_blocks=20, page_size=4)) as engine:
        assert engine.max_model_len == 80  # full-attention layers need the whole history
