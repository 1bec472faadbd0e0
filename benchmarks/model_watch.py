"""What the per-step model check (acb/watch.py) costs, against the steps it guards.

    python benchmarks/model_watch.py            # a SmolLM2-135M-shaped Llama (random weights)

Builds an engine over a model of SmolLM2-135M's shape (30 layers, hidden 576, 273
parameters, 395 modules), runs a batch of 32 requests of 32 new tokens, and reports
the mean time of ``ModelRunner.check_model()`` (what the engine runs before every
step) over 2000 calls next to the mean step time of the same run, so contention on a
shared machine affects both alike.
"""

from __future__ import annotations

import asyncio
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0])

import transformers

import acb
from acb.testing import runner_of


def smollm2_shaped() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
    )
    return transformers.LlamaForCausalLM(config).eval()


async def main() -> None:
    model = smollm2_shaped()
    prompts = [[(7 * i + j) % 49000 + 3 for j in range(24)] for i in range(32)]
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=512)) as engine:
        await engine.generate(prompts[0], max_new_tokens=2, ignore_eos=True)  # warm-up
        steps0, t = engine.stats().steps, time.perf_counter()
        await engine.generate_batch(prompts, max_new_tokens=32, ignore_eos=True)
        step_ms = (time.perf_counter() - t) / (engine.stats().steps - steps0) * 1e3
        runner = runner_of(engine)
        n = 2000
        t = time.perf_counter()
        for _ in range(n):
            runner.check_model()
        check_us = (time.perf_counter() - t) / n * 1e6
        mods = sum(1 for _ in model.modules())
        params = sum(1 for _ in model.parameters())
        fused = runner.fast_paths.fused is not None  # read while the engine is open: closing releases it
    print(f"model: {mods} modules, {params} parameters; fused forward {'on' if fused else 'off'}")
    print(f"check_model: {check_us:.1f} us per step; mean step {step_ms:.2f} ms "
          f"(32 requests, 32 new tokens): {check_us / (step_ms * 1e3) * 100:.2f} % of a step")


if __name__ == "__main__":
    asyncio.run(main())
