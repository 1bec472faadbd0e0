"""Speculative decoding (EngineConfig.speculative_method="ngram"): lossless, in the same
batched step, with exact page accounting, composed with the engine's other features.

A tiny random model rarely repeats itself, so the prompts here are repetitive (a token
run, a short cycle, a prompt that ends with an n-gram it holds earlier): the lookup
then finds matches, and every test asserts that proposals were made, and accepted and
rejected, so none can pass without speculating."""

from __future__ import annotations

import asyncio
import math
import zlib

import pytest

import acb
from acb.core.kv_cache import KVCacheManager
from acb.core.scheduler import Scheduler, Sequence
from acb.core.speculative import NgramIndex, Speculation
from acb.core.step import StepOutput
from acb.testing import ARCHITECTURES, random_prompts, reference_greedy, speculate_always, tiny_model, tiny_tokenizer

SPEC = dict(speculative_method="ngram")


def engine_for(model, tokenizer=None, **config) -> acb.Engine:
    """An engine over ``model``; with speculation (``**SPEC`` in ``config``) proposing all it
    finds (``speculate_always``: what these tests check is verification, not the cost
    model, which measured step times on a loaded machine may turn down)."""
    engine = acb.Engine(model, tokenizer, config=acb.EngineConfig(**config))
    if config.get("speculative_method"):
        speculate_always(engine)
    return engine


def repetitive_prompts(seed: int) -> list[list[int]]:
    """Prompts whose continuations the n-gram lookup can propose from: runs, cycles, and a
    random prompt quoted twice (its end matches its first copy)."""
    rnd = random_prompts(2, 6, 10, seed=seed)
    return [[5] * 10, [17] * 11, [5, 6, 7] * 4, rnd[0] + rnd[0][:-2], rnd[1]]


def _stats_show_speculation(stats) -> None:
    assert stats.spec_proposed_tokens > 0, "nothing was proposed: the test did not speculate"
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens, "want acceptances and rejections"
    assert stats.spec_acceptance_rate == pytest.approx(stats.spec_accepted_tokens / stats.spec_proposed_tokens)


# ----------------------------------------------------------------------------- proposer
def test_ngram_index_proposes_what_followed_the_latest_match():
    idx = NgramIndex(2, 4)
    assert idx.propose([1, 2, 3, 4, 9, 1, 2], 3) == [3, 4, 9]  # "1 2" seen before, then "3 4 9"
    assert idx.propose([1, 2, 3, 4, 9, 1, 2, 3, 8, 2, 3], 2) == [8, 2]  # latest "2 3" wins over the first
    assert NgramIndex(2, 4).propose([5, 6, 7, 8], 4) == []  # no suffix repeats
    # longest n first: "7 1 2" (n=3) matched before "1 2" (n=2) would be
    assert NgramIndex(2, 4).propose([7, 1, 2, 5, 1, 2, 6, 7, 1, 2], 1) == [5]
    # a match overlapping the suffix continues its period
    assert NgramIndex(2, 4).propose([4, 4, 4], 5) == [4, 4, 4, 4, 4]
    assert NgramIndex(2, 2).propose([9, 1, 2, 1, 2], 4) == [1, 2, 1, 2]


# ----------------------------------------------------------------------------- scheduler level
def _spec_scheduler(num_pages=32, page_size=4, budget=64):
    s = Scheduler(KVCacheManager(num_pages, page_size), max_batch_tokens=budget, max_requests=8)
    s.speculation = Speculation(4, 2, 4)
    return s


def _run(s, plan, token_of):
    """The device's part, pretended: ``token_of(seq, t)`` is sampled at the row's ``t``-th entry."""
    tokens = []
    for seq, sample, d in zip(plan.seqs, plan.input.sample, plan.input.drafts):
        tokens += [token_of(seq, t) for t in range(d + 1)] if sample else []
    return s.update(plan, StepOutput(tokens, None))


