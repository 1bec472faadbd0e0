"""One-shot GPU check (``bash benchmarks/gpu_check.sh``; no network needed):

1. the Triton kernels against the PyTorch reference on the device (the default suite's
   interpreter cases, at head dims 16, 64, 128 and 256);
2. greedy parity against transformers' generate per architecture (Llama, Qwen2/3,
   Mistral, Gemma 2/3; the Gemmas use the sliding layers' own page pool) x CUDA graphs
   on/off x async batching on/off, and CPU offload;
3. one bf16 timing table: acb eager / graphs / graphs + async against transformers'
   ``generate_batch`` (paged SDPA, with and without its own CUDA graphs), 64 and 256
   requests, SmolLM2's shape and a ~1.1B Llama shape (random weights from configs), with
   tok/s, ms per step, kernel-busy % (kernel time summed by torch.profiler over the
   timed window, divided by its wall time) and the host syncs counted in the timed window
   under ``torch.cuda.set_sync_debug_mode("warn")`` (acb's must be 0).

On a machine without CUDA it says so and exits 0, checking nothing. Timing rows that
would start after BUDGET_S are skipped (and say so), so the run ends inside the shell
script's limit. The table also goes to docs/logs/gpu_check-<date>.md and replaces the
one between the gpu-check markers in docs/performance.md.
"""

from __future__ import annotations

import asyncio
import datetime
import inspect
import os
import random
import re
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import acb  # noqa: E402
from acb.testing import ARCHITECTURES, random_prompts, reference_greedy, runner_of, tiny_model  # noqa: E402

DEV = os.environ.get("ACB_GPU_CHECK_DEVICE", "cuda")
BUDGET_S = float(os.environ.get("ACB_GPU_CHECK_BUDGET_S", "400"))
# narrower runs when device time is short: which parts, model shapes and request counts
_NARROWING = ("ACB_GPU_CHECK_PARTS", "ACB_GPU_CHECK_SHAPES", "ACB_GPU_CHECK_REQUESTS")
PARTS = os.environ.get("ACB_GPU_CHECK_PARTS", "kernels,parity,timing").split(",")
SHAPES = os.environ.get("ACB_GPU_CHECK_SHAPES", "smollm2,llama-1b").split(",")
REQUESTS = [int(n) for n in os.environ.get("ACB_GPU_CHECK_REQUESTS", "64,256").split(",")]
WHOLE = not any(os.environ.get(name) for name in _NARROWING)  # only a whole run's table is published
ROOT = os.path.join(os.path.dirname(__file__), "..")
T0 = time.perf_counter()


def kernel_parity() -> bool:
    from acb.testing import attention_cases as cases

    ok = True
    for name, check, params in (("decode", cases.check_decode, cases.DECODE_CASES),
                                ("prefill", cases.check_prefill, cases.PREFILL_CASES),
                                ("write", cases.check_write, [(dt,) for dt in cases.TOLERANCE])):
        worst, failures = 0.0, []
        for head_dim in (16, 64, 128, 256):
            for case in params:
                try:
                    worst = max(worst, check(*case, device=DEV, head_dim=head_dim))
                except Exception as e:  # noqa: BLE001 - report every failing case
                    failures.append(f"{case} d={head_dim}: {e!r}")
        torch.cuda.synchronize()
        print(f"KERNEL {name:8s} {'ok' if not failures else 'FAIL'} ({4 * len(params)} cases, max error {worst:.2e})",
              flush=True)
        for f in failures:
            print(f"    {f}", flush=True)
        ok &= not failures
    return ok


def parity() -> bool:
    ok_all = True
    runs = [(arch, a, g, False) for arch in ARCHITECTURES for g in (False, True) for a in (True, False)]
    # CPU offload on CUDA: pinned host pool, asynchronous copies on the runner's stream
    runs += [(arch, a, True, True) for arch in ("llama", "mistral", "gemma3") for a in (True, False)]
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
                if graphs else dict(use_cuda_graph=False)
            if offload:
                extra["cpu_offload_space"] = 0.01
            cfg = acb.EngineConfig(page_size=4, num_blocks=24, max_batch_tokens=24, max_requests_per_batch=8,
                                   safety_margin=0.0, async_batching=async_batching, **extra)

            async def run(model=model, cfg=cfg, prompts=prompts, max_new=max_new):
                async with acb.Engine(model, config=cfg) as engine:
                    hs = [engine.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, max_new)]
                    res = [await h for h in hs]
                    g = runner_of(engine).fast_paths.decode_graphs
                    return res, engine.stats(), (len(g.graphs), g.failed) if g is not None else None

            res, stats, graph_state = asyncio.run(run())
            bad = sum(r.token_ids != e for r, e in zip(res, expected))
            ok = bad == 0 and stats.free_blocks == stats.total_blocks
            note = f", backend={stats.attn_backend}"
            if graphs:
                hybrid = stats.sliding_total_blocks > 0  # graphs are not used for two page pools yet
                captured, failed = graph_state if graph_state else (0, not hybrid)
                ok &= (captured > 0 or hybrid) and not failed
                note += f", graphs captured={captured}{' CAPTURE FAILED' if failed else ''}"
                note += " (hybrid: eager)" if hybrid else ""
            if offload:
                ok &= stats.offloads == stats.preemptions == stats.restores and stats.recomputed_tokens == 0
                note += f", offloads={stats.offloads} restores={stats.restores} recomputed={stats.recomputed_tokens}"
            print(f"PARITY {arch:8s} async={async_batching!s:5s} graphs={graphs!s:5s} offload={offload!s:5s} "
                  f"{'ok' if ok else 'FAIL'} ({bad} of {len(prompts)} differ, preemptions={stats.preemptions}{note})",
                  flush=True)
            ok_all &= ok
        except Exception:
            traceback.print_exc()
            print(f"PARITY {arch} async={async_batching} graphs={graphs} offload={offload} ERROR", flush=True)
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


