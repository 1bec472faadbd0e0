"""Every behaviour API.md promises, through the public names only, on asyncio,
uvloop and trio (anyio's pytest plugin runs each coroutine test on every backend)."""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import os
import shutil
import tempfile

import anyio
import pytest
import torch

import acb
from acb.engine.settings import inactive_settings
from acb.testing import reference_greedy, runner_of, speculate_always, step_counts, tiny_engine, tiny_model

PROMPT = [5, 17, 33, 60, 91, 120]


pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", params=[
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
])
def anyio_backend(request):
    """Every API behaviour here is checked on asyncio's default loop, on uvloop and on trio."""
    return request.param


async def _wait_until(pred, timeout=10.0):
    deadline = anyio.current_time() + timeout
    while not pred():
        assert anyio.current_time() < deadline, "condition not reached"
        await anyio.sleep(0.001)


def _all_pages_free(engine: acb.Engine) -> bool:
    s = engine.stats()
    return s.free_blocks == s.total_blocks and s.running == 0 and s.waiting == 0


# ----------------------------------------------------------------- prompts and outputs
async def test_text_prompt_streams_chunks_whose_text_joins_to_the_completion():
    async with tiny_engine() as engine:
        chunks = [c async for c in engine.stream("hello world", max_new_tokens=12, ignore_eos=True)]
        assert chunks[-1].finish_reason == "length"
        assert all(c.finish_reason is None for c in chunks[:-1])
        ids = [t for c in chunks for t in c.token_ids]
        assert len(ids) == 12
        text = "".join(c.text for c in chunks)
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)


async def test_chat_prompt_uses_the_chat_template():
    async with tiny_engine() as engine:
        msgs = [{"role": "user", "content": "hi"}]
        done = await engine.generate(msgs, max_new_tokens=4, ignore_eos=True)
        templ = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        templ = templ["input_ids"] if hasattr(templ, "keys") else templ
        assert done.prompt_token_ids == list(templ)


async def test_generate_returns_completion_with_metrics():
    async with tiny_engine() as engine:
        done = await engine.generate(PROMPT, max_new_tokens=5, ignore_eos=True)
    assert isinstance(done, acb.Completion)
    assert done.prompt_token_ids == PROMPT and len(done.token_ids) == 5
    m = done.metrics
    assert m.num_prompt_tokens == len(PROMPT) and m.num_generated_tokens == 5
    assert 0 <= m.ttft_s <= m.latency_s
    assert m.num_cached_prompt_tokens == 0


async def test_generate_batch_returns_results_in_input_order():
    model = tiny_model()
    prompts = [[200, 3, 4], [4, 5, 6, 7, 8, 9], [100], [4, 5, 6, 7, 8]]
    expected = [reference_greedy(model, p, 6) for p in prompts]
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=4)) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
    assert [r.prompt_token_ids for r in results] == prompts
    assert [r.token_ids for r in results] == expected


async def test_logprobs_one_per_token_when_asked():
    async with tiny_engine() as engine:
        chunks = [c async for c in engine.stream(PROMPT, max_new_tokens=6, logprobs=True, ignore_eos=True)]
        done = await engine.generate(PROMPT, max_new_tokens=6, logprobs=True, ignore_eos=True)
        plain = await engine.generate(PROMPT, max_new_tokens=2, ignore_eos=True)
    lps = [lp for c in chunks for lp in c.logprobs]
    assert len(lps) == 6 and all(lp <= 0 for lp in lps)
    assert done.logprobs == pytest.approx(lps, abs=1e-4)
    assert plain.logprobs is None


async def test_sampling_params_object_and_keyword_override():
    params = acb.SamplingParams(max_new_tokens=3, ignore_eos=True)
    async with tiny_engine(sampling=acb.SamplingParams(max_new_tokens=2, ignore_eos=True)) as engine:
        assert len((await engine.generate(PROMPT)).token_ids) == 2  # engine default
        assert len((await engine.generate(PROMPT, sampling=params)).token_ids) == 3
        assert len((await engine.generate(PROMPT, sampling=params, max_new_tokens=5)).token_ids) == 5


