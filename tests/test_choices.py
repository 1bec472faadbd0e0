"""n > 1: choices forked from one prefilled prompt share its pages (copy-on-write of
the partial last page), stream interleaved by ``Chunk.index``, cancel together or
one by one, and every page comes back (the integrity check runs throughout)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import acb
from acb.testing import random_prompts, reference_greedy, tiny_engine, tiny_model

PROMPT = random_prompts(1, 13, 13, seed=5)[0]  # 13 tokens: a partial second page (page_size 8)
LONG_PROMPT = random_prompts(1, 21, 21, seed=6)[0]


def _counting(model):
    """Count the tokens each forward computes (a hook: the step runs transformers' forward)."""
    counted = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: counted.append(args[0].numel()))
    return counted


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:8]], ids=["partial-page", "whole-page"])
async def test_greedy_choices_equal_generate_and_the_prompt_is_prefilled_once(prompt):
    model = tiny_model()
    counted = _counting(model)
    engine = acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=8, debug_checks=True))
    async with engine:
        done = await engine.generate(prompt, n=4, max_new_tokens=12, ignore_eos=True)
        engine.check_integrity()
        assert engine.stats().free_blocks == engine.stats().total_blocks
    assert sum(counted) == len(prompt) + 4 * 11  # the prompt once, then each choice's own tokens
    expected = reference_greedy(model, prompt, 12)
    assert [c.token_ids for c in done.choices] == [expected] * 4
    assert [c.index for c in done.choices] == [0, 1, 2, 3] and done.choices[0] is done


def _forced_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' logprob of each of ``tokens`` after ``prompt`` and the ones before it."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral"])
async def test_choices_on_sliding_window_models_share_both_page_pools(arch):
    """Hybrid models (gemma2/3: the sliding layers have a page pool of their own) fork the
    sliding pages too and copy both on write; every layer sliding (mistral) forks the
    recycled block table. The prompt (21 tokens) outgrows the window (8), ends in a
    partial page and is prefilled in chunks of 5, so the leader recycles pages behind
    its window before the fork (and the two pools' page ids part ways). Each sampled
    choice's logprobs are the model's for its own tokens: no choice reads KV another
    one wrote."""
    model = tiny_model(arch)
    counted = _counting(model)
    config = acb.EngineConfig(num_blocks=64, page_size=4, max_batch_tokens=5, debug_checks=True)
    engine = acb.Engine(model, config=config)
    async with engine:
        chunks = []
        async for chunk in engine.stream(LONG_PROMPT, n=3, max_new_tokens=14, temperature=1.0, seed=3, logprobs=True,
                                         ignore_eos=True):
            chunks.append(chunk)
            engine.check_integrity()  # both pools: shared pages counted once per holder
        await asyncio.sleep(0)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.free_blocks == stats.total_blocks
        assert stats.sliding_free_blocks == stats.sliding_total_blocks
        assert (stats.sliding_total_blocks == 0) == (arch == "mistral")
    assert sum(counted) == len(LONG_PROMPT) + 3 * 13  # the prompt once
    choices = [[c for c in chunks if c.index == i] for i in range(3)]
    tokens = [[t for c in cs for t in c.token_ids] for cs in choices]
    assert len({tuple(t) for t in tokens}) == 3
    for toks, cs in zip(tokens, choices, strict=True):
        got = [lp for c in cs for lp in c.logprobs]
        assert got == pytest.approx(_forced_logprobs(model, LONG_PROMPT, toks), abs=1e-3)


async def test_sampled_choices_stream_interleaved_and_reproduce_with_a_seed():
    async with tiny_engine(debug_checks=True) as engine:
        kw = dict(n=4, max_new_tokens=16, temperature=1.0, seed=21, ignore_eos=True)
        chunks = []
        async for chunk in engine.stream(PROMPT, **kw):
            chunks.append(chunk)
            engine.check_integrity()  # shared pages counted once per holder, mid-flight
        again = await engine.generate(PROMPT, **kw)
    streamed = [[t for c in chunks if c.index == i for t in c.token_ids] for i in range(4)]
    assert streamed == [c.token_ids for c in again.choices]
    assert len({tuple(t) for t in streamed}) == 4  # each choice samples on its own
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2, 3]
    assert chunks[-1].finish_reason == "length"


async def test_choices_cancel_one_by_one_or_together_and_pages_come_back():
    async with tiny_engine(num_blocks=64, debug_checks=True) as engine:
        handle = engine.submit(PROMPT, n=3, max_new_tokens=200, ignore_eos=True)
        seen: dict[int, int] = {}
        async for chunk in handle:
            seen[chunk.index] = seen.get(chunk.index, 0) + len(chunk.token_ids)
            if chunk.index == 1 and not chunk.finish_reason and seen[1] >= 3:
                assert handle.cancel(index=1)
            if seen.get(0, 0) >= 20 and chunk.finish_reason is None:
                handle.cancel()
        done = await handle
        reasons = [c.finish_reason for c in done.choices]
        assert reasons == ["cancelled"] * 3
        assert len(done.choices[1].token_ids) < len(done.choices[0].token_ids)
        await asyncio.sleep(0)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.free_blocks == stats.total_blocks and stats.running == 0


async def test_too_many_choices_are_refused_by_name():
    async with tiny_engine(max_requests_per_batch=4) as engine:
        with pytest.raises(acb.InvalidRequestError) as e:
            await engine.generate(PROMPT, n=5)
        assert e.value.param == "n"