def test_rejected_proposals_give_their_pages_back_in_the_same_step():
    s = _spec_scheduler()
    seq = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1], 20, spec=s.speculation.state())
    s.add(seq)
    for want in (9, 8):  # the prefill samples 9, a decode 8: the tails "1 9", "9 8" are new
        plan = s.schedule()
        assert plan.num_drafts == 0
        _run(s, plan, lambda q, t, want=want: want)
    plan = s.schedule()
    _run(s, plan, lambda q, t: 9)  # tail "8 9": it was followed by "1 9 8 9"
    plan = s.schedule()
    assert plan.input.drafts == [4] and plan.input.row_tokens(0) == [9, 1, 9, 8, 9]
    assert plan.input.starts == [12] and len(seq.block_table) == s.kv.pages_for(17)  # pages for every proposal
    sampled = [1, 5, 0, 0, 0]  # the first proposal is accepted, the second rejected (5 instead of 9)
    update = _run(s, plan, lambda q, t: sampled[t])
    assert seq.output_ids == [9, 8, 9, 1, 5] and update.samples == [0, 1] and update.ends == [4, 5]
    assert seq.num_computed == 14  # 12 + the row's own token + one accepted proposal
    assert len(seq.block_table) == s.kv.pages_for(14) == 4  # the rejected proposals' page is back
    s.kv.check_integrity([seq.block_table])
    assert s.kv.num_free == s.kv.num_pages - 4
    assert (s.speculation.proposed, s.speculation.accepted) == (4, 1)


def test_a_cancel_during_verification_releases_every_page():
    s = _spec_scheduler()
    seq = Sequence("a", [3, 4, 3, 4, 3, 4, 3], 20, spec=s.speculation.state())
    other = Sequence("b", [5, 6, 7, 8], 20, spec=s.speculation.state())
    s.add(seq)
    s.add(other)
    _run(s, s.schedule(), lambda q, t: 4 if q is seq else 9)
    plan = s.schedule()
    assert plan.input.drafts == [4, 0]  # "3 4" again: proposals for seq, none for the other
    s.finish(seq)  # cancelled while its verification is in flight
    update = _run(s, plan, lambda q, t: 4)
    assert update.seqs == [other]
    assert seq.block_table == [] and seq.output_ids == [4]
    s.kv.check_integrity([other.block_table])
    s.finish(other)
    assert s.kv.num_free == s.kv.num_pages


def test_a_row_verifying_is_not_planned_again_until_its_step_is_taken_in():
    s = _spec_scheduler()
    seq = Sequence("a", [6, 6, 6, 6], 20, spec=s.speculation.state())
    s.add(seq)
    _run(s, s.schedule(), lambda q, t: 6)
    plan = s.schedule()
    assert plan.num_drafts == 4
    assert s.schedule().seqs == []  # its length is unknown until the verification is in
    _run(s, plan, lambda q, t: 6)  # all accepted, and the token after them
    assert seq.output_ids == [6] * 6 and seq.num_computed == 9
    assert s.schedule().seqs == [seq]


# ----------------------------------------------------------------------------- engine level
# llama and a hybrid (gemma3: sliding and full layers, two page pools) in the default suite;
# the other architectures in the extras step (each run costs seconds on two cores)
@pytest.mark.parametrize("arch", [a if a in ("llama", "gemma3") else pytest.param(a, marks=pytest.mark.extras)
                                  for a in ARCHITECTURES])
async def test_greedy_with_speculation_equals_generate(arch):
    """Token for token against transformers' generate, with chunked prefill (a small
    budget) and preemption (a small cache) in the same runs, an opted-out row beside."""
    model = tiny_model(arch)
    prompts = repetitive_prompts(zlib.crc32(arch.encode()) % 1000)
    max_new = [30 + (i * 5) % 13 for i in range(len(prompts))]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    config = dict(page_size=4, num_blocks=26, max_batch_tokens=24, max_requests_per_batch=8, safety_margin=0.0,
                  debug_checks=True, **SPEC)
    async with engine_for(model, **config) as engine:
        handles = [engine.submit(p, max_new_tokens=n, ignore_eos=True, speculative=False if i == 3 else None)
                   for i, (p, n) in enumerate(zip(prompts, max_new))]
        results = [await h for h in handles]
        stats = engine.stats()
        engine.check_integrity()
    for got, want in zip(results, expected):
        assert got.token_ids == want
    _stats_show_speculation(stats)
    if arch != "mistral":  # every layer slides: pages behind the window go back, nobody runs out
        assert stats.preemptions > 0
    assert stats.free_blocks == stats.total_blocks


