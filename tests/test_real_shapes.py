"""The attention layouts of the models people run, at two layers: greedy output in float32 equals
transformers' own ``generate`` token for token, prompts batched together with chunked prefill, on
the default CPU path (the fused forward and the native attention kernels). The shapes the tiny test
models never take: 7:1 and 8:1 GQA, 14 and 15 query heads (not powers of two), head dims 64, 128 and
256, one KV head."""

from __future__ import annotations

import pytest
import torch

import acb
from acb.testing import random_prompts, reference_greedy

# (architecture, query heads, KV heads, head dim): whose attention layout
SHAPES = {
    "qwen2.5-0.5b": ("qwen2", 14, 2, 64),  # 7:1, 14 heads, q/k/v biases
    "qwen2.5-1.5b": ("qwen2", 12, 2, 128),  # 6:1, head dim 128
    "qwen3-0.6b": ("qwen3", 16, 8, 128),  # 2:1, q/k norms
    "llama-3.2-1b": ("llama", 32, 8, 64),  # 4:1, 32 heads
    "smollm2-360m": ("llama", 15, 5, 64),  # 15 heads
    "8-to-1": ("llama", 16, 2, 64),
    "gemma-3-1b": ("gemma3_text", 4, 1, 256),  # one KV head, head dim 256
}


def _model(arch: str, heads: int, kv_heads: int, head_dim: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"query_pre_attn_scalar": head_dim, "sliding_window": 64} if arch == "gemma3_text" else {}
    config = AutoConfig.for_model(arch, hidden_size=heads * head_dim, intermediate_size=192, num_hidden_layers=2,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                  vocab_size=384, max_position_embeddings=1024, tie_word_embeddings=False, **extra)
    torch.manual_seed(heads * 100 + kv_heads)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights wide enough that the greedy tokens vary (not one repeated token)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("shape", SHAPES)
async def test_greedy_matches_transformers_at_real_attention_layouts(shape):
    model = _model(*SHAPES[shape])
    prompts = random_prompts(5, 3, 90, seed=len(shape))
    max_new = [12, 5, 9, 16, 7]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    assert len({tuple(e) for e in expected}) > 1, "reference output not varied"
    config = acb.EngineConfig(page_size=16, num_blocks=64, max_batch_tokens=64, dtype="float32")
    async with acb.Engine(model, config=config) as engine:
        handles = [engine.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, max_new)]
        results = [await h for h in handles]
        path = engine.stats().forward_path
    for got, want, p in zip(results, expected, prompts):
        assert got.token_ids == want, f"{shape}: a prompt of {len(p)} tokens diverged ({path})"
