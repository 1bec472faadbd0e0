"""CUDA graphs, padding buckets and compile levels: everything that can be checked
without a GPU. Padding is forced on the CPU (eagerly, no capture) to prove that it never
changes a token; the graph capture itself is checked by the CUDA-only test at the end
and by benchmarks/gpu_check.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import acb
from acb.attention import paged as attention
from acb.attention.block_tables import BlockTables
from acb.attention.metadata import DeviceIds, Packed
from acb.core.step import StepInput
from acb.engine.settings import inactive_settings
from acb.testing import random_prompts, reference_greedy, runner_of, step_counts, tiny_model
from acb.worker import compiling, cuda_graphs
from acb.worker.cuda_graphs import DecodePadding, bucket_for, decode_buckets, padded_kv_pages
from acb.worker.runner import ModelRunner

# ------------------------------------------------------------------ buckets and padding


def test_row_buckets_are_powers_of_two_then_multiples_of_the_interval():
    assert decode_buckets(64, 16) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40, 3) == [1, 2] + list(range(3, 40, 3)) + [40]


def test_row_buckets_end_at_the_cap():
    assert decode_buckets(8, 16) == [1, 2, 4, 8]
    assert decode_buckets(10, 4) == [1, 2, 4, 8, 10]
    assert decode_buckets(1, 16) == [1]


def test_zero_interval_uses_the_default():
    assert decode_buckets(256, 0) == decode_buckets(256, cuda_graphs.DEFAULT_Q_INTERVAL)


def test_rows_go_to_the_smallest_bucket_that_holds_them():
    buckets = decode_buckets(64, 16)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 16, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 48, 64]
    assert bucket_for(65, buckets) is None


def test_context_is_padded_to_the_kv_interval_in_whole_pages():
    assert padded_kv_pages(1, 32, 8) == 4
    assert padded_kv_pages(32, 32, 8) == 4
    assert padded_kv_pages(33, 32, 8) == 8
    assert padded_kv_pages(5, 12, 8) == 2  # 12 tokens round up to 2 pages
    assert padded_kv_pages(1, 0, 16) == cuda_graphs.DEFAULT_KV_INTERVAL // 16


def test_padding_rows_write_the_scratch_slot_and_read_one_zero_key():
    pad = DecodePadding(decode_buckets(16, 4), kv_interval=16, page_size=4, scratch_slot=99)
    p = Packed(tokens=[7, 8, 9], positions=[10, 3, 20], token_rows=[0, 1, 2], decode_q=[0, 1, 2],
               lengths=[11, 4, 21], table_rows=[0, 1, 2])
    width = pad.pad(p.tokens, p.positions, p.decode_q, p.lengths, p.table_rows)
    assert width == 32  # 21 tokens -> 32 (two intervals of 16), 8 pages of 4
    assert p.tokens == [7, 8, 9, cuda_graphs.PAD_TOKEN]
    assert p.positions == [10, 3, 20, 0]
    assert p.decode_q == [0, 1, 2, 3]
    assert p.lengths == [11, 4, 21, 1]
    assert p.table_rows == [0, 1, 2, -1]  # the empty row: the zero page
    ids = DeviceIds(torch.device("cpu"))
    tables = BlockTables(torch.device("cpu"), 4, 30, ids)
    step = StepInput()
    for row, pages in enumerate([[10, 11, 12], [3], [20, 21, 22, 23, 24, 25]]):
        step.send_table(row, 0, pages)
    tables.apply(step.delta_rows, step.delta_cols, step.delta_pages, step.delta_swa)
    runner = SimpleNamespace(kv=SimpleNamespace(tables=tables, swa_layers=frozenset()), _tensor=ids,
                             fast_paths=SimpleNamespace(decode_padding=pad))
    slots, _ = ModelRunner._slots(runner, p, ids(p.positions))
    assert slots.tolist() == [12 * 4 + 2, 3 * 4 + 3, 25 * 4, 99]  # the padding row: the scratch slot
    assert tables.gather(ids(p.table_rows), ids(p.lengths), width)[-1].tolist() == [30] * 8


def test_a_step_beyond_the_last_bucket_is_left_unpadded():
    pad = DecodePadding([1, 2], kv_interval=8, page_size=4, scratch_slot=99)
    lists = ([1, 2, 3], [0, 0, 0], [0, 1, 2], [1, 1, 1], [1, 2, 3])
    assert pad.pad(*lists) is None
    assert lists[0] == [1, 2, 3] and lists[3] == [1, 1, 1]


# ------------------------------------------------------------------ padded parity on CPU


async def _submit_all(engine, prompts, max_new):
    handles = [engine.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, max_new)]
    return [await h for h in handles]


def _record_shapes(runner) -> list[tuple[int, int, bool]]:
    """Wrap the runner's _build: (rows, page-table width, padded) of every decode step."""
    shapes: list[tuple[int, int, bool]] = []
    build = runner._build

    def recording(step):
        out = build(step)
        meta = out[3]
        if meta.decode is not None and not meta.prefills:
            shapes.append((*meta.pool.decode_pages.shape, meta.decode.padded))
        return out

    runner._build = recording
    return shapes