async def test_opted_out_requests_never_carry_proposals():
    model = tiny_model("llama")
    async with engine_for(model, page_size=4, num_blocks=64, **SPEC) as engine:
        out = await engine.generate([17] * 12, max_new_tokens=16, ignore_eos=True, speculative=False)
        assert engine.stats().spec_proposed_tokens == 0
        spec = await engine.generate([17] * 12, max_new_tokens=16, ignore_eos=True)
        assert engine.stats().spec_proposed_tokens > 0
    assert out.token_ids == spec.token_ids == reference_greedy(model, [17] * 12, 16)


def _engines(model, **config):
    base = dict(page_size=4, num_blocks=128)
    base.update(config)
    return engine_for(model, **base), engine_for(model, **base, **SPEC)


async def _both(model, requests, **config):
    """Each request run on an engine without and one with speculation: (plain, speculative, stats)."""
    plain, spec = _engines(model, **config)
    out = []
    for engine in (plain, spec):
        async with engine:
            out.append(await asyncio.gather(*(engine.generate(p, **kw) for p, kw in requests)))
            stats = engine.stats()
            engine.check_integrity()
    return out[0], out[1], stats


async def test_features_compose_with_speculation():
    """Stop tokens and EOS inside an accepted run, min_new_tokens, logprobs and top
    logprobs of accepted tokens, penalties at each position, n > 1, seeded sampling:
    each the same with speculation as without (seeded sampling token for token too)."""
    model = tiny_model("qwen3")
    cycle = [5, 6, 7] * 5
    greedy = reference_greedy(model, cycle, 30)
    stop = greedy[12]
    requests = [
        (cycle, dict(max_new_tokens=30, stop_token_ids=[stop])),
        (cycle, dict(max_new_tokens=30, stop_token_ids=[stop], min_new_tokens=14)),
        (cycle, dict(max_new_tokens=7)),
        ([17] * 10, dict(max_new_tokens=20, logprobs=True, top_logprobs=3, ignore_eos=True)),
        (cycle, dict(max_new_tokens=20, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                     ignore_eos=True)),
        # penalties whose history must hold the proposals before each position: without
        # them this request's tokens differ (checked by breaking it)
        ([17] * 10, dict(max_new_tokens=24, repetition_penalty=1.05, frequency_penalty=0.1, ignore_eos=True)),
        (cycle, dict(max_new_tokens=16, n=2, temperature=0.8, top_k=3, seed=5, ignore_eos=True)),
        ([17] * 10, dict(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=11, logit_bias={60: 2.0},
                         ignore_eos=True)),
    ]
    plain, spec, stats = await _both(model, requests)
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert b.token_ids == a.token_ids, i
        assert b.finish_reason == a.finish_reason, i
        assert [c.token_ids for c in b.choices or []] == [c.token_ids for c in a.choices or []], i
        if a.logprobs is not None:
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
            assert [sorted(d) for d in b.top_logprobs] == [sorted(d) for d in a.top_logprobs]
    assert plain[0].finish_reason == "stop" and len(plain[0].token_ids) == 13
    assert len(plain[1].token_ids) > 14
    _stats_show_speculation(stats)


async def test_stop_strings_inside_an_accepted_run_truncate_it():
    """The output is a run of one token: proposals are all accepted, five tokens a step,
    and the stop string (six of them) completes inside such a run: the tokens after it
    are dropped, as they never existed without speculation."""
    model = tiny_model("llama")
    tok = tiny_tokenizer()
    prompt = [17] * 10
    greedy = reference_greedy(model, prompt, 24)
    assert greedy[:8] == [greedy[0]] * 8
    stop = tok.decode(greedy[:6])
    outs = []
    for config in (dict(), SPEC):
        async with engine_for(model, tok, page_size=4, num_blocks=64, **config) as engine:
            outs.append(await engine.generate(prompt, max_new_tokens=24, stop=[stop], ignore_eos=True))
            stats = engine.stats()
    a, b = outs
    assert a.finish_reason == b.finish_reason == "stop"
    assert b.token_ids == a.token_ids == greedy[:6] and b.text == a.text == ""
    assert stats.spec_accepted_tokens >= 4 and stats.generated_tokens == 6


