"""What LoRA adapters cost, in one process and one engine, on the standard workload.

    python benchmarks/adapters.py --json benchmarks/results/adapters-DATE.json
    python benchmarks/adapters.py --limit 16         # quick look

SmolLM2-135M-Instruct (the dtype Engine.from_pretrained picks here), an engine with
max_adapters=8, max_adapter_rank=16, and random rank-16 adapters on q/k/v/o/gate/up/down
(B non-zero). Runs, each over every prompt of the workload (64 new tokens each, greedy,
EOS ignored, all submitted at once, a cold prefix cache):

- ``base``: no request names an adapter;
- ``one``: every request runs the same adapter;
- ``eight``: request i runs adapter i % 8;
- with ``--rounds N``, base / one / eight N times over, interleaved; the costs are against
  the mean of every base run, from the means of every run of each kind;
- ``one_pytorch`` and ``eight_pytorch`` (once): the same without the native LoRA kernels
  (``acb/kernels/csrc/lora_cpu.cpp``), the deltas with PyTorch ops as in bfloat16 (what float32
  ran before the kernels);
- ``base`` again at the end (the machine's drift between the first and the last run).

Then ``load``: the base workload again while, after a quarter of its tokens, an adapter
is loaded from a PEFT folder on disk: the load's wall time, and the inter-token latency
of the streams while it loads against before it. Last, ``one_qv`` (each round): every request
on one adapter that targets q_proj and v_proj only, PEFT's default for Llama.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workloads  # noqa: E402
from systems import load_model, pct  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model, rank: int, seed: int) -> tuple[dict, dict]:
    """(LoRA config, state dict) of a random rank-``rank`` adapter on every target projection."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i, layer in enumerate(model.model.layers):
        for proj in TARGETS:
            parent = layer.self_attn if proj in TARGETS[:4] else layer.mlp
            out_f, in_f = getattr(parent, proj).weight.shape
            key = f"base_model.model.model.layers.{i}.{'self_attn' if proj in TARGETS[:4] else 'mlp'}.{proj}"
            state[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) / in_f ** 0.5
            state[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
              "bias": "none", "lora_dropout": 0.0}
    return config, state


def save_folder(config: dict, state: dict, folder: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "adapter_model.safetensors"))


async def run(engine, w, names: list, on_progress=None) -> dict:
    """Stream every prompt at once (request i with ``names[i % len(names)]``): throughput,
    TTFT and ITL, and each token's arrival time."""
    ttft, itl, stamps, counts = [], [], [], []

    async def one(i: int, prompt: list[int]) -> None:
        start = last = time.perf_counter()
        n = 0
        async for chunk in engine.stream(prompt, max_new_tokens=w.max_new_tokens, ignore_eos=True,
                                         adapter=names[i % len(names)]):
            now = time.perf_counter()
            k = len(chunk.token_ids)
            if n == 0 and k:
                ttft.append(now - start)
            elif k:
                itl.extend([(now - last) / k] * k)
                stamps.extend([now] * k)
            n += k
            last = now
            if on_progress is not None:
                on_progress(k)
        counts.append(n)

    engine.kv.evict_all_cached()
    steps0 = engine.stats().steps
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(w.prompts)))
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "generated_tokens": sum(counts), "tok_per_s": sum(counts) / elapsed,
            "steps": engine.stats().steps - steps0, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99), "_itl": itl, "_stamps": stamps}


async def load_while_serving(engine, w, folder: str) -> dict:
    """The base workload, and one adapter loaded from ``folder`` once a quarter of its
    tokens are out: the load's wall time and the ITL during it against before it."""
    total = len(w.prompts) * w.max_new_tokens
    done = [0]
    quarter = asyncio.Event()

    def progress(k: int) -> None:
        done[0] += k
        if done[0] >= total // 4:
            quarter.set()

    async def loader() -> tuple[float, float]:
        await quarter.wait()
        t = time.perf_counter()
        await engine.load_adapter(folder, "loaded")
        return t, time.perf_counter()

    served, (t_start, t_end) = await asyncio.gather(run(engine, w, [None], progress), loader())
    pairs = list(zip(served.pop("_stamps"), served.pop("_itl")))
    during = [g for s, g in pairs if t_start <= s <= t_end + 0.05]  # tokens that arrived while it loaded
    before = [g for s, g in pairs if s < t_start]
    await engine.unload_adapter("loaded")
    return {**served, "load_s": t_end - t_start, "itl_during_load_p50_s": pct(during, 50),
            "itl_during_load_max_s": max(during, default=None), "tokens_during_load": len(during),
            "itl_before_load_p50_s": pct(before, 50), "itl_before_load_p99_s": pct(before, 99)}