@pytest.mark.parametrize(("arch", "backend"), [("llama", "torch"), ("qwen3", "torch"), ("mistral", "torch"),
                                               ("llama", "native")])
async def test_padding_never_changes_a_token(arch, backend):
    model = tiny_model(arch)
    prompts = random_prompts(7, 3, 30, seed=5)
    max_new = [6 + (i * 5) % 17 for i in range(len(prompts))]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    config = acb.EngineConfig(page_size=4, num_blocks=96, max_requests_per_batch=16, attn_backend=backend,
                              q_padding_interval_size=4, kv_padding_interval_size=12)
    async with acb.Engine(model, config=config) as engine:
        runner = runner_of(engine)
        assert runner.fast_paths.decode_padding is None  # on CPU the config alone does not pad
        runner.configure_fast_paths(engine.config, engine.max_requests, pad_on_cpu=True)
        shapes = _record_shapes(runner)
        results = await _submit_all(engine, prompts, max_new)
        kv = runner.kv
        zero_page = [c[:, kv.null_slot : kv.null_slot + kv.page_size - 1] for c in kv.k_cache]
        assert all(bool((z == 0).all()) for z in zero_page), "padding wrote a zero-page slot it must only read"
    assert [r.token_ids for r in results] == expected
    buckets = decode_buckets(16, 4)
    assert shapes and all(padded for _, _, padded in shapes)
    assert any(rows not in (7, 6, 5) for rows, _, _ in shapes)
    assert all(rows in buckets and (width * 4) % 12 < 4 for rows, width, _ in shapes), shapes


async def test_hybrid_models_are_not_padded_and_stay_exact(caplog):
    """Gemma 2/3 keep their sliding layers in a second page pool, which the graph
    buckets do not cover yet: padding is refused, with a warning, and tokens stay exact."""
    model = tiny_model("gemma2")
    prompts = random_prompts(5, 3, 20, seed=6)
    expected = [reference_greedy(model, p, 10) for p in prompts]
    config = acb.EngineConfig(page_size=4, num_blocks=96, q_padding_interval_size=4)
    async with acb.Engine(model, config=config) as engine:
        with caplog.at_level("WARNING", logger="acb"):
            runner_of(engine).configure_fast_paths(engine.config, engine.max_requests, pad_on_cpu=True)
        assert runner_of(engine).fast_paths.decode_padding is None
        results = await _submit_all(engine, prompts, [10] * len(prompts))
    assert "hybrid" in caplog.text
    assert [r.token_ids for r in results] == expected


