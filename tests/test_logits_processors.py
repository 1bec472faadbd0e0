"""Per-request logits processors (``SamplingParams.logits_processors``): transformers'
``LogitsProcessor`` objects and plain callables ``(input_ids, scores) -> scores`` run on their
own request's row only. A processor that does nothing changes nothing (bit-exact), one never
touches another request's row, transformers' own processors give what transformers' ``generate``
gives, and one that raises or returns another shape fails its request by name while the
engine and the rest of the batch go on."""

from __future__ import annotations

import asyncio

import pytest
import torch
from http_helpers import wait_pages_free
from transformers import LogitsProcessor, LogitsProcessorList, NoBadWordsLogitsProcessor

import acb
from acb.testing import EOS_ID, reference_greedy, tiny_engine, tiny_model

PROMPTS = ["hello there", "the cat sat", "a b c d e f", "zzz"]
# greedy, seeded sampling, penalties: the settings whose rows take other paths through sampling
SETTINGS = [dict(temperature=0), dict(temperature=0.9, seed=5), dict(temperature=0, repetition_penalty=1.3),
            dict(temperature=0.7, top_k=20, seed=2, logit_bias={70: 3.0})]


class Identity(LogitsProcessor):
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores


async def _batch(engine: acb.Engine, processors: list | None = None, max_new_tokens: int = 12) -> list[acb.Completion]:
    handles = [engine.submit(p, max_new_tokens=max_new_tokens, ignore_eos=True, logprobs=True, **s,
                             **({"logits_processors": processors[i]} if processors and processors[i] else {}))
               for i, (p, s) in enumerate(zip(PROMPTS, SETTINGS, strict=True))]
    return list(await asyncio.gather(*handles))


async def test_processors_that_do_nothing_change_nothing_bit_exact():
    async with tiny_engine() as engine:
        plain = await _batch(engine)
        with_noop = await _batch(engine, [[lambda ids, scores: scores], [Identity()], [Identity(), Identity()],
                                          [lambda ids, scores: scores.clone()]])
    for a, b in zip(plain, with_noop, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


async def test_a_processor_sees_its_prompt_and_output_so_far():
    calls: list[tuple[list[int], tuple[int, ...], torch.dtype]] = []

    def record(input_ids, scores):
        calls.append((input_ids[0].tolist(), tuple(scores.shape), scores.dtype))
        return scores

    async with tiny_engine() as engine:
        done = await engine.generate("hello", max_new_tokens=6, ignore_eos=True, temperature=0,
                                     logits_processors=[record])
    full = done.prompt_token_ids + done.token_ids
    assert [ids for ids, _, _ in calls] == [full[:len(done.prompt_token_ids) + i] for i in range(6)]
    assert {(shape, dtype) for _, shape, dtype in calls} == {((1, engine.vocab_size), torch.float32)}


async def test_a_processor_changes_its_own_row_and_no_other():
    async with tiny_engine() as engine:
        a = engine.tokenizer.convert_tokens_to_ids("a")

        def force_a(input_ids, scores):  # only "a" may follow
            forced = torch.full_like(scores, float("-inf"))
            forced[:, a] = 0.0
            return forced

        plain = await _batch(engine)
        mixed = await _batch(engine, [None, [force_a], None, None])
    assert mixed[1].text == "a" * 12
    for i in (0, 2, 3):
        assert mixed[i].token_ids == plain[i].token_ids and mixed[i].logprobs == plain[i].logprobs


async def test_transformers_own_processor_gives_what_transformers_generate_gives():
    prompt = [1, 72, 105, 33, 40, 50, 60]
    async with tiny_engine() as engine:
        free = await engine.generate(prompt, max_new_tokens=10, ignore_eos=True, temperature=0)
    banned = [[t] for t in free.token_ids[:3]]  # the tokens greedy decoding picks first
    processor = NoBadWordsLogitsProcessor(banned, eos_token_id=EOS_ID)
    async with tiny_engine() as engine:
        done = await engine.generate(prompt, max_new_tokens=10, ignore_eos=True, temperature=0,
                                     logits_processors=[processor])
    expected = reference_greedy(tiny_model(), prompt, 10, logits_processor=LogitsProcessorList([processor]))
    assert done.token_ids == expected
    assert not {t for [t] in banned} & set(done.token_ids)


@pytest.mark.parametrize(("bad", "why"), [
    (lambda ids, scores: 1 / 0, "ZeroDivisionError"),
    (lambda ids, scores: scores[0], "returned (259,), not scores of shape (1, 259)"),
    (lambda ids, scores: None, "returned NoneType"),
])
async def test_a_failing_processor_fails_its_request_by_name_and_the_rest_goes_on(bad, why):
    async with tiny_engine() as engine:
        plain = await _batch(engine)
        handles = [engine.submit(p, max_new_tokens=12, ignore_eos=True, logprobs=True, **s,
                                 **({"logits_processors": [bad]} if i == 2 else {}))
                   for i, (p, s) in enumerate(zip(PROMPTS, SETTINGS, strict=True))]
        results = await asyncio.gather(*handles, return_exceptions=True)
        error = results[2]
        assert isinstance(error, acb.RequestFailedError)
        assert "its logits processor" in str(error) and "<lambda>" in str(error) and why in str(error)
        for i in (0, 1, 3):
            assert results[i].token_ids == plain[i].token_ids and results[i].logprobs == plain[i].logprobs
        with pytest.raises(acb.RequestFailedError):  # a streaming consumer gets the error, never its token
            async for chunk in engine.stream("again", max_new_tokens=4, logits_processors=[bad]):
                assert not chunk.token_ids
        after = await engine.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True, temperature=0)
        assert after.token_ids == plain[0].token_ids
        await wait_pages_free(engine)


