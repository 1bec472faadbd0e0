"""Greedy output equals transformers' own ``generate``, token for token, for every
supported architecture, whatever else shares the batch: staggered arrivals,
chunked prefill (small token budget) and preemption (small cache)."""

from __future__ import annotations

import asyncio
import zlib

import pytest
import torch

import acb
from acb.model.fused import native_bf16
from acb.testing import ARCHITECTURES, random_prompts, reference_greedy, step_counts, tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
async def test_greedy_matches_transformers_generate(arch):
    model = tiny_model(arch)
    # a fixed seed per architecture (hash() of a str changes with every process: the preemption
    # this test asserts came and went with it)
    prompts = random_prompts(13, 3, 40, seed=zlib.crc32(arch.encode()) % 1000)
    max_new = [8 + (i * 7) % 25 for i in range(len(prompts))]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    assert len({tuple(e) for e in expected}) == len(expected), "reference output not varied"
    # A 24-token budget forces chunked prefill; 24 pages of 4 tokens hold any one
    # request but not the running set as it grows (no safety margin), which forces preemption.
    config = acb.EngineConfig(page_size=4, num_blocks=24, max_batch_tokens=24, max_requests_per_batch=8,
                              safety_margin=0.0)
    engine = acb.Engine(model, config=config)
    async with engine:
        results = await _run_staggered_keep(engine, prompts, max_new)
        stats = engine.stats()
    for got, want, p in zip(results, expected, prompts):
        assert got.token_ids == want, f"prompt of {len(p)} tokens diverged"
        assert got.finish_reason == "length"
    assert stats.preemptions > 0
    assert stats.free_blocks == stats.total_blocks


async def _run_staggered_keep(engine, prompts, max_new):
    """Submit in three waves; each later wave waits until the engine has produced
    more tokens, so new prefills join a batch of running decodes."""
    handles = []
    waves = [prompts[:5], prompts[5:9], prompts[9:]]
    for w, wave in enumerate(waves):
        for p in wave:
            handles.append(engine.submit(p, max_new_tokens=max_new[len(handles)], ignore_eos=True))
        if w < len(waves) - 1:
            before = engine.stats().generated_tokens
            async with asyncio.timeout(30):
                while engine.stats().generated_tokens < before + 3:
                    await asyncio.sleep(0.001)
    return [await h for h in handles]


@pytest.mark.parametrize("async_batching", [True, False])
async def test_parity_with_and_without_step_overlap(async_batching):
    model = tiny_model("llama")
    prompts = random_prompts(6, 5, 30, seed=7)
    expected = [reference_greedy(model, p, 12) for p in prompts]
    config = acb.EngineConfig(page_size=8, num_blocks=64, async_batching=async_batching)
    async with acb.Engine(model, config=config) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
        carried = step_counts(engine).carried  # steps fed a token sampled by the step still in flight
    assert [r.token_ids for r in results] == expected
    assert (carried > 0) == async_batching


async def test_eos_stops_like_generate():
    model = tiny_model("llama")
    prompts = random_prompts(20, 3, 12, seed=3)
    expected = [reference_greedy(model, p, 60, eos=True) for p in prompts]
    assert any(e and e[-1] == 2 and len(e) < 60 for e in expected), "no prompt reaches EOS"
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=128, page_size=8)) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=60)
    for r, e in zip(results, expected):
        assert r.token_ids == e
        assert r.finish_reason == ("eos" if e[-1] == 2 and len(e) < 60 else "length")


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mistral"])
@pytest.mark.parametrize("backend", ["native", "torch"])
async def test_both_cpu_attention_backends_match_generate(arch, backend):
    model = tiny_model(arch)
    prompts = random_prompts(6, 3, 30, seed=21)
    expected = [reference_greedy(model, p, 20) for p in prompts]
    config = acb.EngineConfig(page_size=4, num_blocks=96, max_batch_tokens=32, attn_backend=backend)
    async with acb.Engine(model, config=config) as engine:
        if backend == "native":
            assert engine.stats().attn_backend == "native", "native CPU kernel did not build"
        results = await engine.generate_batch(prompts, max_new_tokens=20, ignore_eos=True)
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("max_blocks", [None, 0, 10])
async def test_max_blocks_per_request_bounds_the_decode_fast_path(max_blocks):
    model = tiny_model("llama")
    prompts = random_prompts(6, 3, 30, seed=22)
    expected = [reference_greedy(model, p, 20) for p in prompts]
    # pages of 4 tokens: the widest context grows from 8 to 13 pages, so a bound of 10 pages
    # serves the early decode steps on the fast path and the later ones on PyTorch's
    config = acb.EngineConfig(page_size=4, num_blocks=128, max_blocks_per_request=max_blocks)
    async with acb.Engine(model, config=config) as engine:
        if engine.stats().attn_backend != "native":
            pytest.skip("the native CPU kernel did not build here")
        results = await engine.generate_batch(prompts, max_new_tokens=20, ignore_eos=True)
        fast, steps = step_counts(engine).fast_decode, engine.stats().steps
    assert [r.token_ids for r in results] == expected
    if max_blocks is None:
        assert fast >= steps - 2  # every step with decode rows (not the first prefill)
    elif max_blocks == 0:
        assert fast == 0
    else:
        assert 0 < fast < steps - 2



@pytest.mark.parametrize("dtype, kv", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8"),
                                       pytest.param(torch.bfloat16, "int8", marks=pytest.mark.extras)])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
async def test_a_prompts_logprobs_are_the_same_bits_however_it_was_cut(arch, dtype, kv):
    """On the native kernels a prompt's logits do not depend on how it was chunked. A
    prompt of 17 tokens on pages of 8 runs whole; again, where a prefix hit leaves its last
    token alone in its step (llama: the hybrid pools of gemma3 cache no prefixes); and under
    budgets that cut it 8 / 8 / 1 and 16 / 1: the generated tokens' logprobs and
    alternatives are the same bits. A one-token chunk of a prompt runs as a prefill row
    (``StepInput.prompt_singles``): as a decode row it went through the decode kernel, whose
    float32 sums run in another order, and the logprobs moved by ~1e-6, enough to flip a
    greedy or seeded draw between two near-equal candidates. (PyTorch's and Triton's
    attention do not promise this: their sums change with the cut, by ~1e-6.)"""
    if dtype == torch.bfloat16 and native_bf16() is None:
        pytest.skip("no bf16 fused path here")
    model = tiny_model(arch).to(dtype)
    prompt = random_prompts(1, 17, 17, seed=31)[0]
    kw = dict(max_new_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3)

    def config(budget):
        return acb.EngineConfig(page_size=8, num_blocks=64, max_batch_tokens=budget, kv_cache_dtype=kv)

    async with acb.Engine(model, config=config(64)) as engine:
        assert engine.stats().attn_backend == "native", "the native CPU kernels did not build"
        whole = await engine.generate(prompt, **kw)
        runs = [await engine.generate(prompt, **kw)]
        assert (engine.stats().prefix_hit_rate > 0) == (arch == "llama")
    for budget in (8, 16):
        async with acb.Engine(model, config=config(budget)) as engine:
            runs.append(await engine.generate(prompt, **kw))
    for r in runs:
        assert r.token_ids == whole.token_ids
        assert r.logprobs == whole.logprobs and r.top_logprobs == whole.top_logprobs
