"""CPU offload (``cpu_offload_space``): a preempted request's KV pages go to a host
pool and come back into fresh pages when it resumes, so nothing is recomputed but
its last known token (for logits). Greedy output stays equal to ``generate``."""

from __future__ import annotations

import asyncio
import logging

import psutil
import pytest
import torch
from reliability_helpers import PROMPTS, expected, idle_and_free, until

import acb
from acb.core.kv_cache import HostPool, KVCacheManager
from acb.core.model_shape import ModelShape
from acb.core.scheduler import WAITING, Scheduler, Sequence
from acb.core.step import PageMoves, StepOutput
from acb.testing import random_prompts, reference_greedy, tiny_engine, tiny_model
from acb.worker.runner import ModelRunner

# 24 pages of 4 tokens, no safety margin: any one request fits, the running set does not.
STARVED = dict(page_size=4, num_blocks=24, max_batch_tokens=24, max_requests_per_batch=8, safety_margin=0.0)


async def _staggered(engine, prompts, max_new):
    handles = []
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        handles.append(engine.submit(p, max_new_tokens=n, ignore_eos=True))
        if i % 4 == 3:
            before = engine.stats().generated_tokens
            async with asyncio.timeout(30):
                while engine.stats().generated_tokens < before + 2:
                    await asyncio.sleep(0.001)
    return [await h for h in handles]


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "gemma2"])
@pytest.mark.parametrize("async_batching", [True, False])
async def test_offload_resumes_preempted_requests_without_recompute_and_exact_tokens(arch, async_batching):
    model = tiny_model(arch)
    prompts = random_prompts(12, 3, 40, seed=11)
    max_new = [10 + (i * 7) % 23 for i in range(len(prompts))]
    want = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new, strict=True)]
    config = acb.EngineConfig(**STARVED, cpu_offload_space=0.01, async_batching=async_batching, debug_checks=True)
    engine = acb.Engine(model, config=config)
    async with engine:
        got = await _staggered(engine, prompts, max_new)
        stats = engine.stats()
        engine.check_integrity()
    assert [c.token_ids for c in got] == want
    assert stats.preemptions > 0
    assert stats.offloads == stats.preemptions  # the pool never ran out
    assert stats.restores == stats.offloads
    assert stats.recomputed_tokens == 0
    assert stats.offloaded_blocks == 0 and stats.host_blocks > 0
    assert stats.free_blocks == stats.total_blocks
    assert sum(c.metrics.num_preemptions for c in got) == stats.preemptions


async def test_without_offload_the_same_run_recomputes():
    model = tiny_model("llama")
    prompts = random_prompts(12, 3, 40, seed=11)
    max_new = [10 + (i * 7) % 23 for i in range(len(prompts))]
    want = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new, strict=True)]
    async with acb.Engine(model, config=acb.EngineConfig(**STARVED)) as engine:
        got = await _staggered(engine, prompts, max_new)
        stats = engine.stats()
    assert [c.token_ids for c in got] == want
    assert stats.preemptions > 0 and stats.offloads == 0 and stats.host_blocks == 0
    assert stats.recomputed_tokens > 0


async def test_a_full_pool_falls_back_to_recompute_and_stays_exact():
    model = tiny_model("llama")
    per_page = ModelShape.of(model.config).kv_bytes_per_token(torch.float32) * 4
    prompts = random_prompts(12, 3, 40, seed=5)
    max_new = [10 + (i * 5) % 23 for i in range(len(prompts))]
    want = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new, strict=True)]
    config = acb.EngineConfig(**STARVED, cpu_offload_space=6 * per_page / 2**30, debug_checks=True)
    async with acb.Engine(model, config=config) as engine:
        assert engine.stats().host_blocks == 6
        got = await _staggered(engine, prompts, max_new)
        stats = engine.stats()
    assert [c.token_ids for c in got] == want
    assert 0 < stats.offloads < stats.preemptions  # some fit the pool, some were recomputed
    assert stats.recomputed_tokens > 0
    assert stats.offloaded_blocks == 0 and stats.free_blocks == stats.total_blocks


async def test_cancelling_offloaded_requests_frees_their_host_slots():
    engine = tiny_engine(**STARVED, cpu_offload_space=0.01, debug_checks=True)
    async with engine:
        handles = [engine.submit(PROMPTS[i % len(PROMPTS)], max_new_tokens=40, ignore_eos=True) for i in range(10)]
        await until(lambda: engine.stats().offloaded_blocks > 0)
        for h in handles:
            h.cancel()
        await until(lambda: idle_and_free(engine))
        engine.check_integrity()
        assert engine.stats().offloaded_blocks == 0
        done = await engine.generate(PROMPTS[2], max_new_tokens=12, ignore_eos=True)
        assert done.token_ids == expected(PROMPTS[2], 12)


def _moves(*entries: tuple[int, ...]) -> PageMoves:
    """Page moves from (src, dst[, sliding page]) entries."""
    moves = PageMoves()
    for entry in entries:
        moves.add(*entry)
    return moves