async def test_padded_decode_shapes_repeat():
    model = tiny_model("llama")
    prompts = random_prompts(11, 5, 12, seed=2)
    config = acb.EngineConfig(page_size=4, num_blocks=96, max_requests_per_batch=16, attn_backend="torch",
                              q_padding_interval_size=8, kv_padding_interval_size=32)
    async with acb.Engine(model, config=config) as engine:
        runner_of(engine).configure_fast_paths(engine.config, engine.max_requests, pad_on_cpu=True)
        shapes = _record_shapes(runner_of(engine))
        await _submit_all(engine, prompts, [4 + 3 * i for i in range(11)])
    distinct = {(rows, width) for rows, width, _ in shapes}
    assert len(shapes) >= 3 * len(distinct), f"{len(shapes)} decode steps but {len(distinct)} shapes"


# ------------------------------------------------------------------ the graph runner, CUDA stood in for


class RecordedGraph:
    """A CUDA graph's stand-in on the CPU: capture keeps the work without running it
    (as CUDA records kernels without running them), replay runs it."""

    def __init__(self) -> None:
        self.work = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.work()


class CpuGraphs(cuda_graphs.DecodeGraphs):
    def _free_memory(self) -> int:
        return 1 << 40

    def _new_graph(self):
        return RecordedGraph()

    def _record(self, graph, work) -> None:
        graph.work = work


class FailingCapture(CpuGraphs):
    def _record(self, graph, work) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")


def _cpu_graphs(engine, graphs_cls):
    """Pad the engine's decode steps and run them through ``graphs_cls`` (CUDA stood in for)."""
    runner = runner_of(engine)
    runner.configure_fast_paths(engine.config, engine.max_requests, pad_on_cpu=True)
    fast, kv = runner.fast_paths, runner.kv
    fast.decode_graphs = graphs_cls(fast.decode_forward, kv.k_cache, kv.v_cache, kv.page_size, engine.max_requests,
                                    engine.model.config, None, runner.attn_backend, generator=runner.generator)
    return fast.decode_graphs


async def _run_with_graphs(graphs_cls, arch="llama", longest_prompt=30, **sampling):
    """Outputs and greedy expected ones with decode steps padded and run through
    ``graphs_cls``: static buffers, metadata derived from them, sampling in the graph,
    the shared output buffers."""
    model = tiny_model(arch)
    prompts = random_prompts(7, 3, longest_prompt, seed=9)
    max_new = [6 + (i * 5) % 17 for i in range(len(prompts))]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    config = acb.EngineConfig(page_size=4, num_blocks=96, max_requests_per_batch=16, attn_backend="torch",
                              q_padding_interval_size=4, kv_padding_interval_size=12)
    async with acb.Engine(model, config=config) as engine:
        graphs = _cpu_graphs(engine, graphs_cls)
        handles = [engine.submit(p, max_new_tokens=n, ignore_eos=True, **sampling) for p, n in zip(prompts, max_new)]
        results = [await h for h in handles]
    return [r.token_ids for r in results], expected, graphs


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
async def test_graph_runner_replays_each_bucket_and_keeps_parity(arch):
    got, expected, graphs = await _run_with_graphs(CpuGraphs, arch)
    assert got == expected
    assert graphs.graphs and not graphs.failed
    replays = sum(g.graph.replays for g in graphs.graphs.values())
    assert replays > 2 * len(graphs.graphs), "buckets were captured but hardly reused"
    assert all(rows in decode_buckets(16, 4) and mode == "greedy" for rows, _, mode in graphs.graphs)


async def test_a_failed_capture_falls_back_to_eager_and_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="acb"):
        got, expected, graphs = await _run_with_graphs(FailingCapture)
    assert got == expected
    assert graphs.failed and not graphs.graphs
    assert "CUDA graph capture failed" in caplog.text and "run eagerly" in caplog.text


