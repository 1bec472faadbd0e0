"""acb.testing's pytest fixtures on the test's own loop: under anyio's plugin
(asyncio, uvloop, trio) and under pytest-asyncio."""

from __future__ import annotations

import asyncio

import pytest

from acb.core.eventloop import current_backend

BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", BACKENDS)
async def test_acb_engine_fixture_under_anyio(acb_engine, anyio_backend):
    assert current_backend() == anyio_backend[0]
    assert acb_engine.is_running
    chunks = [c async for c in acb_engine.stream("hi", max_new_tokens=4, ignore_eos=True)]
    assert chunks[-1].finish_reason == "length"
    assert len((await acb_engine.generate([5, 6], max_new_tokens=3, ignore_eos=True)).token_ids) == 3


async def test_acb_engine_fixture_under_pytest_asyncio(acb_engine, acb_tiny_model, acb_tokenizer):
    asyncio.get_running_loop()  # pytest-asyncio's loop
    assert acb_engine.is_running
    assert len((await acb_engine.generate([5, 6], max_new_tokens=3, ignore_eos=True)).token_ids) == 3
    assert acb_tokenizer.decode(acb_tokenizer.encode("ok")) == "ok" and acb_tiny_model.training is False
