"""Warnings users see must be acb's own (issue 63): ``acb serve``'s start-up, on the tiny model
and on the real SmolLM2 (also on a first load, which converts its GGUF: dense, and into int8,
where torch once warned that the GGUF's memory map is not writable), answers a request and
stops without a single Python warning on its stderr, every warning shown
(``PYTHONWARNINGS=always``). The README's quick start is held to the same in
test_doc_examples.py."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys

import aiohttp
import pytest
from http_helpers import acb_serve

# what Python prints for a warning: "path:line: SomeWarning: message" (acb's log lines say WARNING)
WARNING_LINE = re.compile(r"^.*\b[A-Z]\w*Warning: .*$", re.M)


def warnings_in(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are Python warnings."""
    return WARNING_LINE.findall(stderr)


def test_a_third_party_warning_is_seen():
    """The check itself: torch's warning about a read-only NumPy array (the GGUF one) is caught."""
    code = "import numpy, torch; a = numpy.zeros(3); a.flags.writeable = False; torch.from_numpy(a)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "always"})
    assert run.returncode == 0, run.stderr
    assert len(warnings_in(run.stderr)) == 1 and "not writable" in run.stderr


async def _serve_answer_stop(tmp_path, *args: str, env: dict[str, str] | None = None) -> str:
    """Start ``acb serve *args`` with every warning shown, ask one chat question, stop it
    with SIGINT; its stderr."""
    with open(tmp_path / "server.log", "w") as log:
        async with acb_serve(*args, log=log, env={"PYTHONWARNINGS": "always", **(env or {})},
                             timeout=600) as (url, proc):
            async with aiohttp.ClientSession(base_url=url) as session:
                body = {"messages": [{"role": "user", "content": "Name a cat breed."}], "max_tokens": 4}
                async with session.post("/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 60) == 0
    return (tmp_path / "server.log").read_text()


async def test_acb_serve_tiny_prints_no_warning(tmp_path):
    stderr = await _serve_answer_stop(tmp_path, "--tiny")
    assert warnings_in(stderr) == [], stderr[-4000:]


def _int8_kernels() -> bool:
    from acb.kernels.cpu import int8_kernels

    kernels = int8_kernels()
    return kernels is not None and kernels.available()


@pytest.mark.slow
@pytest.mark.extras  # the tiny model's serve above runs in the default suite
async def test_acb_serve_smollm2_prints_no_warning(tmp_path):
    stderr = await _serve_answer_stop(tmp_path)
    assert warnings_in(stderr) == [], stderr[-4000:]


# a first load converts the GGUF (dense: ~50 s; into int8: ~40 s and more), as test_gguf_int8.py
# does: CI runs these in its extras step
@pytest.mark.slow
@pytest.mark.extras
@pytest.mark.parametrize("args", [[], ["--quantization", "int8"]], ids=["dense", "int8"])
async def test_acb_serve_smollm2_first_load_prints_no_warning(tmp_path, args):
    if args and not _int8_kernels():
        pytest.skip("acb's int8 kernels need AVX-512 VNNI or AVX2 and a compiler")
    stderr = await _serve_answer_stop(tmp_path, *args, env={"ACB_CACHE_DIR": str(tmp_path / "cache")})
    assert "first load only" in stderr  # (the GGUF was read, not a cached conversion)
    assert warnings_in(stderr) == [], stderr[-4000:]
