"""Attention backends: which one ``attn_backend`` picks, refusals where one cannot run, and
the Triton backend end to end on CPU (Triton's interpreter, ``TRITON_INTERPRET=1`` from
tests/conftest.py): greedy tokens equal transformers' generate with chunked prefill,
prefix hits, sliding windows, soft-capping and the hybrid models' second page pool."""

from __future__ import annotations

import pytest
import torch

import acb
from acb.attention.selector import resolve_backend
from acb.integrations.metrics import ServerMetrics
from acb.testing import random_prompts, reference_greedy, step_counts, tiny_model

pytest.importorskip("triton", reason="triton is installed by scripts/setup.sh")

CPU = torch.device("cpu")


def test_auto_picks_native_on_cpu_in_the_dtypes_its_kernels_read_and_torch_otherwise():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert resolve_backend("auto", CPU, dtype) == "native"
    assert resolve_backend("auto", CPU, torch.float64) == "torch"
    assert resolve_backend("torch", CPU, torch.bfloat16) == "torch"


def test_auto_picks_triton_on_cuda():
    # no CUDA tensor is made: the choice depends only on the device type and the import
    assert resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "triton"


@pytest.mark.parametrize(("backend", "dtype", "why"), [
    ("native", torch.float64, "float32, bfloat16 and float16 models on CPU"),
    ("flash_attn", torch.float32, "flash-attn"),
])
def test_a_backend_that_cannot_run_here_is_refused_by_name(backend, dtype, why):
    model = tiny_model("llama").to(dtype)
    with pytest.raises(ValueError, match=f"attn_backend='{backend}'.*{why}"):
        acb.Engine(model, config=acb.EngineConfig(attn_backend=backend))


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="attn_backend='triton'.*CUDA device"):
        acb.Engine(tiny_model("llama"), config=acb.EngineConfig(attn_backend="triton"))


def test_the_backend_in_use_is_in_stats_and_metrics():
    # (a started engine's stats are checked by the Triton parity test below)
    engine = acb.Engine(tiny_model("llama"), config=acb.EngineConfig(num_blocks=16, attn_backend="torch"))
    assert engine.stats().attn_backend == "torch"
    assert 'acb_attention_backend_info{backend="torch"} 1' in ServerMetrics().render(engine.stats())


# The interpreter takes tens of milliseconds per program, so these runs are short:
# llama (grouped-query heads, prefix hits), gemma2 (sliding window and soft-capping in
# every layer), gemma3 (the sliding layers' own page pool).
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3"])
async def test_triton_backend_matches_generate(arch):
    """A shared prefix (prefix hits where caching is on), ``max_batch_tokens`` splitting
    prompts into chunks (continuations), steps mixing prefill chunks with decode rows."""
    model = tiny_model(arch)
    shared = random_prompts(1, 9, 9, seed=5)[0]
    prompts = [shared + p for p in random_prompts(2, 2, 7, seed=6)] + random_prompts(1, 1, 1, seed=7)
    expected = [reference_greedy(model, p, 6) for p in prompts]
    config = acb.EngineConfig(page_size=4, num_blocks=32, max_batch_tokens=12, attn_backend="triton")
    async with acb.Engine(model, config=config) as engine:
        first = await engine.generate(prompts[0], max_new_tokens=6, ignore_eos=True)
        rest = await engine.generate_batch(prompts[1:], max_new_tokens=6, ignore_eos=True)
        stats, counts = engine.stats(), step_counts(engine)
    assert [r.token_ids for r in [first, *rest]] == expected
    assert stats.attn_backend == "triton"
    assert counts.fast_decode > 0
    if arch == "llama":
        assert stats.prefix_hit_rate > 0


async def test_max_blocks_per_request_bounds_the_triton_decode_path():
    model = tiny_model("llama")
    prompts = random_prompts(2, 14, 14, seed=8)
    expected = [reference_greedy(model, p, 6) for p in prompts]
    # pages of 4 tokens: contexts grow from 4 to 5 pages, so a bound of 4 pages serves the
    # first decode steps on the Triton kernel and the later ones on PyTorch's path
    config = acb.EngineConfig(page_size=4, num_blocks=32, max_blocks_per_request=4, attn_backend="triton")
    async with acb.Engine(model, config=config) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
        decode_steps = engine.stats().steps - 1  # the first step holds the prompts
        fast = step_counts(engine).fast_decode
    assert [r.token_ids for r in results] == expected
    assert 0 < fast < decode_steps
