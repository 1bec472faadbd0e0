"""Sampling controls: each processor and warper equals transformers' own on the same
logits; greedy with a control on equals transformers' generate with it; seeded rows
stay independent of their neighbours with every control on; top logprobs; the
model's generation_config supplies what a request leaves unset."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import acb
from acb.testing import EOS_ID, random_prompts, reference_greedy, tiny_engine, tiny_model
from acb.worker.sampling import Controls, process, warp

PROMPTS = random_prompts(3, 5, 20, seed=3)


def _controls(**fields) -> Controls:
    base = dict(penalized=[], history=[], num_prompt=[], carry=[], repetition=[], presence=[], frequency=[],
                banned=[], bias=[])
    return Controls(**{**base, **fields})


def test_repetition_penalty_equals_transformers_processor():
    torch.manual_seed(0)
    logits = torch.randn(3, 40) * 3
    histories = [[1, 2, 3, 3, 9], [4, 5], [7, 7, 7, 8, 30, 31]]
    penalties = [1.3, 0.7, 2.0]
    c = _controls(penalized=[0, 1, 2], history=histories, num_prompt=[5, 2, 6], carry=[-1] * 3,
                  repetition=penalties, presence=[0.0] * 3, frequency=[0.0] * 3)
    out = process(logits, c)
    for r in range(3):
        ref = RepetitionPenaltyLogitsProcessor(penalties[r])(torch.tensor([histories[r]]), logits[r:r + 1].clone())
        assert torch.equal(out[r], ref[0])


def test_in_flight_token_counts_in_the_history():
    """With step overlap a row's last token is still on the device: it is taken from
    the previous step's sampled ids."""
    logits = torch.zeros(2, 10) + 1.0
    c = _controls(penalized=[1], history=[[3]], num_prompt=[1], carry=[0], repetition=[2.0], presence=[0.0],
                  frequency=[0.0])
    out = process(logits, c, prev_sampled=torch.tensor([6, 0]))
    assert out[1, 3] == out[1, 6] == 0.5 and out[1, 5] == 1.0 and torch.equal(out[0], logits[0])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 8)
    c = _controls(penalized=[0], history=[[1, 1, 2, 2, 2, 3]], num_prompt=[2], carry=[-1], repetition=[1.0],
                  presence=[0.5], frequency=[0.25])
    out = process(logits, c)[0]
    assert out[1] == 0.0  # only in the prompt
    assert out[2] == pytest.approx(-0.5 - 3 * 0.25)
    assert out[3] == pytest.approx(-0.5 - 0.25)


