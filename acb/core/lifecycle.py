"""The engine's lifecycle: one state, changed in one place (``Lifecycle.move``).

::

    STOPPED --start()--> RUNNING --stop()--> DRAINING --loop done--> STOPPED --aclose()--> CLOSED
                            |                   |
                            +--stop(hard=True), a device failure--> HALTING --loop done--> STOPPED
                            +--the loop crashed--> STOPPED

DRAINING finishes what the engine holds; HALTING ends the loop at once (every
unfinished request has failed). A device failure also leaves its reason, which
``start()`` clears and which the errors of a stopped engine quote until then.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from .errors import EngineClosedError, EngineStoppedError


class EngineState(enum.Enum):
    STOPPED = "stopped"
    RUNNING = "running"
    DRAINING = "draining"  # stop(): the loop finishes what it holds, admitting nothing
    HALTING = "halting"  # stop(hard=True) or a device failure: the loop ends at once
    CLOSED = "closed"


_TRANSITIONS = {
    EngineState.STOPPED: frozenset({EngineState.RUNNING, EngineState.CLOSED}),
    EngineState.RUNNING: frozenset({EngineState.DRAINING, EngineState.HALTING, EngineState.STOPPED}),
    EngineState.DRAINING: frozenset({EngineState.HALTING, EngineState.STOPPED}),
    EngineState.HALTING: frozenset({EngineState.STOPPED}),
    EngineState.CLOSED: frozenset(),
}


class Lifecycle:
    """The engine's state, and the reason it stopped when a failure stopped it.
    ``outside_error`` reports a failure found outside the loop (a tensor-parallel rank
    that died): the engine then admits nothing."""

    __slots__ = ("state", "reason", "_outside_error")

    def __init__(self, outside_error: Callable[[], BaseException | None] = lambda: None) -> None:
        self.state = EngineState.STOPPED
        self.reason: str | None = None
        self._outside_error = outside_error

    def move(self, to: EngineState, reason: str | None = None) -> None:
        """Go to ``to`` (staying put is allowed); RuntimeError for a move the lifecycle
        does not have. ``reason``: why a failure stopped the engine (kept until start)."""
        if to is not self.state and to not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"acb engine: no transition from {self.state.value} to {to.value}")
        self.state = to
        if to is EngineState.RUNNING:
            self.reason = None
        elif reason is not None:
            self.reason = reason

    @property
    def halting(self) -> bool:
        return self.state is EngineState.HALTING

    @property
    def looping(self) -> bool:
        """Whether the loop task is (or should be) alive."""
        return self.state in (EngineState.RUNNING, EngineState.DRAINING, EngineState.HALTING)

    @property
    def accepting(self) -> bool:
        return self.state is EngineState.RUNNING and self._outside_error() is None

    def check_open(self) -> None:
        if self.state is EngineState.CLOSED:
            raise EngineClosedError("the engine is closed")

    def check_startable(self) -> None:
        self.check_open()
        error = self._outside_error()
        if error is not None:
            raise EngineStoppedError(self.reason or f"the engine stopped: {error}")

    def check_accepting(self) -> None:
        """Raise the error a request gets from an engine that admits nothing now."""
        self.check_startable()
        if self.state is not EngineState.RUNNING:
            raise EngineStoppedError(self.reason or "the engine is not running: call `await engine.start()` first")
