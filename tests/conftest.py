"""Shared fixtures: tiny in-process models (see acb.testing) and helpers."""

from __future__ import annotations

import os

# Triton's interpreter runs acb's Triton kernels on CPU tensors (tests/test_triton_kernels.py
# and the engine's attn_backend="triton" tests). Triton reads this when a kernel is
# defined, so it must be set before anything imports acb.kernels.triton_attention.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from acb.testing import tiny_model, tiny_tokenizer

# Under pytest-xdist (scripts/test.sh runs one worker per core) each worker's torch, and the
# processes its tests start, take the worker's share of the cores instead of all of them: two
# workers each spinning two OpenMP threads on two cores ran the suite no faster than one.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    import torch  # noqa: E402

    torch.set_num_threads(_share)

# `acb serve` processes the tests start log no periodic throughput lines unless a test asks
os.environ.setdefault("ACB_LOG_INTERVAL", "0")


@pytest.fixture(autouse=True, scope="session")
def integrity_checks():
    """Every engine the suite builds checks its page accounting (refcounts against the live
    requests' block tables, no page twice in the free list or in one table, the disk tier's
    index) whenever it goes idle: ``EngineConfig.debug_checks``, turned on by the environment
    (``acb.core.defaults``), which the ``acb serve`` processes tests start inherit too.
    tests/test_integrity_checks.py shows it is on."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACB_DEBUG_CHECKS", "1")
        yield


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def steady_ram(monkeypatch):
    """The RAM available, as the cache sizing reads it (psutil), held at 16 GiB: tests that compare two
    layouts would otherwise see the other workers' processes move it between the two."""
    import types

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=16 << 30))


@pytest.fixture
def llama():
    return tiny_model("llama")



def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true")


def _runs_extras(config: pytest.Config) -> bool:
    return (config.getoption("markexpr", "") or "").strip() == "extras"


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


# The default suite skips a module or test whose optional package (Ray, Triton, xgrammar, ...) is
# missing: `pytest.importorskip(..., reason=...)` names it, so a fresh `pip install -e .[test]`
# still collects. CI's extras run (scripts/test-extras.sh, after `setup.sh --extras`) must run
# what it selected: there such a skip fails instead, as a missing package always did there.
@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if report.skipped and isinstance(collector, pytest.Module) and _in_ci() and _runs_extras(collector.config):
        reason = _skip_reason(report)
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid} was skipped in CI's extras run ({reason}): "
                           "scripts/setup.sh --extras must install what it needs")
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if (report.skipped and not hasattr(report, "wasxfail") and _in_ci()
            and item.get_closest_marker("extras") is not None):
        reason = _skip_reason(report)
        report.outcome = "failed"
        report.longrepr = f"an extras test was skipped in CI ({reason}): CI must run every extras test"
    return report


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