async def test_contexts_wider_than_the_graph_cap_run_eagerly(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPH_KV_TOKENS", 24)
    got, expected, graphs = await _run_with_graphs(CpuGraphs, longest_prompt=10)  # contexts up to 32
    assert got == expected
    assert graphs.graphs and graphs.skipped
    assert all(width * 4 <= 24 for _, width, _ in graphs.graphs)
    assert all(width * 4 > 24 for _, width in graphs.skipped)


async def test_graphs_replay_the_triton_kernels():
    """The graph body on the Triton backend (what runs on CUDA), under the interpreter:
    decode rows through the Triton decode kernel reading the static page table."""
    pytest.importorskip("triton", reason="triton is installed by scripts/setup.sh")
    model = tiny_model("llama")
    prompts = random_prompts(3, 3, 6, seed=12)
    expected = [reference_greedy(model, p, 5) for p in prompts]
    config = acb.EngineConfig(page_size=4, num_blocks=32, attn_backend="triton", q_padding_interval_size=2,
                              kv_padding_interval_size=8)
    async with acb.Engine(model, config=config) as engine:
        graphs = _cpu_graphs(engine, CpuGraphs)
        assert graphs.kernel == "triton"
        results = await engine.generate_batch(prompts, max_new_tokens=5, ignore_eos=True)
    assert [r.token_ids for r in results] == expected
    assert graphs.graphs and sum(g.graph.replays for g in graphs.graphs.values()) > len(graphs.graphs)


async def test_max_blocks_per_request_keeps_wide_steps_out_of_triton_graphs():
    pytest.importorskip("triton", reason="triton is installed by scripts/setup.sh")
    model = tiny_model("llama")
    prompts = random_prompts(2, 3, 6, seed=13)
    expected = [reference_greedy(model, p, 4) for p in prompts]
    config = acb.EngineConfig(page_size=4, num_blocks=32, attn_backend="triton", q_padding_interval_size=2,
                              kv_padding_interval_size=8, max_blocks_per_request=0)
    async with acb.Engine(model, config=config) as engine:
        graphs = _cpu_graphs(engine, CpuGraphs)
        results = await engine.generate_batch(prompts, max_new_tokens=4, ignore_eos=True)
        fast_steps = step_counts(engine).fast_decode
    assert [r.token_ids for r in results] == expected
    assert not graphs.graphs and fast_steps == 0


async def test_sampled_rows_are_sampled_inside_the_graph():
    # top_k=1 makes sampling deterministic: it must pick the greedy token, inside the graph
    got, expected, graphs = await _run_with_graphs(CpuGraphs, temperature=0.8, top_k=1, top_p=0.9)
    assert got == expected
    assert graphs.graphs and all(mode == "sample" for _, _, mode in graphs.graphs)


async def test_logprobs_come_out_of_the_graph():
    model = tiny_model("llama")
    prompt = random_prompts(1, 5, 5, seed=3)[0]
    config = acb.EngineConfig(page_size=4, num_blocks=32, attn_backend="torch", q_padding_interval_size=4)
    async with acb.Engine(model, config=config) as engine:
        eager = await engine.generate(prompt, max_new_tokens=6, ignore_eos=True, logprobs=True)
        graphs = _cpu_graphs(engine, CpuGraphs)
        graphed = await engine.generate(prompt, max_new_tokens=6, ignore_eos=True, logprobs=True)
    assert graphed.token_ids == eager.token_ids
    assert graphed.logprobs == pytest.approx(eager.logprobs, abs=1e-4)
    assert {mode for _, _, mode in graphs.graphs} == {"greedy+logprobs"}


async def test_seeded_rows_sample_outside_the_graph_and_stay_reproducible():
    model = tiny_model("llama")
    prompts = random_prompts(3, 4, 9, seed=4)
    config = acb.EngineConfig(page_size=4, num_blocks=64, attn_backend="torch", q_padding_interval_size=4)
    kwargs = dict(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=123)
    async with acb.Engine(model, config=config) as engine:
        eager = await engine.generate_batch(prompts, **kwargs)
        graphs = _cpu_graphs(engine, CpuGraphs)
        graphed = await engine.generate_batch(prompts, **kwargs)
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert graphs.graphs and all(mode is None for _, _, mode in graphs.graphs)


def test_graph_sampling_follows_the_eager_rules():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    # rows: greedy, top_k=1, top_k=3, top_p tiny, temperature below the minimum
    params = torch.tensor([[0.0, 0.7, 1.3, 1.0, 1e-7], [0, 1, 3, 0, 0], [1.0, 1.0, 1.0, 1e-6, 1.0]])
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        ids, logprobs = cuda_graphs.graph_sample(logits, params, "sample+logprobs", gen)
        top = logits.argmax(-1)
        assert ids[[0, 1, 3, 4]].tolist() == top[[0, 1, 3, 4]].tolist()
        assert ids[2].item() in logits[2].topk(3).indices.tolist()
        torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0])
    ids, logprobs = cuda_graphs.graph_sample(logits, params, "greedy", gen)
    assert ids.tolist() == logits.argmax(-1).tolist() and logprobs.numel() == 0


