"""Speculative decoding with a draft model (EngineConfig(speculative_method="draft",
draft_model=...)): lossless whatever the draft proposes, its mirrored cache right (a
self-draft accepts everything greedy), exact page accounting, the engine's features
composed, what cannot act refused by name.

Three drafts: the model itself (a self-draft: every greedy proposal is the model's own
argmax, so anything below full acceptance is a broken draft cache), a noisy copy of it
(some proposals accepted, some rejected) and a smaller random model of the same
vocabulary (another shape of cache; nearly everything rejected)."""

from __future__ import annotations

import asyncio
import copy
import zlib

import pytest
import torch

import acb
from acb.core.speculative import DraftSpeculation
from acb.engine.settings import inactive_settings
from acb.testing import (
    ARCHITECTURES,
    random_prompts,
    reference_greedy,
    speculate_always,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
)


def small_draft(arch: str, seed: int = 1) -> torch.nn.Module:
    """A random model of ``arch`` with the tiny models' vocabulary but fewer, narrower
    layers and other heads (its own cache shape), same attention layout."""
    from transformers import AutoModelForCausalLM

    overrides = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=8, num_hidden_layers=2)
    if arch == "gemma3":
        overrides["layer_types"] = ["sliding_attention", "full_attention"]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32).eval()


def noisy_copy(model: torch.nn.Module, scale: float = 0.6, seed: int = 2) -> torch.nn.Module:
    """The model with noise on its output head: it proposes the model's token often, not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.lm_head.weight
        w += scale * w.std() * torch.randn(w.shape, generator=gen)
    return draft


def draft_engine(model, draft, tokenizer=None, **config) -> acb.Engine:
    """An engine proposing with ``draft`` all it may (``speculate_always``: these tests check
    verification and the mirrored cache, not the cost model)."""
    engine = acb.Engine(model, tokenizer, config=acb.EngineConfig(speculative_method="draft", draft_model=draft,
                                                                   **config))
    speculate_always(engine)
    return engine


SMALL = dict(page_size=4, num_blocks=26, max_batch_tokens=24, max_requests_per_batch=8, safety_margin=0.0,
             debug_checks=True)


async def _greedy(engine, prompts, max_new, opt_out=-1):
    async with engine:
        handles = [engine.submit(p, max_new_tokens=n, ignore_eos=True, speculative=False if i == opt_out else None)
                   for i, (p, n) in enumerate(zip(prompts, max_new))]
        results = [await h for h in handles]
        stats = engine.stats()
        engine.check_integrity()
    return [r.token_ids for r in results], stats


# llama and a hybrid (gemma3: sliding and full layers, two page pools) in the default suite
ARCHS = [a if a in ("llama", "gemma3") else pytest.param(a, marks=pytest.mark.extras) for a in ARCHITECTURES]


@pytest.mark.parametrize("arch", ARCHS)
async def test_self_draft_equals_generate_and_accepts_everything(arch):
    """Token for token against transformers' generate, with chunked prefill (a small
    budget) and preemption (a small cache), an opted-out row beside; the model drafting
    for itself has every proposal accepted, which only a draft cache holding the right
    KV at every page (prefill chunks, recomputed rows, proposals) gives."""
    model = tiny_model(arch)
    prompts = random_prompts(5, 6, 14, seed=zlib.crc32(arch.encode()) % 1000)
    max_new = [24 + (i * 5) % 11 for i in range(len(prompts))]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    got, stats = await _greedy(draft_engine(model, model, **SMALL), prompts, max_new, opt_out=3)
    assert got == expected
    assert stats.spec_proposed_tokens > 40
    assert stats.spec_acceptance_rate > 0.97, stats.spec_acceptance_rate
    if arch != "mistral":  # every layer slides: pages behind the window go back, nobody runs out
        assert stats.preemptions > 0
    assert stats.free_blocks == stats.total_blocks


@pytest.mark.parametrize("arch", ARCHS)
async def test_other_drafts_change_no_token(arch):
    """A smaller random draft (its own cache shape; nearly all rejected) and a noisy copy
    (accepted and rejected): the same greedy tokens as generate, every page back."""
    model = tiny_model(arch)
    prompts = random_prompts(4, 6, 14, seed=7)
    max_new = [20, 26, 17, 23]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    for draft in (small_draft(arch), noisy_copy(model)):
        got, stats = await _greedy(draft_engine(model, draft, **SMALL), prompts, max_new)
        assert got == expected
        assert stats.spec_proposed_tokens > stats.spec_accepted_tokens
        assert stats.free_blocks == stats.total_blocks
    assert 0 < stats.spec_accepted_tokens  # the noisy copy's: some accepted, some not


async def test_features_compose_with_a_draft():
    """Stop tokens inside an accepted run, min_new_tokens, logprobs, penalties (the draft's
    proposals counted at each position after them), n > 1 seeded sampling, logit bias:
    each the same as on an engine without speculation."""
    model = tiny_model("qwen3")
    prompt = random_prompts(1, 12, 12, seed=0)[0]  # its penalised request differs if proposals go uncounted
    greedy = reference_greedy(model, prompt, 30)
    stop = greedy[12]
    requests = [
        (prompt, dict(max_new_tokens=30, stop_token_ids=[stop])),
        (prompt, dict(max_new_tokens=30, stop_token_ids=[stop], min_new_tokens=14)),
        (prompt, dict(max_new_tokens=7)),
        (prompt, dict(max_new_tokens=20, logprobs=True, top_logprobs=3, ignore_eos=True)),
        (prompt, dict(max_new_tokens=24, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3,
                      ignore_eos=True)),
        (prompt, dict(max_new_tokens=16, n=2, temperature=0.8, top_k=3, seed=5, ignore_eos=True)),
        (prompt, dict(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=11, logit_bias={60: 2.0},
                      ignore_eos=True)),
    ]
    outs = []
    for engine in (acb.Engine(model, config=acb.EngineConfig(page_size=4, num_blocks=128)),
                   draft_engine(model, noisy_copy(model, 0.3), page_size=4, num_blocks=128)):
        async with engine:
            outs.append(await asyncio.gather(*(engine.generate(p, **kw) for p, kw in requests)))
            stats = engine.stats()
            engine.check_integrity()
    plain, spec = outs
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert b.token_ids == a.token_ids, i
        assert b.finish_reason == a.finish_reason, i
        assert [c.token_ids for c in b.choices or []] == [c.token_ids for c in a.choices or []], i
        if a.logprobs is not None:
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert plain[0].finish_reason == "stop" and len(plain[0].token_ids) == 13
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens


@pytest.mark.parametrize("method", ["draft", "ngram"])
async def test_choices_fork_from_a_prompt_whose_last_chunk_is_one_token(method):
    """A prompt of 15 tokens in chunks of 7: its last row is one token, where a lone request
    would propose. With n > 1 the other choices fork from that row, so it carries no
    proposals: the forks took the leader's proposals as computed, ran one past their prompt
    and were never planned again (the loop spun, the request never ended)."""
    model = tiny_model("qwen3")
    prompt = random_prompts(1, 15, 15, seed=7)[0]
    if method == "ngram":  # a prompt whose tail repeats, so the n-gram lookup proposes at its end
        prompt = prompt[:9] + prompt[3:9]
    want = reference_greedy(model, prompt, 10)
    config = dict(page_size=8, num_blocks=128, max_batch_tokens=7, debug_checks=True)
    engine = draft_engine(model, noisy_copy(model, 0.3), **config) if method == "draft" else \
        acb.Engine(model, config=acb.EngineConfig(speculative_method="ngram", **config))
    if method == "ngram":
        speculate_always(engine)
    async with engine:
        async with asyncio.timeout(60):
            done = await engine.generate(prompt, n=3, max_new_tokens=10, ignore_eos=True)
            alone = await engine.generate(prompt, max_new_tokens=10, ignore_eos=True)
        stats = engine.stats()
    assert [c.token_ids for c in done.choices] == [want] * 3 and alone.token_ids == want
    assert stats.spec_proposed_tokens > 0 or method == "ngram"  # random outputs repeat no n-gram after the prompt


async def test_prefix_caching_and_cpu_offload_with_a_draft():
    """A prefix-cache hit starts from pages whose draft KV an earlier request's mirror
    wrote; preempted requests offloaded to the host come back with their draft KV too:
    a self-draft still accepts everything."""
    model = tiny_model("llama")
    prompt = random_prompts(1, 20, 20, seed=9)[0]
    expected = reference_greedy(model, prompt, 24)
    async with draft_engine(model, model, page_size=4, num_blocks=64) as engine:
        first = await engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
        again = await engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
        stats = engine.stats()
        engine.check_integrity()
    assert first.token_ids == again.token_ids == expected
    assert again.metrics.num_cached_prompt_tokens > 0
    assert stats.spec_acceptance_rate > 0.97

    prompts = random_prompts(4, 14, 20, seed=10)
    expected = [reference_greedy(model, p, 24) for p in prompts]
    config = dict(page_size=4, num_blocks=30, max_requests_per_batch=4, safety_margin=0.0, cpu_offload_space=0.01)
    async with draft_engine(model, model, **config) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=24, ignore_eos=True)
        stats = engine.stats()
        engine.check_integrity()
    assert [r.token_ids for r in results] == expected
    assert stats.offloads > 0 and stats.restores > 0
    assert stats.spec_acceptance_rate > 0.97


async def test_cancel_mid_run_gives_every_page_back():
    model = tiny_model("llama")
    async with draft_engine(model, noisy_copy(model), page_size=4, num_blocks=64) as engine:
        handles = [engine.submit(p, max_new_tokens=200, ignore_eos=True) for p in random_prompts(3, 8, 12, seed=2)]
        async with asyncio.timeout(30):
            while engine.stats().spec_proposed_tokens < 12:
                engine.check_integrity()
                await asyncio.sleep(0)
        for h in handles:
            h.cancel()
        assert {(await h).finish_reason for h in handles} == {"cancelled"}
        engine.check_integrity()
        stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks


async def test_a_draft_folder_loads_like_the_model(tmp_path):
    model = tiny_model("llama")
    small_draft("llama").save_pretrained(tmp_path / "draft")
    tiny_tokenizer().save_pretrained(tmp_path / "draft")
    prompt = random_prompts(1, 10, 10, seed=5)[0]
    async with draft_engine(model, str(tmp_path / "draft"), page_size=4, num_blocks=64) as engine:
        out = await engine.generate(prompt, max_new_tokens=12, ignore_eos=True)
        assert engine.stats().spec_proposed_tokens > 0
    assert out.token_ids == reference_greedy(model, prompt, 12)


def test_drafts_that_cannot_propose_are_refused_by_name():
    model = tiny_model("llama")
    for draft, why in ((tiny_model("llama"), None),
                       (small_draft("gemma3"), "attention layout"),
                       (_with_vocab(small_draft("llama"), 300), "vocabulary"),
                       (object(), "model folder or a transformers model"),
                       ("/nonexistent/draft", "could not be loaded")):
        config = acb.EngineConfig(speculative_method="draft", draft_model=draft, num_blocks=32)
        if why is None:
            acb.Engine(model, config=config)
            continue
        with pytest.raises(ValueError, match=f"draft_model.*{why}"):
            acb.Engine(model, config=config)
    for kwargs in (dict(speculative_method="draft"), dict(speculative_method="ngram", draft_model=model),
                   dict(draft_model=model)):
        with pytest.raises(ValueError, match="draft_model"):
            acb.EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="speculative_method"):
        acb.EngineConfig(speculative_method="draft", draft_model=model, tensor_parallel_size=2)
    # the n-gram lookup's settings do nothing with a draft: named as inactive
    assert inactive_settings(acb.EngineConfig(speculative_method="draft", draft_model=model, prompt_lookup_max=6),
                             "cpu") == ["prompt_lookup_max"]


def test_the_cache_budget_counts_the_draft_pages(steady_ram):
    """The draft's cache has a page for each of the model's: a self-draft halves the pages
    a memory budget buys."""
    from acb.worker import sizing

    model = tiny_model("llama")
    config = acb.EngineConfig(max_memory_percent=0.01)
    alone, mirrored = sizing.layout(model, config).num_pages, sizing.layout(model, config, model).num_pages
    assert mirrored == pytest.approx(alone / 2, rel=0.05)
    small = sizing.layout(model, config, small_draft("llama")).num_pages
    assert mirrored < small < alone


def _with_vocab(model: torch.nn.Module, vocab: int) -> torch.nn.Module:
    model.resize_token_embeddings(vocab)
    return model


def test_the_draft_chain_costs_its_proposals():
    """The bar a proposal clears is (R b + c) / (a + b R), c one chain step of the draft:
    a draft as slow as the model never pays; a cheap one proposes all it may."""
    spec = DraftSpeculation(4)
    row = spec.state()
    row.accept = 0.9
    for tokens, seconds in ((1, 0.030), (5, 0.034), (16, 0.045), (64, 0.090)):
        spec.observe_step(tokens, seconds)
    spec.observe_draft(4, 4 * 0.002)
    spec.begin_plan(1)
    assert spec.wanted(row) == 4
    assert spec.propose(row, [1, 2, 3], 3) == [0, 0, 0]  # placeholders: the draft fills them on the device
    spec.observe_draft(4, 4 * 0.05)  # a chain step costing more than a step of the model
    for _ in range(20):
        spec.observe_draft(4, 4 * 0.05)
    spec.begin_plan(1)
    assert spec.wanted(row) == 0
