"""OpenAI batch files (acb.integrations.batch_files, ``acb run-batch``): every line answered once, in
OpenAI's output format, refused requests as error lines, the same tokens as the engine's own, and a
killed run finished by running it again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from acb.integrations.batch_files import finished_ids, read_requests, run_batch_file
from acb.integrations.openai_service import OpenAIService
from acb.testing import tiny_engine


def _line(i: int, chat: bool = True, **body) -> dict:
    if chat:
        body = {"model": "acb-tiny", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 6,
                "temperature": 0, **body}
        return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    body = {"model": "acb-tiny", "prompt": f"prompt {i}", "max_tokens": 6, "temperature": 0, **body}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}


def _write(path, lines) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def _results(path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a request was answered twice"
    return {r["custom_id"]: r for r in rows}


async def test_every_line_is_answered_once_in_openais_format_with_refusals_as_error_lines(tmp_path):
    lines = [_line(i, chat=i % 2 == 0) for i in range(24)]
    lines.append(_line(90, temperature=-1))  # a request the API refuses
    lines.append(_line(91, stream=True))  # batch results are written whole
    lines.append(_line(92, model="another-model"))
    _write(tmp_path / "in.jsonl", lines)
    async with tiny_engine() as engine:
        service = OpenAIService(engine, model_name="acb-tiny")
        summary = await run_batch_file(service, tmp_path / "in.jsonl", tmp_path / "out.jsonl", max_concurrency=8)
        direct = await engine.generate("prompt 3", max_new_tokens=6, do_sample=False)
    assert (summary.total, summary.skipped, summary.succeeded, summary.failed) == (27, 0, 24, 3)
    results = _results(tmp_path / "out.jsonl")
    assert set(results) == {line["custom_id"] for line in lines}
    for i in range(24):
        r = results[f"r{i}"]
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == ("chat.completion" if i % 2 == 0 else "text_completion")
        assert body["usage"]["completion_tokens"] == 6
    assert results["r3"]["response"]["body"]["choices"][0]["text"] == direct.text  # the engine's own tokens
    bad = results["r90"]
    assert bad["response"]["status_code"] == 400 and "temperature" in bad["error"]["message"]
    assert bad["response"]["body"]["error"]["param"] == "temperature"
    assert results["r91"]["response"]["status_code"] == 400 and "stream" in results["r91"]["error"]["message"]
    assert results["r92"]["response"]["status_code"] == 404


async def test_a_rerun_skips_finished_lines_and_reruns_a_torn_one(tmp_path):
    lines = [_line(i) for i in range(10)]
    _write(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    async with tiny_engine() as engine:
        service = OpenAIService(engine, model_name="acb-tiny")
        _write(tmp_path / "first.jsonl", lines[:4])
        await run_batch_file(service, tmp_path / "first.jsonl", out)
        with open(out, "a") as f:
            f.write('{"id": "batch_req_x", "custom_id": "r4", "respo')  # a kill mid-line
        summary = await run_batch_file(service, tmp_path / "in.jsonl", out)
    assert (summary.skipped, summary.succeeded) == (4, 6)
    assert set(_results(out)) == {f"r{i}" for i in range(10)}


@pytest.mark.parametrize("line, needle", [
    ("not json", "line 2: not JSON"),
    (json.dumps(_line(0)), "line 2: custom_id 'r0' repeats line 1's"),
    (json.dumps({**_line(5), "url": "/v1/images"}), "line 2: 'url' must be one of"),
    (json.dumps({**_line(5), "method": "GET"}), "line 2: 'method' must be \"POST\""),
    (json.dumps({k: v for k, v in _line(5).items() if k != "custom_id"}), "line 2: 'custom_id'"),
    (json.dumps({**_line(5), "body": []}), "line 2: 'body' must be a JSON object"),
])
def test_a_file_that_is_not_a_batch_file_is_refused_naming_the_line(tmp_path, line, needle):
    _write(tmp_path / "in.jsonl", [_line(0), line])
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        read_requests(tmp_path / "in.jsonl")


def test_an_output_file_that_is_not_results_is_refused(tmp_path):
    (tmp_path / "out.jsonl").write_text('{"custom_id": "r0"}\nsomething else\n')
    with pytest.raises(ValueError, match="line 2: not a batch result"):
        finished_ids(tmp_path / "out.jsonl")


@pytest.mark.extras  # a process started, killed and started again: CI's extras step
def test_the_command_killed_mid_run_finishes_when_run_again(tmp_path):
    n = 300
    _write(tmp_path / "in.jsonl", [_line(i, max_tokens=24) for i in range(n)])
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "acb.serving.cli", "run-batch", "--tiny", "-i", str(tmp_path / "in.jsonl"), "-o",
           str(out), "--max-concurrency", "16", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not out.exists() or out.read_text().count("\n") < 20):
            assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    first = len(finished_ids(out))
    assert 20 <= first < n
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{first} finished before" in done.stderr
    results = _results(out)
    assert set(results) == {f"r{i}" for i in range(n)}
    assert all(r["response"]["status_code"] == 200 for r in results.values())


def test_bad_files_exit_2_before_the_model_loads(tmp_path):
    _write(tmp_path / "in.jsonl", ["{"])
    done = subprocess.run([sys.executable, "-m", "acb.serving.cli", "run-batch", "--tiny", "-i",
                           str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "line 1: not JSON" in done.stderr
