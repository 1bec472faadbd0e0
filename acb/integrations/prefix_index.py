"""Prefix-aware routing over several engines: which replica holds the longest cached
prefix of a prompt, and where to send the prompt. Plain Python, no Ray, no torch (the Ray
router in :mod:`acb.integrations.ray_prefix` wraps it).

Each replica's set of cached pages is rebuilt from its ``engine.kv_events()``: the replica
sends its event batches, numbered, to a :class:`PrefixIndex` (``apply``); the index adds
the hashes of ``BlockStored``, removes those of ``BlockRemoved`` and clears on
``AllBlocksCleared``. A prompt's pages are hashed as the engine's prefix cache hashes them
(``acb.prefix_page_hashes``: chained page hashes, the same in every process), so the
longest run of a prompt's first pages found in a replica's set is what that replica's
cache would hit (``match``).

A replica is *unknown* until its first resync arrives, and again as soon as a batch is
missing (its numbering has a gap, or it starts a new stream without a resync) or it has
been silent for ``stale_after_s`` (a live replica sends a heartbeat when idle): an
unknown replica's set is not trusted, it only competes on load, until a resync (the
whole current set, which a fresh ``kv_events()`` subscription starts with) rebuilds it.

:func:`rank_replicas` turns the matches and the replicas' loads into the ranks Ray
Serve's router takes: the replica with the longest cached prefix first, unless it is
overloaded; then, as the free-pages router does, the replicas with the most free pages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from acb import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, prefix_page_hashes

# One batch as a replica sends it: (resync, events), each event ("stored", hashes),
# ("removed", hashes) or ("cleared",). Hashes only: token ids are not needed to match.
WireBatch = tuple[bool, list[tuple]]


def wire_batch(batch: KVEventBatch) -> WireBatch:
    """A ``kv_events()`` batch in the compact form a replica sends to the index."""
    events: list[tuple] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(("stored", list(event.block_hashes)))
        elif isinstance(event, BlockRemoved):
            events.append(("removed", list(event.block_hashes)))
        elif isinstance(event, AllBlocksCleared):
            events.append(("cleared",))
        else:
            raise TypeError(f"not a KV-cache event: {event!r}")
    return batch.resync, events


@dataclass(slots=True)
class ReplicaPages:
    """One replica's cached pages as its event stream tells them."""

    page_size: int
    stream: str = ""  # the replica's current subscription (a new one starts with a resync)
    seq: int = 0  # the last batch applied from it
    known: bool = False
    last_push: float = 0.0  # clock() at its last push (a live replica pushes at least every heartbeat)
    hashes: set[int] = field(default_factory=set)
    resyncs: int = 0
    gaps: int = 0  # times a batch was missing and the replica became unknown