class WrongReplay(CpuGraphs):
    """A capture that replays something else than it recorded."""

    def _record(self, graph, work) -> None:
        def wrong():
            work()
            self.logits.add_(1.0)

        graph.work = wrong


@pytest.mark.parametrize(("graphs_cls", "passes"), [(CpuGraphs, True), (WrongReplay, False), (FailingCapture, False)])
async def test_graph_self_check_keeps_graphs_only_when_replay_matches_eager(graphs_cls, passes, caplog):
    model = tiny_model("llama")
    config = acb.EngineConfig(page_size=4, num_blocks=32, attn_backend="torch", q_padding_interval_size=4)
    async with acb.Engine(model, config=config) as engine:
        _cpu_graphs(engine, graphs_cls)
        with caplog.at_level(logging.WARNING, logger="acb"):
            assert runner_of(engine).fast_paths.check_graphs() is passes
        assert (runner_of(engine).fast_paths.decode_graphs is not None) is passes
        assert (runner_of(engine).fast_paths.decode_padding is not None) is passes
        out = await engine.generate([5, 6, 7], max_new_tokens=4, ignore_eos=True)
    assert out.token_ids == reference_greedy(model, [5, 6, 7], 4)
    assert ("self-check failed" in caplog.text) is not passes


# ------------------------------------------------------------------ settings, logging, memory


async def test_graph_and_compile_settings_are_active():
    config = acb.EngineConfig(use_cuda_graph=True, q_padding_interval_size=8, kv_padding_interval_size=256,
                              compile_level=2, varlen_compile_level=0, decode_compile_level=3, num_blocks=32)
    assert inactive_settings(config, "cuda") == []
    assert inactive_settings(config, "cpu") == ["use_cuda_graph", "q_padding_interval_size", "kv_padding_interval_size"]
    model = tiny_model("llama")
    async with acb.Engine(model, config=config) as engine:  # the compile levels act on the CPU too
        runner = runner_of(engine)
        assert runner.fast_paths.varlen_forward is model and runner.fast_paths.decode_forward is not model
        assert runner.fast_paths.decode_graphs is None and runner.fast_paths.decode_padding is None


@pytest.mark.parametrize("name", ["varlen_compile_level", "decode_compile_level"])
@pytest.mark.parametrize("value", [-1, 4, 1.0, True])
def test_per_path_compile_levels_are_validated(name, value):
    with pytest.raises(ValueError, match=name):
        acb.EngineConfig(**{name: value})


async def test_cuda_graphs_on_cpu_say_why_they_are_off(caplog):
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="acb"):
        async with acb.Engine(model, config=acb.EngineConfig(num_blocks=32, use_cuda_graph=True)) as engine:
            fast = runner_of(engine).fast_paths
            assert fast.decode_padding is None and fast.decode_graphs is None
            assert (await engine.generate([5, 6, 7], max_new_tokens=3, ignore_eos=True)).token_ids == \
                reference_greedy(model, [5, 6, 7], 3)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("CUDA graphs need a CUDA device" in m and "run eagerly" in m for m in warnings), warnings
    assert any("decode steps: eager, unpadded" in r.getMessage() for r in caplog.records)