class Window:
    """The timed window: wall time, kernel time summed by torch.profiler (CUPTI), and the
    host syncs torch reports under ``set_sync_debug_mode("warn")`` (from any thread)."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        # the profiler starts before, and stops after, the sync check: its own syncs are not the engine's
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.__enter__()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self.sync_sites: list[str] = []
        self.harness_syncs = 0
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        self.t = time.perf_counter()
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None):
        """A sync's site: the innermost frame outside torch (torch's own Python, such as
        ``torch.cuda.synchronize``, says nothing about who called it), from any thread."""
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and not f.filename.endswith("warnings.py")]
        site = frames[-1] if frames else None
        if site and site.filename == __file__ and site.lineno in _WINDOW_LINES:
            # raised inside the window's own set-up (seen once per process, at its first
            # set_sync_debug_mode("warn"), before the engine runs): not the engine's
            self.harness_syncs += 1
            return
        self.sync_sites.append(f"{os.path.relpath(site.filename, ROOT)}:{site.lineno}" if site else
                               f"{filename}:{lineno}")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")  # first: the window's own sync is not counted
        torch.cuda.synchronize()
        self.wall = time.perf_counter() - self.t
        self._warnings.__exit__(*exc)
        self.prof.__exit__(*exc)
        self.syncs = len(self.sync_sites)
        self.sync_sites = sorted(set(self.sync_sites))
        self.kernel_s = sum(e.self_device_time_total for e in self.prof.key_averages()) / 1e6
        return False

    @property
    def busy(self) -> float:
        return 100.0 * self.kernel_s / self.wall


_source, _first = inspect.getsourcelines(Window)
_WINDOW_LINES = range(_first, _first + len(_source))

def time_acb(model, prompts, warmup, new, **cfg) -> tuple[float, int, Window, str]:
    """(seconds, steps, window, note). The warm-up runs a workload of the same shape
    (other prompts: prefix caching is off, as the timed prompts must not hit the cache),
    so Triton's compilation and the graph buckets the timed run needs are done before
    the clock starts; the note counts captures during the timed run (each syncs)."""
    async def run():
        config = acb.EngineConfig(max_memory_percent=0.3, allow_prefix_sharing=False, **cfg)
        async with acb.Engine(model, config=config) as engine:
            runner = runner_of(engine)
            await engine.generate_batch(warmup, max_new_tokens=new, ignore_eos=True)
            graphs = runner.fast_paths.decode_graphs
            g0 = len(graphs.graphs) if graphs else 0
            s0 = engine.stats().steps
            with Window() as window:
                await engine.generate_batch(prompts, max_new_tokens=new, ignore_eos=True)
            steps = engine.stats().steps - s0
            note = f"backend={engine.stats().attn_backend}"
            if window.syncs:
                note += f", syncs at {' '.join(window.sync_sites)}"
            if window.harness_syncs:
                note += f", {window.harness_syncs} sync in the window's own set-up (not counted)"
            if graphs is not None:
                note += f", {len(graphs.graphs)} graphs (+{len(graphs.graphs) - g0} in run)"
                note += " CAPTURE FAILED" if graphs.failed else ""
            return window.wall, steps, window, note

    wall, steps, window, note = asyncio.run(run())
    return wall, steps, window, note + f", {allocated_gib()} after close"


def allocated_gib() -> str:
    """GPU memory still allocated by PyTorch after a system's run (the model's weights and
    nothing else, if the engine gave its KV pages and graphs back)."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    return f"{torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated"


def time_hf(model, prompts, new, cuda_graph: bool) -> tuple[float, Window]:
    from transformers import GenerationConfig

    model.config._attn_implementation = "sdpa"
    kwargs = {}
    try:
        from transformers import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(use_cuda_graph=cuda_graph)
    except ImportError:
        if cuda_graph:
            raise
    gen = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:8], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0), **kwargs)
    with Window() as window:
        model.generate_batch(inputs=prompts, generation_config=gen, **kwargs)
    return window.wall, window


