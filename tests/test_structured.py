"""Structured outputs (xgrammar): every json_schema / regex / choice output parses and
validates, on the tiny model (greedy and sampled, mixed with unconstrained rows, with
and without step overlap) and on the real SmolLM2."""

from __future__ import annotations

import json
import re

import anyio
import jsonschema
import pytest

import acb
from acb.testing import random_prompts, tiny_engine

pytest.importorskip("xgrammar", reason="structured outputs need xgrammar: pip install 'acb[structured]'")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "count", "color"],
    "additionalProperties": False,
}
PROMPTS = random_prompts(6, 3, 20, seed=11)


@pytest.mark.parametrize("async_batching", [True, False])
async def test_every_constrained_output_parses_and_validates(async_batching):
    async with tiny_engine(async_batching=async_batching) as engine:
        free = [engine.submit(p, max_new_tokens=24, temperature=1.0, ignore_eos=True) for p in PROMPTS]
        schema = [engine.submit(p, max_new_tokens=64, json_schema=SCHEMA, temperature=1.0, seed=i)
                  for i, p in enumerate(PROMPTS)]
        schema.append(engine.submit(PROMPTS[0], max_new_tokens=64, json_schema=json.dumps(SCHEMA)))
        regex = [engine.submit(p, max_new_tokens=32, regex=r"[a-c]{2,4}-[0-9]{3}", temperature=1.0)
                 for p in PROMPTS]
        # 18 draws: all 6 prompts' draws alike has a chance of ~0.4 % on the tiny model (measured: its
        # most likely answer per prompt ranges 42-88 %), three rounds ~1e-7
        choice = [engine.submit(p, max_new_tokens=16, choice=["yes", "no", "maybe"], temperature=1.5)
                  for p in PROMPTS * 3]
        done = {name: [await h for h in group]
                for name, group in (("free", free), ("schema", schema), ("regex", regex), ("choice", choice))}
        assert engine.stats().free_blocks == engine.stats().total_blocks
    for c in done["schema"]:
        jsonschema.validate(json.loads(c.text), SCHEMA)
        assert c.finish_reason == "eos"
    for c in done["regex"]:
        assert re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", c.text) and c.finish_reason == "eos"
    assert all(c.text in ("yes", "no", "maybe") for c in done["choice"])
    assert len({c.text for c in done["choice"]}) > 1  # sampled, not forced to one answer
    assert all(len(c.token_ids) == 24 for c in done["free"])


async def test_streamed_constrained_text_is_the_completions():
    async with tiny_engine() as engine:
        text = "".join([c.text async for c in engine.stream(PROMPTS[1], json_schema=SCHEMA, max_new_tokens=64)])
        done = await engine.generate(PROMPTS[1], json_schema=SCHEMA, max_new_tokens=64)
    assert text == done.text
    jsonschema.validate(json.loads(text), SCHEMA)


async def test_a_completed_grammar_ends_the_request_even_with_ignore_eos():
    """ignore_eos lets EOS through as a token, but once the grammar is complete nothing
    more would parse: the request ends there ('stop'), its text valid."""
    async with tiny_engine() as engine:
        outs = [await engine.generate(p, json_schema=SCHEMA, max_new_tokens=64, ignore_eos=True, temperature=1.0,
                                      seed=i) for i, p in enumerate(PROMPTS[:3])]
        regex = await engine.generate(PROMPTS[0], regex=r"[a-c]{2}", max_new_tokens=16, ignore_eos=True)
    for c in outs:
        assert c.finish_reason == "stop" and len(c.token_ids) < 64
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert regex.finish_reason == "stop" and re.fullmatch(r"[a-c]{2}", regex.text)


async def test_a_completed_grammar_ends_the_request_before_min_new_tokens(caplog):
    """min_new_tokens holds back EOS, and a complete grammar allows nothing but EOS: the
    grammar's end wins (the rows used to sample token 0, outside the grammar, until the
    minimum was reached), sampled and greedy, one choice or several."""
    async with tiny_engine() as engine:
        outs = [await engine.generate(PROMPTS[0], choice=["yes", "no"], min_new_tokens=6, max_new_tokens=16),
                await engine.generate(PROMPTS[1], regex=r"[a-c]{2}", min_new_tokens=9, max_new_tokens=16,
                                      temperature=1.0, seed=3),
                *(await engine.generate(PROMPTS[2], json_schema=SCHEMA, min_new_tokens=60, max_new_tokens=64,
                                        n=2, temperature=1.0, seed=5)).choices]
    for c in outs:
        assert 0 not in c.token_ids and c.finish_reason in ("eos", "stop"), (c.token_ids, c.finish_reason)
    assert outs[0].text in ("yes", "no") and re.fullmatch(r"[a-c]{2}", outs[1].text)
    for c in outs[2:]:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert "breaks its grammar" not in caplog.text


async def test_bad_grammars_are_refused_by_name():
    async with tiny_engine() as engine:
        with pytest.raises(acb.InvalidRequestError) as e:
            await engine.generate(PROMPTS[0], json_schema={"type": "nonsense"})
        assert e.value.param == "json_schema"
        with pytest.raises(acb.InvalidRequestError) as e:
            await engine.generate(PROMPTS[0], regex="a", choice=["x"])
        assert e.value.param == "choice"
        assert (await engine.generate(PROMPTS[0], max_new_tokens=4)).finish_reason == "length"  # goes on