async def test_stop_token_ids_and_stop_strings():
    async with tiny_engine() as engine:
        free = await engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
        stop_id = free.token_ids[4]
        first = free.token_ids.index(stop_id)
        by_id = await engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
        assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish_reason == "stop"
        needle = free.text[5:8]
        assert needle, "reference text too short"
        by_str = await engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True, stop=[needle])
        assert by_str.finish_reason == "stop"
        assert by_str.text == free.text[: free.text.index(needle)]


async def test_submit_handle_streams_and_awaits():
    async with tiny_engine() as engine:
        handle = engine.submit(PROMPT, max_new_tokens=5, ignore_eos=True, request_id="mine")
        assert handle.request_id == "mine"
        chunks = [c async for c in handle]
        done = await handle
        assert [t for c in chunks for t in c.token_ids] == done.token_ids
        assert all(c.request_id == "mine" for c in chunks)


async def test_slow_consumer_gets_every_token_merged():
    async with tiny_engine() as engine:
        fast = await engine.generate(PROMPT, max_new_tokens=30, ignore_eos=True)
        stream = engine.stream(PROMPT, max_new_tokens=30, ignore_eos=True)
        other = engine.generate([9, 9, 9], max_new_tokens=30, ignore_eos=True)
        await other  # the engine ran all steps while nobody read the stream
        chunks = [c async for c in stream]
    assert len(chunks) < 30  # merged
    assert [t for c in chunks for t in c.token_ids] == fast.token_ids
    assert "".join(c.text for c in chunks) == fast.text


# ----------------------------------------------------------------- bad input
BAD_INPUTS = [  # (prompt, keywords, what the error names)
    ("", {}, "empty"),
    ([], {}, "empty"),
    ([1, 2, 10_000], {}, "vocabulary"),
    ([1, -1], {}, "vocabulary"),
    ([1, "a"], {}, "ints"),
    (123, {}, "prompt"),
    (PROMPT, {"temperature": -1.0}, "temperature"),
    (PROMPT, {"temperature": float("nan")}, "temperature"),
    (PROMPT, {"top_p": 0.0}, "top_p"),
    (PROMPT, {"top_p": 1.5}, "top_p"),
    (PROMPT, {"top_k": -2}, "top_k"),
    (PROMPT, {"max_new_tokens": 0}, "max_new_tokens"),
    (PROMPT, {"max_new_tokens": 10**7}, "max_new_tokens"),
    (PROMPT, {"seed": -5}, "seed"),
    (PROMPT, {"bogus": 1}, "bogus"),
    (PROMPT, {"stop": [""]}, "stop"),
]


async def test_bad_input_raises_invalid_request_and_engine_keeps_serving():
    """Each bad input refused by submit, stream, generate and generate_batch, naming what was wrong,
    while one request runs on to its end and every page comes back (one engine for all the cases)."""
    async with tiny_engine() as engine:
        running = engine.submit(PROMPT, max_new_tokens=200, ignore_eos=True)  # runs through the cases
        for prompt, kwargs, field in BAD_INPUTS:
            for call in (engine.submit, engine.stream):
                with pytest.raises(acb.InvalidRequestError, match=field):
                    call(prompt, **kwargs)
            with pytest.raises(acb.InvalidRequestError, match=field):
                await engine.generate(prompt, **kwargs)
            with pytest.raises(acb.InvalidRequestError, match=field):
                await engine.generate_batch([PROMPT, prompt], **kwargs)
        done = await running
        assert len(done.token_ids) == 200
        assert _all_pages_free(engine)


async def test_invalid_request_error_is_a_value_error():
    assert issubclass(acb.InvalidRequestError, ValueError)
    assert issubclass(acb.InvalidRequestError, acb.AcbError)