async def main_async(args) -> dict:
    import acb
    from acb.testing import runner_of

    w = workloads.build("standard", args.workload_file, args.limit, 2.0)
    model, tok = load_model()
    config = acb.EngineConfig(max_adapters=8, max_adapter_rank=16)
    adapters = [random_adapter(model, 16, seed) for seed in range(10)]  # (before the engine prepacks the model)
    out: dict = {"load_start": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "requests": len(w.prompts), "max_new_tokens": w.max_new_tokens, "runs": {}}
    async with acb.Engine(model, tokenizer=tok, config=config) as engine:
        t = time.perf_counter()
        for i in range(8):
            await engine.load_adapter(adapters[i], f"a{i}")
        out["load_8_from_memory_s"] = time.perf_counter() - t
        await engine.generate_batch(w.prompts, max_new_tokens=2, ignore_eos=True)  # warm-up, every length class
        await engine.generate_batch(w.prompts[:8], max_new_tokens=2, ignore_eos=True, adapter="a0")
        eight = [f"a{i}" for i in range(8)]
        bank = runner_of(engine).lora
        kernels = bank.kernels
        plan = [(f"{label}_{r}" if r > 1 else label, names, kernels) for r in range(1, args.rounds + 1)
                for label, names in (("base", [None]), ("one", ["a0"]), ("eight", eight))]
        plan += [("one_pytorch", ["a0"], None), ("eight_pytorch", eight, None), ("base_again", [None], kernels)]
        for label, names, native in plan:
            bank.kernels = native  # None: the fused forward adds the deltas with PyTorch ops
            res = await run(engine, w, names)
            res.pop("_stamps")
            res.pop("_itl")
            out["runs"][label] = res
            print(f"{label:10s} {res['tok_per_s']:7.1f} tok/s  ITL p50 {1e3 * res['itl_p50_s']:.0f} ms  "
                  f"({res['elapsed_s']:.1f} s, {res['steps']} steps)", flush=True)
        await engine.unload_adapter("a7")  # a free slot for the load while serving
        with tempfile.TemporaryDirectory() as folder:
            save_folder(*adapters[8], folder)
            out["load"] = await load_while_serving(engine, w, folder)
        # an adapter on q_proj / v_proj only (PEFT's default targets for Llama): the MLP stays fused
        config_qv, state = adapters[9]
        state = {k: v for k, v in state.items() if ".q_proj." in k or ".v_proj." in k}
        await engine.load_adapter(({**config_qv, "target_modules": ["q_proj", "v_proj"]}, state), "qv")
        for r in range(1, args.rounds + 1):
            res = await run(engine, w, ["qv"])
            res.pop("_stamps")
            res.pop("_itl")
            out["runs"][f"one_qv_{r}"] = res
            print(f"one_qv_{r}   {res['tok_per_s']:7.1f} tok/s  ITL p50 {1e3 * res['itl_p50_s']:.0f} ms", flush=True)
        out["dtype"] = engine.stats().dtype
        out["forward_path"] = engine.stats().forward_path
    runs = out["runs"]

    def mean(kind: str) -> float:  # over the rounds (base: and the last run)
        rates = [r["tok_per_s"] for label, r in runs.items() if label.rstrip("_0123456789") == kind
                 or (kind == "base" and label == "base_again")]
        return sum(rates) / len(rates)

    base = mean("base")
    kinds = ("base", "one", "eight", "one_pytorch", "eight_pytorch", "one_qv")
    out["tok_per_s_mean"] = {kind: mean(kind) for kind in kinds}
    out["native_lora_kernels"] = kernels is not None
    for kind in kinds[1:]:
        out[f"cost_{kind}"] = 1 - mean(kind) / base
    out["load_end"] = os.getloadavg()
    lo = out["load"]
    print(f"cost: one adapter {100 * out['cost_one']:.1f} %, eight {100 * out['cost_eight']:.1f} % "
          f"(PyTorch ops: {100 * out['cost_one_pytorch']:.1f} %, {100 * out['cost_eight_pytorch']:.1f} %), "
          f"one on q/v only "
          f"{100 * out['cost_one_qv']:.1f} % (against the "
          f"mean of both base runs); load while serving {lo['load_s']:.2f} s, ITL during it p50 "
          f"{1e3 * (lo['itl_during_load_p50_s'] or 0):.0f} ms max {1e3 * (lo['itl_during_load_max_s'] or 0):.0f} ms, "
          f"before it p50 {1e3 * lo['itl_before_load_p50_s']:.0f} ms; load avg {out['load_start']} -> "
          f"{out['load_end']}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--workload-file", default=None)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--rounds", type=int, default=1, help="repeat base/one/eight this many times, interleaved")
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    out["command"] = "python benchmarks/adapters.py " + " ".join(sys.argv[1:])
    out["date"], out["source"] = out["started"], out["command"]  # what benchmarks/results/ files carry
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
