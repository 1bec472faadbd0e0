"""The engine's seam to the running event loop: asyncio (uvloop too) or trio.

The engine's own waiting is done with anyio primitives (``anyio.Event``,
``anyio.sleep``, cancel scopes), so the same code runs on every backend. Two
things anyio does not offer are here, bound once per ``start()`` to the cheapest
call the running loop has:

- spawning the engine's loop task, which outlives the ``start()`` call that made
  it (asyncio: ``loop.create_task``; trio: a system task, trio's home for services
  that no nursery of the caller owns);
- waking the loop from another thread without blocking that thread (asyncio:
  ``loop.call_soon_threadsafe``; trio: ``TrioToken.run_sync_soon``). The step
  worker uses it to hand a finished step back, and ``Engine.cancel`` to reach the
  loop from a foreign thread.

Steps run on a dedicated one-thread executor, not on anyio's thread pool: steps must
execute strictly in order, and always on the same OS thread (its OpenMP pool and
CUDA stream are set up once); a ``CapacityLimiter(1)`` serialises calls but may
switch threads between them.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

import anyio


def current_backend() -> str:
    """``"asyncio"`` or ``"trio"``: the event loop running in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            return "trio"
    raise RuntimeError("acb needs a running asyncio or trio event loop (none is running in this thread)")


class LoopHandle:
    """The event loop that called ``Engine.start()``, as the engine needs it."""

    __slots__ = ("backend", "thread", "call_soon_threadsafe", "Event", "_loop")

    def __init__(self) -> None:
        self.backend = current_backend()
        self.thread = threading.get_ident()
        # anyio's Event class for this backend: ``anyio.Event()`` looks the backend up on
        # every call; the class itself does not (per-chunk waits cost what asyncio's do)
        self.Event: type[anyio.Event] = type(anyio.Event())
        if self.backend == "asyncio":
            self._loop = asyncio.get_running_loop()
            self.call_soon_threadsafe: Callable[..., Any] = self._loop.call_soon_threadsafe
        else:
            import trio

            self._loop = None
            self.call_soon_threadsafe = trio.lowlevel.current_trio_token().run_sync_soon

    def spawn(self, fn: Callable[[], Coroutine[Any, Any, None]], name: str) -> Any:
        """Run ``fn()`` as a task of its own that outlives the caller (it must not raise
        anything but cancellation). Returns the asyncio task (keep a reference), or None."""
        if self._loop is not None:
            return self._loop.create_task(fn(), name=name)
        import trio

        trio.lowlevel.spawn_system_task(fn, name=name)
        return None

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread

    async def wait_future(self, future: Future) -> Any:
        """The result of a ``concurrent.futures.Future`` from a worker thread, awaited
        without blocking the loop. Cancelling the wait leaves the work running."""
        if not future.done():
            done = self.Event()
            wake = self.call_soon_threadsafe

            def on_done(_: Future) -> None:
                try:
                    wake(done.set)
                except RuntimeError:  # the loop has ended: nobody is waiting any more
                    pass

            future.add_done_callback(on_done)
            await done.wait()
        return future.result()


__all__ = ["LoopHandle", "current_backend"]