async def test_duplicate_live_request_id_is_rejected():
    async with tiny_engine() as engine:
        h = engine.submit(PROMPT, request_id="dup", max_new_tokens=30, ignore_eos=True)
        with pytest.raises(acb.InvalidRequestError, match="dup"):
            engine.submit(PROMPT, request_id="dup")
        await h
        await engine.generate(PROMPT, request_id="dup", max_new_tokens=2)  # free again once finished


def test_engine_config_validates_fields_by_name():
    for field, value in [("page_size", 2), ("num_blocks", 0), ("scheduler", "lifo"), ("max_memory_percent", 0),
                         ("safety_margin", 1.5), ("compile_level", 4), ("attn_backend", "magic"),
                         ("max_batch_tokens", -1), ("dtype", "int8")]:
        with pytest.raises(ValueError, match=field):
            acb.EngineConfig(**{field: value})


# ----------------------------------------------------------------- lifecycle
async def test_submitting_before_start_raises_stopped():
    engine = tiny_engine()
    with pytest.raises(acb.EngineStoppedError):
        engine.submit(PROMPT)
    with pytest.raises(acb.EngineStoppedError):
        await engine.generate(PROMPT)


async def test_graceful_stop_drains_then_restart_serves():
    engine = tiny_engine()
    await engine.start()
    handles = [engine.submit(PROMPT, max_new_tokens=10, ignore_eos=True) for _ in range(4)]
    await engine.stop()
    for h in handles:
        assert len((await h).token_ids) == 10
    with pytest.raises(acb.EngineStoppedError):
        engine.submit(PROMPT)
    await engine.start()
    assert len((await engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True)).token_ids) == 3
    await engine.aclose()


async def test_hard_stop_fails_unfinished_iterators_with_engine_stopped():
    engine = tiny_engine()
    await engine.start()
    stream = engine.stream(PROMPT, max_new_tokens=500, ignore_eos=True)
    handle = engine.submit(PROMPT, max_new_tokens=500, ignore_eos=True)
    await stream.__anext__()
    await engine.stop(hard=True)
    with pytest.raises(acb.EngineStoppedError):
        async for _ in stream:
            pass
    with pytest.raises(acb.EngineStoppedError):
        await handle
    assert _all_pages_free(engine)
    await engine.start()  # restart after a hard stop
    assert len((await engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True)).token_ids) == 3
    await engine.aclose()


async def test_closed_engine_raises_closed_everywhere():
    engine = tiny_engine()
    async with engine:
        pass
    with pytest.raises(acb.EngineClosedError):
        engine.submit(PROMPT)
    with pytest.raises(acb.EngineClosedError):
        await engine.start()
    with pytest.raises(acb.EngineClosedError):
        await engine.generate_batch([PROMPT])
    assert issubclass(acb.EngineClosedError, acb.AcbError)


# ----------------------------------------------------------------- cancellation
async def test_cancel_by_break_frees_pages_and_leaves_others_intact():
    model = tiny_model()
    expected = reference_greedy(model, [7, 8, 9], 40)
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=64, page_size=4)) as engine:
        other = engine.submit([7, 8, 9], max_new_tokens=40, ignore_eos=True)
        got = 0
        async for chunk in engine.stream(PROMPT, max_new_tokens=200, ignore_eos=True):
            got += len(chunk.token_ids)
            if got >= 3:
                break
        await _wait_until(lambda: engine.stats().running == 1)
        assert (await other).token_ids == expected
        assert _all_pages_free(engine)