async def test_a_grammar_compiles_once_then_comes_from_the_cache():
    """Keyed by the canonical text: the same schema as a dict or as JSON text with other
    spacing compiles once; n > 1 choices share the one compile."""
    async with tiny_engine() as engine:
        await engine.generate(PROMPTS[0], json_schema=SCHEMA, max_new_tokens=64)
        assert (engine.stats().grammars_compiled, engine.stats().grammar_cache_hits) == (1, 0)
        again = await engine.generate(PROMPTS[1], json_schema=json.dumps(SCHEMA, indent=2), max_new_tokens=64)
        sync = await engine.submit(PROMPTS[2], json_schema=SCHEMA, max_new_tokens=64, n=3, temperature=1.0, seed=1)
        assert (engine.stats().grammars_compiled, engine.stats().grammar_cache_hits) == (1, 2)
        await engine.generate(PROMPTS[0], regex=r"[a-c]{2}", max_new_tokens=8)
        assert engine.stats().grammars_compiled == 2
    for c in [again, *sync.choices]:
        jsonschema.validate(json.loads(c.text), SCHEMA)


async def test_identical_requests_arriving_together_share_one_compile():
    outs = []
    async with tiny_engine() as engine:
        async def one(prompt):
            outs.append(await engine.generate(prompt, regex=r"[a-c]{2,4}-[0-9]{3}", max_new_tokens=32))

        async with anyio.create_task_group() as tg:
            for p in PROMPTS[:4]:
                tg.start_soon(one, p)
        assert (engine.stats().grammars_compiled, engine.stats().grammar_cache_hits) == (1, 3)
    assert len(outs) == 4 and all(re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", c.text) for c in outs)


async def test_the_grammar_cache_keeps_the_most_recently_used():
    async with tiny_engine(grammar_cache_size=2) as engine:
        for regex in ("a+", "b+", "a+", "c+", "a+", "b+"):  # b+ is the least recent when c+ comes
            await engine.generate(PROMPTS[0], regex=regex, max_new_tokens=4)
        assert (engine.stats().grammars_compiled, engine.stats().grammar_cache_hits) == (4, 2)
    async with tiny_engine(grammar_cache_size=0) as engine:
        for _ in range(2):
            await engine.generate(PROMPTS[0], regex="a+", max_new_tokens=4)
        assert engine.stats().grammars_compiled == 2


async def test_a_grammar_slower_than_the_bound_is_refused_by_name_and_the_engine_goes_on():
    """Every path refuses it naming the field: asubmit / generate (off the loop) and submit
    (on the caller's thread, for at most the bound). The compile runs on to its end and is
    cached (it cannot be stopped): the same schema asked again is then served."""
    big = {"type": "string", "enum": [f"value-{i:05d}-{'x' * (i % 7)}" for i in range(5_000)]}
    async with tiny_engine(grammar_compile_timeout_s=0.01) as engine:
        with pytest.raises(acb.InvalidRequestError, match="grammar_compile_timeout_s") as e:
            await engine.generate(PROMPTS[0], json_schema=big, max_new_tokens=8)
        assert e.value.param == "json_schema"
        with pytest.raises(acb.InvalidRequestError, match="grammar_compile_timeout_s") as e:
            engine.submit(PROMPTS[0], choice=[f"choice {i}" for i in range(5_000)], max_new_tokens=8)
        assert e.value.param == "choice"
        assert (await engine.generate(PROMPTS[0], max_new_tokens=4, ignore_eos=True)).finish_reason == "length"
        with anyio.fail_after(60):  # the refused compile finishes into the cache
            while engine.stats().grammars_compiled < 2:
                await anyio.sleep(0.05)
        done = await engine.generate(PROMPTS[0], json_schema=big, max_new_tokens=24)
        assert engine.stats().grammars_compiled == 2
    assert json.loads(done.text) in big["enum"]


def test_grammar_settings_are_checked_by_name():
    for bad in ({"grammar_compile_timeout_s": 0}, {"grammar_compile_timeout_s": float("inf")},
                {"grammar_compile_timeout_s": "1"}, {"grammar_cache_size": -1}, {"grammar_cache_size": 1.5}):
        with pytest.raises(ValueError, match=f"EngineConfig.{next(iter(bad))}"):
            acb.EngineConfig(**bad)
    assert acb.EngineConfig(grammar_compile_timeout_s=None, grammar_cache_size=0).grammar_cache_size == 0


@pytest.mark.slow
async def test_smollm2_json_schema_outputs_validate():
    from acb.model.loading import load, smollm2

    folder, gguf = smollm2()
    model, tok = load(folder, gguf)
    person = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                       "languages": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                     "maxItems": 3}},
        "required": ["name", "age", "languages"],
        "additionalProperties": False,
    }
    questions = ["Describe a fictional programmer as JSON.", "Give me a JSON record of a famous scientist.",
                 "Invent a person who speaks three languages; answer in JSON."]
    engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(num_blocks=128))
    async with engine:
        outs = await engine.generate_batch([[{"role": "user", "content": q}] for q in questions],
                                           json_schema=person, max_new_tokens=96)
        picked = await engine.generate([{"role": "user", "content": "Is the sky blue?"}], choice=["yes", "no"])
    for c in outs:
        jsonschema.validate(json.loads(c.text), person)
    assert picked.text in ("yes", "no")
