"""pytest fixtures for testing apps against a real acb engine (registered as the
``acb`` pytest plugin when acb is installed).

- ``acb_tiny_model``: a tiny random Llama (fresh for each test);
- ``acb_tokenizer``: the byte-level tokenizer;
- ``acb_engine_factory``: ``async with acb_engine_factory(**EngineConfig fields) as engine``
  works under pytest-asyncio and anyio's plugin alike;
- ``acb_engine``: a started engine, closed after the test. It runs on the test's own
  event loop: anyio's plugin (whichever ``anyio_backend``: asyncio, uvloop, trio) when
  the test uses it, else pytest-asyncio's.

Example::

    @pytest.mark.anyio
    async def test_my_app(acb_engine):
        assert (await acb_engine.generate("hi", max_new_tokens=4)).token_ids
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


async def _started_engine():
    async with tiny_engine() as engine:
        yield engine


@pytest.fixture
def acb_engine(request):
    # A plain fixture that runs the async one on the right runner itself: an async
    # fixture would be claimed by pytest-asyncio (auto mode takes them all) even for
    # a test that anyio's plugin runs on trio.
    if "anyio_backend" in request.fixturenames:
        from anyio.pytest_plugin import extract_backend_and_options, get_runner

        name, options = extract_backend_and_options(request.getfixturevalue("anyio_backend"))
        with get_runner(name, options) as runner:
            yield from runner.run_asyncgen_fixture(_started_engine, {})
    else:
        yield request.getfixturevalue("_acb_asyncio_engine")


try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - pytest-asyncio is optional for users
    pass
else:
    _acb_asyncio_engine = pytest_asyncio.fixture(_started_engine, name="_acb_asyncio_engine")
