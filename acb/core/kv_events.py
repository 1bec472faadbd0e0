"""KV-cache events: which prefix pages the engine holds, for routers that send a request
to the replica that already caches its prefix. Plain Python, no torch.

The ``KVCacheManager`` reports, as they happen, the pages whose prefix hash it registers
(``BlockStored``), the hashes it forgets (``BlockRemoved``: an evicted cached page) and a
wholesale reset (``AllBlocksCleared``: the model changed). The engine collects them into
one ``KVEventBatch`` per step and hands each batch to every subscriber of
``engine.kv_events()`` (vLLM's event names and fields, RFC #16669).

A subscriber never slows the engine: each has a bounded queue of batches. When it is full
the queued batches are dropped (counted in ``dropped``) and the subscriber's next batch is
a *resync*: ``AllBlocksCleared`` followed by one ``BlockStored`` per page registered now,
built when the subscriber reads it. Replaying the batches in order (a set of hashes: add on
``BlockStored``, discard on ``BlockRemoved``, clear on ``AllBlocksCleared``) gives the
engine's current set of prefix pages, resync or not: every event states what is true after
it, so whatever queued after a resync replays onto it to the same set. A new subscription
starts with a resync too.

Example::

    async for batch in engine.kv_events():
        for event in batch.events:
            if isinstance(event, acb.BlockStored):
                index.update(event.block_hashes)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class BlockStored:
    """Full pages registered for prefix hits: ``block_hashes`` are consecutive pages of one
    token chain, the first one following ``parent_block_hash`` (None: the chain's start);
    ``token_ids`` are their tokens, ``block_size`` per page."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # where the pages live: "GPU" or "CPU"


@dataclass(slots=True)
class BlockRemoved:
    """Pages whose prefix hashes the cache forgot (evicted to make room)."""

    block_hashes: list[int]
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """Every prefix hash is forgotten (the model's weights changed; or a resync follows)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """The events of one engine step, in order. ``ts``: ``time.time()`` when it was made.
    ``resync``: the batch describes the whole current set (it starts with
    ``AllBlocksCleared``); ``dropped``: batches this subscriber lost (its queue was full)
    just before it."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    dropped: int = 0
    resync: bool = False


class KVEventStream:
    """One subscriber's batches: an async iterator (``engine.kv_events()``) that ends when the
    engine stops or the stream is closed. Reads run on the event loop's thread."""

    def __init__(self, publisher: KVEventPublisher, max_batches: int) -> None:
        self._publisher = publisher
        self.max_batches = max_batches
        self._queue: deque[KVEventBatch] = deque()
        self._resync = True  # a new subscriber first gets the whole current set
        self._lost = 0  # batches dropped since the last resync was read
        self.dropped = 0  # batches dropped in all
        self.closed = False
        self._waiter: Any = None

    def _put(self, batch: KVEventBatch) -> None:
        if self._resync:
            return  # the resync read next describes the state this batch leads to
        if len(self._queue) >= self.max_batches:
            lost = len(self._queue) + 1
            self._queue.clear()
            self._lost += lost
            self.dropped += lost
            self._resync = True
        else:
            self._queue.append(batch)
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set()

    def pending(self) -> list[KVEventBatch]:
        """Every batch ready now, without waiting (a resync first, if one is due)."""
        out = []
        if self._resync and not self.closed:
            out.append(self._take_resync())
        out.extend(self._queue)
        self._queue.clear()
        return out

    def _take_resync(self) -> KVEventBatch:
        self._resync = False
        batch = KVEventBatch(time.time(), [AllBlocksCleared(), *self._publisher.snapshot()], self._lost, True)
        self._lost = 0
        return batch

    def close(self) -> None:
        """Unsubscribe: the iterator ends after what is queued."""
        if not self.closed:
            self.closed = True
            self._publisher.streams.discard(self)
            self._wake()

    def __aiter__(self) -> KVEventStream:
        return self

    async def __anext__(self) -> KVEventBatch:
        import anyio

        while True:
            if self._resync and not self.closed:
                return self._take_resync()
            if self._queue:
                return self._queue.popleft()
            if self.closed:
                raise StopAsyncIteration
            self._waiter = waiter = anyio.Event()
            await waiter.wait()


class KVEventPublisher:
    """Collects the cache's events (``pending``: the list the ``KVCacheManager`` appends
    to) and, once per step (``flush``), hands them as one batch to every open stream."""

    def __init__(self, snapshot: Callable[[], Iterable[KVEvent]]) -> None:
        self.snapshot = snapshot  # the current set as BlockStored events (for resyncs)
        self.pending: list[KVEvent] = []
        self.streams: set[KVEventStream] = set()
        self.batches = 0  # batches published

    def subscribe(self, max_batches: int) -> KVEventStream:
        """A new subscriber's stream, holding at most ``max_batches`` (an int >= 1) unread batches."""
        if not isinstance(max_batches, int) or isinstance(max_batches, bool) or max_batches < 1:
            raise ValueError(f"max_batches must be an int >= 1, got {max_batches!r}")
        stream = KVEventStream(self, max_batches)
        self.streams.add(stream)
        return stream

    def flush(self) -> None:
        """Publish what happened since the last flush as one batch (nothing if nothing did)."""
        if not self.pending:
            return
        batch = KVEventBatch(time.time(), list(self.pending))
        self.pending.clear()  # the same list: the cache manager appends to it
        self.batches += 1
        for stream in self.streams:
            stream._put(batch)

    def close(self) -> None:
        """End every stream (the engine stopped)."""
        self.flush()
        for stream in list(self.streams):
            stream.close()
