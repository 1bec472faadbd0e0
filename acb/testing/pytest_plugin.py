"""pytest fixtures for testing apps against a real acb engine (registered as the
``acb`` pytest plugin when acb is installed).

- ``acb_tiny_model``: a tiny random Llama (fresh for each test);
- ``acb_tokenizer``: the byte-level tokenizer;
- ``acb_engine_factory``: ``async with acb_engine_factory(**EngineConfig fields) as engine``
  works under pytest-asyncio and anyio's plugin alike;
- ``acb_engine``: a started engine (pytest-asyncio), stopped after the test.
"""

from __future__ import annotations

import pytest

from . import tiny_engine, tiny_model, tiny_tokenizer


@pytest.fixture
def acb_tiny_model():
    return tiny_model("llama")


@pytest.fixture
def acb_tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def acb_engine_factory():
    return tiny_engine


try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - pytest-asyncio is optional for users
    pass
else:

    @pytest_asyncio.fixture
    async def acb_engine():
        async with tiny_engine() as engine:
            yield engine