async def test_default_config_logs_the_eager_decode_path_without_warnings(caplog):
    with caplog.at_level(logging.INFO, logger="acb"):
        async with acb.Engine(tiny_model("llama"), config=acb.EngineConfig(num_blocks=32)):
            pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "graph" in r.getMessage()]
    assert any("decode steps: eager, unpadded" in r.getMessage() for r in caplog.records)


def test_graph_memory_is_reserved_only_when_graphs_are_asked_for():
    cfg = tiny_model("llama").config
    assert cuda_graphs.graph_memory_reserve(cfg, torch.bfloat16, acb.EngineConfig()) == 0
    assert cuda_graphs.graph_memory_reserve(cfg, torch.bfloat16, acb.EngineConfig(use_cuda_graph=False,
                                                                                 q_padding_interval_size=8)) == 0
    small = cuda_graphs.graph_memory_reserve(cfg, torch.bfloat16, acb.EngineConfig(use_cuda_graph=True,
                                                                                  max_requests_per_batch=16))
    auto = cuda_graphs.graph_memory_reserve(cfg, torch.bfloat16, acb.EngineConfig(kv_padding_interval_size=64,
                                                                                 max_requests_per_batch=64))
    assert 0 < small < auto
    # on a CUDA device graphs are on unless turned off
    assert cuda_graphs.graph_memory_reserve(cfg, torch.bfloat16, acb.EngineConfig(), cuda=True) > 0
    assert cuda_graphs.graph_memory_reserve(cfg, torch.bfloat16, acb.EngineConfig(use_cuda_graph=False),
                                            cuda=True) == 0
    assert cuda_graphs.graph_memory_reserve(cfg, torch.bfloat16, acb.EngineConfig(tensor_parallel_size=2),
                                            cuda=True) == 0
    # one layer's gathered keys and values at the largest bucket and context, at least
    assert small >= 2 * 2 * 16 * cuda_graphs.MAX_GRAPH_KV_TOKENS * 16 * 2


# ------------------------------------------------------------------ compile levels


def test_compile_levels_map_to_torch_compile_arguments():
    assert compiling.compile_kwargs(0) == {}
    assert compiling.compile_kwargs(1) == {"mode": "default", "dynamic": True}
    assert compiling.compile_kwargs(2) == {"mode": "max-autotune-no-cudagraphs", "dynamic": True}
    assert compiling.compile_kwargs(3) == {"mode": "max-autotune-no-cudagraphs", "dynamic": False}
    with pytest.raises(ValueError):
        compiling.compile_kwargs(4)


def test_per_path_levels_override_the_common_one():
    assert compiling.path_levels(2, None, None) == (2, 2)
    assert compiling.path_levels(2, 0, 3) == (0, 3)
    assert compiling.path_levels(0, None, 1) == (0, 1)


