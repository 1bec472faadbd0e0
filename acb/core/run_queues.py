"""The scheduler's queues: the waiting sequences and the running ones, both in rank order
(the order of admission and of preemption), and the prefill-only sequences waiting
(embedding requests: admitted in arrival order with the step's embedding share,
``Scheduler._plan_prefill_only``). Plain Python."""

from __future__ import annotations

import bisect
from collections import deque

from .sequence import FINISHED, FORKING, RUNNING, WAITING, Sequence


class RunQueues:
    """``waiting`` (new and preempted sequences) and ``running``, ranked by ``policy``:
    fifo and prefill_first by arrival; ``priority`` by ``(arrival step + priority *
    aging_steps, priority, arrival)`` (``(priority, arrival)`` with ``aging_steps=0``)."""

    def __init__(self, policy: str, aging_steps: int) -> None:
        if policy not in ("fifo", "prefill_first", "priority"):
            raise ValueError(f"policy must be fifo, prefill_first or priority, got {policy!r}")
        self.policy = policy
        self.aging_steps = aging_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefill_only: deque[Sequence] = deque()

    def rank(self, seq: Sequence) -> tuple[int, ...]:
        if self.policy != "priority":
            return (seq.arrival,)
        if self.aging_steps:
            # aged: ranked as if it arrived priority * aging_steps plans later, so a more
            # urgent request overtakes it only within that window (bounded starvation)
            return (seq.queued_plan + seq.priority * self.aging_steps, seq.priority, seq.arrival)
        return (seq.priority, seq.arrival)

    def enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Put ``seq`` in the waiting queue: in rank order under ``priority``; else at the
        tail (new) or the head (``front``: a victim or an heir, older than what waits)."""
        seq.status = WAITING
        if seq.prefill_only:  # (preempted ones resume first: they hold pooled positions already)
            self.prefill_only.appendleft(seq) if front else self.prefill_only.append(seq)
        elif self.policy == "priority":
            bisect.insort(self.waiting, seq, key=_rank_of)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def start(self, seq: Sequence) -> None:
        """``seq`` runs: its place in ``running``, kept in rank order (resumed victims rank
        before the tail)."""
        seq.status = RUNNING
        i = len(self.running)
        while i > 0 and self.running[i - 1].rank > seq.rank:
            i -= 1
        self.running.insert(i, seq)

    def dequeue(self, seq: Sequence) -> None:
        """Take ``seq``, the head of its waiting queue, out of it (it is being admitted)."""
        (self.prefill_only if seq.prefill_only else self.waiting).popleft()

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it (a choice not forked yet: out of its
        leader's list of choices)."""
        if seq.status is RUNNING:
            self.running.remove(seq)
        elif seq.status is WAITING:
            (self.prefill_only if seq.prefill_only else self.waiting).remove(seq)
        elif seq.status is FORKING:
            for leader in (*self.waiting, *self.running):
                if leader.forks and seq in leader.forks:
                    leader.forks.remove(seq)
        seq.status = FINISHED


def _rank_of(seq: Sequence) -> tuple[int, ...]:
    return seq.rank
