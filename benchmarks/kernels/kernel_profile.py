"""Where an acb step's time goes: each native call of the fused forward timed, prefill and decode apart.

    python benchmarks/kernel_profile.py int8_bf16 48 96   # variant (int8_bf16 | bf16 | fp32), prompts, new tokens
    python benchmarks/kernel_profile.py bf16 48 96 realtext  # bench.py's real-text prompts (prefill-heavy)
    python benchmarks/kernel_profile.py int8_bf16_kv8 48 96  # a _kv8 suffix: int8 KV pages
    PYTHONPATH=. python benchmarks/kernel_profile.py bf16  # from a worktree: its acb, not the installed one
    python benchmarks/kernel_profile.py int8 16 32 --shape qwen2.5-0.5b  # a popular shape (benchmarks/shapes.py)
    python benchmarks/kernel_profile.py int8_bf16 48 96 realtext --native-loop  # decode as the engine runs it
    python benchmarks/kernel_profile.py int8_bf16 48 96 realtext --native-loop --split-rows 0  # no halves

Runs SmolLM2 through an Engine on the first N prompts of a workload (standard unless named) (one generate_batch,
after a warm-up pass), with the fused forward's kernel modules wrapped so every call into them (int8 GEMMs,
quantization, RMSNorm, RoPE, acb's bf16 GEMMs), the ``lm_head`` module and ``acb.attention.paged.attend`` are
timed (the native attention calls inside it indented); oneDNN's GEMMs of the layers (fp32, and bf16 with
``cpu_bf16_gemm=False`` or ``ACB_CPU_BF16_GEMM=0``; called directly) fall in "(rest of forward)". Prints the wall
time, the forward's share of it (the rest is scheduling, sampling and host work), and per step kind the time
of each call (decode steps through the forwards' Python loops, ``fused.NATIVE_DECODE_LOOP`` off, so their
calls are seen: the engine runs them in one native call). ``--native-loop`` runs decode steps as the engine
does, in the DecodeLoops (each step then timed whole, its calls unseen); ``--split-rows N`` sets the loops'
``split_rows`` (0: a step never runs as two halves; acb/kernels/csrc/decode_loop.h). The wrappers cost ~1 us a
call: compare shares, not absolute figures, with bench.py's. Run it under the exclusive lock on a quiet
machine (results recorded in docs/performance.md, int8 section).
"""
# ruff: noqa: E402
import asyncio
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shapes.py
import torch
import workloads
from shapes import checkpoint

import acb
from acb.attention import paged, selector
from acb.loading import load
from acb.model import fused, int8_forward

T: dict = collections.defaultdict(float)  # (step kind, name) -> seconds
C: dict = collections.defaultdict(int)  # (step kind, name) -> calls
kind = ["?"]


