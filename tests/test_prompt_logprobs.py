"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal transformers' own forward's
log-softmax over the prompt, per token, within 1e-4 (float32 on CPU; acb's paged
attention and fused forward sum in another order than transformers' SDPA): for every
architecture, with the prompt computed in several chunks, after its pages were cached
by an earlier request (a prefix-cache hit it must not take), and for n > 1."""

from __future__ import annotations

import pytest
import torch

import acb
from acb.testing import ARCHITECTURES, random_prompts, reference_log_softmax, tiny_model

TOL = 1e-4


def check_scores(scores: acb.PromptLogprobs, reference: torch.Tensor, prompt: list[int], k: int) -> None:
    """``scores`` against transformers' log-softmax: each token's logprob, its rank (a
    near-tie within the tolerance may fall either way) and the k best alternatives."""
    assert scores.token_ids == prompt
    assert scores.logprobs[0] is None and scores.ranks[0] is None and scores.top_logprobs[0] is None
    for p in range(1, len(prompt)):
        row = reference[p - 1]
        want = row[prompt[p]].item()
        assert abs(scores.logprobs[p] - want) < TOL, f"position {p}: {scores.logprobs[p]} != {want}"
        lo, hi = int((row > want + TOL).sum()) + 1, int((row >= want - TOL).sum())
        assert lo <= scores.ranks[p] <= hi, f"position {p}: rank {scores.ranks[p]} not in [{lo}, {hi}]"
        top = scores.top_logprobs[p]
        values, ids = row.topk(k)
        assert len(top) == k
        assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=TOL)
        assert set(top) == set(ids.tolist()), f"position {p}: top-{k} ids"


@pytest.mark.parametrize("arch", ARCHITECTURES)
async def test_prompt_logprobs_equal_transformers_forward_with_chunked_prefill(arch):
    model = tiny_model(arch)
    prompts = random_prompts(3, 20, 45, seed=7)
    reference = [reference_log_softmax(model, p) for p in prompts]
    # a 16-token budget: every prompt is computed in two to three chunks, beside the others
    config = acb.EngineConfig(page_size=4, num_blocks=96, max_batch_tokens=16, max_requests_per_batch=4)
    async with acb.Engine(model, config=config) as engine:
        done = await engine.generate_batch(prompts, max_new_tokens=3, prompt_logprobs=2)
        plain = await engine.generate(prompts[0], max_new_tokens=3)
    for got, ref, p in zip(done, reference, prompts):
        check_scores(got.prompt_logprobs, ref, p, 2)
    assert plain.prompt_logprobs is None
    assert plain.token_ids == done[0].token_ids  # scoring the prompt changes nothing generated


async def test_prompt_logprobs_after_a_prefix_cache_hit_are_recomputed():
    model = tiny_model("llama")
    prompt = random_prompts(1, 40, 40, seed=3)[0]
    reference = reference_log_softmax(model, prompt)
    config = acb.EngineConfig(page_size=4, num_blocks=64, max_batch_tokens=16)
    async with acb.Engine(model, config=config) as engine:
        first = await engine.generate(prompt, max_new_tokens=2)  # caches the prompt's pages
        again = await engine.generate(prompt, max_new_tokens=2)
        assert again.metrics.num_cached_prompt_tokens > 0  # a plain request hits
        scored = await engine.generate(prompt, max_new_tokens=2, prompt_logprobs=0)
        after = await engine.generate(prompt, max_new_tokens=2)
    assert scored.metrics.num_cached_prompt_tokens == 0  # computed whole, for its logits
    check_scores(scored.prompt_logprobs, reference, prompt, 0)
    assert after.metrics.num_cached_prompt_tokens > 0  # and its pages still serve later requests
    assert scored.token_ids == first.token_ids == after.token_ids


async def test_prompt_logprobs_with_n_choices_and_on_the_first_chunk_of_each():
    model = tiny_model("qwen2")
    prompt = random_prompts(1, 30, 30, seed=5)[0]
    reference = reference_log_softmax(model, prompt)
    config = acb.EngineConfig(page_size=4, num_blocks=96, max_batch_tokens=12)
    async with acb.Engine(model, config=config) as engine:
        done = await engine.generate(prompt, max_new_tokens=4, n=3, temperature=1.0, seed=1, prompt_logprobs=1)
        firsts: dict[int, acb.Chunk] = {}
        later = []
        async for chunk in engine.stream(prompt, max_new_tokens=4, n=2, temperature=1.0, seed=2,
                                         prompt_logprobs=1):
            if chunk.index not in firsts:
                firsts[chunk.index] = chunk
            else:
                later.append(chunk)
    assert len(done.choices) == 3
    for choice in done.choices:
        check_scores(choice.prompt_logprobs, reference, prompt, 1)
    assert set(firsts) == {0, 1}
    for chunk in firsts.values():
        assert chunk.token_ids, "the scores ride on the chunk with the first token"
        check_scores(chunk.prompt_logprobs, reference, prompt, 1)
    assert later and all(c.prompt_logprobs is None for c in later)


async def test_prompt_logprobs_survive_preemption_and_one_token_prompts():
    model = tiny_model("llama")
    prompts = random_prompts(6, 25, 35, seed=11)
    reference = [reference_log_softmax(model, p) for p in prompts]
    # 20 pages of 4 tokens cannot hold six growing requests: some are preempted and recomputed
    config = acb.EngineConfig(page_size=4, num_blocks=20, max_batch_tokens=24, safety_margin=0.0)
    async with acb.Engine(model, config=config) as engine:
        done = await engine.generate_batch(prompts, max_new_tokens=20, prompt_logprobs=3)
        stats = engine.stats()
        single = await engine.generate([5], max_new_tokens=2, prompt_logprobs=3)
    assert stats.preemptions > 0
    for got, ref, p in zip(done, reference, prompts):
        check_scores(got.prompt_logprobs, ref, p, 3)
    assert single.prompt_logprobs == acb.PromptLogprobs([5], [None], [None], [None])


async def test_prompt_logprobs_refuses_bad_values():
    async with acb.Engine(tiny_model("llama")) as engine:
        for bad in (-1, 1.5, True, 10**9):
            with pytest.raises(acb.InvalidRequestError) as e:
                await engine.generate([3, 4, 5], max_new_tokens=1, prompt_logprobs=bad)
            assert e.value.param == "prompt_logprobs"
