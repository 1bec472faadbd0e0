"""What ``submit`` and ``stream`` hand to the caller."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import anyio

from .mailbox import ChoicesMailbox, Mailbox, Outcome
from .outputs import Chunk, Completion


class ChunkStream:
    """Async iterator over one request's chunks. Leaving it early (``break``, an
    exception, or cancellation of the consuming task or of its anyio cancel scope)
    cancels the request."""

    __slots__ = ("_mailbox", "_cancel", "_done", "__weakref__")

    def __init__(self, mailbox: Mailbox | ChoicesMailbox, cancel: Callable[[], None]) -> None:
        self._mailbox = mailbox
        self._cancel = cancel
        self._done = False

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        try:
            chunk = await self._mailbox.get()
        except BaseException as e:
            if isinstance(e, anyio.get_cancelled_exc_class()):
                self._abandon()
            else:
                self._done = True
            raise
        if chunk is None:
            self._done = True
            raise StopAsyncIteration
        if chunk.finish_reason is not None and self._mailbox.finished:  # with n > 1: every choice's
            self._done = True
        return chunk

    def _abandon(self) -> None:
        if not self._done:
            self._done = True
            self._cancel()

    async def aclose(self) -> None:
        """Stop consuming: cancels the request if it has not finished."""
        self._abandon()

    def __del__(self) -> None:
        # ``break`` out of ``async for`` drops the last reference right away (CPython):
        # that is when an abandoned request gets cancelled.
        try:
            self._abandon()
        except Exception:
            pass


class RequestHandle:
    """A submitted request: ``async for chunk in handle`` streams it, ``await handle``
    gives its :class:`Completion`, ``handle.cancel()`` cancels it.

    Example::

        handle = engine.submit("Hello", max_new_tokens=8)
        async for chunk in handle:
            print(chunk.text, end="")
        completion = await handle
    """

    __slots__ = ("request_id", "_mailbox", "_future", "_cancel")

    def __init__(self, request_id: str, mailbox: Mailbox | ChoicesMailbox | None, future: Outcome,
                 cancel: Callable[[], Any]) -> None:
        self.request_id = request_id
        self._mailbox = mailbox
        self._future = future
        self._cancel = cancel

    def cancel(self, index: int | None = None) -> bool:
        """Cancel the request (with ``n`` > 1: every choice, or only choice ``index``);
        returns False if it had already ended."""
        return bool(self._cancel() if index is None else self._cancel(index))

    def done(self) -> bool:
        """True once the request has finished (any ``finish_reason``) or failed."""
        return self._future.done()

    def __aiter__(self) -> ChunkStream:
        # A fresh iterator each time, referenced only by the ``async for`` that asked
        # for it: leaving that loop early drops it, and dropping it cancels the request.
        if self._mailbox is None:
            raise RuntimeError("this request was submitted without streaming")
        return ChunkStream(self._mailbox, self._cancel)

    async def _wait(self) -> Completion:
        try:
            return await self._future.wait()
        except BaseException:
            if not self._future.done():  # the waiter was cancelled, not the request
                self._cancel()
            raise

    def __await__(self) -> Generator[Any, None, Completion]:
        return self._wait().__await__()