async def test_cancel_by_task_cancellation():
    """Cancelling the consuming task (an anyio cancel scope: task.cancel() on asyncio,
    trio's own cancellation on trio) cancels its request: streaming or awaiting."""
    async with tiny_engine() as engine:
        started = anyio.Event()

        async def consume():
            async for _ in engine.stream(PROMPT, max_new_tokens=400, ignore_eos=True):
                started.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await started.wait()
            tg.cancel_scope.cancel()
        await _wait_until(lambda: _all_pages_free(engine))

        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(engine.generate, PROMPT, max_new_tokens=400, ignore_eos=True))
            await _wait_until(lambda: engine.stats().running == 1)
            tg.cancel_scope.cancel()
        await _wait_until(lambda: _all_pages_free(engine))

        batch = [PROMPT, [7, 8, 9]]
        with anyio.move_on_after(0.05) as scope:  # a deadline cancels a whole batch
            await engine.generate_batch(batch, max_new_tokens=1000, ignore_eos=True)
        assert scope.cancelled_caught
        await _wait_until(lambda: _all_pages_free(engine))


@pytest.mark.parametrize("anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})],
                         ids=["asyncio", "uvloop"])
async def test_cancel_by_asyncio_task_cancel():
    """asyncio's own ``task.cancel()`` on a task that streams or awaits (trio has no
    task objects: test_cancel_by_task_cancellation covers its cancel scopes)."""
    async with tiny_engine() as engine:
        started = asyncio.Event()

        async def consume():
            async for _ in engine.stream(PROMPT, max_new_tokens=400, ignore_eos=True):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_until(lambda: _all_pages_free(engine))

        gen_task = asyncio.create_task(engine.generate(PROMPT, max_new_tokens=400, ignore_eos=True))
        await _wait_until(lambda: engine.stats().running == 1)
        gen_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gen_task
        await _wait_until(lambda: _all_pages_free(engine))


async def test_cancel_by_handle_and_by_id_returns_partial_completion():
    async with tiny_engine() as engine:
        for how in ("handle", "id"):
            handle = engine.submit(PROMPT, max_new_tokens=400, ignore_eos=True)
            chunks = []
            async for chunk in handle:
                chunks.append(chunk)
                if len(chunks) == 2:
                    assert (handle.cancel() if how == "handle" else engine.cancel(handle.request_id))
            assert chunks[-1].finish_reason == "cancelled"
            done = await handle
            assert done.finish_reason == "cancelled"
            assert done.token_ids == [t for c in chunks for t in c.token_ids]
            assert 0 < len(done.token_ids) < 400
            assert _all_pages_free(engine)
        assert engine.cancel("no-such-request") is False
        assert handle.cancel() is False  # already ended


async def test_stats_fields():
    async with tiny_engine() as engine:
        await engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
        s = engine.stats()
    for name in ("running", "waiting", "total_blocks", "free_blocks", "cached_blocks",
                 "prefix_hit_rate", "steps", "generated_tokens", "preemptions"):
        assert hasattr(s, name)
    assert s.generated_tokens == 4 and s.steps >= 4 and s.total_blocks == 256


def test_sync_generate_batch_without_event_loop():
    model = tiny_model()
    expected = reference_greedy(model, PROMPT, 5)
    results = acb.generate_batch(model, [PROMPT, [3, 4]], max_new_tokens=5, ignore_eos=True,
                                 config=acb.EngineConfig(num_blocks=32))
    assert results[0].token_ids == expected and len(results[1].token_ids) == 5


