"""One function per system under test. Each runs in its own process (see bench.py),
takes a Workload, and returns its measurements as a dict."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shapes import checkpoint, model_dir
from workloads import Workload

SHAPE = "smollm2"  # bench.py --shape: which model the systems run (shapes.py)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarize(name: str, w: Workload, elapsed: float, generated: int, ttft: list[float], itl: list[float],
              extra: dict | None = None) -> dict:
    out = {
        "system": name, "workload": w.name, "requests": len(w.prompts), "prompt_tokens": w.prompt_tokens,
        "generated_tokens": generated, "elapsed_s": elapsed, "tok_per_s": generated / elapsed,
        "req_per_s": len(w.prompts) / elapsed,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99), "peak_rss_gib": peak_rss_gib(),
        # every sample, for the distribution plots (benchmarks/plots.py)
        "ttft_samples_s": [round(t, 5) for t in ttft], "itl_samples_s": [round(t, 5) for t in itl],
    }
    out.update(extra or {})
    return out


SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def load_model():
    """The benchmark's model (SmolLM2, or ``--shape``'s) in float32, and its tokenizer."""
    from acb.model.loading import load

    return load(*checkpoint(SHAPE))


# ---------------------------------------------------------------------------- acb
class LagTicker:
    """Measures event-loop lag: how late a 5 ms sleep wakes up."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.period)
            self.lags.append(max(0.0, loop.time() - t - self.period))

    def __enter__(self) -> LagTicker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


def run_acb(w: Workload, config_kwargs: dict | None = None, dtype: str | None = None,
            quantization: str | None = None) -> dict:
    """acb over SmolLM2 (or ``--shape``'s model) in ``dtype`` (None: what ``Engine.from_pretrained`` picks
    here by default); ``quantization="int8"``: the GGUF file read straight into int8 (acb.model.gguf_int8),
    a folder quantized after loading, either saved once and read back (acb.model.int8_cache)."""
    import acb
    from acb.core.progress import BatchProgress
    from acb.model.int8_weights import weight_bytes
    from acb.model.loading import default_dtype, load

    config = acb.EngineConfig(**(config_kwargs or {}))
    requested = config.dtype or dtype
    dtype = requested or default_dtype("cpu")
    config = dataclasses.replace(config, dtype=dtype, quantization=quantization or config.quantization)
    # loaded in the dtype it runs in, as Engine.from_pretrained does (not float32 and then cast:
    # that would put the float32 copy into the peak RSS reported)
    t_load = time.perf_counter()
    model, tok = load(*checkpoint(SHAPE), dtype=dtype, quantization=config.quantization)
    load_s = time.perf_counter() - t_load
    name = f"acb_{config.quantization + '_' if config.quantization else ''}{SHORT[dtype]}" + \
        ("_kv8" if config.kv_cache_dtype == "int8" else "") + ("" if requested else "_default")

    async def main() -> dict:
        engine = acb.Engine(model, tokenizer=tok, config=config)
        async with engine:
            # warm-up at full size: one pass over every prompt length class, short outputs
            await engine.generate_batch(w.prompts, max_new_tokens=2, ignore_eos=True)
            engine.kv.evict_all_cached()  # the timed run starts with a cold prefix cache
            ttft: list[float] = []
            itl: list[float] = []
            counts = []
            arrivals = w.arrivals()

            async def one(i: int, prompt: list[int]) -> None:
                await asyncio.sleep(arrivals[i])
                start = last = time.perf_counter()
                n = 0
                async for chunk in engine.stream(prompt, max_new_tokens=w.max_new_tokens, ignore_eos=True):
                    now = time.perf_counter()
                    if n == 0:
                        ttft.append(now - start)
                    elif chunk.token_ids:
                        itl.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
                    n += len(chunk.token_ids)
                    last = now
                counts.append(n)
                bar.add(n)

            steps0 = engine.stats().steps
            bar = BatchProgress(len(w.prompts), desc="acb")
            with LagTicker() as ticker, bar:
                t0 = time.perf_counter()
                await asyncio.gather(*(one(i, p) for i, p in enumerate(w.prompts)))
                elapsed = time.perf_counter() - t0
            s = engine.stats()
            lags = ticker.lags
            return summarize(name, w, elapsed, sum(counts), ttft, itl, {
                "loop_lag_p50_ms": 1e3 * pct(lags, 50), "loop_lag_p99_ms": 1e3 * pct(lags, 99),
                "loop_lag_max_ms": 1e3 * max(lags), "steps": s.steps - steps0,
                "prefix_hit_rate": s.prefix_hit_rate, "preemptions": s.preemptions,
                "max_batch_tokens": s.max_batch_tokens, "total_blocks": s.total_blocks,
                "dtype": s.dtype, "forward_path": s.forward_path, "quantization": s.quantization,
                "kv_cache_dtype": config.kv_cache_dtype or s.dtype,
                "weight_mib": weight_bytes(engine.model) / 2**20, "load_s": load_s, "shape": SHAPE,
            })

    try:
        import uvloop

        return uvloop.run(main())
    except ImportError:
        return asyncio.run(main())


