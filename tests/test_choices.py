"""n > 1: choices forked from one prefilled prompt share its pages (copy-on-write of
the partial last page), stream interleaved by ``Chunk.index``, cancel together or
one by one, and every page comes back (the integrity check runs throughout)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import acb
from acb.testing import random_prompts, reference_greedy, runner_of, tiny_engine, tiny_model

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



def _corrupt_a_sent_entry(engine) -> tuple[int, int]:
    """Change, in the runner's block-table store, an entry a running choice has sent: (its
    store row, the entry's true value)."""
    seq = next(s for s in engine.scheduler.running if s.num_sent_pages)
    store = runner_of(engine).kv.tables
    true = int(store.pages[seq.table_row + 1, 0])
    store.pages[seq.table_row + 1, 0] = true + 1
    return seq.table_row + 1, true


async def test_the_integrity_check_compares_the_runners_block_tables_with_the_schedulers():
    async with tiny_engine(num_blocks=64) as engine:
        handle = engine.submit(PROMPT, n=3, max_new_tokens=40, ignore_eos=True)
        checked = False
        async for _ in handle:
            if not checked and engine.stats().generated_tokens >= 9:
                checked = True
                engine.check_integrity()  # forked tables, copy-on-write and new pages sent
                row, true = _corrupt_a_sent_entry(engine)
                with pytest.raises(AssertionError, match="block-table row"):
                    engine.check_integrity()  # after the step in flight
                runner_of(engine).kv.tables.pages[row, 0] = true
                engine.check_integrity()
                handle.cancel()
        await handle
        assert checked


async def test_a_block_table_check_behind_a_step_waiting_for_its_grammar_masks_fails_the_next_step():
    # a step in flight whose grammar masks the loop has not handed out yet: the check cannot
    # wait for it (the step waits for the loop), so it is queued behind it on the step thread
    async with tiny_engine(num_blocks=64) as engine:
        handle = engine.submit(PROMPT, regex="[ab]{300}", max_new_tokens=400)
        steps = engine._steps

        async def check_while_masks_are_pending() -> None:
            while True:
                # not sleep(0): a loop that never blocks keeps the GIL from the step and mask
                # threads (each torch call's release and retake waits a switch interval), and
                # the steps took ~5 s each in half the runs. The window is a whole step long.
                await asyncio.sleep(0.001)
                last = steps._last_launched
                if engine.stats().generated_tokens >= 9 and last is not None and last.masks is not None:
                    _corrupt_a_sent_entry(engine)
                    engine.check_integrity()  # queued: does not raise here
                    return

        checker = asyncio.ensure_future(check_while_masks_are_pending())
        with pytest.raises(acb.RequestFailedError, match="block-table row"):
            await handle
        assert checker.done() and steps._tables_check is None