async def test_invalid_request_error_names_its_field():
    async with tiny_engine() as engine:
        for kwargs, param in [({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"), ({"bogus": 1}, "bogus"),
                              ({"max_new_tokens": 10**7}, "max_new_tokens"), ({"stop": [""]}, "stop")]:
            with pytest.raises(acb.InvalidRequestError) as info:
                engine.submit(PROMPT, **kwargs)
            assert info.value.param == param
        with pytest.raises(acb.InvalidRequestError) as info:
            engine.submit([10**6])
        assert info.value.param == "prompt"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_runs_as_a_plain_anyio_program(backend):
    async def main():
        async with tiny_engine() as engine:
            async with anyio.create_task_group() as tg:
                results = {}

                async def one(i):
                    results[i] = (await engine.generate([5 + i, 6, 7], max_new_tokens=4, ignore_eos=True)).token_ids

                for i in range(4):
                    tg.start_soon(one, i)
            return results

    results = anyio.run(main, backend=backend)
    assert sorted(results) == [0, 1, 2, 3] and all(len(v) == 4 for v in results.values())


def _counting_integrity_checks(engine):
    """Count the cache checks the engine runs (debug_checks: each time the loop goes idle)."""
    calls = []
    check = engine.kv.check_integrity
    engine.kv.check_integrity = lambda tables: (calls.append(1), check(tables))
    return calls


def _refuses_or_moves(overrides):
    if torch.cuda.is_available():
        engine = tiny_engine(num_blocks=16, **overrides)
        return next(engine.model.parameters()).device.type == "cuda"
    with pytest.raises(ValueError, match="EngineConfig.device"):
        tiny_engine(num_blocks=16, **overrides)
    return True


async def _steps_to_prefill(engine, n: int) -> bool:
    """A prompt of ``n`` tokens takes two steps to prefill (chunks of max_batch_tokens=300;
    the default budget takes it in one)."""
    before = engine.stats().steps
    await engine.generate([3 + i % 250 for i in range(n)], max_new_tokens=1)
    return engine.stats().steps - before == 2


def _admitted_before_overload(engine) -> int:
    """How many requests queue (submitted in one go, none scheduled yet) before the next
    is refused as overload."""
    handles = []
    try:
        while len(handles) < 100:
            handles.append(engine.submit(PROMPT, max_new_tokens=1))
    except acb.EngineOverloadedError:
        return len(handles)
    finally:
        for h in handles:
            h.cancel()
    return -1


def _planned(name: str, overrides: dict) -> bool:
    """The setting changes how the engine's own scheduler plans (on an engine not started,
    its scheduler driven by hand): against the default, the same requests are planned
    differently."""
    from acb.core.scheduler import Sequence
    from acb.core.step import StepOutput

    def first_rows(**fields):
        scheduler = tiny_engine(num_blocks=12, page_size=4, max_batch_tokens=16, **fields).scheduler
        scheduler.add(Sequence("r0", list(range(3, 19)), 8, arrival=0))  # 4 pages, and a 5th for its decode: 7 left
        plan = scheduler.schedule()
        scheduler.update(plan, StepOutput([7] * plan.num_sampled, None))
        scheduler.add(Sequence("r1", list(range(40, 56)), 8, arrival=1))  # 4 more pages: 3 left
        return [(seq.seq_id, n) for seq, _, n, _, _ in scheduler.schedule().rows()]

    default = first_rows()
    assert default == [("r0", 1), ("r1", 15)], default  # fifo: the decode first, the prefill fills the budget
    changed = first_rows(**overrides)
    if name == "scheduler":  # prefill_first: the new prompt's whole chunk first, the decode after it
        return changed == [("r1", 16)]
    return changed == [("r0", 1)]  # safety_margin=0.3: r1 would leave 3 of 12 pages free (< 3.6; default 0.15: 1.8)


_FAULTS: list = []
_KV_DISK = os.path.join(tempfile.gettempdir(), f"acb-test-api-kv-disk-{os.getpid()}")  # made by the engine
atexit.register(shutil.rmtree, _KV_DISK, True)
# field -> (a non-default value, whether an engine over a tiny model on the CPU shows its effect);
# None: the field acts elsewhere only and inactive_settings() names it on the CPU; a string:
# the test that exercises it (it needs other processes)
_EFFECTS = {
    "page_size": ({"page_size": 8}, lambda e: e.page_size == 8 and e.stats().page_size == 8),
    "num_blocks": ({"num_blocks": 40}, lambda e: e.stats().total_blocks == 40),
    "max_memory_percent": ({"max_memory_percent": 0.0001, "num_blocks": None},
                           lambda e: e.num_pages < tiny_engine(num_blocks=None, max_memory_percent=0.001).num_pages),
    "max_batch_tokens": ({"max_batch_tokens": 300}, lambda e: _steps_to_prefill(e, 400)),
    "max_requests_per_batch": ({"max_requests_per_batch": 3}, lambda e: e.scheduler.max_requests == 3),
    "scheduler": ({"scheduler": "prefill_first"}, "planned"),
    "safety_margin": ({"safety_margin": 0.3}, "planned"),
    "allow_prefix_sharing": ({"allow_prefix_sharing": False}, lambda e: not e.kv.enable_prefix_caching),
    "cpu_offload_space": ({"cpu_offload_space": 0.01}, lambda e: e.stats().host_blocks > 0),
    # (the tier's own behaviour: tests/test_kv_disk.py)
    "kv_disk_path": ({"kv_disk_path": _KV_DISK}, lambda e: e.kv.disk is not None),
    "kv_disk_space": ({"kv_disk_path": _KV_DISK, "kv_disk_space": 0.5}, lambda e: e.kv.disk.space == 2**29),
    "use_cuda_graph": ({"use_cuda_graph": True}, None),
    "q_padding_interval_size": ({"q_padding_interval_size": 8}, None),
    "kv_padding_interval_size": ({"kv_padding_interval_size": 64}, None),
    "async_batching": ({"async_batching": False}, lambda e: step_counts(e).carried == 0),
    "compile_level": ({"compile_level": 1}, lambda e: runner_of(e).fast_paths.decode_forward is not e.model),
    "varlen_compile_level": ({"varlen_compile_level": 1},
                             lambda e: runner_of(e).fast_paths.varlen_forward is not e.model
                             and runner_of(e).fast_paths.decode_forward is e.model),
    "decode_compile_level": ({"decode_compile_level": 1},
                             lambda e: runner_of(e).fast_paths.decode_forward is not e.model
                             and runner_of(e).fast_paths.varlen_forward is e.model),
    "max_blocks_per_request": ({"max_blocks_per_request": 0}, lambda e: step_counts(e).fast_decode == 0),
    "attn_backend": ({"attn_backend": "torch"}, lambda e: e.stats().attn_backend == "torch"),
    "device": ({"device": "cuda"}, "refused or moved"),
    "dtype": ({"dtype": "bfloat16"}, lambda e: next(e.model.parameters()).dtype == torch.bfloat16),
    "debug_checks": ({"debug_checks": True}, "counted"),
    "fault_hook": ({"fault_hook": lambda step, stage: _FAULTS.append(stage)}, lambda e: "forward" in _FAULTS),
    "tensor_parallel_size": ({"tensor_parallel_size": 2}, "tests/test_tensor_parallel.py"),
    "distributed_timeout_s": ({"distributed_timeout_s": 5.0}, "tests/test_tensor_parallel.py"),
    "max_waiting_requests": ({"max_waiting_requests": 5}, lambda e: _admitted_before_overload(e) == 5),
    # away from scheduler="priority" it ranks nothing: named (its effect: tests/test_priority.py)
    "priority_aging_steps": ({"priority_aging_steps": 7}, None),
    "kv_events": ({"kv_events": True}, lambda e: e.kv_events().pending()[0].resync),
    "grammar_compile_timeout_s": ({"grammar_compile_timeout_s": 1e-9}, lambda e: _grammar_refused(e)),
    "grammar_cache_size": ({"grammar_cache_size": 0}, lambda e: _grammar_compiles(e, 2) == 2),
    # int8 weights (AVX-512 VNNI or AVX2 CPUs; refused by name elsewhere): tests/test_quantization.py
    "quantization": ({"quantization": "int8"}, "tests/test_quantization.py"),
    "kv_cache_dtype": ({"kv_cache_dtype": "int8"}, lambda e: runner_of(e).kv.k_cache[0].dtype == torch.int8),
    # adapters loaded at once and their rank bound: refused past them by name
    "max_adapters": ({"max_adapters": 1}, "tests/test_adapters.py"),
    "max_adapter_rank": ({"max_adapter_rank": 4}, "tests/test_adapters.py"),
    "cpu_kernels": ({"cpu_kernels": False}, lambda e: e.stats().attn_backend == "torch"
                    and e.stats().forward_reason == "EngineConfig.cpu_kernels=False"),
    "cpu_prepack": ({"cpu_prepack": False}, lambda e: not runner_of(e).fast_paths.prepacked
                    and e.stats().forward_path == "transformers"),
    "cpu_fused_forward": ({"cpu_fused_forward": False}, lambda e: runner_of(e).fast_paths.prepacked
                          and e.stats().forward_reason == "EngineConfig.cpu_fused_forward=False"),
    # the GEMMs of a bfloat16 model's fused forward only: named on float32 (its effect: tests/test_bf16_gemm.py)
    "cpu_bf16_gemm": ({"cpu_bf16_gemm": False}, None),
    "speculative_method": ({"speculative_method": "ngram"}, lambda e: _speculates(e)),
    # without speculative_method they tune nothing: named (their effects: tests/test_speculative.py)
    "num_speculative_tokens": ({"num_speculative_tokens": 2}, None),
    "prompt_lookup_min": ({"prompt_lookup_min": 3, "prompt_lookup_max": 4}, None),
    "prompt_lookup_max": ({"prompt_lookup_max": 6}, None),
    # the draft of speculative_method="draft" (refused by name without it): tests/test_speculative_draft.py
    "draft_model": ({}, "tests/test_speculative_draft.py"),
    "max_embedding_tokens": ({"max_embedding_tokens": 5}, lambda e: e.scheduler.prefill_only.max_tokens == 5),
}


async def _speculates(engine) -> bool:
    """A repetitive prompt's greedy run is verified from proposals (tests/test_speculative.py at length)."""
    speculate_always(engine)
    await engine.generate([17] * 12, max_new_tokens=12, ignore_eos=True)
    return engine.stats().spec_accepted_tokens > 0


def _grammar_refused(engine) -> bool:
    """A compile past grammar_compile_timeout_s is refused naming the field
    (tests/test_structured.py checks it at length)."""
    with pytest.raises(acb.InvalidRequestError, match="grammar_compile_timeout_s"):
        engine.submit(PROMPT, choice=[f"choice {i}" for i in range(2_000)])  # ~0.1 s to compile
    return True


def _grammar_compiles(engine, times: int) -> int:
    """How many compiles ``times`` submissions of one regex take (1 with the cache on)."""
    for _ in range(times):
        engine.submit(PROMPT, regex="[a-z]{3}", max_new_tokens=4).cancel()
    return engine.stats().grammars_compiled


# What a setting does is the engine's, not the event loop's: asyncio in the default run,
# uvloop and trio in CI's extras step (each pass builds ~40 engines: 11 s on two cores)
@pytest.mark.parametrize("anyio_backend", [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop", marks=pytest.mark.extras),
    pytest.param(("trio", {}), id="trio", marks=pytest.mark.extras),
])
async def test_every_engine_setting_has_an_effect_or_is_named_inactive(caplog, monkeypatch):
    """Each EngineConfig field, set away from its default, changes what an engine does on the CPU,
    or inactive_settings() names it and the engine warns naming it: nothing is silently inert."""
    import dataclasses

    monkeypatch.delenv("ACB_DEBUG_CHECKS", raising=False)  # (the suite's: debug_checks=False is seen here)

    assert set(_EFFECTS) == {f.name for f in dataclasses.fields(acb.EngineConfig)}, \
        "a new EngineConfig field needs an effect here (or an entry in inactive_settings)"
    for name, (overrides, effect) in _EFFECTS.items():
        config = acb.EngineConfig(**overrides)
        if effect is None:
            assert inactive_settings(config, "cpu") == [name], name
            caplog.clear()
            with caplog.at_level("WARNING", logger="acb"):
                tiny_engine(num_blocks=16, **overrides)
            assert f"EngineConfig.{name}=" in caplog.text and "no effect on cpu" in caplog.text, name
            continue
        assert name not in inactive_settings(config, "cpu", "float32"), name
        if isinstance(effect, str):
            if effect == "planned":
                assert _planned(name, overrides), name
            elif effect == "refused or moved":
                assert _refuses_or_moves(overrides), name
            elif effect == "counted":
                for debug in (False, True):
                    engine = tiny_engine(num_blocks=16, debug_checks=debug)
                    calls = _counting_integrity_checks(engine)
                    async with engine:
                        await engine.generate(PROMPT, max_new_tokens=3)
                        await anyio.sleep(0.05)
                    assert bool(calls) == debug, name
            continue
        engine = tiny_engine(**{"num_blocks": 64, **overrides})
        async with engine:
            if name in ("async_batching", "max_blocks_per_request", "fault_hook"):  # seen while serving
                await engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
            seen = effect(engine)
            assert (await seen if inspect.isawaitable(seen) else seen), name


def test_inactive_settings_fire_where_the_engine_runs():
    on_cpu = acb.EngineConfig(use_cuda_graph=True, kv_padding_interval_size=64, max_blocks_per_request=4,
                              num_blocks=32, max_memory_percent=0.2)
    assert inactive_settings(on_cpu, "cpu") == ["max_memory_percent", "use_cuda_graph", "kv_padding_interval_size"]
    assert inactive_settings(acb.EngineConfig(max_blocks_per_request=4, attn_backend="torch"), "cuda") == \
        ["max_blocks_per_request"]
    assert inactive_settings(on_cpu, "cpu", "bfloat16") == inactive_settings(on_cpu, "cpu")  # native kernels read bf16
    assert inactive_settings(acb.EngineConfig(max_blocks_per_request=4, attn_backend="torch"), "cpu") == \
        ["max_blocks_per_request"]  # no native kernel
    assert inactive_settings(acb.EngineConfig(q_padding_interval_size=8, use_cuda_graph=False), "cuda") == \
        ["q_padding_interval_size"]
    assert inactive_settings(acb.EngineConfig(q_padding_interval_size=8), "cuda") == []
    assert inactive_settings(acb.EngineConfig(), "cpu") == inactive_settings(acb.EngineConfig(), "cuda") == []
    off = acb.EngineConfig(cpu_bf16_gemm=False)  # the GEMMs of a bf16 model's fused CPU forward only
    assert inactive_settings(off, "cpu", "bfloat16") == []
    assert inactive_settings(off, "cuda", "bfloat16") == inactive_settings(off, "cpu", "float32") == ["cpu_bf16_gemm"]


async def test_engine_serves_on_the_loop_under_test(anyio_backend):
    from acb.core.eventloop import current_backend

    name, options = anyio_backend
    assert current_backend() == name
    if options.get("use_uvloop"):
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    async with tiny_engine() as engine:
        assert len((await engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True)).token_ids) == 3


async def test_aclose_gives_the_model_back_with_its_own_attention():
    model = tiny_model()
    before = model.config._attn_implementation
    seen = []
    layer = model.model.layers[0].self_attn
    hook = layer.register_forward_pre_hook(lambda m, a, k: seen.append(m.config._attn_implementation),
                                           with_kwargs=True)
    async with acb.Engine(model, config=acb.EngineConfig(num_blocks=16)) as engine:
        assert model.config._attn_implementation == before  # acb's attention only inside its steps
        await engine.generate(PROMPT, max_new_tokens=2)
    hook.remove()
    assert seen and set(seen) == {"acb_paged"}
    assert model.config._attn_implementation == before and type(model.config) is type(tiny_model().config)