def timed(name, fn):
    def f(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[(kind[0], name)] += time.perf_counter() - t0
            C[(kind[0], name)] += 1
    return f


class Proxy:
    """A kernel module whose callables are timed."""

    def __init__(self, mod, prefix):
        self._m, self._p = mod, prefix

    def __getattr__(self, n):
        v = getattr(self._m, n)
        if callable(v):
            v = timed(self._p + n, v)
        setattr(self, n, v)  # wrapped once: later lookups find it without __getattr__
        return v


def instrument(decode_rows: int, native_loop: bool = False, split_rows: int | None = None) -> None:
    # decode steps through the Python loops, so each of their kernel calls is timed too (the
    # engine runs them in one native call, the DecodeLoops: ~1.6 ms a SmolLM2 int8 decode step less)
    fused.NATIVE_DECODE_LOOP = native_loop
    if split_rows is not None:
        for cls in (int8_forward.Int8Forward, fused.FusedForward):
            def native(self, _orig=cls._native_loop):
                loop = _orig(self)
                if loop is not None:
                    loop.split_rows = split_rows
                return loop
            cls._native_loop = native
    for cls in (int8_forward.Int8Forward, fused.FusedForward):
        def call(self, context, input_ids, *a, _orig=cls.__call__, **k):
            if not isinstance(self.k, Proxy):
                self.k = Proxy(self.k, "k.")
                if hasattr(self, "q8"):
                    self.q8 = Proxy(self.q8, "q8.")
                if getattr(self, "bf16", None) is not None:  # acb's bf16 GEMMs (acb/kernels/csrc/bf16_cpu.cpp)
                    self.bf16 = Proxy(self.bf16, "bf16.")
                self.lm_head = timed("lm_head", self.lm_head)  # when not on the bf16 GEMMs' own
            rows = input_ids.shape[-1]
            kind[0] = "decode" if rows <= decode_rows else "prefill"
            t0 = time.perf_counter()
            out = _orig(self, context, input_ids, *a, **k)
            T[(kind[0], "FORWARD")] += time.perf_counter() - t0
            C[(kind[0], "FORWARD")] += 1
            T[(kind[0], "rows")] += rows
            return out
        cls.__call__ = call
    paged.attend = timed("paged_attention", paged.attend)


def report(variant: str, n_prompts: int, new: int, wall: float, steps: int) -> None:
    print(f"{variant}: load {os.getloadavg()[0]:.2f}; wall {wall:.2f} s, {steps} steps, "
          f"{n_prompts * new / wall:.1f} tok/s")
    fwd = sum(v for (_, n), v in T.items() if n == "FORWARD")
    print(f"forward total {fwd:.2f} s ({fwd / wall:.0%} of wall); outside the forward {wall - fwd:.2f} s")
    for kd in ("prefill", "decode"):
        f, calls = T.get((kd, "FORWARD"), 0), C.get((kd, "FORWARD"), 0)
        if not calls:
            continue
        print(f"-- {kd}: {calls} forwards, {T[(kd, 'rows')] / calls:.0f} rows avg, {f:.2f} s, "
              f"{1e3 * f / calls:.1f} ms each")
        items = sorted(((v, n) for (k2, n), v in T.items() if k2 == kd and n not in ("FORWARD", "rows")),
                       reverse=True)
        for v, n in items:
            print(f"   {n:<22} {v:7.3f} s {v / f:6.1%}  {C[(kd, n)]:6d} calls {1e6 * v / C[(kd, n)]:8.1f} us")
        rest = f - sum(v for v, n in items if not n.startswith(" "))  # indented: inside paged_attention's
        print(f"   {'(rest of forward)':<22} {rest:7.3f} s {rest / f:6.1%}")


def main() -> None:
    argv = list(sys.argv)
    native_loop = "--native-loop" in argv
    if native_loop:
        argv.remove("--native-loop")
    split_rows = None
    if "--split-rows" in argv:
        i = argv.index("--split-rows")
        split_rows = int(argv[i + 1])
        del argv[i: i + 2]
    shape = "smollm2"
    if "--shape" in argv:
        i = argv.index("--shape")
        shape = argv[i + 1]
        del argv[i: i + 2]
    sys.argv = argv
    variant = sys.argv[1] if len(sys.argv) > 1 else "int8_bf16"  # int8_bf16 | int8 | bf16 | fp32, [_kv8]
    kv8 = variant.endswith("_kv8")
    variant = variant.removesuffix("_kv8")
    n_prompts = int(sys.argv[2]) if len(sys.argv) > 2 else 48
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 96
    w = workloads.build(sys.argv[4] if len(sys.argv) > 4 else "standard", None, n_prompts, 2.0)
    dtype = "bfloat16" if variant in ("bf16", "int8_bf16") else "float32"
    quant = "int8" if variant.startswith("int8") else None
    model, tok = load(*checkpoint(shape), dtype=dtype, quantization=quant)
    model = model if quant else model.to(getattr(torch, dtype))
    instrument(n_prompts, native_loop, split_rows)

    async def run() -> tuple[float, int]:
        engine = acb.Engine(model, tokenizer=tok, config=acb.EngineConfig(
            dtype=dtype, quantization=quant, kv_cache_dtype="int8" if kv8 else None))
        async with engine:
            if selector.KERNELS.get("native") is not None:  # its calls timed inside paged_attention's
                selector.KERNELS["native"] = Proxy(selector.KERNELS["native"], "  attn.")
            await engine.generate_batch(w.prompts, max_new_tokens=2, ignore_eos=True)
            engine.kv.evict_all_cached()
            T.clear()
            C.clear()
            s0 = engine.stats().steps
            t0 = time.perf_counter()
            await engine.generate_batch(w.prompts, max_new_tokens=new, ignore_eos=True)
            return time.perf_counter() - t0, engine.stats().steps - s0

    wall, steps = asyncio.run(run())
    report(variant + ("_kv8" if kv8 else ""), n_prompts, new, wall, steps)


if __name__ == "__main__":
    main()
