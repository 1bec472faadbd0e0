"""Tensor parallelism on CPU: two gloo ranks, one thread each, over acb's tiny models.

Greedy tokens with tensor_parallel_size=2 equal one rank's and transformers' generate,
with chunked prefill, preemption, prefix hits and a cancellation in the same run; a
rank killed mid-stream fails its requests and leaves no process behind; sizes that do
not divide the model are refused at construction.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from unittest import mock

import aiohttp
import psutil
import pytest
import torch
from http_helpers import free_port

import acb
from acb.core.step import StepInput
from acb.distributed import protocol
from acb.testing import random_prompts, reference_greedy, runner_of, tiny_model, tiny_tokenizer
from acb.worker.runner import ModelRunner

NEW_TOKENS = 12


def tp_config(**fields) -> acb.EngineConfig:
    # small pages and budget: long prompts prefill in chunks, 24 pages force preemptions
    base = dict(tensor_parallel_size=2, page_size=8, num_blocks=24, max_batch_tokens=48, distributed_timeout_s=30)
    base.update(fields)
    return acb.EngineConfig(**base)


def workload() -> list[list[int]]:
    shared = random_prompts(1, 20, 20, seed=7)[0]
    prompts = random_prompts(6, 4, 70, seed=3)  # some longer than max_batch_tokens: chunked
    return prompts + [shared + p[:5] for p in prompts[:3]]  # a shared 20-token prefix: prefix hits


async def run_workload(engine: acb.Engine, prompts: list[list[int]]) -> tuple[list[list[int]], str]:
    """Every prompt's greedy tokens, with one extra request cancelled after its first
    chunk while the others run."""
    victim = engine.submit(random_prompts(1, 30, 30, seed=11)[0], max_new_tokens=100)
    batch = asyncio.ensure_future(engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    async for _ in victim:
        victim.cancel()
    done = await victim
    return [c.token_ids for c in await batch], done.finish_reason


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # each of the two ranks then takes one
    yield
    torch.set_num_threads(threads)


# Each case starts its own rank process (5-15 s here, more on a busy machine): llama in
# the default suite, the other architectures in CI's extras step
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.extras),
                                  pytest.param("mistral", marks=pytest.mark.extras)])
async def test_tp2_greedy_equals_one_rank_and_transformers(arch, monkeypatch):
    if arch == "qwen2":  # transformers' forward, its row-parallel projections summed by hooks
        monkeypatch.setenv("ACB_CPU_FUSED", "0")
    model = tiny_model(arch)
    prompts = workload()
    async with acb.Engine(model, tokenizer=tiny_tokenizer(), config=tp_config(tensor_parallel_size=1)) as one:
        # built while the one-rank engine holds the model (its linear weights prepacked)
        engine = acb.Engine(model, tokenizer=tiny_tokenizer(), config=tp_config())
        assert torch.get_num_threads() == 1 and len(engine.worker_pids) == 1
        async with engine:
            tp_tokens, cancelled = await run_workload(engine, prompts)
            stats = engine.stats()
            assert stats.free_blocks == stats.total_blocks  # cancelled and finished pages are back
        assert not psutil.pid_exists(engine.worker_pids[0]) or \
            psutil.Process(engine.worker_pids[0]).status() == psutil.STATUS_ZOMBIE  # aclose ended rank 1
        one_tokens, _ = await run_workload(one, prompts)
    assert cancelled == "cancelled"
    if arch != "mistral":  # its 8-token window recycles pages (no preemption) and turns prefix caching off
        assert stats.preemptions > 0 and stats.prefix_hit_rate > 0
    assert tp_tokens == one_tokens
    for prompt, tokens in zip(prompts, tp_tokens, strict=True):
        assert tokens == reference_greedy(model, prompt, NEW_TOKENS)
    assert len({tuple(t) for t in tp_tokens}) > 1  # the reference is varied, so the check can fail


@pytest.mark.extras  # another pair of rank processes (~10 s): CI's extras step
async def test_tp2_choices_equal_one_rank():
    """n > 1 under tensor parallelism: the forks' rows and their copy-on-write copies reach
    rank 1 (a copy it missed would leave it attending to a page it never wrote). Greedy
    choices equal transformers'; seeded sampled ones equal one rank's, logprobs included."""
    model = tiny_model("llama")
    prompts = random_prompts(2, 13, 21, seed=4)  # partial last pages (page_size 8): copied on write
    kw = dict(n=3, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    sampled_kw = dict(kw, temperature=1.0, seed=9, logprobs=True)

    async def run(engine: acb.Engine) -> tuple[list, list]:
        greedy = await asyncio.gather(*(engine.generate(p, **kw) for p in prompts))
        sampled = await asyncio.gather(*(engine.generate(p, **sampled_kw) for p in prompts))
        stats = engine.stats()
        assert stats.free_blocks == stats.total_blocks
        return ([[c.token_ids for c in done.choices] for done in greedy],
                [[(c.token_ids, c.logprobs) for c in done.choices] for done in sampled])

    async with acb.Engine(model, config=tp_config(tensor_parallel_size=1, num_blocks=256)) as one:
        async with acb.Engine(model, config=tp_config(num_blocks=256)) as engine:
            tp_greedy, tp_sampled = await run(engine)
            long = engine.submit(prompts[0], n=2, max_new_tokens=200, ignore_eos=True)
            while engine.stats().running < 2:  # its tables are in both ranks' stores
                await asyncio.sleep(0.005)
            engine.check_integrity()  # rank 1's store too (it answers the check)
            _rank1_refuses_tables_its_store_does_not_hold(engine)
            long.cancel()
            assert (await long).choices[0].finish_reason == "cancelled"
        one_greedy, one_sampled = await run(one)
    for prompt, choices in zip(prompts, tp_greedy, strict=True):
        assert choices == [reference_greedy(model, prompt, NEW_TOKENS)] * 3
    assert tp_greedy == one_greedy
    assert [[t for t, _ in choices] for choices in tp_sampled] == [[t for t, _ in choices] for choices in one_sampled]
    assert len({tuple(t) for choices in tp_sampled for t, _ in choices}) == 6
    for tp_choices, one_choices in zip(tp_sampled, one_sampled, strict=True):
        for (_, tp_lp), (_, one_lp) in zip(tp_choices, one_choices, strict=True):
            assert tp_lp == pytest.approx(one_lp, abs=1e-4)


def _rank1_refuses_tables_its_store_does_not_hold(engine: acb.Engine) -> None:
    """The check can fail: rank 0 sends tables with one page changed; rank 1 answers with its rank."""
    runner = runner_of(engine)
    tables = engine.scheduler.sent_tables()
    row, pages, swa = next(t for t in tables if t[1])
    wrong = [(row, [*pages[:-1], pages[-1] + 1], swa)]
    with runner.tp.lock:
        runner.tp.channel.send_check(wrong)
        assert runner.tp.channel.agree(0) == 1
    with pytest.raises(AssertionError, match="rank 1"), mock.patch.object(ModelRunner, "check_tables"):
        runner.check_tables(wrong)  # rank 0's own check skipped: rank 1's answer raises


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# a SIGKILLed rank is noticed at once (its connections close); a stopped one when a
# collective times out (short here: 5 s)
@pytest.mark.extras  # two more rank processes each (~10 s): CI's extras step
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP])
async def test_failed_rank_fails_requests_and_stops_the_engine(signum):
    before = _children()
    config = tp_config(distributed_timeout_s=5 if signum == signal.SIGSTOP else 20, num_blocks=256)
    engine = acb.Engine(tiny_model("llama"), tokenizer=tiny_tokenizer(), config=config)
    [worker] = engine.worker_pids
    async with engine:
        stream = engine.submit([5, 6, 7, 8], max_new_tokens=500, ignore_eos=True)
        other = engine.submit([9, 10, 11], max_new_tokens=500, ignore_eos=True)
        with pytest.raises(acb.RequestFailedError):
            async with asyncio.timeout(60):  # a hang guard, well above the timeout
                async for _ in stream:
                    if signum is not None:
                        os.kill(worker, signum)
                        signum = None
        with pytest.raises(acb.RequestFailedError):
            await other
        assert not engine.is_running
        with pytest.raises(acb.EngineStoppedError):
            engine.submit([1, 2, 3])
    assert _children() <= before  # rank 1 is gone and reaped: no zombie, no orphan


@pytest.mark.extras
async def test_serve_with_two_ranks_answers_an_openai_request(tmp_path):
    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "acb.cli", "serve", "--tiny", "--tensor-parallel-size", "2", "--port", str(port),
            stdout=asyncio.subprocess.PIPE, stderr=log)
    try:
        ready = await asyncio.wait_for(proc.stdout.readline(), 300)
        assert f"http://127.0.0.1:{port}" in ready.decode(), (tmp_path / "server.log").read_text()
        [rank1] = psutil.Process(proc.pid).children()
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as session:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "ignore_eos": True}
            async with session.post("/v1/chat/completions", json=body) as resp:
                answer = await resp.json()
        assert resp.status == 200 and answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 120) == 0
        assert not rank1.is_running()  # the server's aclose() ended rank 1
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_non_dividing_size_is_refused_before_any_rank_starts():
    before = _children()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's attention heads"):
        acb.Engine(tiny_model("llama"), config=tp_config(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=2: acb shards Llama-family"):
        acb.Engine(tiny_model("gemma2"), config=tp_config())
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        acb.EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="compile_level"):
        acb.EngineConfig(tensor_parallel_size=2, compile_level=1)
    assert _children() == before


def _columns(step: StepInput) -> dict:
    return {name: getattr(step, name) for name in ("starts", "carry_from", "sample", "token_ids", "token_offsets",
                                                   "table_rows", "delta_rows", "delta_cols", "delta_pages",
                                                   "delta_swa", "plain", "refresh", "prompt_singles")} | {
        name: getattr(step, name).entries() for name in ("swap_out", "swap_in", "copy_pages", "copy_swa_pages")}


def test_step_input_packs_into_one_int32_tensor_and_back_with_carried_tokens_written_in():
    step = StepInput(refresh=True)
    step.add_row([5, 6, 7], 0, [3], swa_pages=[2])
    step.add_row([9, 0], 16, [1, 4, 2], carry_from=1, swa_pages=[-1, 4, 5])
    step.add_table_row([0], 30, table_row=7, carry_from=0, sample=False)  # its table as sent before
    step.send_table(7, 2, [2, 6], [0, 1])  # a page replaced (copy-on-write) and a new one
    step.add_table_row([], 31, table_row=8)  # a forked choice: no tokens
    step.send_table(8, 0, [8, -1, 2, 6], [-1, -1, 0, 1])
    step.add_row([11], 16, [9, 10], swa_pages=[-1, 3], prompt=True)  # a prompt's last token, after a prefix hit
    step.swap_out.add(3, 1)
    step.swap_in.add(0, 7, 2)
    step.copy_pages.add(5, 9)
    step.copy_swa_pages.add(1, 3)
    packed = protocol.pack_step(step)
    assert packed.dtype == torch.int32 and packed.dim() == 1
    back = protocol.unpack_step(packed)
    assert _columns(back) == _columns(step) and back.sampling is None
    assert back.counts() == [3, 2, 1, 0, 1] and back.table_rows == [0, 1, 7, 8, 4]
    assert back.prompt_singles == [4]
    tables = back.tables()
    assert tables[7] == ({2: 2, 3: 6}, {2: 0, 3: 1}) and tables[1] == ({0: 1, 1: 4, 2: 2}, {0: -1, 1: 4, 2: 5})
    assert tables[8][0] == {0: 8, 1: -1, 2: 2, 3: 6}
    # what rank 0 broadcasts: the placeholders of carried tokens replaced by the sampled ids
    positions, sources = protocol.carried_positions(step)
    assert sources == [1, 0] and [int(packed[p]) for p in positions] == [0, 0]
    sampled = torch.tensor([41, 42])
    packed[positions] = sampled[sources].to(torch.int32)
    assert protocol.unpack_step(packed).token_ids == [5, 6, 7, 9, 42, 41, 11]


@pytest.mark.extras  # another pair of rank processes (~10 s): CI's extras step
async def test_tp2_in_bf16_computes_what_one_rank_does():
    """A bf16 model over two ranks. Its rotary ``inv_freq`` buffers are bf16 (``model.to``) where a
    skeleton built in bf16 makes them float32: sent as they were, rank 1 received half the bytes it
    read, rotated with garbage, and no first token matched one rank's. On acb's bf16 GEMMs the
    partial sums are float32, so the two layouts agree (oneDNN's sum bf16 partials: near-ties differ)."""
    from acb.model.fused import native_bf16

    model = tiny_model("llama").to(torch.bfloat16)
    prompts = random_prompts(6, 4, 40, seed=3)
    base = dict(page_size=8, num_blocks=64, max_batch_tokens=48, dtype="bfloat16")
    async with acb.Engine(model, tokenizer=tiny_tokenizer(), config=tp_config(tensor_parallel_size=1, **base)) as one:
        want = [r.token_ids for r in await one.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)]
        async with acb.Engine(model, tokenizer=tiny_tokenizer(), config=tp_config(**base)) as engine:
            got = [r.token_ids for r in await engine.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)]
            assert engine.stats().dtype == "bfloat16"
    assert [g[0] for g in got] == [w[0] for w in want]
    agreement = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w)) / (12 * len(prompts))
    assert agreement >= (0.9 if native_bf16() is not None else 0.5), agreement


@pytest.mark.extras  # another pair of rank processes (~20 s): CI's extras step
async def test_tp2_embeddings_equal_one_ranks_beside_generation():
    """Engine.embed on two ranks: the pooled positions stay on rank 0 (as prompt logprobs do; the
    other rank only computes the layers with it), so the vectors are one rank's, while a greedy
    stream beside them keeps its tokens."""
    model = tiny_model("llama")
    texts = [[5, 17, 33, 60, 91], [7, 8, 9], list(range(3, 40))]
    prompt = [11, 12, 13, 14]
    async with acb.Engine(model, tokenizer=tiny_tokenizer(), config=tp_config(tensor_parallel_size=1)) as one:
        want = {p: await one.embed(texts, pooling=p) for p in ("last", "mean")}
        tokens = (await one.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)).token_ids
        async with acb.Engine(model, tokenizer=tiny_tokenizer(), config=tp_config()) as engine:
            stream = asyncio.ensure_future(engine.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True))
            got = {p: await engine.embed(texts, pooling=p) for p in ("last", "mean")}
            assert (await stream).token_ids == tokens
    for p in want:
        assert torch.allclose(torch.tensor(got[p]), torch.tensor(want[p]), atol=1e-5), p
