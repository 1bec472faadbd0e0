"""How the engine's output reaches its consumers: the per-request ``Mailbox`` that merges
deltas for a consumer that falls behind (``ChoicesMailbox``: a request's ``n`` choices read as
one stream), and the ``Outcome`` a request's final ``Completion`` or error is set on. The engine
side fills them on the event loop's thread; ``acb.RequestHandle`` reads them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from .outputs import Chunk

if TYPE_CHECKING:
    from .outputs import RequestMetrics
    from .prompt_logprobs import PromptLogprobs


class Mailbox:
    """Output of one request waiting for its consumer. The engine never waits for
    the consumer: deltas accumulate here and the next read takes them all as one
    chunk, so memory is bounded by the request's tokens, not by the steps taken."""

    __slots__ = ("request_id", "token_ids", "text", "logprobs", "top_logprobs", "finish_reason", "error",
                 "final_taken", "index", "prompt_logprobs", "reasoning", "reasoning_mask", "metrics", "_waiter",
                 "_new_event")

    def __init__(self, request_id: str, want_logprobs: bool,
                 new_event: Callable[[], anyio.Event] = anyio.Event, want_top_logprobs: bool = False,
                 index: int = 0) -> None:
        self.request_id = request_id
        self.index = index
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[float] | None = [] if want_logprobs else None
        self.top_logprobs: list[dict[int, float]] | None = [] if want_top_logprobs else None
        self.finish_reason: str | None = None
        self.metrics: RequestMetrics | None = None  # set with the finish: the last chunk carries it
        self.error: BaseException | None = None
        self.final_taken = False
        self.prompt_logprobs: PromptLogprobs | None = None  # until taken with the next chunk
        self.reasoning: list[str] = []
        self.reasoning_mask: list[bool] | None = None
        self._waiter: anyio.Event | None = None  # made only while the consumer waits
        self._new_event = new_event

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    def put(self, token_ids: list[int], text: str, logprobs: list[float] | None,
            finish_reason: str | None = None, top_logprobs: list[dict[int, float]] | None = None,
            reasoning: str = "", reasoning_mask: list[bool] | None = None) -> None:
        self.token_ids.extend(token_ids)
        if text:
            self.text.append(text)
        if reasoning:
            self.reasoning.append(reasoning)
        if reasoning_mask is not None:
            self.reasoning_mask = (self.reasoning_mask or []) + reasoning_mask
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(logprobs)
        if top_logprobs is not None and self.top_logprobs is not None:
            self.top_logprobs.extend(top_logprobs)
        if finish_reason is not None:
            self.finish_reason = finish_reason
        self._wake()

    def put_prompt_logprobs(self, scores: PromptLogprobs) -> None:
        """The prompt's scores, for the next chunk (they come with the first token's step)."""
        self.prompt_logprobs = scores
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    @property
    def finished(self) -> bool:
        """Whether the final chunk has been taken."""
        return self.final_taken

    async def get(self) -> Chunk | None:
        """Wait for output, then take all of it as one chunk; None once the final
        chunk has been taken. Raises the request's error after the output that
        came before it has been taken."""
        while True:
            chunk = self.take()
            if chunk is not None:
                return chunk
            if self.final_taken:
                return None
            if self.error is not None:
                raise self.error
            self._waiter = waiter = self._new_event()
            await waiter.wait()

    def take(self) -> Chunk | None:
        """All output waiting now as one chunk, or None if there is none."""
        if not (self.token_ids or self.text or self.prompt_logprobs or self.reasoning
                or (self.finish_reason and not self.final_taken)):
            return None
        chunk = Chunk(self.request_id, self.token_ids, "".join(self.text), self.logprobs, self.finish_reason,
                      self.index, self.top_logprobs, self.prompt_logprobs, "".join(self.reasoning),
                      self.reasoning_mask,
                      self.metrics if self.finish_reason is not None else None)
        self.prompt_logprobs = None
        self.reasoning = []
        self.reasoning_mask = None
        self.token_ids = []
        self.text = []
        if self.logprobs is not None:
            self.logprobs = []
        if self.top_logprobs is not None:
            self.top_logprobs = []
        if self.finish_reason is not None:
            self.final_taken = True
        return chunk


class Outcome:
    """A request's final ``Completion`` or error: the engine's stand-in for an
    ``asyncio.Future`` that any anyio backend (asyncio, trio) can await. Set on the
    event loop's thread only."""

    __slots__ = ("_result", "_error", "_done", "_event", "_callbacks", "_new_event")

    def __init__(self, new_event: Callable[[], anyio.Event] = anyio.Event) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = False
        self._event: anyio.Event | None = None  # made only when someone waits
        self._callbacks: list[Callable[[Outcome], None]] | None = None
        self._new_event = new_event

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:
        self._result = result
        self._settle()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._settle()

    def _settle(self) -> None:
        if self._done:
            raise RuntimeError("the outcome is already set")
        self._done = True
        if self._event is not None:
            self._event.set()
        for callback in self._callbacks or ():
            callback(self)

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        """The result, or raise the error (only once ``done()``)."""
        if not self._done:
            raise RuntimeError("the outcome is not set yet")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, callback: Callable[[Outcome], None]) -> None:
        """Call ``callback(self)`` once set (at once if it already is)."""
        if self._done:
            callback(self)
        else:
            self._callbacks = [*(self._callbacks or ()), callback]

    async def wait(self) -> Any:
        """Wait until set, then return the result or raise the error."""
        if not self._done:
            if self._event is None:
                self._event = self._new_event()
            await self._event.wait()
        return self.result()


class ChoicesMailbox:
    """The mailboxes of a request's ``n`` choices, read as one stream: their chunks
    interleave (``Chunk.index`` tells them apart, each choice's own order kept) and it
    ends after every choice's final chunk."""

    __slots__ = ("members", "_new_event", "_next")

    def __init__(self, request_id: str, n: int, want_logprobs: bool, want_top_logprobs: bool,
                 new_event: Callable[[], anyio.Event] = anyio.Event) -> None:
        self._new_event = new_event
        self.members = [Mailbox(request_id, want_logprobs, new_event, want_top_logprobs, i) for i in range(n)]
        self._next = 0  # round robin: a fast choice does not starve the others' chunks

    @property
    def finished(self) -> bool:
        return all(m.final_taken for m in self.members)

    async def get(self) -> Chunk | None:
        """The next chunk of any choice; None once every final chunk has been taken."""
        n = len(self.members)
        while True:
            for k in range(n):
                chunk = self.members[(self._next + k) % n].take()
                if chunk is not None:
                    self._next = (self._next + k + 1) % n
                    return chunk
            if self.finished:
                return None
            for m in self.members:
                if m.error is not None and not m.final_taken:
                    raise m.error
            waiter = self._new_event()
            for m in self.members:  # whichever choice gets output first wakes this reader
                m._waiter = waiter
            await waiter.wait()