async def test_engine_compiles_each_path_with_its_level(monkeypatch):
    calls = []

    def fake_compile(model, **kwargs):
        calls.append(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = tiny_model("llama")
    config = acb.EngineConfig(num_blocks=32, compile_level=1, decode_compile_level=3)
    async with acb.Engine(model, config=config) as engine:
        assert runner_of(engine).fast_paths.decode_forward is not model or calls  # torch.compile was asked
        out = await engine.generate([9, 8, 7], max_new_tokens=4, ignore_eos=True)
    assert calls == [compiling.compile_kwargs(1), compiling.compile_kwargs(3)]
    assert out.token_ids == reference_greedy(model, [9, 8, 7], 4)
    assert model.config._attn_implementation not in (attention.ATTN_NAME, attention.ATTN_NAME_COMPILED)


@pytest.mark.extras  # torch.compile's first compile on the CPU: ~24 s on two cores
async def test_compile_level_1_keeps_greedy_parity():
    model = tiny_model("llama")
    prompts = random_prompts(4, 3, 20, seed=1)
    expected = [reference_greedy(model, p, 10) for p in prompts]
    config = acb.EngineConfig(num_blocks=64, page_size=8, attn_backend="torch", compile_level=1)
    async with acb.Engine(model, config=config) as engine:
        results = await engine.generate_batch(prompts, max_new_tokens=10, ignore_eos=True)
    assert [r.token_ids for r in results] == expected


# ------------------------------------------------------------------ CUDA only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("async_batching", [True, False])
async def test_cuda_graphs_keep_greedy_parity(async_batching):
    model = tiny_model("llama", device="cuda")
    prompts = random_prompts(9, 3, 30, seed=4)
    max_new = [6 + (i * 5) % 17 for i in range(len(prompts))]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    config = acb.EngineConfig(page_size=8, num_blocks=128, max_requests_per_batch=16, use_cuda_graph=True,
                              q_padding_interval_size=4, kv_padding_interval_size=32, async_batching=async_batching)
    async with acb.Engine(model, config=config) as engine:
        results = await _submit_all(engine, prompts, max_new)
        graphs = runner_of(engine).fast_paths.decode_graphs
        assert graphs is not None and not graphs.failed and graphs.graphs
    assert [r.token_ids for r in results] == expected


async def test_speculation_with_graphs_keeps_parity_and_replays_only_steps_without_proposals():
    """Speculative decoding beside decode graphs (CUDA stood in for): a step whose rows carry
    proposals is varlen and runs eagerly, decode-only steps without proposals replay their
    graphs, and greedy output is still transformers' own."""
    from acb.testing import speculate_always

    model = tiny_model("llama")
    rnd = random_prompts(2, 6, 10, seed=4)
    prompts = [[5] * 10, [5, 6, 7] * 4, rnd[0] + rnd[0][:-2], rnd[1]]  # n-gram lookups find these
    max_new = [12, 9, 14, 7]
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, max_new)]
    config = acb.EngineConfig(page_size=4, num_blocks=96, max_requests_per_batch=16, attn_backend="torch",
                              q_padding_interval_size=4, kv_padding_interval_size=12, speculative_method="ngram")
    async with acb.Engine(model, config=config) as engine:
        speculate_always(engine)
        graphs = _cpu_graphs(engine, CpuGraphs)
        handles = [engine.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, max_new)]
        got = [(await h).token_ids for h in handles]
        stats = engine.stats()
        # a decode-only step after speculation: one request with no repetition to look up
        tail = await engine.generate(list(range(40, 52)), max_new_tokens=6, ignore_eos=True)
    assert got == expected
    assert tail.token_ids == reference_greedy(model, list(range(40, 52)), 6)
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0, "the test did not speculate"
    assert graphs.graphs and not graphs.failed
    assert sum(g.graph.replays for g in graphs.graphs.values()) > 0, "no decode step replayed a graph"


async def test_a_hybrid_model_on_cuda_says_only_that_graphs_skip_its_two_pools(caplog):
    """On a CUDA device a sliding-window hybrid (two page pools) runs eagerly, said once: the
    graph settings' "need a CUDA device" warning is for CPUs (gpu_check's first H200 run logged both)."""
    async with acb.Engine(tiny_model("gemma3"), config=acb.EngineConfig(num_blocks=32)) as engine:
        fast = runner_of(engine).fast_paths
        assert fast.kv.swa_layers  # the hybrid's sliding layers
        cpu_stream = fast.stream
        fast._build_graphs = lambda: None  # nothing is captured here: only the settings' messages
        try:
            for stream, cuda in ((object(), True), (None, False)):
                fast.stream = stream  # as on a CUDA device / on the CPU
                caplog.clear()
                with caplog.at_level(logging.INFO, logger="acb"):
                    fast._configure_graphs(acb.EngineConfig(use_cuda_graph=True), 8, False)
                messages = [r.getMessage() for r in caplog.records]
                assert any("not used for hybrid sliding-window models" in m for m in messages) == cuda, messages
                assert any("need a CUDA device" in m for m in messages) == (not cuda), messages
                assert fast.decode_graphs is None and fast.decode_padding is None
        finally:
            fast.stream = cpu_stream
