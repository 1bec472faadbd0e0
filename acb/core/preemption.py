"""Taking pages back from running sequences when the cache runs out: which sequence gives
them (the victim), what it keeps (its KV copied to the host pool with CPU offload, else
nothing: it is recomputed), and how an offloaded one comes back into fresh pages. Plain
Python; the copies themselves ride on the next step (``StepInput.swap_out`` / ``swap_in``)."""

from __future__ import annotations

from .kv_cache import RECYCLED, HostPool
from .page_tables import PageTables
from .run_queues import RunQueues
from .sequence import RUNNING, Sequence, current
from .step import PageMoves, StepPlan


class Preemption:
    """Victims, offload and restore over the scheduler's queues and page tables.

    A victim is the running sequence that ranks last (arrived last; under ``priority``, the
    least urgent) and has no row in the plan being made; it goes back to the head of the
    waiting queue (in rank order under ``priority``), so it resumes before anything that
    arrived after it. With a host pool its KV is copied out first and copied back into fresh
    pages when it resumes, so only its last known token is computed again (for its logits);
    without one, or when the pool is full, it is recomputed from the start."""

    def __init__(self, queues: RunQueues, pages: PageTables, host_pool: HostPool | None) -> None:
        self.queues = queues
        self.pages = pages
        self.host_pool = host_pool
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens thrown away by preemption
        self._pending_swap_out = PageMoves()
        self._pending_offloaded: list[Sequence] = []

    def pick_victim(self, scheduled: set[int]) -> Sequence:
        # ``running`` is in rank order: the last one unscheduled ranks after the caller
        # (itself unscheduled), so a victim is never more urgent than who needs the page
        for seq in reversed(self.queues.running):
            if id(seq) not in scheduled:
                return seq
        raise AssertionError("no preemptible sequence")  # the caller itself is never scheduled

    def preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.queues.running.remove(seq)
        self.pages.drop_row(seq)
        # KV is kept for host-known tokens only (an in-flight token is sampled again),
        # and at least one is left to compute so the resumed row has logits.
        keep = min(seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids) - 1)
        if not self._offload(seq, keep):
            self.num_recomputed_tokens += max(keep, 0)
            seq.num_recycled_pages = 0
        self.pages.release(seq)
        seq.num_computed = 0
        seq.num_inflight = 0
        seq.drafts = []  # proposed for a row it is not getting
        seq.num_registered_pages = 0
        seq.last_page_hash = seq.prefix_root
        seq.epoch += 1
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Victims are taken newest first, so the head keeps arrival order (fifo).
        self.queues.enqueue(seq, front=True)
        plan.preempted.append(seq)

    def _offload(self, seq: Sequence, keep: int) -> bool:
        host = self.host_pool
        if host is None or keep <= 0:
            return False
        kv, kv_swa = self.pages.kv, self.pages.kv_swa
        entries = seq.block_table[: kv.pages_for(keep)]
        live = [p for p in entries if p != RECYCLED]
        if len(live) > host.num_free:
            return False
        slots = iter(host.offload(len(live)))
        seq.host_table = [RECYCLED if p == RECYCLED else next(slots) for p in entries]
        out = self._pending_swap_out
        if kv_swa is None:
            out.src += live
            out.dst += (s for s in seq.host_table if s >= 0)
            out.swa += [-1] * len(live)
        else:  # hybrid: full-attention entries are never recycled; sliding ones may be
            swa = seq.swa_table[: len(entries)]
            seq.host_swa = [p >= 0 for p in swa]
            out.src += entries
            out.dst += seq.host_table
            out.swa += swa
        self._pending_offloaded.append(seq)
        seq.num_offloaded_tokens = keep
        return True

    def take_swap_outs(self, plan: StepPlan) -> None:
        """Swap-outs ride on the next step that runs: the runner copies the pages out before
        that step's forward, the first thing that could overwrite them."""
        if plan.seqs and self._pending_swap_out:
            plan.input.swap_out, self._pending_swap_out = self._pending_swap_out, PageMoves()
            plan.offloaded, self._pending_offloaded = self._pending_offloaded, []

    def make_room(self, plan: StepPlan, seq: Sequence, need: int, swa_need: int | None, reserve: float,
                  scheduled: set[int]) -> bool:
        """``priority``: preempt running sequences that rank after waiting ``seq`` and have no
        row yet, least urgent first, when their pages make ``need`` fit; none if they would not."""
        kv, kv_swa = self.pages.kv, self.pages.kv_swa
        victims = []
        freed = swa_freed = 0
        for victim in reversed(self.queues.running):
            if victim.rank <= seq.rank:
                break
            if id(victim) in scheduled:
                continue
            victims.append(victim)
            freed += sum(1 for p in victim.block_table if p >= 0 and kv.refcount[p] == 1)
            if kv_swa is not None:
                swa_freed += sum(1 for p in victim.swa_table if p >= 0 and kv_swa.refcount[p] == 1)
            swa_ok = kv_swa is None or (need if swa_need is None else swa_need) <= kv_swa.num_free + swa_freed
            if need <= kv.num_free + freed - reserve and swa_ok:
                for v in victims:
                    self.preempt(v, plan)
                return self.pages.fits(need, reserve, swa_need)
        return False

    def restore(self, plan: StepPlan, seq: Sequence, need: int, swa_need: int) -> None:
        """Copy offloaded ``seq``'s KV back into ``need`` fresh pages (``swa_need`` sliding-layer
        ones), the rest of its new pages after them; it resumes at its offloaded tokens."""
        kv, kv_swa = self.pages.kv, self.pages.kv_swa
        slots = [s for s in seq.host_table if s >= 0]
        pages = kv.allocate(need)
        it = iter(pages)
        seq.block_table = [RECYCLED if s < 0 else next(it) for s in seq.host_table]
        swap_in = plan.input.swap_in
        if seq.host_swa is None:
            swap_in.src += slots
            swap_in.dst += (p for p in seq.block_table if p >= 0)
            swap_in.swa += [-1] * len(slots)
        else:
            swa_pages = kv_swa.allocate(swa_need)
            swa_it = iter(swa_pages)
            seq.swa_table = [next(swa_it) if had else RECYCLED for had in seq.host_swa]
            swap_in.src += seq.host_table
            swap_in.dst += seq.block_table
            swap_in.swa += seq.swa_table
            seq.swa_table.extend(swa_pages[sum(seq.host_swa) :])
            seq.host_swa = None
        seq.block_table.extend(pages[len(slots) :])
        self.host_pool.restore(slots)
        seq.num_computed = seq.num_offloaded_tokens
        seq.host_table = None
        seq.num_offloaded_tokens = 0
        seq.restored_plan = plan.index

    def drop_offload(self, seq: Sequence) -> None:
        """Forget a preempted sequence's offloaded KV (it will be recomputed)."""
        if seq.host_table is not None:
            self.host_pool.release_after_plan(s for s in seq.host_table if s >= 0)
            seq.host_table = None
            seq.host_swa = None
            seq.num_offloaded_tokens = 0
            seq.num_recycled_pages = 0

    def step_failed(self, plan: StepPlan) -> tuple[list[Sequence], list[Sequence]]:
        """A step raised: the sequences that fail with it, (those it computed rows of,
        still current; those restored since from the offloaded KV it produced). A failed
        step may have left garbage in KV that preempted sequences offloaded (their last
        rows ran in it) or may not have done its swap-outs: such a sequence still
        waiting is recomputed instead."""
        failed = [seq for seq, epoch in zip(plan.seqs, plan.epochs, strict=True) if current(seq, epoch)]
        restored: list[Sequence] = []
        if self.host_pool is not None:
            suspects = {id(s): s for s in plan.offloaded}
            suspects.update((id(seq), seq) for seq, epoch in zip(plan.seqs, plan.epochs, strict=True)
                            if epoch != seq.epoch)  # preempted since: its swap-out may be garbage
            for seq in suspects.values():
                if seq.host_table is not None:
                    self.drop_offload(seq)
                elif seq.status is RUNNING and seq.restored_plan > plan.index:
                    restored.append(seq)
        return failed, restored