def test_pool_size_follows_the_setting_and_is_capped_at_80_percent_of_available_ram(caplog):
    model = tiny_model("llama")
    per_page = ModelShape.of(model.config).kv_bytes_per_token(torch.float32) * 16
    engine = acb.Engine(model, config=acb.EngineConfig(num_blocks=32, cpu_offload_space=0.001))
    assert engine.stats().host_blocks == int(0.001 * 2**30 // per_page)
    cap_pages = 0.8 * psutil.virtual_memory().available / per_page
    auto = acb.Engine(model, config=acb.EngineConfig(num_blocks=32, cpu_offload_space=None)).stats().host_blocks
    assert 0.9 * cap_pages < auto <= 1.02 * cap_pages
    with caplog.at_level(logging.WARNING, logger="acb"):
        huge = acb.Engine(model, config=acb.EngineConfig(num_blocks=32, cpu_offload_space=1e6)).stats().host_blocks
    assert huge <= 1.02 * cap_pages
    assert "cpu_offload_space" in caplog.text
    assert acb.Engine(model, config=acb.EngineConfig(num_blocks=32)).stats().host_blocks == 0


@torch.inference_mode()
def test_runner_swaps_pages_out_and_back_into_other_pages_bit_for_bit():
    model = tiny_model("qwen3")
    runner = ModelRunner(model, num_pages=8, page_size=4, host_pages=4)
    try:
        for k, v in zip(runner.kv.k_cache, runner.kv.v_cache, strict=True):
            k.copy_(torch.randn_like(k))
            v.copy_(torch.randn_like(v))
        ps = runner.kv.page_size
        before = [(k[:, 2 * ps : 4 * ps].clone(), v[:, 5 * ps : 6 * ps].clone())
                  for k, v in zip(runner.kv.k_cache, runner.kv.v_cache, strict=True)]
        runner.kv.offload.swap_out(_moves((2, 3), (3, 0), (5, 1)))
        for cache in runner.kv.k_cache + runner.kv.v_cache:
            cache[:, : 8 * ps].zero_()
        runner.kv.offload.swap_in(_moves((3, 6), (0, 7), (1, 0)))
        for (k_want, v_want), k, v in zip(before, runner.kv.k_cache, runner.kv.v_cache, strict=True):
            assert torch.equal(k[:, 6 * ps : 8 * ps], k_want)
            assert torch.equal(v[:, 0:ps], v_want)
    finally:
        runner.release()


def test_scheduler_offloads_the_victim_and_restores_it_into_fresh_pages():
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)
    host = HostPool(8)
    sched = Scheduler(kv, max_batch_tokens=64, max_requests=8, host_pool=host)
    a, b = Sequence("a", list(range(8)), 20, arrival=0), Sequence("b", list(range(8)), 20, arrival=1)
    sched.add(a)
    sched.add(b)
    plans = []
    while not b.host_table:  # both prefill (2 pages each), then decode until b is preempted
        plans.append(sched.schedule())
        sched.update(plans[-1], StepOutput([1] * plans[-1].num_sampled, None))  # their sampled tokens arrive
    # b (newest) was offloaded: its known tokens' KV minus the last one, in host slots
    assert b.status is WAITING and b.num_offloaded_tokens == b.num_tokens - 1
    assert len([s for s in b.host_table if s >= 0]) == kv.pages_for(b.num_offloaded_tokens)
    swaps = [pair for p in plans for pair in p.input.swap_out.entries()]
    assert len(swaps) == len(b.host_table)
    slots = [s for s in b.host_table if s >= 0]
    sched.finish(a)
    plan = sched.schedule()
    assert plan.seqs == [b] and plan.input.counts() == [1]  # only the last token
    swap_in = plan.input.swap_in
    assert swap_in.src == slots
    assert b.host_table is None and b.num_computed == len(b.prompt_ids) + len(b.output_ids)
    assert swap_in.dst == b.block_table[: len(swap_in)]
    sched.schedule()
    host.check_integrity()
    assert host.num_free == host.num_slots


@torch.inference_mode()
def test_runner_swaps_hybrid_entries_with_and_without_a_sliding_page():
    model = tiny_model("gemma3")  # layers 0 and 1 slide, layer 2 does not
    runner = ModelRunner(model, num_pages=8, page_size=4, host_pages=4, swa_pages=5, swa_layers=frozenset({0, 1}))
    try:
        ps = runner.kv.page_size
        assert runner.kv.k_cache[0].shape[1] == 6 * ps and runner.kv.k_cache[2].shape[1] == 9 * ps
        for cache in runner.kv.k_cache + runner.kv.v_cache:
            cache[:, :-ps].copy_(torch.randn_like(cache[:, :-ps]))  # every page but the zero page
        full_before = runner.kv.k_cache[2][:, 1 * ps : 2 * ps].clone(), runner.kv.v_cache[2][:, 4 * ps : 5 * ps].clone()
        swa_before = runner.kv.k_cache[0][:, 3 * ps : 4 * ps].clone()
        # entry 1: full page 1 with sliding page 3; entry 2: full page 4, its sliding page recycled
        runner.kv.offload.swap_out(_moves((1, 0, 3), (4, 2, -1)))
        for cache in runner.kv.k_cache + runner.kv.v_cache:
            cache[:, : -ps].zero_()
        runner.kv.offload.swap_in(_moves((0, 6, 2), (2, 7, -1)))
        assert torch.equal(runner.kv.k_cache[2][:, 6 * ps : 7 * ps], full_before[0])
        assert torch.equal(runner.kv.v_cache[2][:, 7 * ps : 8 * ps], full_before[1])
        assert torch.equal(runner.kv.k_cache[0][:, 2 * ps : 3 * ps], swa_before)
        assert bool((runner.kv.k_cache[0][:, 5 * ps :] == 0).all())  # the sliding pool's zero page untouched
    finally:
        runner.release()