# ---------------------------------------------------------------------------- transformers
def run_hf_generate_batch(w: Workload) -> dict:
    """transformers' own continuous batching (``generate_batch``) with its defaults."""
    from transformers import GenerationConfig

    model, tok = load_model()
    model.config._attn_implementation = "sdpa"
    gen = GenerationConfig(max_new_tokens=w.max_new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=tok.pad_token_id or 0)
    model.generate_batch(inputs=w.prompts[:2], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=tok.pad_token_id or 0))
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=w.prompts, generation_config=gen, record_timestamps=True)
    elapsed = time.perf_counter() - t0
    ttft, itl, generated = [], [], 0
    for o in out.values():
        generated += len(o.generated_tokens)
        ts = o.timestamps or []
        if ts:
            ttft.append(ts[0] - t0 if ts[0] > t0 - 1 else ts[0] - o.created_time)
            itl.extend(b - a for a, b in zip(ts, ts[1:]))
    return summarize("hf_generate_batch", w, elapsed, generated, ttft, itl)


def run_hf_generate(w: Workload, batch_size: int = 8, sort: bool = True) -> dict:
    """transformers ``generate`` in static, left-padded batches (sorted by length)."""
    import torch
    from tqdm import tqdm
    from transformers.generation.streamers import BaseStreamer

    model, tok = load_model()
    model.config._attn_implementation = "sdpa"
    order = sorted(range(len(w.prompts)), key=lambda i: len(w.prompts[i])) if sort else list(range(len(w.prompts)))

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def run_batch(batch: list[list[int]], clock=None) -> int:
        n = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (n - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=w.max_new_tokens, do_sample=False,
                                 min_new_tokens=w.max_new_tokens, pad_token_id=pad, streamer=clock)
        return (out.shape[1] - n) * len(batch)

    run_batch([w.prompts[order[0]]] * 2)  # warm-up
    ttft, itl, generated = [], [], 0
    t0 = time.perf_counter()
    for b in tqdm(range(0, len(order), batch_size), desc=f"hf_generate (batches of {batch_size})", unit="batch"):
        clock = Clock()
        generated += run_batch([w.prompts[i] for i in order[b : b + batch_size]], clock)
        # put() #0 is the prompt, #1 the first new tokens; every request waited since t0
        ttft.extend([clock.times[1] - t0] * len(order[b : b + batch_size]))
        itl.extend(b2 - a for a, b2 in zip(clock.times[1:], clock.times[2:]))
    elapsed = time.perf_counter() - t0
    return summarize(f"hf_generate_bs{batch_size}{'_sorted' if sort else ''}", w, elapsed, generated, ttft, itl)


# ---------------------------------------------------------------------------- vLLM
VLLM_SCRIPT = r'''
import json, sys, time, resource
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    llm = LLM(model=spec["model_dir"], tokenizer=spec["model_dir"], dtype=spec["dtype"], max_model_len=1024,
              enforce_eager=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    sp = SamplingParams(max_tokens=spec["max_new_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm up at full size
    # The timed run starts with a cold prefix cache, as acb's does: otherwise every prompt
    # would hit the pages the warm-up left and its prefill would be skipped.
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ttft = []
    for o in outs:
        m = getattr(o, "metrics", None)
        if m is not None and getattr(m, "first_token_time", None) and getattr(m, "arrival_time", None):
            ttft.append(m.first_token_time - m.arrival_time)
    json.dump({"elapsed_s": elapsed, "generated": sum(len(o.outputs[0].token_ids) for o in outs),
               "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
               "ttft": ttft, "tokens": [list(o.outputs[0].token_ids) for o in outs],
               "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20},
              open(spec["out"], "w"))
'''


def run_vllm(w: Workload, venv: str, dtype: str = "auto") -> dict:
    """vLLM's CPU engine, run by the venv's own python as a subprocess (never imported here).
    ``dtype="auto"`` is what ``vllm serve`` runs by default: on x86 CPUs it downcasts a
    float32 checkpoint to bfloat16."""
    py = Path(venv) / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"model_dir": model_dir(SHAPE), "prompts": w.prompts, "max_new_tokens": w.max_new_tokens,
                "out": os.path.join(tmp, "out.json"), "dtype": dtype}
        Path(tmp, "spec.json").write_text(json.dumps(spec))
        Path(tmp, "run.py").write_text(VLLM_SCRIPT)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                   VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"))
        subprocess.run([str(py), os.path.join(tmp, "run.py"), os.path.join(tmp, "spec.json")], env=env,
                       check=True, stdout=sys.stderr)
        res = json.loads(Path(spec["out"]).read_text())
    ran = res.get("dtype", dtype)
    out = summarize(f"vllm_cpu_{SHORT.get(ran, ran)}" + ("_default" if dtype == "auto" else ""), w, res["elapsed_s"],
                    res["generated"], res["ttft"], [])
    out["dtype"] = ran
    out["peak_rss_gib"] = res["peak_rss_gib"]
    out["tokens_sha"] = hash(json.dumps(res["tokens"]))
    return out
