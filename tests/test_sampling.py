"""Sampling: seeded reproducibility whatever shares the batch; top-k / top-p never
emit an excluded token; temperature 0 is greedy."""

from __future__ import annotations

import math

import torch

from acb.testing import random_prompts, tiny_engine
from acb.worker.sampling import SamplingBatch, sample

PROMPT = [5, 17, 33, 60, 91, 120]


def _batch(n, temperature=1.0, top_k=0, top_p=1.0, seed=None):
    return SamplingBatch.from_rows([(temperature, top_k, top_p, seed, i) for i in range(n)], want_logprobs=True)


def test_top_k_never_emits_outside_the_k_best():
    logits = torch.log(torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]])).repeat(4000, 1)
    ids, _ = sample(logits, _batch(4000, top_k=2), torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    ids, _ = sample(logits, _batch(4000, top_p=0.7), torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0, 1}  # 0.5 < 0.7 <= 0.8
    ids, _ = sample(logits, _batch(4000, top_p=0.5), torch.Generator().manual_seed(0))
    assert set(ids.tolist()) == {0}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).unsqueeze(0).repeat(20000, 1)
    ids, _ = sample(logits, _batch(20000), torch.Generator().manual_seed(1))
    freq = torch.bincount(ids, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.02)


def test_temperature_sharpens_and_zero_is_greedy():
    logits = torch.tensor([[1.0, 0.5, 0.0]]).repeat(5000, 1)
    hot, _ = sample(logits, _batch(5000, temperature=2.0), torch.Generator().manual_seed(0))
    cold, _ = sample(logits, _batch(5000, temperature=0.1), torch.Generator().manual_seed(0))
    assert (cold == 0).float().mean() > 0.99 > (hot == 0).float().mean()
    greedy, _ = sample(logits[:3], _batch(3, temperature=0.0))
    assert greedy.tolist() == [0, 0, 0]


def test_logprobs_are_of_the_model_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    ids, lp = sample(logits, _batch(1, temperature=0.0))
    assert math.isclose(lp.item(), torch.log_softmax(logits, -1)[0, 0].item(), rel_tol=1e-6)


def test_seeded_rows_do_not_depend_on_their_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    alone, _ = sample(logits[2:3], SamplingBatch.from_rows([(0.9, 10, 0.9, 42, 3)], False))
    rows = [(1.0, 0, 1.0, None, 0)] * 6
    rows[2] = (0.9, 10, 0.9, 42, 3)
    crowded, _ = sample(logits, SamplingBatch.from_rows(rows, False), torch.Generator().manual_seed(5))
    assert crowded[2].item() == alone[0].item()


async def test_same_seed_same_tokens_alone_and_in_a_crowded_batch():
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    async with tiny_engine() as engine:
        alone = await engine.generate(PROMPT, **kw)
        again = await engine.generate(PROMPT, **kw)
        crowd = [engine.submit(p, max_new_tokens=24, temperature=1.0, ignore_eos=True)
                 for p in random_prompts(10, 3, 30, seed=9)]
        crowded = await engine.generate(PROMPT, **kw)
        other_seed = await engine.generate(PROMPT, **{**kw, "seed": 99})
        for h in crowd:
            await h
    assert alone.token_ids == again.token_ids == crowded.token_ids
    assert other_seed.token_ids != alone.token_ids


async def test_unseeded_sampling_varies():
    async with tiny_engine() as engine:
        outs = {tuple((await engine.generate(PROMPT, max_new_tokens=16, temperature=1.5,
                                             ignore_eos=True)).token_ids) for _ in range(4)}
    assert len(outs) > 1
