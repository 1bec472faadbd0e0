"""Shared fixtures: tiny in-process models (see acb.testing) and helpers."""

from __future__ import annotations

import os

# Triton's interpreter runs acb's Triton kernels on CPU tensors (tests/test_triton_kernels.py
# and the engine's attn_backend="triton" tests). Triton reads this when a kernel is
# defined, so it must be set before anything imports acb.kernels.triton_attention.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from acb.testing import tiny_model, tiny_tokenizer

# `acb serve` processes the tests start log no periodic throughput lines unless a test asks
os.environ.setdefault("ACB_LOG_INTERVAL", "0")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def llama():
    return tiny_model("llama")



def pytest_collection_modifyitems(items):
    """Tests marked ``anyio`` run under anyio's plugin (its ``anyio_backend`` fixture
    picks asyncio, uvloop or trio), not under pytest-asyncio's auto mode, which
    claims every coroutine test: such items are handed back as plain test functions."""
    from pytest_asyncio.plugin import PytestAsyncioFunction

    for i, item in enumerate(items):
        if isinstance(item, PytestAsyncioFunction) and item.get_closest_marker("anyio") is not None:
            items[i] = pytest.Function.from_parent(
                item.parent, name=item.name, callspec=getattr(item, "callspec", None), callobj=item.obj,
                fixtureinfo=item._fixtureinfo, keywords=item.keywords, originalname=item.originalname,
            )
