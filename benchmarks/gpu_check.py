"""One-shot GPU check: greedy parity against transformers' generate on CUDA for every
architecture, then acb timed against transformers' generate_batch on the same workload.

    bash benchmarks/gpu_check.sh        # on a machine with a CUDA GPU; no network needed

Models are random weights built from configs (SmolLM2's shape and a ~1B Llama shape).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import acb  # noqa: E402
from acb.testing import ARCHITECTURES, random_prompts, reference_greedy, tiny_model  # noqa: E402

DEV = os.environ.get("ACB_GPU_CHECK_DEVICE", "cuda")


def parity() -> bool:
    ok_all = True
    for arch in ARCHITECTURES:
        for async_batching in (True, False):
            try:
                model = tiny_model(arch, device=DEV)
                prompts = random_prompts(13, 3, 40, seed=11)
                max_new = [8 + (i * 7) % 25 for i in range(len(prompts))]
                expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
                cfg = acb.EngineConfig(page_size=4, num_blocks=24, max_batch_tokens=24, max_requests_per_batch=8,
                                       safety_margin=0.0, async_batching=async_batching)

                async def run(model=model, cfg=cfg, prompts=prompts, max_new=max_new):
                    async with acb.Engine(model, config=cfg) as engine:
                        hs = [engine.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, max_new)]
                        res = [await h for h in hs]
                        return res, engine.stats()

                res, stats = asyncio.run(run())
                bad = sum(r.token_ids != e for r, e in zip(res, expected))
                ok = bad == 0 and stats.free_blocks == stats.total_blocks
                print(f"PARITY {arch:8s} async={async_batching!s:5s} {'ok' if ok else 'FAIL'} "
                      f"({bad} of {len(prompts)} differ, preemptions={stats.preemptions})", flush=True)
                ok_all &= ok
            except Exception:
                traceback.print_exc()
                print(f"PARITY {arch} async={async_batching} ERROR", flush=True)
                ok_all = False
    return ok_all


def make_model(shape: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if shape == "smollm2":
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                          tie_word_embeddings=True, rope_theta=100000.0)
    else:  # ~1.1B, TinyLlama's shape
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(DEV).eval()
    return model, cfg.vocab_size


def workload(vocab: int, n: int = 64, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 512))] for _ in range(n)]


def time_acb(model, prompts, new, **cfg) -> tuple[float, int, float]:
    """(seconds, steps, fraction of the wall time the GPU spent inside steps)."""
    async def run():
        engine = acb.Engine(model, config=acb.EngineConfig(max_memory_percent=0.3, **cfg))
        async with engine:
            await engine.generate_batch(prompts[:8], max_new_tokens=4, ignore_eos=True)
            torch.cuda.synchronize()
            engine._runner.measure_device_time = True
            engine._runner.device_busy_ms = 0.0
            s0 = engine.stats().steps
            t = time.perf_counter()
            await engine.generate_batch(prompts, max_new_tokens=new, ignore_eos=True)
            dt = time.perf_counter() - t
            return dt, engine.stats().steps - s0, engine._runner.device_busy_ms / 1e3 / dt

    return asyncio.run(run())


def time_hf(model, prompts, new) -> float:
    from transformers import GenerationConfig

    model.config._attn_implementation = "sdpa"
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:8], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0))
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate_batch(inputs=prompts, generation_config=gen)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def timing() -> None:
    new = 64
    print(f"{'model':<10}{'requests':>9}{'system':>28}{'tok/s':>10}{'s':>8}{'steps':>7}{'GPU busy':>10}")
    for shape in ("smollm2", "llama-1b"):
        model, vocab = make_model(shape)
        for n in (64, 256):
            prompts = workload(vocab, n)
            rows = []
            for label, cfg in (("acb eager, async on", {}), ("acb eager, async off", {"async_batching": False})):
                try:
                    dt, steps, busy = time_acb(model, prompts, new, **cfg)
                    rows.append((label, n * new / dt, dt, steps, busy))
                except Exception as e:
                    print(f"{label} failed: {e!r}")
            try:
                dt = time_hf(model, prompts, new)
                rows.append(("transformers generate_batch", n * new / dt, dt, None, None))
            except Exception as e:
                print(f"transformers generate_batch failed: {e!r}")
            for label, tps, dt, steps, busy in rows:
                print(f"{shape:<10}{n:>9}{label:>28}{tps:>10.0f}{dt:>8.2f}{steps if steps else '-':>7}"
                      f"{format(busy, '.0%') if busy is not None else '-':>10}", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    import transformers

    print("transformers", transformers.__version__, flush=True)
    ok = parity()
    timing()
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    sys.exit(0 if ok else 1)
