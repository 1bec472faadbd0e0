"""The ``acb`` command: ``acb serve --tiny`` as a real process, spoken to over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from importlib.metadata import entry_points

import aiohttp
import pytest
from http_helpers import free_port, sse_events

from acb.serving.cli import main


def test_console_script_points_at_main():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "acb"]
    assert script.value == "acb.cli:main"


@pytest.mark.parametrize("argv", [[], ["serve", "--port", "70000"], ["serve", "--tiny", "some/dir"],
                                  ["serve", "/no/such/model/dir"], ["serve", "--tiny", "--cpu-offload-space", "-1"],
                                  ["serve", "--tiny", "--num-replicas", "2"],  # Ray options need --ray
                                  ["serve", "--tiny", "--ray", "--port", "0"],
                                  ["serve", "--tiny", "--ray", "--target-queue-depth", "8"],
                                  ["serve", "--tiny", "--ray", "--num-replicas", "3", "--max-replicas", "2"],
                                  ["serve", "--tiny", "--ray", "--port", "8000", "--kv-events", "--router", "queue"],
                                  ["serve", "--tiny", "--router", "prefix"],  # needs --ray
                                  ["serve", "--tiny", "--ray", "--port", "8000", "--router", "nearest"],
                                  ["serve", "--ray", "/no/such/model/dir"]])
def test_bad_command_lines_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "usage: acb" in capsys.readouterr().err


def test_serve_options_reach_the_engine_config():
    from acb.serving.cli import _build_engine, build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--tiny", "--num-blocks", "40", "--cpu-offload-space", "0.001",
                              "--scheduler", "priority", "--priority-aging-steps", "7",
                              "--grammar-compile-timeout", "2.5"])
    engine, name = _build_engine(args, parser)
    assert name == "acb-tiny"
    assert engine.config.grammar_compile_timeout_s == 2.5
    stats = engine.stats()
    assert stats.total_blocks == 40 and stats.host_blocks > 0
    assert engine.scheduler.policy == "priority" and engine.scheduler.aging_steps == 7


def test_a_taken_port_exits_1_with_a_message(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--tiny", "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.fixture
def server_log(tmp_path):
    with open(tmp_path / "server.log", "w") as log:
        yield log


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_serve_process_answers_then_drains_and_exits_0_on_signal(signum, server_log, tmp_path):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "acb.cli", "serve", "--tiny", "--port", str(port), "--drain-timeout", "20",
        "--scheduler", "priority", "--kv-events", "--enable-per-request-metrics",
        stdout=asyncio.subprocess.PIPE, stderr=server_log, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        ready = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert f"http://127.0.0.1:{port}" in ready.decode(), (tmp_path / "server.log").read_text()
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(base_url=url) as session:
            async with session.get("/health") as resp:
                assert resp.status == 200
            async with session.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True,
                                                             "priority": -1}) as resp:
                answer = await resp.json()
                assert answer["usage"]["completion_tokens"] == answer["metrics"]["completion_tokens"] == 4
            kv_events = await session.get("/v1/kv_events")  # never ends by itself: the engine's drain ends it
            assert json.loads((await anext(sse_events(kv_events)))[1])["resync"]
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "ignore_eos": True,
                    "stream": True}
            async with session.post("/v1/chat/completions", json=body) as resp:
                events = sse_events(resp)
                await anext(events)
                proc.send_signal(signum)  # mid-stream: the request must still finish
                rest = [data async for _, data in events]
            await asyncio.wait_for(kv_events.read(), 10)  # not after aiohttp's 25 s handler timeout
            kv_events.release()
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
