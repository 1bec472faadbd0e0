"""Admission: the head of the waiting queue starts running when its first row's pages fit
(keeping the safety margin while others run), from the prefix cache's longest match, or
from its offloaded KV; strictly in order (nothing overtakes the head). Plain Python."""

from __future__ import annotations

from collections.abc import Callable

from .kv_cache import chain_hash
from .page_tables import PageTables
from .preemption import Preemption
from .run_queues import RunQueues
from .sequence import RUNNING, Sequence
from .step import StepPlan


class Admission:
    """Admits waiting sequences into a plan; ``start(plan, seq, n)`` (the scheduler's) makes
    an admitted sequence running and plans its first row of ``n`` tokens."""

    def __init__(self, queues: RunQueues, pages: PageTables, preemption: Preemption, safety_margin: float,
                 start: Callable[[StepPlan, Sequence, int], None]) -> None:
        self.queues = queues
        self.pages = pages
        self.preemption = preemption
        self.safety_margin = safety_margin
        self._start = start
        # first-page hash -> the running sequence computing that page: requests that
        # would start with the same page wait for it, then share it instead of
        # computing it again in the same step
        self.pending_first_page: dict[int, Sequence] = {}

    def admit(self, plan: StepPlan, budget: int, max_requests: int, held_back: int = 0,
              prefill_only: bool = False) -> int:
        """Admit from the head while the budget and the request cap allow; the budget left.
        ``held_back``: pages admission leaves free beside the safety margin while others run
        (prefill_first: the pages the running sequences' rows of this step need).
        ``prefill_only``: from the queue of prefill-only sequences (embeddings), not the waiting one."""
        waiting = self.queues.prefill_only if prefill_only else self.queues.waiting
        while waiting and budget > 0 and len(plan.seqs) < max_requests:
            left = self.admit_one(plan, waiting[0], budget, held_back=held_back)
            if left is None:
                break  # strictly in order: nothing overtakes the head
            budget = left
        return budget

    def admit_one(self, plan: StepPlan, seq: Sequence, budget: int, scheduled: set[int] | None = None,
                  held_back: int = 0) -> int | None:
        """Admit ``seq``, the head of the waiting queue, with its first row; the budget
        left, or None if it cannot be admitted now (under ``priority``, ``scheduled`` given,
        after preempting what ranks after it if that is enough)."""
        if seq.host_table is not None:
            return self._admit_offloaded(plan, seq, budget, scheduled, held_back)
        kv = self.pages.kv
        matched: list[int] = []
        loads: list[bytes] = []  # keys of the pages after ``matched`` read from the disk tier
        first_hash = None
        last_hash = None
        if seq.num_computed == 0 and not seq.block_table and seq.prefix_lookup:
            tokens = seq.token_at(0, seq.num_tokens)
            matched, last_hash = kv.match_prefix(tokens, seq.prefix_root)
            if kv.disk is not None and kv.enable_prefix_caching:
                found = kv.disk.lookup(tokens, len(matched), seq.lora_id, kv.num_pages - len(matched))
                if found is None:
                    kv.release(matched)
                    return None  # in order: its next pages are being read from disk (and checked)
                loads = found
            if kv.enable_prefix_caching and not matched and not loads and len(tokens) > kv.page_size:
                first_hash = chain_hash(seq.prefix_root, tokens[: kv.page_size])
                if self._first_page_in_flight(first_hash):
                    kv.release(matched)
                    return None  # in order: wait until the leader's page is cached
        cached = len(matched) + len(loads)
        n = min(seq.num_tokens - cached * kv.page_size, budget)
        need = kv.pages_for(cached * kv.page_size + n) - len(matched)
        # Below the safety margin only running sequences grow; an idle engine
        # still admits, or a request that needs most of the cache would wait forever.
        if not self._room(plan, seq, need, None, scheduled, held_back):
            kv.release(matched)
            return None
        self.queues.dequeue(seq)
        plan.admitted.append(seq)
        if cached:
            seq.block_table = matched
            seq.num_computed = cached * kv.page_size
            seq.num_registered_pages = len(matched)  # the loaded pages register when the first row is done
            seq.last_page_hash = last_hash
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = seq.num_computed
            kv.record_lookup(len(seq.prompt_ids), seq.num_computed)
        self.pages.allocate(seq, need)
        if loads:  # (``matched`` is the block table now, grown by the allocation)
            plan.input.disk_pages += seq.block_table[cached - len(loads) : cached]
            plan.input.disk_payloads += kv.disk.take(loads)
        if first_hash is not None:
            self.pending_first_page[first_hash] = seq
        self._start(plan, seq, n)
        return budget - n

    def _admit_offloaded(self, plan: StepPlan, seq: Sequence, budget: int, scheduled: set[int] | None,
                         held_back: int) -> int | None:
        """Resume an offloaded sequence into fresh pages; None if they are not free."""
        kv = self.pages.kv
        slots = sum(1 for s in seq.host_table if s >= 0)
        n = min(seq.num_tokens - seq.num_offloaded_tokens, budget)
        extra = kv.pages_for(seq.num_offloaded_tokens + n) - len(seq.host_table)
        need = slots + extra
        swa_need = sum(seq.host_swa) + extra if seq.host_swa is not None else 0
        if not self._room(plan, seq, need, swa_need, scheduled, held_back):
            return None
        self.queues.dequeue(seq)
        plan.admitted.append(seq)
        self.preemption.restore(plan, seq, need, swa_need)
        self._start(plan, seq, n)
        return budget - n

    def _room(self, plan: StepPlan, seq: Sequence, need: int, swa_need: int | None,
              scheduled: set[int] | None, held_back: int) -> bool:
        """Whether waiting ``seq`` can take ``need`` pages now (keeping the safety margin
        unless the engine is idle). Under ``priority`` (``scheduled`` given: the sequences
        with rows in this plan) it preempts running sequences that rank after it, least
        urgent first, when their pages make it fit."""
        idle = not self.queues.running and not plan.seqs
        reserve = 0.0 if idle else self.safety_margin * self.pages.kv.num_pages + held_back
        if self.pages.fits(need, reserve, swa_need):
            return True
        return scheduled is not None and self.preemption.make_room(plan, seq, need, swa_need, reserve, scheduled)

    def _first_page_in_flight(self, first_hash: int) -> bool:
        owner = self.pending_first_page.get(first_hash)
        if owner is None:
            return False
        if owner.status is RUNNING and owner.num_registered_pages == 0:
            return True
        del self.pending_first_page[first_hash]  # cached now, or its owner left
        return False
