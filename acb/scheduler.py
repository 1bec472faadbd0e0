"""Which tokens of which sequences run in the next step. Plain Python over plain data.

The whole decision is a columnar ``StepPlan`` (acb.step) of rows ``(sequence, start,
num_tokens)`` with their tokens and the block-table entries they change (deltas): prefill,
chunked prefill and decode are the same thing with different ``num_tokens``.
A step may be planned while the previous one still runs (async batching): a
sequence's last token may then be *in flight* (sampled on the device, not yet
seen here), and its row takes that token from the previous step's output.
"""

from __future__ import annotations

import bisect
import enum
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .kv_cache import RECYCLED, HostPool, KVCacheManager, chain_hash
from .step import PageMoves, StepOutput, StepPlan, StepUpdate


class SeqStatus(enum.Enum):
    """Where a sequence is: queued (new, or preempted), running (it has pages and rows),
    finished (its pages released), or forking (a choice of an n > 1 request waiting for
    its first choice to prefill the prompt it shares)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FORKING = "forking"


WAITING, RUNNING, FINISHED, FORKING = SeqStatus


@dataclass(slots=True, eq=False)
class Sequence:
    """The scheduler's view of one request: its tokens (the generated ones stored here
    only), pages and progress. ``Scheduler`` owns it."""

    seq_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival: int = 0
    priority: int = 0  # lower = more urgent (scheduler="priority")
    slot: int = -1  # its request's row in the request table's sampling columns (acb.live.SamplingColumns)
    # the order of admission and of the running list, lowest first (Scheduler._rank):
    # (arrival,) for fifo and prefill_first; priority aged by the plan it was queued at
    rank: tuple[int, ...] = ()
    queued_plan: int = -1  # the plan index when it was first queued
    stop_ids: frozenset[int] = frozenset()  # sampled, these end it with "stop"
    eos_ids: frozenset[int] = frozenset()  # and these with "eos" (empty with ignore_eos)
    output_ids: list[int] = field(default_factory=list)
    num_inflight: int = 0  # sampled tokens not yet seen on the host (0 or 1)
    num_computed: int = 0  # tokens whose KV is written or being written
    block_table: list[int] = field(default_factory=list)
    # its row in the runner's block-table store (acb.block_tables) while running, and how many
    # leading entries of its tables the store holds as they are here: the rest go with its next row
    table_row: int = -1
    num_sent_pages: int = 0
    num_cached_prompt_tokens: int = 0
    num_registered_pages: int = 0
    last_page_hash: int | None = None
    epoch: int = 0  # bumped on preemption: rows of older epochs are stale
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    num_recycled_pages: int = 0  # leading block-table entries given back (sliding window)
    # Hybrid models (some layers slide, some do not): the sliding layers' pages, from
    # their own pool, one entry per block-table entry; entries behind the window are
    # RECYCLED, so the sliding layers hold only the window's pages.
    swa_table: list[int] = field(default_factory=list)
    # CPU offload: while preempted, the host slot of each offloaded block-table entry
    # (RECYCLED kept as is) and the number of tokens whose KV the slots hold
    host_table: list[int] | None = None
    host_swa: list[bool] | None = None  # hybrid models: which offloaded entries had a sliding page
    num_offloaded_tokens: int = 0
    restored_plan: int = -1  # index of the plan that restored it
    # n > 1: the other choices of the request, forked from this one when its prompt is
    # prefilled (they share its pages; see Scheduler._fork)
    forks: list[Sequence] | None = None
    # the plan that last sampled it and the index of its row among that plan's sampled
    # rows: a row carrying its in-flight token takes it from there on the device
    sampled_plan: int = -1
    sampled_row: int = -1
    # False: never start from the prefix cache (a request scoring its prompt needs every
    # prompt position's logits, which cached pages do not keep); its pages are still registered
    prefix_lookup: bool = True
    # LoRA: the adapter's slot in the runner's stacked weights (-1: the base model) and the
    # parent hash of its prefix chain's first page (acb.kv_cache.adapter_root; None: base)
    adapter: int = -1
    prefix_root: int | None = None
    # speculative decoding (acb.speculative.RowState; None: this sequence never proposes)
    # and the proposals its row of the plan being made carries
    spec: Any = None
    drafts: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus every generated token, in flight included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_inflight

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_inflight

    def table_changed(self, index: int) -> None:
        """Entries from ``index`` on of its block table (or sliding table) were replaced,
        recycled or cut: they are sent again with its next row. Whoever changes a sent
        entry calls this (the integrity check finds a table that went unsent)."""
        if index < self.num_sent_pages:
            self.num_sent_pages = index

    def token_at(self, start: int, stop: int) -> list[int]:
        """Host-known token ids for positions [start, stop)."""
        np_ = len(self.prompt_ids)
        if stop <= np_:
            return self.prompt_ids[start:stop]
        if start >= np_:
            return self.output_ids[start - np_ : stop - np_]
        return self.prompt_ids[start:] + self.output_ids[: stop - np_]


class Scheduler:  # ~670 lines, over the house's 300: see "Why one class" below
    """FIFO, prefill-first or priority scheduling under a token budget and a request cap.

    Preemption (when pages run out for a running sequence) takes the running
    sequence that ranks last (arrived last; under ``priority``, the least urgent)
    and has not been given a row in this step yet; if there is none, the sequence
    that needs the page preempts itself. The victim's pages are released and it goes
    back to the waiting queue in rank order (the head, for fifo), so it resumes
    before anything that arrived after it.

    ``priority``: sequences are ranked by ``(arrival step + priority * aging_steps,
    priority, arrival)`` (``(priority, arrival)`` with ``aging_steps=0``). Rows are
    planned in rank order over running and waiting sequences together, and a waiting
    sequence that does not fit preempts running ones that rank after it, least urgent
    first, when that makes it fit. With a host pool (CPU offload)
    the victim's KV is copied out first and copied back into fresh pages when it
    resumes, so only its last known token is computed again (for its logits);
    without one, or when the pool is full, it is recomputed from the start.

    Why one class: planning, admission, preemption, offload and copy-on-write all move
    the same sequences between the same two queues and the same page pools within one
    ``schedule()`` call, and the page accounting (``check_integrity``) holds only at its
    end. Split across objects, each would write the others' state mid-plan; kept here,
    every write to a sequence or a queue is in this file (docs/design.md, "Who owns what").
    The block-table deltas (which entries a row sends) follow the same writes, so they are
    here too.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_batch_tokens: int,
        max_requests: int,
        policy: str = "fifo",
        safety_margin: float = 0.0,
        sliding_window: int | None = None,
        host_pool: HostPool | None = None,
        kv_swa: KVCacheManager | None = None,
        aging_steps: int = 0,
    ) -> None:
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests
        if policy not in ("fifo", "prefill_first", "priority"):
            raise ValueError(f"policy must be fifo, prefill_first or priority, got {policy!r}")
        self.policy = policy
        self.aging_steps = aging_steps
        self.safety_margin = safety_margin
        # Set only when *every* layer slides: pages wholly behind the window are then
        # dead for all layers and go back to the pool, bounding a request's memory.
        self.sliding_window = sliding_window
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # computed tokens thrown away by preemption
        self.num_generated_tokens = 0  # tokens taken into sequences by update()
        self.host_pool = host_pool
        # Hybrid models: the sliding layers' page pool (``sliding_window`` is then theirs);
        # None when every layer slides (the block table itself is recycled) or none does.
        self.kv_swa = kv_swa
        self._pending_swap_out = PageMoves()
        self._pending_offloaded: list[Sequence] = []
        self.plan_index = 0
        # first-page hash -> the running sequence computing that page: requests that
        # would start with the same page wait for it, then share it instead of
        # computing it again in the same step
        self.pending_first_page: dict[int, Sequence] = {}
        # rows of the runner's block-table store: given to a sequence when it starts running,
        # taken back when it stops (the lowest free first keeps the store small)
        self._free_table_rows: list[int] = []
        self.num_table_rows = 0
        # the common decode row has a shortcut (_decode_row) without sliding windows
        self._plain_decode = sliding_window is None and kv_swa is None
        self.speculation: Any = None  # acb.speculative.Speculation when decode rows may carry proposals

    def add(self, seq: Sequence, forks: list[Sequence] | None = None) -> None:
        """Queue a new sequence; ``forks``: the other choices of an n > 1 request, whose
        first choice ``seq`` is (they fork from it in the step that prefills its prompt)."""
        seq.status = WAITING
        if forks:
            seq.forks = forks
            for s in forks:
                s.status = FORKING
        for s in (seq, *(seq.forks or ())):
            s.queued_plan = self.plan_index
            s.rank = self._rank(s)
        self._enqueue(seq)

    def _rank(self, seq: Sequence) -> tuple[int, ...]:
        if self.policy != "priority":
            return (seq.arrival,)
        if self.aging_steps:
            # aged: ranked as if it arrived priority * aging_steps plans later, so a more
            # urgent request overtakes it only within that window (bounded starvation)
            return (seq.queued_plan + seq.priority * self.aging_steps, seq.priority, seq.arrival)
        return (seq.priority, seq.arrival)

    def _enqueue(self, seq: Sequence, front: bool = False) -> None:
        """Put ``seq`` in the waiting queue: in rank order under ``priority``; else at the
        tail (new) or the head (``front``: a victim or an heir, older than what waits)."""
        if self.policy == "priority":
            bisect.insort(self.waiting, seq, key=_rank_of)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished, cancelled or failed) and release its pages. A
        finished sequence stays finished: finishing it again does nothing."""
        if seq.status is FINISHED:
            return
        if seq.status is RUNNING:
            self.running.remove(seq)
        elif seq.status is WAITING:
            self.waiting.remove(seq)
        elif seq.status is FORKING:  # a choice cancelled before its fork
            for leader in self.waiting:
                if leader.forks and seq in leader.forks:
                    leader.forks.remove(seq)
            for leader in self.running:
                if leader.forks and seq in leader.forks:
                    leader.forks.remove(seq)
        if seq.forks:  # its other choices are not forked yet: the next one prefills for them
            heir, *rest = seq.forks
            heir.forks = rest or None
            heir.status = WAITING
            self._enqueue(heir, front=True)
            seq.forks = None
        self.kv.release(seq.block_table)
        seq.block_table = []
        self._release_swa(seq)
        self._drop_table_row(seq)
        seq.num_recycled_pages = 0
        self.drop_offload(seq)
        seq.status = FINISHED

    def update(self, plan: StepPlan, out: StepOutput) -> StepUpdate:
        """Take a finished step's sampled tokens into its sequences: each row still
        current (not finished or preempted since ``plan`` was made) registers the full
        pages it completed for prefix hits, and each sampled one appends its token and
        ends its sequence on a stop token, EOS or its length (releasing its pages)."""
        update = StepUpdate()
        kv = self.kv
        inp = plan.input
        register = kv.enable_prefix_caching
        drafts = inp.drafts if plan.num_drafts else None
        j = 0  # the row's first entry in ``out``
        for i, seq in enumerate(plan.seqs):
            sample = inp.sample[i]
            first = j
            j += sample + (drafts[i] if drafts else 0)
            if not _current(seq, plan.epochs[i]):
                continue
            if drafts and drafts[i]:
                self._verify(plan, i, first, out, update)
                continue
            if register:
                done = inp.starts[i] + inp.token_offsets[i + 1] - inp.token_offsets[i]
                if done // kv.page_size > seq.num_registered_pages:
                    seq.num_registered_pages, seq.last_page_hash = kv.register_full_pages(
                        seq.block_table, seq.token_at(0, done), seq.num_registered_pages, seq.last_page_hash, done)
            if sample:
                token = out.token_ids[first]
                seq.num_inflight -= 1
                seq.output_ids.append(token)
                self.num_generated_tokens += 1
                reason = _finish_reason(seq, token)
                update.add(seq, first, reason)
                if reason is not None:
                    self.finish(seq)
        return update

    def _verify(self, plan: StepPlan, i: int, first: int, out: StepOutput, update: StepUpdate) -> None:
        """Row ``i`` carried proposals: take in those equal to the token sampled at their
        position, and the first sampled token that differs (or the one after the last
        proposal), truncated at a stop token, EOS or the length (acb.speculative says
        why this is exact). The pages its rejected proposals were written to go back now."""
        inp, seq = plan.input, plan.seqs[i]
        d = inp.drafts[i]
        proposals = inp.token_ids[inp.token_offsets[i + 1] - d : inp.token_offsets[i + 1]]
        ids = out.token_ids
        accepted = 0
        while accepted < d and ids[first + accepted] == proposals[accepted]:
            accepted += 1
        self.speculation.observe_row(seq.spec, d, accepted)
        seq.num_inflight -= 1
        seq.num_computed = inp.starts[i] + 1 + accepted  # the KV of the rejected ones is garbage
        reason = None
        for t in range(accepted + 1):
            seq.output_ids.append(ids[first + t])
            self.num_generated_tokens += 1
            reason = _finish_reason(seq, ids[first + t])
            update.add(seq, first + t, reason)
            if reason is not None:
                self.finish(seq)
                return
        kv = self.kv
        if kv.enable_prefix_caching and seq.num_computed // kv.page_size > seq.num_registered_pages:
            seq.num_registered_pages, seq.last_page_hash = kv.register_full_pages(
                seq.block_table, seq.token_at(0, seq.num_computed), seq.num_registered_pages, seq.last_page_hash,
                seq.num_computed)
        keep = kv.pages_for(seq.num_computed)
        if len(seq.block_table) > keep:
            kv.release(seq.block_table[keep:])
            del seq.block_table[keep:]
            seq.table_changed(keep)  # the runner's store holds those columns: sent again when refilled
            if self.kv_swa is not None:
                self.kv_swa.release([p for p in seq.swa_table[keep:] if p >= 0])
                del seq.swa_table[keep:]

    def truncate(self, seq: Sequence, end: int) -> None:
        """End ``seq`` after its first ``end`` generated tokens: the output side found its
        end (a stop string) inside a run of accepted proposals taken in at once."""
        self.finish(seq)
        self.num_generated_tokens -= max(len(seq.output_ids) - end, 0)
        del seq.output_ids[end:]

    def step_failed(self, plan: StepPlan) -> tuple[list[Sequence], list[Sequence]]:
        """A step raised: the sequences that fail with it, (those it computed rows of,
        still current; those restored since from the offloaded KV it produced). A failed
        step may have left garbage in KV that preempted sequences offloaded (their last
        rows ran in it) or may not have done its swap-outs: such a sequence still
        waiting is recomputed instead."""
        failed = [seq for seq, epoch in zip(plan.seqs, plan.epochs, strict=True) if _current(seq, epoch)]
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

    def drop_offload(self, seq: Sequence) -> None:
        """Forget a preempted sequence's offloaded KV (it will be recomputed)."""
        if seq.host_table is not None:
            self.host_pool.release_after_plan(s for s in seq.host_table if s >= 0)
            seq.host_table = None
            seq.host_swa = None
            seq.num_offloaded_tokens = 0
            seq.num_recycled_pages = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.plan_index += 1
        if self.host_pool is not None:
            self.host_pool.end_plan()
        plan = StepPlan(index=self.plan_index)
        budget = self.max_batch_tokens
        if self.speculation is not None:
            self.speculation.begin_plan(len(self.running))
        if self.policy == "prefill_first":
            budget = self._admit(plan, budget)
            self._continue_running(plan, budget)
        elif self.policy == "priority":
            self._plan_by_rank(plan, budget)
        else:
            budget = self._continue_running(plan, budget)
            self._admit(plan, budget)
        if plan.seqs and self._pending_swap_out:
            # Swap-outs ride on the next step that runs: the runner copies the pages
            # out before that step's forward, the first thing that could overwrite them.
            plan.input.swap_out, self._pending_swap_out = self._pending_swap_out, PageMoves()
            plan.offloaded, self._pending_offloaded = self._pending_offloaded, []
        return plan

    def _tokens_wanted(self, seq: Sequence) -> int:
        if seq.num_generated >= seq.max_new_tokens:
            return 0  # its last token is in flight; it finishes when that arrives
        return seq.num_tokens - seq.num_computed

    def _add_row(self, plan: StepPlan, seq: Sequence, n: int, start: int | None = None) -> None:
        """Append ``seq``'s row of ``n`` tokens from ``start`` (default: its next token to
        compute) to ``plan``, with the entries of its page tables not sent yet; its
        tokens count as computed (and a sampled one as in flight) from here on."""
        start = seq.num_computed if start is None else start
        end = start + n
        drafts = seq.drafts  # set by _propose for this row only (its last token is known then)
        d = len(drafts)
        sample = end - d == seq.num_tokens
        carry_from = -1
        if sample and seq.num_inflight > 0:  # its last token is in flight: a placeholder here
            tokens = seq.token_at(start, end - 1)
            tokens.append(0)
            if seq.sampled_plan == plan.index - 1:
                carry_from = seq.sampled_row
        else:
            tokens = seq.token_at(start, end - d)
        if d:
            tokens += drafts
            seq.drafts = []
            plan.num_drafts += d
        plan.seqs.append(seq)
        plan.epochs.append(seq.epoch)
        inp = plan.input
        table = seq.block_table
        sent = seq.num_sent_pages
        if sent < len(table):
            inp.send_table(seq.table_row, sent, table[sent:], seq.swa_table[sent:] if self.kv_swa is not None else None)
            seq.num_sent_pages = len(table)
        inp.add_table_row(tokens, start, seq.table_row, carry_from, sample, seq.adapter, d)
        if sample:
            seq.sampled_plan = plan.index
            seq.sampled_row = plan.num_sampled
            plan.num_sampled += 1 + d
            if seq.forks and seq.num_generated == 0:
                self._fork(plan, seq, end)
            seq.num_inflight += 1
        seq.num_computed += n

    def _decode_row(self, plan: StepPlan, seq: Sequence) -> bool:
        """The common row, planned in one go: one token, the sampled one before it known or
        in flight, at most one new page and none shared (no copy-on-write), no sliding
        window, no choices to fork. False (and nothing done) for any other row: the caller
        takes the general path. What it plans is what that path would."""
        c = seq.num_computed
        out = seq.output_ids
        generated = len(out) + seq.num_inflight
        if len(seq.prompt_ids) + generated - c != 1 or generated >= seq.max_new_tokens or seq.forks:
            return False
        kv = self.kv
        table = seq.block_table
        i = c // kv.page_size
        if i < len(table):
            if c % kv.page_size and kv.refcount[table[i]] > 1:
                return False  # shared partial page: copy-on-write
        elif i > len(table) or not (kv.free_pages or kv.cached_lru):
            return False  # no page free: the general path preempts
        else:
            table += kv.allocate(1)
        inp = plan.input
        sent = seq.num_sent_pages
        if sent < len(table):
            inp.send_table(seq.table_row, sent, table[sent:])
            seq.num_sent_pages = len(table)
        if seq.num_inflight:
            inp.add_table_row(_PLACEHOLDER, c, seq.table_row,
                              seq.sampled_row if seq.sampled_plan == plan.index - 1 else -1, True, seq.adapter)
        else:
            inp.add_table_row((out[-1] if out else seq.prompt_ids[-1],), c, seq.table_row, -1, True, seq.adapter)
        plan.seqs.append(seq)
        plan.epochs.append(seq.epoch)
        seq.sampled_plan = plan.index
        seq.sampled_row = plan.num_sampled
        plan.num_sampled += 1
        seq.num_inflight += 1
        seq.num_computed = c + 1
        return True

    def _fork(self, plan: StepPlan, leader: Sequence, end: int) -> None:
        """The leader's prompt is computed by this row: its other choices take references
        to its pages (the shared partial last page is copied when one of them first writes
        to it) and sample their first token from the same logits, in rows of no tokens
        right after the leader's."""
        for seq in leader.forks:
            seq.block_table = list(leader.block_table)
            self.kv.share(seq.block_table)
            if self.kv_swa is not None:
                seq.swa_table = list(leader.swa_table)
                self.kv_swa.share(seq.swa_table)
            seq.num_recycled_pages = leader.num_recycled_pages
            seq.num_computed = end
            seq.num_cached_prompt_tokens = leader.num_cached_prompt_tokens
            seq.status = RUNNING
            self._insert_running(seq)
            plan.admitted.append(seq)
            self._add_row(plan, seq, 0, end)
        leader.forks = None

    def _copy_on_write(self, seq: Sequence, plan: StepPlan) -> None:
        """Give ``seq`` its own copy of its partial last page if another sequence holds it
        too (forked choices), before a row writes into it; on hybrid models its sliding-layer
        page as well (forks share both, so both are shared). The caller counted the pages."""
        if not self._shares_partial_page(seq):
            return
        i = seq.num_computed // self.kv.page_size
        seq.table_changed(i)
        plan.input.copy_pages.add(seq.block_table[i], self._replace_page(self.kv, seq.block_table, i))
        if self.kv_swa is not None:
            plan.input.copy_swa_pages.add(seq.swa_table[i], self._replace_page(self.kv_swa, seq.swa_table, i))

    @staticmethod
    def _replace_page(kv: KVCacheManager, table: list[int], i: int) -> int:
        """Swap entry ``i`` of ``table`` for a fresh page of ``kv``; the fresh page."""
        fresh = kv.allocate(1)[0]
        kv.release([table[i]])
        table[i] = fresh
        return fresh

    def _shares_partial_page(self, seq: Sequence) -> bool:
        ps = self.kv.page_size
        if seq.num_computed % ps == 0 or seq.num_computed // ps >= len(seq.block_table):
            return False
        page = seq.block_table[seq.num_computed // ps]
        return page >= 0 and self.kv.refcount[page] > 1

    def _continue_running(self, plan: StepPlan, budget: int) -> int:
        scheduled: set[int] = {id(seq) for seq in plan.seqs}
        for seq in list(self.running):
            if budget <= 0 or len(plan.seqs) >= self.max_requests:
                break
            budget = self._continue(plan, seq, budget, scheduled)
        return budget

    def _continue(self, plan: StepPlan, seq: Sequence, budget: int, scheduled: set[int]) -> int:
        """Give running ``seq`` its next row (preempting to find its pages); the budget left."""
        if seq.status is not RUNNING or id(seq) in scheduled:
            return budget
        drafts = 0  # speculative proposals (a decode row whose last token is known)
        if seq.spec is not None and self.speculation is not None and self._tokens_wanted(seq) == 1:
            drafts = self._propose(seq, budget - 1, self._shares_partial_page(seq))
        if not drafts and self._plain_decode and self._decode_row(plan, seq):
            scheduled.add(id(seq))
            return budget - 1
        n = min(self._tokens_wanted(seq), budget)
        if n <= 0:
            return budget
        if self.sliding_window:
            self._recycle_out_of_window(seq)
        cow = self._shares_partial_page(seq)
        n += drafts
        need = self.kv.pages_for(seq.num_computed + n) - len(seq.block_table)
        while not self._fits(need + cow):
            victim = self._pick_victim(scheduled)
            self._preempt(victim, plan)
            if victim is seq:
                break
        if seq.status is not RUNNING:
            return budget
        if cow:
            self._copy_on_write(seq, plan)
        if need > 0:
            self._allocate(seq, need)
        before = len(plan.seqs)
        self._add_row(plan, seq, n)
        if len(plan.seqs) == before + 1:
            scheduled.add(id(seq))
        else:
            scheduled.update(id(s) for s in plan.seqs[before:])  # with the choices forked from it
        return budget - n

    def _propose(self, seq: Sequence, budget: int, cow: bool) -> int:
        """Decode row ``seq``'s proposals (``seq.drafts``), as many as pay (acb.speculative),
        fit the budget, the length left and the free pages (proposals never preempt); how many.
        Only a row whose last token is known proposes: a row in flight is planned plainly."""
        seq.drafts = []
        spec = self.speculation
        k = min(spec.wanted(seq.spec), budget, seq.max_new_tokens - seq.num_generated - 1)
        if k <= 0 or seq.num_inflight:
            return 0
        drafts = spec.propose(seq.spec, seq.token_at(0, seq.num_tokens), k)
        have = len(seq.block_table) + self.kv.num_free - cow
        while drafts and self.kv.pages_for(seq.num_computed + 1 + len(drafts)) > have:
            drafts.pop()
        if self.kv_swa is not None:
            have = len(seq.swa_table) + self.kv_swa.num_free - cow
            while drafts and self.kv.pages_for(seq.num_computed + 1 + len(drafts)) > have:
                drafts.pop()
        seq.drafts = drafts
        return len(drafts)

    def _plan_by_rank(self, plan: StepPlan, budget: int) -> int:
        """``priority``: rows in rank order over running and waiting sequences together, so
        an urgent newcomer takes the budget (and, preempting, the pages) before less urgent
        running sequences. Admission stays strictly in rank order: once the waiting head
        cannot be admitted, nothing behind it is."""
        scheduled: set[int] = set()
        running = list(self.running)  # in rank order
        k = 0
        admitting = True
        while budget > 0 and len(plan.seqs) < self.max_requests:
            while k < len(running) and (running[k].status is not RUNNING or id(running[k]) in scheduled):
                k += 1
            seq = running[k] if k < len(running) else None
            if admitting and self.waiting and (seq is None or self.waiting[0].rank < seq.rank):
                before = len(plan.seqs)
                left = self._admit_one(plan, self.waiting[0], budget, scheduled)
                if left is None:
                    admitting = False
                else:
                    scheduled.update(id(s) for s in plan.seqs[before:])
                    budget = left
                continue
            if seq is None:
                break
            k += 1
            budget = self._continue(plan, seq, budget, scheduled)
        return budget

    def _recycle_out_of_window(self, seq: Sequence) -> None:
        """Give back the pages this sequence's next queries can no longer see. The next
        query is at ``num_computed`` and sees keys at positions > num_computed - window.
        (A step still in flight may read such a page: any new owner writes to it in a
        later step, and steps run in order.)"""
        dead = max(0, seq.num_computed - self.sliding_window + 1) // self.kv.page_size
        if dead > seq.num_recycled_pages:
            kv, table = (self.kv_swa, seq.swa_table) if self.kv_swa is not None else (self.kv, seq.block_table)
            pages = [p for p in table[seq.num_recycled_pages : dead] if p != RECYCLED]
            table[seq.num_recycled_pages : dead] = [RECYCLED] * (dead - seq.num_recycled_pages)
            seq.table_changed(seq.num_recycled_pages)
            kv.release(pages)
            seq.num_recycled_pages = dead

    def _fits(self, need: int, reserve: float = 0.0, swa_need: int | None = None) -> bool:
        """Whether ``need`` more pages (and ``swa_need`` sliding-layer pages, by default as
        many) can be taken now, leaving ``reserve`` pages of the main pool."""
        if need > self.kv.num_free - reserve:
            return False
        return self.kv_swa is None or (need if swa_need is None else swa_need) <= self.kv_swa.num_free

    def _allocate(self, seq: Sequence, need: int) -> None:
        seq.block_table.extend(self.kv.allocate(need))
        if self.kv_swa is not None:
            seq.swa_table.extend(self.kv_swa.allocate(need))

    def _release_swa(self, seq: Sequence) -> None:
        if self.kv_swa is not None:
            self.kv_swa.release(seq.swa_table)
            seq.swa_table = []

    def _pick_victim(self, scheduled: set[int]) -> Sequence:
        # ``running`` is in rank order: the last one unscheduled ranks after the caller
        # (itself unscheduled), so a victim is never more urgent than who needs the page
        for seq in reversed(self.running):
            if id(seq) not in scheduled:
                return seq
        raise AssertionError("no preemptible sequence")  # the caller itself is never scheduled

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self._drop_table_row(seq)
        # KV is kept for host-known tokens only (an in-flight token is sampled again),
        # and at least one is left to compute so the resumed row has logits.
        keep = min(seq.num_computed, len(seq.prompt_ids) + len(seq.output_ids) - 1)
        if not self._offload(seq, keep):
            self.num_recomputed_tokens += max(keep, 0)
            seq.num_recycled_pages = 0
        self.kv.release(seq.block_table)
        seq.block_table = []
        self._release_swa(seq)
        seq.num_computed = 0
        seq.num_inflight = 0
        seq.drafts = []  # proposed for a row it is not getting
        seq.num_registered_pages = 0
        seq.last_page_hash = seq.prefix_root
        seq.epoch += 1
        seq.num_preemptions += 1
        seq.status = WAITING
        self.num_preemptions += 1
        # Victims are taken newest first, so the head keeps arrival order (fifo).
        self._enqueue(seq, front=True)
        plan.preempted.append(seq)

    def _offload(self, seq: Sequence, keep: int) -> bool:
        host = self.host_pool
        if host is None or keep <= 0:
            return False
        entries = seq.block_table[: self.kv.pages_for(keep)]
        live = [p for p in entries if p != RECYCLED]
        if len(live) > host.num_free:
            return False
        slots = iter(host.offload(len(live)))
        seq.host_table = [RECYCLED if p == RECYCLED else next(slots) for p in entries]
        out = self._pending_swap_out
        if self.kv_swa is None:
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

    def _room(self, plan: StepPlan, seq: Sequence, need: int, swa_need: int | None,
              scheduled: set[int] | None) -> bool:
        """Whether waiting ``seq`` can take ``need`` pages now (keeping the safety margin
        unless the engine is idle). Under ``priority`` (``scheduled`` given: the sequences
        with rows in this plan) it preempts running sequences that rank after it, least
        urgent first, when their pages make it fit; none if they would not."""
        kv = self.kv
        idle = not self.running and not plan.seqs
        reserve = 0.0 if idle else self.safety_margin * kv.num_pages
        if self._fits(need, reserve, swa_need):
            return True
        if scheduled is None:
            return False
        victims = []
        freed = swa_freed = 0
        for victim in reversed(self.running):
            if victim.rank <= seq.rank:
                break
            if id(victim) in scheduled:
                continue
            victims.append(victim)
            freed += sum(1 for p in victim.block_table if p >= 0 and kv.refcount[p] == 1)
            if self.kv_swa is not None:
                swa_freed += sum(1 for p in victim.swa_table if p >= 0 and self.kv_swa.refcount[p] == 1)
            swa_ok = self.kv_swa is None or (need if swa_need is None else swa_need) <= self.kv_swa.num_free + swa_freed
            if need <= kv.num_free + freed - reserve and swa_ok:
                for v in victims:
                    self._preempt(v, plan)
                return self._fits(need, reserve, swa_need)
        return False

    def _admit_offloaded(self, plan: StepPlan, seq: Sequence, budget: int,
                         scheduled: set[int] | None = None) -> int | None:
        """Resume an offloaded sequence into fresh pages; None if they are not free."""
        kv = self.kv
        slots = [s for s in seq.host_table if s >= 0]
        n = min(seq.num_tokens - seq.num_offloaded_tokens, budget)
        extra = kv.pages_for(seq.num_offloaded_tokens + n) - len(seq.host_table)
        need = len(slots) + extra
        swa_need = sum(seq.host_swa) + extra if seq.host_swa is not None else 0
        if not self._room(plan, seq, need, swa_need, scheduled):
            return None
        self.waiting.popleft()
        plan.admitted.append(seq)
        pages = kv.allocate(need)
        it = iter(pages)
        seq.block_table = [RECYCLED if s < 0 else next(it) for s in seq.host_table]
        swap_in = plan.input.swap_in
        if seq.host_swa is None:
            swap_in.src += slots
            swap_in.dst += (p for p in seq.block_table if p >= 0)
            swap_in.swa += [-1] * len(slots)
        else:
            swa_pages = self.kv_swa.allocate(swa_need)
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
        seq.restored_plan = self.plan_index
        seq.status = RUNNING
        self._insert_running(seq)
        self._add_row(plan, seq, n)
        return budget - n

    def _admit(self, plan: StepPlan, budget: int) -> int:
        while self.waiting and budget > 0 and len(plan.seqs) < self.max_requests:
            left = self._admit_one(plan, self.waiting[0], budget)
            if left is None:
                break  # strictly in order: nothing overtakes the head
            budget = left
        return budget

    def _admit_one(self, plan: StepPlan, seq: Sequence, budget: int,
                   scheduled: set[int] | None = None) -> int | None:
        """Admit ``seq``, the head of the waiting queue, with its first row; the budget
        left, or None if it cannot be admitted now (under ``priority``, ``scheduled`` given,
        after preempting what ranks after it if that is enough)."""
        kv = self.kv
        if seq.host_table is not None:
            return self._admit_offloaded(plan, seq, budget, scheduled)
        matched: list[int] = []
        first_hash = None
        last_hash = None
        if seq.num_computed == 0 and not seq.block_table and seq.prefix_lookup:
            tokens = seq.token_at(0, seq.num_tokens)
            matched, last_hash = kv.match_prefix(tokens, seq.prefix_root)
            if kv.enable_prefix_caching and not matched and len(tokens) > kv.page_size:
                first_hash = chain_hash(seq.prefix_root, tokens[: kv.page_size])
                if self._first_page_in_flight(first_hash):
                    kv.release(matched)
                    return None  # in order: wait until the leader's page is cached
        n = min(seq.num_tokens - len(matched) * kv.page_size, budget)
        need = kv.pages_for(len(matched) * kv.page_size + n) - len(matched)
        # Below the safety margin only running sequences grow; an idle engine
        # still admits, or a request that needs most of the cache would wait forever.
        if not self._room(plan, seq, need, None, scheduled):
            kv.release(matched)
            return None
        self.waiting.popleft()
        plan.admitted.append(seq)
        if matched:
            seq.block_table = matched
            seq.num_computed = len(matched) * kv.page_size
            seq.num_registered_pages = len(matched)
            seq.last_page_hash = last_hash
        if seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = seq.num_computed
            kv.record_lookup(len(seq.prompt_ids), seq.num_computed)
        self._allocate(seq, need)
        if first_hash is not None:
            self.pending_first_page[first_hash] = seq
        seq.status = RUNNING
        self._insert_running(seq)
        self._add_row(plan, seq, n)
        return budget - n

    def _first_page_in_flight(self, first_hash: int) -> bool:
        owner = self.pending_first_page.get(first_hash)
        if owner is None:
            return False
        if owner.status is RUNNING and owner.num_registered_pages == 0:
            return True
        del self.pending_first_page[first_hash]  # cached now, or its owner left
        return False

    def _insert_running(self, seq: Sequence) -> None:
        """``seq`` starts running: a block-table row of its own (its tables all unsent), and
        its place in ``running``, kept in rank order (resumed victims rank before the tail)."""
        if self._free_table_rows:
            seq.table_row = heapq.heappop(self._free_table_rows)
        else:
            seq.table_row = self.num_table_rows
            self.num_table_rows += 1
        seq.num_sent_pages = 0
        i = len(self.running)
        while i > 0 and self.running[i - 1].rank > seq.rank:
            i -= 1
        self.running.insert(i, seq)


    def _drop_table_row(self, seq: Sequence) -> None:
        """``seq`` stops running: its block-table row goes back (what the store holds there
        is never read again: the next owner sends its own tables from the first entry)."""
        if seq.table_row >= 0:
            heapq.heappush(self._free_table_rows, seq.table_row)
            seq.table_row = -1
            seq.num_sent_pages = 0

    def sent_tables(self) -> list[tuple[int, list[int], list[int] | None]]:
        """(row, sent entries of the block table, of the sliding table) per running
        sequence: what the runner's block-table store must hold (``BlockTables.check``)."""
        rows = [seq.table_row for seq in self.running]
        assert len(set(rows)) == len(rows) and min(rows, default=0) >= 0, f"block-table rows held twice: {rows}"
        assert not set(rows) & set(self._free_table_rows), "a running sequence's block-table row is free"
        return [(seq.table_row, seq.block_table[: seq.num_sent_pages],
                 seq.swa_table[: seq.num_sent_pages] if self.kv_swa is not None else None) for seq in self.running]


def _finish_reason(seq: Sequence, token: int) -> str | None:
    """Why ``token``, just taken into ``seq``, ends it: a stop token, EOS, its length; or None."""
    if token in seq.stop_ids:
        return "stop"
    if token in seq.eos_ids:
        return "eos"
    if len(seq.output_ids) >= seq.max_new_tokens:
        return "length"
    return None


_PLACEHOLDER = (0,)  # a decode row's token while it is in flight (the runner carries it in)


def _current(seq: Sequence, epoch: int) -> bool:
    """Whether a row planned for ``seq`` at ``epoch`` still belongs to it: not finished,
    cancelled or preempted since the plan was made (the one place this is decided)."""
    return seq.status is RUNNING and epoch == seq.epoch


def _rank_of(seq: Sequence) -> tuple[int, ...]:
    return seq.rank
