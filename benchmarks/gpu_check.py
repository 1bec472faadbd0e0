"""One-shot GPU check: greedy parity against transformers' generate on CUDA for every
architecture (eager, and with CUDA graphs for decode steps), then acb (eager, graphs,
graphs + async batching) timed against transformers' generate_batch on the same
workload, with the GPU's idle time between steps with async batching on and off.

    bash benchmarks/gpu_check.sh        # on a machine with a CUDA GPU; no network needed

Models are random weights built from configs (SmolLM2's shape and a ~1B Llama shape).
The whole run stays under BUDGET_S: timing rows that would start later are skipped
(and say so), so the script always reaches its verdict.
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
BUDGET_S = float(os.environ.get("ACB_GPU_CHECK_BUDGET_S", "400"))
T0 = time.perf_counter()


def parity() -> bool:
    ok_all = True
    runs = [(arch, a, False, False) for arch in ARCHITECTURES for a in (True, False)]
    runs += [(arch, a, True, False) for arch in ARCHITECTURES for a in (True, False)]
    # CPU offload on CUDA: pinned host pool, asynchronous copies on the runner's stream
    runs += [(arch, a, False, True) for arch in ("llama", "mistral", "gemma3") for a in (True, False)]
    prompts = random_prompts(13, 3, 40, seed=11)
    max_new = [8 + (i * 7) % 25 for i in range(len(prompts))]
    references: dict[str, list[list[int]]] = {}
    for arch, async_batching, graphs, offload in runs:
        try:
            model = tiny_model(arch, device=DEV)
            if arch not in references:
                references[arch] = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
            expected = references[arch]
            # graphs: small padding intervals so several row/context buckets are captured
            extra = dict(use_cuda_graph=True, q_padding_interval_size=4, kv_padding_interval_size=16) \
                if graphs else {}
            if offload:
                extra["cpu_offload_space"] = 0.01
            cfg = acb.EngineConfig(page_size=4, num_blocks=24, max_batch_tokens=24, max_requests_per_batch=8,
                                   safety_margin=0.0, async_batching=async_batching, **extra)

            async def run(model=model, cfg=cfg, prompts=prompts, max_new=max_new):
                async with acb.Engine(model, config=cfg) as engine:
                    hs = [engine.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, max_new)]
                    res = [await h for h in hs]
                    g = engine._runner.decode_graphs
                    return res, engine.stats(), (len(g.graphs), g.failed) if g is not None else None

            res, stats, graph_state = asyncio.run(run())
            bad = sum(r.token_ids != e for r, e in zip(res, expected))
            ok = bad == 0 and stats.free_blocks == stats.total_blocks
            note = ""
            if graphs:
                captured, failed = graph_state if graph_state else (0, True)
                ok &= captured > 0 and not failed
                note = f", graphs captured={captured}{' CAPTURE FAILED' if failed else ''}"
            if offload:
                ok &= stats.offloads == stats.preemptions == stats.restores and stats.recomputed_tokens == 0
                note += f", offloads={stats.offloads} restores={stats.restores} recomputed={stats.recomputed_tokens}"
            print(f"PARITY {arch:8s} async={async_batching!s:5s} graphs={graphs!s:5s} offload={offload!s:5s} "
                  f"{'ok' if ok else 'FAIL'} "
                  f"({bad} of {len(prompts)} differ, preemptions={stats.preemptions}{note})", flush=True)
            ok_all &= ok
        except Exception:
            traceback.print_exc()
            print(f"PARITY {arch} async={async_batching} graphs={graphs} offload={offload} ERROR", flush=True)
            ok_all = False
    return ok_all


def compile_parity() -> bool:
    """compile_level=1 with CUDA graphs on a tiny Llama, if the time budget allows it
    (inductor's first compile takes tens of seconds)."""
    left = 470 - (time.perf_counter() - T0)
    if left < 150:
        print(f"PARITY llama compile_level=1 graphs=True SKIPPED (time budget: {left:.0f} s left)", flush=True)
        return True
    try:
        model = tiny_model("llama", device=DEV)
        prompts = random_prompts(6, 3, 30, seed=3)
        expected = [reference_greedy(model, p, 16) for p in prompts]
        cfg = acb.EngineConfig(page_size=8, num_blocks=128, max_requests_per_batch=8, compile_level=1,
                               use_cuda_graph=True, q_padding_interval_size=4, kv_padding_interval_size=32)

        async def run():
            async with acb.Engine(model, config=cfg) as engine:
                res = await engine.generate_batch(prompts, max_new_tokens=16, ignore_eos=True)
                g = engine._runner.decode_graphs
                return res, len(g.graphs), g.failed

        t = time.perf_counter()
        res, captured, failed = asyncio.run(run())
        bad = sum(r.token_ids != e for r, e in zip(res, expected))
        ok = bad == 0 and captured > 0 and not failed
        print(f"PARITY llama compile_level=1 graphs=True {'ok' if ok else 'FAIL'} ({bad} of {len(prompts)} "
              f"differ, graphs captured={captured}{' CAPTURE FAILED' if failed else ''}, "
              f"{time.perf_counter() - t:.0f} s)", flush=True)
        return ok
    except Exception:
        traceback.print_exc()
        print("PARITY llama compile_level=1 graphs=True ERROR", flush=True)
        return False


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


def time_acb(model, prompts, new, **cfg) -> tuple[float, int, float, str]:
    """(seconds, steps, GPU idle ms per step, graphs note). The warm-up runs the whole
    workload with a few new tokens, so the graph buckets the timed run needs are mostly
    captured before the clock starts (the note counts captures during the timed run).
    GPU idle = wall time not covered by any step's span on the stream (start event to
    the event after the sampled ids' copy), per step."""
    async def run():
        engine = acb.Engine(model, config=acb.EngineConfig(max_memory_percent=0.3, **cfg))
        async with engine:
            runner = engine._runner
            await engine.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
            torch.cuda.synchronize()
            graphs = runner.decode_graphs
            g0 = len(graphs.graphs) if graphs else 0
            runner.measure_device_time = True
            runner.device_busy_ms = 0.0
            s0 = engine.stats().steps
            t = time.perf_counter()
            await engine.generate_batch(prompts, max_new_tokens=new, ignore_eos=True)
            dt = time.perf_counter() - t
            steps = engine.stats().steps - s0
            note = ""
            if graphs is not None:
                note = f"{len(graphs.graphs)} graphs (+{len(graphs.graphs) - g0} in run)"
                note += " CAPTURE FAILED" if graphs.failed else ""
            return dt, steps, (dt * 1e3 - runner.device_busy_ms) / max(steps, 1), note

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


SYSTEMS = (
    ("acb eager, async off", {"async_batching": False}),
    ("acb eager, async on", {}),
    ("acb graphs, async off", {"use_cuda_graph": True, "async_batching": False}),
    ("acb graphs, async on", {"use_cuda_graph": True}),
)


def timing() -> None:
    new = 64
    print(f"{'model':<10}{'requests':>9}{'system':>28}{'tok/s':>10}{'s':>8}{'steps':>7}{'idle ms/step':>14}  graphs")
    for shape in ("smollm2", "llama-1b"):
        model, vocab = make_model(shape)
        for n in (64, 256):
            prompts = workload(vocab, n)
            for label, cfg in SYSTEMS + (("transformers generate_batch", None),):
                if time.perf_counter() - T0 > BUDGET_S:
                    print(f"{shape:<10}{n:>9}{label:>28}  SKIPPED (time budget)", flush=True)
                    continue
                try:
                    if cfg is None:
                        dt, steps, idle, note = time_hf(model, prompts, new), None, None, ""
                    else:
                        dt, steps, idle, note = time_acb(model, prompts, new, **cfg)
                except Exception as e:
                    traceback.print_exc()
                    print(f"{shape:<10}{n:>9}{label:>28}  FAILED {e!r}", flush=True)
                    continue
                print(f"{shape:<10}{n:>9}{label:>28}{n * new / dt:>10.0f}{dt:>8.2f}{steps or '-':>7}"
                      f"{format(idle, '.2f') if idle is not None else '-':>14}  {note}", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    import transformers

    print("transformers", transformers.__version__, flush=True)
    ok = parity()
    from gpu_check_tp import tp_parity  # tensor_parallel_size=2: runs where there are 2 GPUs

    ok &= tp_parity()
    print(f"parity took {time.perf_counter() - T0:.0f} s", flush=True)
    timing()
    ok &= compile_parity()
    print(f"GPU CHECK {'PASSED' if ok else 'FAILED'} in {time.perf_counter() - T0:.0f} s")
    sys.exit(0 if ok else 1)
