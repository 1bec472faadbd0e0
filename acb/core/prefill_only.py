"""The prefill-only sequences' share of a step (embedding requests, ``Sequence.prefill_only``,
``acb.core.pooling``): they wait in a queue of their own (``RunQueues.prefill_only``) and are
planned after every other row, under each policy alike, within ``max_tokens`` per step. So a
batch of a thousand texts shares steps with streaming chats without starving them: neither
their decode rows nor the admission of new chats waits behind it. The cap holds when no
generation is live too: a chat arriving then waits for the steps in flight (two, with async
batching), and a step of the whole budget's embedding tokens would hold it for seconds on a
CPU (measured: docs/embeddings.md). Plain Python."""

from __future__ import annotations

from collections.abc import Callable

from .admission import Admission
from .run_queues import RunQueues
from .sequence import Sequence
from .step import StepPlan


class PrefillOnly:
    """Plans the prefill-only rows of a step; ``continue_(plan, seq, budget, scheduled)`` (the
    scheduler's) gives a running sequence its next row and returns the budget left."""

    def __init__(self, queues: RunQueues, admission: Admission, max_tokens: int | None,
                 continue_: Callable[[StepPlan, Sequence, int, set[int]], int]) -> None:
        self.queues = queues
        self.admission = admission
        self.max_tokens = max_tokens  # their prompt tokens per step (None: no cap)
        self.count = 0  # prefill-only sequences queued or running (the scheduler counts them in and out)
        self._continue = continue_

    def plan(self, plan: StepPlan, budget: int, max_requests: int) -> None:
        """The running ones' next chunks, then admissions from their queue in arrival order,
        within ``budget`` (what the other rows left) and ``max_tokens``."""
        if not self.count:
            return
        queues = self.queues
        running = [seq for seq in queues.running if seq.prefill_only]
        if self.max_tokens is not None:
            budget = min(budget, self.max_tokens)
        # never a victim for their pages: a generation sequence (they preempt only each other), nor one whose
        # prompt is all computed (its pages come back when that step is delivered; preempted, it computes again)
        scheduled = {id(seq) for seq in plan.seqs} | {id(seq) for seq in queues.running
                                                        if not seq.prefill_only or seq.num_computed >= seq.num_tokens}
        for seq in running:
            if budget <= 0 or len(plan.seqs) >= max_requests:
                return
            budget = self._continue(plan, seq, budget, scheduled)
        self.admission.admit(plan, budget, max_requests, prefill_only=True)