SYSTEMS = (
    ("acb eager", {"use_cuda_graph": False, "async_batching": False}),
    ("acb graphs", {"use_cuda_graph": True, "async_batching": False}),
    ("acb graphs+async", {"use_cuda_graph": True, "async_batching": True}),
    ("transformers generate_batch", False),
    ("transformers generate_batch+graphs", True),
)
HEADER = "| model | requests | system | tok/s | s | steps | ms/step | kernel busy | host syncs | notes |"


def timing() -> tuple[bool, list[str]]:
    new = 64
    ok = True
    rows = [HEADER, "|" + "---|" * 10]
    print(HEADER, flush=True)
    for shape in SHAPES:
        model, vocab = make_model(shape)
        print(f"{shape}: weights {allocated_gib()}", flush=True)
        for n in REQUESTS:
            prompts, warmup = workload(vocab, n), workload(vocab, n, seed=1)
            best = {}
            for label, cfg in SYSTEMS:
                if time.perf_counter() - T0 > BUDGET_S:
                    line = f"| {shape} | {n} | {label} | SKIPPED (time budget) |"
                else:
                    try:
                        if isinstance(cfg, bool):
                            dt, window = time_hf(model, prompts, new, cfg)
                            steps, note = None, allocated_gib() + " after"
                        else:
                            dt, steps, window, note = time_acb(model, prompts, warmup, new, **cfg)
                            ok &= window.syncs == 0 or "in run)" in note and "(+0 in run)" not in note
                        best[label.split()[0]] = max(best.get(label.split()[0], 0.0), n * new / dt)
                        ms = f"{dt * 1e3 / steps:.2f}" if steps else "-"
                        line = (f"| {shape} | {n} | {label} | {n * new / dt:.0f} | {dt:.2f} | {steps or '-'} | {ms} | "
                                f"{window.busy:.0f} % | {window.syncs} | {note} |")
                    except Exception as e:
                        traceback.print_exc()
                        line = f"| {shape} | {n} | {label} | FAILED {e!r} |"
                print(line, flush=True)
                rows.append(line)
            if best.get("acb") and best.get("transformers"):
                ratio = f"| {shape} | {n} | best acb / best transformers | {best['acb'] / best['transformers']:.2f}x |"
                print(ratio, flush=True)
                rows.append(ratio)
        del model
        torch.cuda.empty_cache()
    return ok, rows


def publish(rows: list[str]) -> None:
    """The table into docs/logs/gpu_check-<date>.md and docs/performance.md (between the
    gpu-check markers), and both into $OUT when set (the device runner's output folder)."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    body = "\n".join([f"GPU check of {stamp} on {device} (`bash benchmarks/gpu_check.sh`):", "", *rows])
    logs = os.path.join(ROOT, "docs", "logs")
    os.makedirs(logs, exist_ok=True)
    table_path = os.path.join(logs, f"gpu_check-{stamp[:10]}.md")
    with open(table_path, "w") as f:
        f.write(body + "\n")
    perf = os.path.join(ROOT, "docs", "performance.md")
    with open(perf) as f:
        text = f.read()
    start, end = "<!-- gpu-check:start -->", "<!-- gpu-check:end -->"
    if start in text and end in text:
        text = re.sub(f"{start}.*?{end}", lambda _: f"{start}\n{body}\n{end}", text, flags=re.S)
        with open(perf, "w") as f:
            f.write(text)
    out = os.environ.get("OUT")
    if out:
        for path in (table_path, perf):
            with open(path) as src, open(os.path.join(out, os.path.basename(path)), "w") as dst:
                dst.write(src.read())


def main() -> int:
    if DEV == "cuda" and not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        print(f"gpu_check: no CUDA device ({why}; torch {torch.__version__}): nothing checked", flush=True)
        return 0
    import transformers

    print(torch.__version__, torch.cuda.get_device_name(0), "transformers", transformers.__version__, flush=True)
    ok = True
    if "kernels" in PARTS:
        ok &= kernel_parity()
    if "parity" in PARTS:
        ok &= parity()
        from gpu_check_tp import tp_parity  # tensor_parallel_size=2: runs where there are 2 GPUs

        ok &= tp_parity()
    print(f"parity took {time.perf_counter() - T0:.0f} s", flush=True)
    if "timing" in PARTS:
        timing_ok, rows = timing()
        ok &= timing_ok
        if WHOLE:
            publish(rows)
    print(f"GPU CHECK {'PASSED' if ok else 'FAILED'} in {time.perf_counter() - T0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