class PrefixIndex:
    """The cached pages of every replica, rebuilt from their ``kv_events()``.

    Example::

        index = PrefixIndex()
        index.apply("r1", "stream-1", 1, page_size=16, batches=[wire_batch(b) for b in stream.pending()])
        index.match(prompt_ids, ["r1", "r2"])  # {"r1": 3, "r2": None}: r1 holds 3 pages, r2 unknown
    """

    def __init__(self, stale_after_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        self.stale_after_s = stale_after_s  # silent this long: its publisher is gone, the set is not trusted
        self.clock = clock
        self.replicas: dict[str, ReplicaPages] = {}

    def apply(self, replica: str, stream: str, seq: int, page_size: int, batches: Sequence[WireBatch]) -> bool:
        """Apply push number ``seq`` (numbered from 1 per ``stream``, one subscription of
        the replica's ``kv_events()``) of ``replica``'s event batches; an empty push is a
        heartbeat. Returns whether the index follows the stream: False when a push is
        missing, or a stream it does not know starts without a resync; the replica is then
        unknown and should subscribe again (a new subscription starts with a resync)."""
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        state = self.replicas.get(replica)
        if state is None or state.page_size != page_size:
            state = self.replicas[replica] = ReplicaPages(page_size)
        state.last_push = self.clock()
        starts_with_resync = bool(batches) and batches[0][0]
        if not starts_with_resync and (not state.known or state.stream != stream or seq != state.seq + 1):
            if state.known:
                state.gaps += 1
            state.known = False
            state.hashes.clear()  # stale: not trusted, not kept
            return False
        for resync, events in batches:
            if resync:
                state.hashes.clear()
                state.known = True
                state.resyncs += 1
            for event in events:
                kind = event[0]
                if kind == "stored":
                    state.hashes.update(event[1])
                elif kind == "removed":
                    state.hashes.difference_update(event[1])
                elif kind == "cleared":
                    state.hashes.clear()
                else:
                    raise ValueError(f"unknown KV event kind {kind!r}")
        state.stream, state.seq = stream, seq
        return True

    def forget(self, replica: str) -> None:
        """Drop a replica's state (it stopped)."""
        self.replicas.pop(replica, None)

    def retain(self, replicas: Iterable[str]) -> None:
        """Drop the state of every replica not in ``replicas`` (the running ones)."""
        keep = set(replicas)
        for replica in [r for r in self.replicas if r not in keep]:
            del self.replicas[replica]

    def match(self, token_ids: Sequence[int], replicas: Iterable[str]) -> dict[str, int | None]:
        """For each replica, how many of the prompt's first pages its cache holds
        (None: unknown, its set is not trusted now)."""
        hashes_by_size: dict[int, list[int]] = {}
        out: dict[str, int | None] = {}
        now = self.clock()
        for replica in replicas:
            state = self.replicas.get(replica)
            if state is None or not state.known or now - state.last_push > self.stale_after_s:
                out[replica] = None
                continue
            hashes = hashes_by_size.get(state.page_size)
            if hashes is None:
                hashes = hashes_by_size[state.page_size] = prefix_page_hashes(token_ids, state.page_size)
            held = 0
            for h in hashes:
                if h not in state.hashes:
                    break
                held += 1
            out[replica] = held
        return out

    def summary(self) -> dict[str, dict[str, int | bool]]:
        """Per replica: known, pages, resyncs, gaps (for logs and tests)."""
        now = self.clock()
        return {r: {"known": s.known and now - s.last_push <= self.stale_after_s, "pages": len(s.hashes),
                    "resyncs": s.resyncs, "gaps": s.gaps} for r, s in self.replicas.items()}


@dataclass(slots=True)
class Load:
    """What a replica reports to routers: requests running or waiting, free KV pages."""

    queue_depth: int
    free_pages: int


def rank_replicas(matches: dict[str, int | None], loads: dict[str, Load], *, max_queue_gap: int = 8,
                  min_match_pages: int = 1, holders_only: bool = False) -> list[list[str]]:
    """Where to send a prompt, as Ray Serve's ranks (Serve takes the replica with the
    shortest queue in the first rank that has room, else tries the next rank).

    First rank: the replicas whose caches hold the most of the prompt's first pages (at
    least ``min_match_pages``), unless they are overloaded, i.e. their queue is more than
    ``max_queue_gap`` longer than the shortest; unknown replicas (None) never match. Then
    the load ranks: the two replicas with the most free pages (shorter queue on ties), then
    the rest. ``holders_only``: the first rank alone when there is one (Serve then retries
    it after a backoff instead of going on to replicas without the prefix)."""
    if max_queue_gap < 0:
        raise ValueError(f"max_queue_gap must be >= 0, got {max_queue_gap!r}")
    if min_match_pages < 1:
        raise ValueError(f"min_match_pages must be >= 1, got {min_match_pages!r}")
    replicas = list(loads)
    if not replicas:
        return []
    by_load = sorted(replicas, key=lambda r: (-loads[r].free_pages, loads[r].queue_depth))
    ranks = [by_load[:2], by_load[2:]] if len(by_load) > 2 else [by_load]
    best = max((matches.get(r) or 0 for r in replicas), default=0)
    if best < min_match_pages:
        return ranks
    shortest = min(loads[r].queue_depth for r in replicas)
    holders = [r for r in replicas if matches.get(r) == best
               and loads[r].queue_depth - shortest <= max_queue_gap]
    if not holders:
        return ranks  # the holders are overloaded: load decides
    return [holders] if holders_only else [holders, *ranks]


__all__ = ["Load", "PrefixIndex", "ReplicaPages", "rank_replicas", "wire_batch"]
