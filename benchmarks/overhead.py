"""The engine's own cost per step, with a null model whose forward does no math.

    python benchmarks/overhead.py              # 16, 256 and 1024 live requests
    python benchmarks/overhead.py --controls 0.1   # a tenth of them with every sampling control on
    python benchmarks/overhead.py --kv-events      # KV-cache events on, one subscriber replaying them

Reports engine steps/s and microseconds of Python per step per live request, so
the engine's overhead and its growth with load are visible apart from the model.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])

import acb  # noqa: E402


class NullModel(torch.nn.Module):
    """Looks like an HF causal LM to acb; returns zero logits without any math."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        from transformers import LlamaConfig

        self.config = LlamaConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=8, intermediate_size=8,
                                  max_position_embeddings=1 << 20)
        self.embed = torch.nn.Embedding(vocab, 8)
        self.generation_config = SimpleNamespace(eos_token_id=None)
        self.vocab = vocab

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, input_ids, logits_to_keep=None, **kwargs):
        n = logits_to_keep.numel() if isinstance(logits_to_keep, torch.Tensor) else input_ids.shape[1]
        return SimpleNamespace(logits=torch.zeros(1, n, self.vocab))


# every sampling control that runs in the sampling pass (acb/worker/sampling.py), for --controls
CONTROLS = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 1.0, 6: -1.0},
                min_new_tokens=10_000)


async def _replay(stream: acb.KVEventStream, counts: list[int]) -> None:
    """A router's side of the KV events: keep the set of cached prefix hashes."""
    cached: set[int] = set()
    async for batch in stream:
        for event in batch.events:
            counts[0] += 1
            if isinstance(event, acb.BlockStored):
                cached.update(event.block_hashes)
            elif isinstance(event, acb.BlockRemoved):
                cached.difference_update(event.block_hashes)
            else:
                cached.clear()


async def measure(live: int, steps: int, profile: bool, controls: float = 0.0, kv_events: bool = False,
                  distinct: bool = False) -> dict:
    config = acb.EngineConfig(num_blocks=live * 8 + 64, page_size=16, max_requests_per_batch=max(live, 1),
                              max_batch_tokens=max(live * 16, 256), kv_events=kv_events)
    engine = acb.Engine(NullModel(), config=config)
    events = [0]
    async with engine:
        consumer = asyncio.ensure_future(_replay(engine.kv_events(), events)) if kv_events else None
        every = round(1 / controls) if controls else 0
        # distinct prompts: each request's pages chain to hashes of their own (identical ones
        # share one chain, whose pages only the first request registers)
        handles = [engine.submit([1 + i % 63, 1 + i // 63 % 63, 3, 4] if distinct else [1, 2, 3, 4],
                                 max_new_tokens=steps + 50, ignore_eos=True,
                                 **(CONTROLS if every and i % every == 0 else {})) for i in range(live)]
        while engine.stats().running < live or engine.stats().generated_tokens < live:
            await asyncio.sleep(0.001)
        prof = cProfile.Profile() if profile else None
        gc_time = [0.0, 0.0, 0]  # seconds in CPython's cyclic GC, start of the current pass, full passes

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                gc_time[1] = time.perf_counter()
            else:
                gc_time[0] += time.perf_counter() - gc_time[1]
                gc_time[2] += info["generation"] == 2

        gc.callbacks.append(on_gc)
        s0, cpu0, t0, e0 = engine.stats().steps, time.process_time(), time.perf_counter(), events[0]
        if prof:
            prof.enable()
        while engine.stats().steps < s0 + steps:
            await asyncio.sleep(0.005)
        if prof:
            prof.disable()
        dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        gc.callbacks.remove(on_gc)
        n = engine.stats().steps - s0
        num_events = events[0] - e0
        for h in handles:
            h.cancel()
    if consumer is not None:
        await consumer  # the stream ends with the engine
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return {"live": live, "steps_per_s": n / dt, "ms_per_step": 1e3 * dt / n,
            "us_per_step_per_request": 1e6 * dt / n / live, "cpu_s_per_wall_s": cpu / dt,
            "gc_ms_per_step": 1e3 * gc_time[0] / n, "full_gc_passes": gc_time[2], "events_per_step": num_events / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--live", default="16,256,1024")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--controls", type=float, default=0.0,
                   help="share of requests with every sampling control on (penalties, logit_bias, min_new_tokens)")
    p.add_argument("--kv-events", action="store_true",
                   help="EngineConfig(kv_events=True) and a subscriber (implies --distinct-prompts)")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="a different prompt per request, so every request registers pages of its own")
    p.add_argument("--gc-tuned", action="store_true",
                   help="gc.freeze() and gc.set_threshold(50_000, 20, 100), as `acb serve` does")
    args = p.parse_args()
    if args.gc_tuned:
        import gc

        gc.freeze()
        gc.set_threshold(50_000, 20, 100)
    print(f"{'live':>6}{'steps/s':>10}{'ms/step':>10}{'us/step/req':>13}{'GC ms/step':>12}{'full GCs':>10}"
          f"{'events/step':>13}")
    for live in map(int, args.live.split(",")):
        r = asyncio.run(measure(live, args.steps, args.profile, args.controls, args.kv_events,
                                args.kv_events or args.distinct_prompts))
        print(f"{r['live']:>6}{r['steps_per_s']:>10.1f}{r['ms_per_step']:>10.2f}{r['us_per_step_per_request']:>13.1f}"
              f"{r['gc_ms_per_step']:>12.2f}{r['full_gc_passes']:>10}{r['events_per_step']:>13.1f}", flush=True)


if __name__ == "__main__":
    main()