async def test_prefix_caching_with_speculation():
    model = tiny_model("llama")
    prompt = [17] * 20
    expected = reference_greedy(model, prompt, 24)
    async with engine_for(model, page_size=4, num_blocks=64, **SPEC) as engine:
        first = await engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
        again = await engine.generate(prompt, max_new_tokens=24, ignore_eos=True)
        stats = engine.stats()
        engine.check_integrity()
    assert first.token_ids == again.token_ids == expected
    assert again.metrics.num_cached_prompt_tokens > 0
    assert stats.spec_accepted_tokens > 0


async def test_cpu_offload_with_speculation():
    """Preempted requests offloaded to the host and restored give the same greedy tokens."""
    model = tiny_model("llama")
    prompts = [[17] * 20, [5, 6, 7] * 6, [5] * 18, [70, 71] * 8]
    expected = [reference_greedy(model, p, 24) for p in prompts]
    config = dict(page_size=4, num_blocks=30, max_requests_per_batch=4, safety_margin=0.0, cpu_offload_space=0.01,
                  **SPEC)
    async with engine_for(model, **config) as engine:
        first = await engine.generate_batch(prompts, max_new_tokens=24, ignore_eos=True)
        stats = engine.stats()
        engine.check_integrity()
    assert [r.token_ids for r in first] == expected
    assert stats.offloads > 0 and stats.restores > 0
    assert stats.spec_accepted_tokens > 0


async def test_cancel_mid_run_and_integrity_while_speculating():
    model = tiny_model("llama")
    async with engine_for(model, page_size=4, num_blocks=64, **SPEC) as engine:
        handles = [engine.submit([t] * 12, max_new_tokens=200, ignore_eos=True) for t in (17, 60, 5)]
        async with asyncio.timeout(30):
            while engine.stats().spec_proposed_tokens < 8:
                engine.check_integrity()
                await asyncio.sleep(0)
        for h in handles:
            h.cancel()
        results = [await h for h in handles]
        assert {r.finish_reason for r in results} == {"cancelled"}
        engine.check_integrity()
        stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks


def _chi2_homogeneity(a: dict, b: dict, pool_below: int = 10) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom over the outcomes of ``a``
    and ``b`` (outcomes seen fewer than ``pool_below`` times in all pooled into one)."""
    pooled: list[dict] = [{}, {}]
    for side, counts in zip(pooled, (a, b)):
        for key, n in counts.items():
            key = key if a.get(key, 0) + b.get(key, 0) >= pool_below else "rare"
            side[key] = side.get(key, 0) + n
    keys = set(pooled[0]) | set(pooled[1])
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = pooled[0].get(k, 0) + pooled[1].get(k, 0)
        for n, counts in zip((na, nb), pooled):
            expected = total * n / (na + nb)
            stat += (counts.get(k, 0) - expected) ** 2 / expected
    return stat, len(keys) - 1


async def test_sampled_output_distribution_is_unchanged():
    """Unseeded sampling (top_k=2, temperature 1.5): the joint distribution of tokens 4 to
    8, which come from steps that verify proposals, is the same with speculation as
    without (a chi-square homogeneity test over 300 samples each; proposals are often
    accepted and often rejected)."""
    from scipy.stats import chi2

    model = tiny_model("llama")
    counts = []
    for config in (dict(), SPEC):
        async with engine_for(model, page_size=4, num_blocks=512, max_requests_per_batch=32, **config) as engine:
            results = await engine.generate_batch([[17] * 10] * 300, max_new_tokens=8, temperature=1.5, top_k=2,
                                                  ignore_eos=True)
            stats = engine.stats()
        tally: dict = {}
        for r in results:
            tally[tuple(r.token_ids[3:])] = tally.get(tuple(r.token_ids[3:]), 0) + 1
        counts.append(tally)
    _stats_show_speculation(stats)
    assert stats.spec_proposed_tokens > 150
    stat, df = _chi2_homogeneity(*counts)
    assert df >= 4
    assert chi2.sf(stat, df) > 1e-3, (stat, df, counts)


# ----------------------------------------------------------------------------- refusals
def test_config_fields_are_checked_by_name():
    for kwargs, name in ((dict(speculative_method="medusa"), "speculative_method"),
                         (dict(speculative_method="draft"), "draft_model"),
                         (dict(speculative_method="ngram", draft_model="x"), "draft_model"),
                         (dict(num_speculative_tokens=0), "num_speculative_tokens"),
                         (dict(prompt_lookup_min=0), "prompt_lookup_min"),
                         (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
                         (dict(draft_model="x"), "draft_model"),
                         (dict(speculative_method="ngram", tensor_parallel_size=2), "speculative_method")):
        with pytest.raises(ValueError, match=name):
            acb.EngineConfig(**kwargs)
    with pytest.raises(acb.InvalidRequestError, match="speculative"):
        acb.SamplingParams(speculative=True)


async def test_structured_outputs_are_refused_unless_the_request_opts_out():
    model = tiny_model("llama")
    async with engine_for(model, tiny_tokenizer(), page_size=4, num_blocks=64, **SPEC) as engine:
        with pytest.raises(acb.InvalidRequestError, match="speculative") as err:
            await engine.generate("pick", choice=["yes", "no"])
        assert err.value.param == "speculative"
        done = await engine.generate("pick", choice=["yes", "no"], speculative=False)
    assert done.text in ("yes", "no")


def test_proposals_turn_down_when_the_batch_is_compute_bound():
    spec = Speculation(4, 2, 4)
    row = spec.state()
    row.accept = 0.8
    for tokens, seconds in ((1, 0.030), (5, 0.034), (16, 0.045), (64, 0.090), (128, 0.150)):
        spec.observe_step(tokens, seconds)
    a, b = spec.cost()
    assert a == pytest.approx(0.03, rel=0.3) and b == pytest.approx(0.00094, rel=0.3)
    spec.begin_plan(1)
    assert spec.wanted(row) == 4  # a lone row on a memory-bound step: all it may
    row.accept = 0.4
    spec.begin_plan(6)
    assert 0 < spec.wanted(row) < 4  # 0.4 ** 3 is below the bar R b / (a + b R), about 0.16
    spec.begin_plan(64)
    assert spec.wanted(row) == 0  # beyond MAX_SPECULATIVE_ROWS
    row.accept = 0.05
    spec.begin_plan(4)
    assert spec.wanted(row) == 0  # proposals that are rarely accepted are not worth their cost
    assert math.isfinite(spec.acceptance_rate)


async def test_a_large_batch_proposes_nothing():
    """Above MAX_SPECULATIVE_ROWS running rows a step is compute-bound: nobody proposes
    (the engine's own cost model, not pinned here)."""
    from acb.core.speculative import MAX_SPECULATIVE_ROWS

    model = tiny_model("llama")
    config = acb.EngineConfig(page_size=4, num_blocks=256, max_requests_per_batch=64, **SPEC)
    async with acb.Engine(model, config=config) as engine:
        results = await engine.generate_batch([[17] * 10] * (MAX_SPECULATIVE_ROWS + 8), max_new_tokens=8,
                                              ignore_eos=True)
        stats = engine.stats()
    assert stats.spec_proposed_tokens == 0
    assert all(r.token_ids == results[0].token_ids for r in results)


def test_each_position_is_sampled_as_its_token_index_would_be():
    """The sampling entries of a row verifying 3 proposals: one per position, each with its
    token index's seed, min_new_tokens ban and penalty history (proposals before it included)."""
    from acb.core.mailbox import Outcome
    from acb.engine.live import LiveRequest, SamplingColumns, sampling_batch
    from acb.worker.sampling import mix_seed

    s = _spec_scheduler()
    params = acb.SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, min_new_tokens=4,
                                repetition_penalty=1.2, top_k=0, top_p=1.0, min_p=0.0)
    columns = SamplingColumns()
    req = LiveRequest.create("a", [6, 6, 6, 6], params, None, Outcome(None), None, frozenset({2}),
                             slot=columns.reserve())
    columns.write(req.seq.slot, req)
    seq = req.seq
    seq.spec = s.speculation.state()
    s.add(seq)
    _run(s, s.schedule(), lambda q, t: 6)  # token 0
    plan = s.schedule()
    assert plan.input.drafts == [4] and plan.input.row_tokens(0) == [6, 6, 6, 6, 6]
    batch = sampling_batch(plan, columns, vocab_size=32)
    assert batch.seeds == [mix_seed(7, i) for i in range(1, 6)]  # tokens 1..5
    c = batch.controls
    assert sorted({row for row, _ in c.banned}) == [0, 1, 2]  # tokens 1, 2, 3 are before min_new_tokens=4
    assert [len(h) for h in c.history] == [5, 6, 7, 8, 9]  # prompt + token 0, then each proposal before
