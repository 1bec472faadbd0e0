"""Progress for long work: generate_batch's tqdm bar (engine and sync), the throughput line
`acb serve` logs at --log-interval, GGUF conversion's bar."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import pytest
from http_helpers import free_port

import acb
from acb.core.progress import ThroughputSummary
from acb.testing import tiny_engine, tiny_model, tiny_tokenizer

PROMPTS = ["hello", "a cat", "what is two and two?", "x"]


async def test_generate_batch_progress_shows_requests_done_and_tokens_per_second(capsys):
    async with tiny_engine() as engine:
        results = await engine.generate_batch(PROMPTS, max_new_tokens=5, ignore_eos=True, progress=True)
    assert [len(r.token_ids) for r in results] == [5] * 4
    err = capsys.readouterr().err
    assert "generate_batch" in err and "4/4" in err and "tok/s" in err


async def test_generate_batch_shows_no_bar_by_default(capsys):
    async with tiny_engine() as engine:
        await engine.generate_batch(PROMPTS, max_new_tokens=3)
    assert capsys.readouterr().err == ""


async def test_generate_batch_progress_must_be_a_bool():
    async with tiny_engine() as engine:
        with pytest.raises(acb.InvalidRequestError, match="progress") as info:
            await engine.generate_batch(PROMPTS, progress="yes")
    assert info.value.param == "progress"


def test_sync_generate_batch_progress_shows_the_bar(capsys):
    results = acb.generate_batch(tiny_model("llama"), PROMPTS[:3], tokenizer=tiny_tokenizer(),
                                 max_new_tokens=4, ignore_eos=True, progress=True)
    assert len(results) == 3
    err = capsys.readouterr().err
    assert "3/3" in err and "tok/s" in err


async def test_throughput_summary_is_quiet_when_idle_and_counts_tokens_after_work():
    async with tiny_engine() as engine:
        summary = ThroughputSummary(engine.stats)
        assert summary.line() is None
        await engine.generate("hello", max_new_tokens=6, ignore_eos=True)
        line = summary.line()
        assert line is not None and "tok/s" in line and "running 0, waiting 0" in line
        assert summary.line() is None  # nothing happened since


async def test_acb_serve_logs_a_throughput_line_at_its_log_interval(tmp_path):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acb.cli", "serve", "--tiny", "--port", str(port), "--log-interval", "0.2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        await asyncio.wait_for(proc.stdout.readline(), 120)  # "acb: serving ... on URL"
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                assert resp.status == 200
        seen = []
        while not any("throughput:" in line for line in seen):
            line = await asyncio.wait_for(proc.stderr.readline(), 30)
            assert line, "acb serve exited without a throughput line: " + "".join(seen)
            seen.append(line.decode())
        summary = next(line for line in seen if "throughput:" in line)
        assert "tok/s" in summary and "waiting" in summary and "KV cache" in summary
    finally:
        proc.terminate()
        await proc.wait()


def test_serve_log_interval_must_not_be_negative(capsys):
    from acb.serving.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--tiny", "--log-interval", "-1"])
    assert "--log-interval" in capsys.readouterr().err


@pytest.mark.extras
def test_gguf_conversion_shows_its_stages_on_a_bar(tmp_path, monkeypatch, capsys):
    from acb.model.loading import _converted_gguf, smollm2

    monkeypatch.setenv("ACB_CACHE_DIR", str(tmp_path))  # a cold cache: the conversion really runs
    target = _converted_gguf(*smollm2())
    assert (target / "config.json").is_file()
    err = capsys.readouterr().err
    assert "acb: converting SmolLM2" in err and "3/3" in err


async def test_a_batch_raises_its_first_failure_while_earlier_requests_still_run():
    """generate_batch raises the first failure at once, wherever its request stands in the
    batch: it used to read the batch in order and hit a request still running first
    (RuntimeError 'the outcome is not set yet', the real error lost)."""
    import types

    from acb.core.mailbox import Outcome
    from acb.core.progress import gather_batch

    reqs = [types.SimpleNamespace(request_id=str(i), future=Outcome()) for i in range(3)]
    cancelled: list[str] = []
    error = acb.RequestFailedError("step failed")

    async def fail_the_second() -> None:
        await asyncio.sleep(0.01)
        reqs[1].future.set_exception(error)

    task = asyncio.ensure_future(fail_the_second())
    with pytest.raises(acb.RequestFailedError) as raised:
        await gather_batch(reqs, asyncio.Event, False, cancelled.append)
    await task
    assert raised.value is error
    assert cancelled == ["0", "1", "2"]  # the rest of the batch is cancelled with it