async def test_a_processor_failing_late_keeps_nothing_of_it_running():
    def fails_on_the_fourth_token(input_ids, scores):
        if input_ids.shape[1] >= len("hello") + 3:
            raise RuntimeError("out of budget")
        return scores

    async with tiny_engine() as engine:
        chunks = []
        with pytest.raises(acb.RequestFailedError, match="out of budget"):
            async for chunk in engine.stream("hello", max_new_tokens=20, ignore_eos=True,
                                             logits_processors=[fails_on_the_fourth_token]):
                chunks += chunk.token_ids
        assert len(chunks) == 3
        await wait_pages_free(engine)


def test_logits_processors_must_be_callables():
    with pytest.raises(acb.InvalidRequestError) as error:
        acb.SamplingParams(logits_processors=["ban"])
    assert error.value.param == "logits_processors"
    assert acb.SamplingParams(logits_processors=None).logits_processors == ()
    one = Identity()
    assert acb.SamplingParams(logits_processors=one).logits_processors == (one,)


async def test_on_a_speculating_engine_a_request_with_processors_gives_what_it_gives_without_speculation():
    seen: list[int] = []

    def record(input_ids, scores):
        seen.append(input_ids.shape[1])
        return scores

    prompt = "abcabcabcabcabcabc"  # n-gram proposals for everyone else
    async with tiny_engine() as engine:
        plain = await engine.generate(prompt, max_new_tokens=16, ignore_eos=True, temperature=0)
    async with tiny_engine(speculative_method="ngram") as engine:
        other = engine.submit(prompt, max_new_tokens=16, ignore_eos=True, temperature=0)
        own = await engine.generate(prompt, max_new_tokens=16, ignore_eos=True, temperature=0,
                                    logits_processors=[record])
        assert (await other).token_ids == plain.token_ids
    assert own.token_ids == plain.token_ids
    assert seen == list(range(len(own.prompt_token_ids), len(own.prompt_token_ids) + 16))  # one call a token
