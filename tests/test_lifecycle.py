"""The engine's lifecycle on its own (acb/core/lifecycle.py): the moves it has, the ones it
refuses, and the errors a stopped, failed or closed engine gives. Plain Python (CI's
torch-free `core` stage runs it)."""

from __future__ import annotations

import pytest

from acb.core.errors import EngineClosedError, EngineStoppedError
from acb.core.lifecycle import EngineState, Lifecycle

S = EngineState


def test_a_graceful_run_and_close():
    life = Lifecycle()
    with pytest.raises(EngineStoppedError, match="call `await engine.start\\(\\)` first"):
        life.check_accepting()
    for state in (S.RUNNING, S.DRAINING, S.STOPPED, S.RUNNING, S.HALTING, S.STOPPED, S.CLOSED):
        life.move(state)
        assert life.state is state
        assert life.accepting == (state is S.RUNNING)
        assert life.looping == (state in (S.RUNNING, S.DRAINING, S.HALTING))
    with pytest.raises(EngineClosedError):
        life.check_accepting()
    with pytest.raises(EngineClosedError):
        life.check_open()


@pytest.mark.parametrize(("start", "to"), [(S.STOPPED, S.DRAINING), (S.STOPPED, S.HALTING), (S.HALTING, S.RUNNING),
                                           (S.DRAINING, S.RUNNING), (S.CLOSED, S.RUNNING), (S.RUNNING, S.CLOSED)])
def test_moves_the_lifecycle_does_not_have_are_refused(start, to):
    life = Lifecycle()
    life.state = start
    with pytest.raises(RuntimeError, match=f"no transition from {start.value} to {to.value}"):
        life.move(to)
    assert life.state is start


def test_a_failure_reason_is_quoted_until_the_next_start():
    life = Lifecycle()
    life.move(S.RUNNING)
    life.move(S.HALTING, "the engine stopped after a device failure: boom")
    life.move(S.STOPPED)
    with pytest.raises(EngineStoppedError, match="device failure: boom"):
        life.check_accepting()
    life.move(S.RUNNING)
    assert life.reason is None and life.accepting


def test_an_outside_failure_stops_admission_and_start():
    error = []
    life = Lifecycle(lambda: error[0] if error else None)
    life.move(S.RUNNING)
    assert life.accepting
    error.append(RuntimeError("rank 1 died"))
    assert not life.accepting
    with pytest.raises(EngineStoppedError, match="rank 1 died"):
        life.check_accepting()
    with pytest.raises(EngineStoppedError, match="rank 1 died"):
        life.check_startable()