def test_penalties_equal_their_dense_definition_on_random_histories():
    """Many repeats, uneven lengths, some rows with an in-flight token: the gathered
    implementation equals the definitions over the whole vocabulary."""
    g = torch.Generator().manual_seed(4)
    rows, vocab = 6, 50
    logits = torch.randn(rows, vocab, generator=g) * 3
    lengths = torch.randint(1, 30, (rows,), generator=g).tolist()
    histories = [torch.randint(0, 12, (n,), generator=g).tolist() for n in lengths]
    num_prompt = [len(h) // 3 for h in histories]
    carry = [-1, 0, -1, 1, -1, -1]
    prev = torch.tensor([5, 7])
    rep = [1.3, 0.8, 1.0, 2.0, 1.1, 1.5]
    presence = [0.5, 0.0, 1.0, -0.4, 0.3, 0.0]
    frequency = [0.2, 0.7, 0.0, 0.1, -0.3, 1.0]
    c = _controls(penalized=list(range(rows)), history=histories, num_prompt=num_prompt, carry=carry,
                  repetition=rep, presence=presence, frequency=frequency)
    out = process(logits, c, prev_sampled=prev)
    for r, h in enumerate(histories):
        full = h + ([int(prev[carry[r]])] if carry[r] >= 0 else [])
        ref = RepetitionPenaltyLogitsProcessor(rep[r])(torch.tensor([full]), logits[r:r + 1].clone())[0]
        counts = torch.bincount(torch.tensor(full[num_prompt[r]:], dtype=torch.long), minlength=vocab).float()
        ref = ref - frequency[r] * counts - presence[r] * (counts > 0).float()
        assert torch.allclose(out[r], ref, atol=1e-5), r


def test_logit_bias_equals_transformers_sequence_bias():
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    bias = {4: 5.0, 9: -3.5}
    out = process(logits, _controls(bias=[(1, t, b) for t, b in bias.items()]))
    ref = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(torch.tensor([[1, 2]]),
                                                                             logits[1:2].clone())
    assert torch.equal(out[1], ref[0]) and torch.equal(out[0], logits[0])


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 0, 1.0, 0.1), (0.8, 12, 0.9, 0.05),
])
def test_warpers_equal_transformers_warpers(temperature, top_k, top_p, min_p):
    torch.manual_seed(2)
    logits = torch.randn(4, 64) * 2
    ours = warp(logits, [temperature] * 4, [top_k] * 4, [top_p] * 4, [min_p] * 4)
    chain = [TemperatureLogitsWarper(temperature)]
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p))
    if min_p:
        chain.append(MinPLogitsWarper(min_p))
    ref = LogitsProcessorList(chain)(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.allclose(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


class _OpenAIPenalties(LogitsProcessor):
    """Presence / frequency penalties over the generated tokens (OpenAI's definition)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores).scatter_add_(
            1, input_ids[:, self.prompt_len:], torch.ones_like(input_ids[:, self.prompt_len:], dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


async def test_greedy_with_controls_on_equals_generate_with_them():
    model = tiny_model()
    engine = acb.Engine(model, tokenizer=None, config=acb.EngineConfig(num_blocks=256, page_size=8))
    async with engine:
        rep = [engine.generate(p, max_new_tokens=20, repetition_penalty=1.3, ignore_eos=True) for p in PROMPTS]
        pen = [engine.generate(p, max_new_tokens=20, presence_penalty=0.8, frequency_penalty=0.6, ignore_eos=True)
               for p in PROMPTS]
        # min-length: EOS pushed up by a bias, held back for the first 6 tokens
        minlen = [engine.generate(p, max_new_tokens=20, min_new_tokens=6, logit_bias={EOS_ID: 6.0})
                  for p in PROMPTS]
        # controls that never move greedy's argmax
        inert = [engine.generate(p, max_new_tokens=20, min_p=0.2, top_k=3, top_p=0.5, ignore_eos=True)
                 for p in PROMPTS]
        rep, pen, minlen, inert = [[(await c).token_ids for c in group] for group in (rep, pen, minlen, inert)]
    for i, p in enumerate(PROMPTS):
        assert rep[i] == reference_greedy(model, p, 20, repetition_penalty=1.3)
        assert rep[i] != reference_greedy(model, p, 20)  # the penalty changed something
        penalties = LogitsProcessorList([_OpenAIPenalties(len(p), 0.8, 0.6)])
        assert pen[i] == reference_greedy(model, p, 20, logits_processor=penalties)
        expected = reference_greedy(model, p, 20, eos=True, min_new_tokens=6, sequence_bias=[[[EOS_ID], 6.0]])
        assert minlen[i] == expected and len(expected) == 7 and expected[-1] == EOS_ID
        assert inert[i] == reference_greedy(model, p, 20)


async def test_seeded_rows_stay_independent_with_every_control_on():
    kw = dict(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=77,
              repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3, min_new_tokens=4,
              logit_bias={65: 2.0, 66: -1.0}, top_logprobs=3, logprobs=True, ignore_eos=True)
    async with tiny_engine() as engine:
        alone = await engine.generate(PROMPTS[0], **kw)
        crowd = [engine.submit(p, max_new_tokens=16, temperature=1.1, repetition_penalty=1.5, logit_bias={70: 3.0},
                               top_logprobs=5, ignore_eos=True) for p in random_prompts(8, 3, 30, seed=9)]
        crowd += [engine.submit(p, max_new_tokens=16, ignore_eos=True) for p in random_prompts(4, 3, 30, seed=8)]
        crowded = await engine.generate(PROMPTS[0], **kw)
        for h in crowd:
            await h
    assert alone.token_ids == crowded.token_ids
    assert alone.top_logprobs == crowded.top_logprobs


async def test_top_logprobs_are_the_models_k_best():
    model = tiny_model()
    engine = acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=8))
    async with engine:
        done = await engine.generate(PROMPTS[1], max_new_tokens=6, top_logprobs=3, logprobs=True, ignore_eos=True)
        chunks = [c async for c in engine.stream(PROMPTS[1], max_new_tokens=6, top_logprobs=3, ignore_eos=True)]
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPTS[1] + done.token_ids])).logits[0, len(PROMPTS[1]) - 1:-1]
    ref_lp, ref_ids = torch.log_softmax(logits.float(), -1).topk(3)
    assert len(done.top_logprobs) == 6
    for i, (alternatives, token) in enumerate(zip(done.top_logprobs, done.token_ids, strict=True)):
        assert list(alternatives) == ref_ids[i].tolist()
        assert list(alternatives.values()) == pytest.approx(ref_lp[i].tolist(), abs=1e-4)
        assert list(alternatives)[0] == token  # greedy picks the best
        assert alternatives[token] == pytest.approx(done.logprobs[i], abs=1e-6)
    streamed = [a for c in chunks for a in c.top_logprobs]
    assert [list(a) for a in streamed] == [list(a) for a in done.top_logprobs]
    assert [v for a in streamed for v in a.values()] == pytest.approx(
        [v for a in done.top_logprobs for v in a.values()], abs=1e-5)
    assert all(c.logprobs is None for c in chunks)


async def test_generation_config_supplies_what_a_request_leaves_unset():
    model = tiny_model()
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.6
    engine = acb.Engine(model, config=acb.EngineConfig(num_blocks=128, page_size=8))
    async with engine:
        default = await engine.generate(PROMPTS[0], max_new_tokens=16, seed=5, ignore_eos=True)
        explicit = await engine.generate(PROMPTS[0], max_new_tokens=16, seed=5, temperature=0.6, ignore_eos=True)
        hotter = await engine.generate(PROMPTS[0], max_new_tokens=16, seed=5, temperature=1.5, ignore_eos=True)
        greedy = await engine.generate(PROMPTS[0], max_new_tokens=16, temperature=0.0, ignore_eos=True)
        no_sample = await engine.generate(PROMPTS[0], max_new_tokens=16, do_sample=False, ignore_eos=True)
    assert default.token_ids == explicit.token_ids != hotter.token_ids
    assert default.token_ids != greedy.token_ids  # it samples: the model asks for it
    assert greedy.token_ids == no_sample.token_ids == reference_greedy(model, PROMPTS[0], 16)


async def test_engine_default_sampling_comes_before_generation_config():
    model = tiny_model()
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.6
    engine = acb.Engine(model, config=acb.EngineConfig(num_blocks=128, page_size=8),
                        sampling=acb.SamplingParams(temperature=0.0))
    async with engine:
        out = await engine.generate(PROMPTS[0], max_new_tokens=12, ignore_eos=True)
    assert out.token_ids == reference_greedy(model, PROMPTS[0], 12)


async def test_max_new_tokens_none_runs_to_the_context_limit():
    async with tiny_engine(num_blocks=8, page_size=8) as engine:
        out = await engine.generate(PROMPTS[0], max_new_tokens=None, ignore_eos=True)
    assert len(PROMPTS[0]) + len(out.token_ids) == 64 and out.finish_reason == "length"


@pytest.mark.parametrize("field,value", [
    ("repetition_penalty", 0.0), ("presence_penalty", float("nan")), ("min_p", 1.5), ("min_new_tokens", -1),
    ("top_logprobs", -2), ("n", 0), ("do_sample", "yes"), ("logit_bias", {"a": 1.0}), ("logit_bias", {3: "x"}),
    ("max_new_tokens", 0), ("json_schema", "{not json"), ("regex", "("), ("choice", []),
])
def test_bad_values_are_refused_by_name(field, value):
    with pytest.raises(acb.InvalidRequestError) as e:
        acb.SamplingParams(**{field: value})
    assert e.value.param == field


async def test_engine_refuses_what_the_vocabulary_cannot_honour():
    async with tiny_engine() as engine:
        with pytest.raises(acb.InvalidRequestError) as e:
            await engine.generate(PROMPTS[0], logit_bias={10_000: 1.0})
        assert e.value.param == "logit_bias"
        with pytest.raises(acb.InvalidRequestError) as e:
            await engine.generate(PROMPTS[0], do_sample=True, temperature=0.0)
        assert e.value.param == "temperature"


async def test_min_new_tokens_holds_back_stop_strings():
    """A stop string in the text of the first ``min_new_tokens`` tokens does not end the
    request; the next one after them does (vLLM's min_tokens)."""
    async with tiny_engine() as engine:
        free = await engine.generate(PROMPTS[0], max_new_tokens=16, ignore_eos=True)
        needle = next(ch for ch in free.text if ch != "\ufffd" and free.text.count(ch) >= 2)

        def text_of(m: int) -> str:
            return engine.tokenizer.decode(free.token_ids[:m], skip_special_tokens=True,
                                           clean_up_tokenization_spaces=False)

        m = next(m for m in range(1, 17) if needle in text_of(m))  # the token that completes the first one
        early = await engine.generate(PROMPTS[0], max_new_tokens=16, ignore_eos=True, stop=[needle])
        assert early.finish_reason == "stop" and len(early.token_ids) == m
        held = await engine.generate(PROMPTS[0], max_new_tokens=16, ignore_eos=True, stop=[needle], min_new_tokens=m)
    second = free.text.index(needle, len(text_of(m)))
    assert held.finish_reason == "stop" and held.text == free.text[:second]
    assert len(held.token_ids) > m and held.token_ids == free.token_ids[: len(held.token_ids)]
