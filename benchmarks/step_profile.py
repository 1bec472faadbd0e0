"""Where a run's time goes: acb alone on a workload, each step's parts timed.

    python benchmarks/step_profile.py                 # the standard workload, SmolLM2, default config

Runs the workload once at full size as a warm-up (as bench.py does), then once timed,
consuming with ``generate_batch``. Steps are split into those carrying prompt tokens
("prefill") and decode-only ones; within them, wall time is summed for building the
step's tensors, attention (and the native kernels inside it), the fused forward's
norms and RoPE, ``lm_head`` and sampling. What is left of a step is the layers' GEMMs
plus small glue (embeddings, rotary tables). Timers wrap Python-level calls, so
they add a few microseconds per call; the totals are a breakdown, not a benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import workloads  # noqa: E402
from systems import load_model  # noqa: E402

import acb  # noqa: E402
from acb.attention import paged, selector  # noqa: E402
from acb.testing import runner_of  # noqa: E402


class Timers:
    def __init__(self) -> None:
        self.kind = "prefill"
        self.total: collections.Counter[tuple[str, str]] = collections.Counter()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[self.kind, name] += time.perf_counter() - t
                self.calls[self.kind, name] += 1

        return timed

    def clear(self) -> None:
        self.total.clear()
        self.calls.clear()


class _KernelProxy:
    """A native kernel module with each function timed (modules' attributes are read-only)."""

    def __init__(self, module, timers: Timers, names: list[str]) -> None:
        self._module = module
        for name in names:
            setattr(self, name, timers.wrap(name, getattr(module, name)))

    def __getattr__(self, name: str):  # every function not timed: the module's own
        return getattr(self._module, name)


def instrument(engine: acb.Engine, timers: Timers) -> None:
    runner = runner_of(engine)
    execute = runner.execute

    def step(s):
        timers.kind = "prefill" if len(s.token_ids) > s.num_rows else "decode"
        return timers.wrap("step", execute)(s)

    runner.execute = step
    runner._build = timers.wrap("build step tensors", runner._build)
    paged.attend = timers.wrap("attention (all)", paged.attend)  # (transformers' path calls it too)
    if "native" in selector.KERNELS:
        selector.KERNELS["native"] = _KernelProxy(selector.KERNELS["native"], timers,
                                                   ["paged_decode", "prefill_attention"])
    import acb.worker.runner as runner_module

    runner_module.sample = timers.wrap("sampling", runner_module.sample)
    if runner.fast_paths.fused is not None:
        runner.fast_paths.fused.k = _KernelProxy(runner.fast_paths.fused.k, timers, ["rms_norm", "rope_"])
        runner.fast_paths.fused.lm_head = timers.wrap("lm_head", runner.fast_paths.fused.lm_head)


async def main(args) -> None:
    w = workloads.build(args.workload, args.workload_file, args.limit)
    model, tok = load_model()
    engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig())
    timers = Timers()
    async with engine:
        fused = runner_of(engine).fast_paths.fused is not None
        instrument(engine, timers)
        await engine.generate_batch(w.prompts, max_new_tokens=2, ignore_eos=True)  # warm-up at full size
        engine.kv.evict_all_cached()
        timers.clear()
        t = time.perf_counter()
        out = await engine.generate_batch(w.prompts, max_new_tokens=w.max_new_tokens, ignore_eos=True)
        elapsed = time.perf_counter() - t
    generated = sum(len(c.token_ids) for c in out)
    print(f"{w.name}: {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tok/s "
          f"(fused forward {'on' if fused else 'off: attention timed only through the fused forward'})")
    for kind in ("prefill", "decode"):
        steps = timers.calls[kind, "step"]
        if not steps:
            continue
        total = timers.total[kind, "step"]
        print(f"\n{kind} steps: {steps}, {total:.2f} s ({1e3 * total / steps:.1f} ms/step)")
        parts = [(name, v) for (k, name), v in timers.total.items() if k == kind and name != "step"]
        accounted = sum(v for name, v in parts if name not in ("paged_decode", "prefill_attention"))
        for name, v in sorted(parts, key=lambda p: -p[1]):
            inner = "  (inside attention)" if name in ("paged_decode", "prefill_attention") else ""
            print(f"  {name:22s} {v:7.3f} s  {timers.calls[kind, name]:6d} calls{inner}")
        print(f"  {'rest: GEMMs and glue':22s} {total - accounted:7.3f} s")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="standard", choices=["standard", "prefix"])
    p.add_argument("--workload-file", default=None)
    p.add_argument("--limit", type=int, default=None)
    asyncio.run(main(p.parse_args()))
