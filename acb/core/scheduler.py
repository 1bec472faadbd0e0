"""Which tokens of which sequences run in the next step. Plain Python over plain data.

The whole decision is a columnar ``StepPlan`` (acb.core.step) of rows ``(sequence, start,
num_tokens)`` with their tokens and the block-table entries they change (deltas): prefill,
chunked prefill and decode are the same thing with different ``num_tokens``.
A step may be planned while the previous one still runs (async batching): a
sequence's last token may then be *in flight* (sampled on the device, not yet
seen here), and its row takes that token from the previous step's output.

The scheduler plans the rows of running sequences and composes the parts that do the rest,
each writing its own part of a sequence (docs/design.md, "Who owns what"): the queues
(``acb.core.run_queues``), the page tables (``acb.core.page_tables``), preemption and CPU offload
(``acb.core.preemption``), admission (``acb.core.admission``) and the intake of sampled tokens
(``acb.core.intake``). The page accounting (``check_integrity``) holds at the end of each
``schedule()`` and ``update()``, not in between.
"""

from __future__ import annotations

from typing import Any

from .admission import Admission
from .intake import Intake
from .kv_cache import HostPool, KVCacheManager
from .page_tables import PageTables
from .preemption import Preemption
from .prefill_only import PrefillOnly
from .run_queues import RunQueues
from .sequence import FINISHED, FORKING, RUNNING, WAITING, SeqStatus, Sequence
from .step import StepOutput, StepPlan, StepUpdate

__all__ = ["FINISHED", "FORKING", "RUNNING", "WAITING", "Scheduler", "SeqStatus", "Sequence"]


class Scheduler:  # ~320 lines: the three policies' row planning (continue, admit, rank), decode's shortcut,
    # forks and proposals, which share the step's budget and page checks; the rest is composed (above)
    """FIFO, prefill-first or priority scheduling under a token budget and a request cap.

    fifo: running sequences continue first (decode rows, then chunks of long prompts), then
    the waiting ones are admitted in arrival order with what is left of the budget;
    prefill_first: admission first. ``priority``: sequences are ranked by ``(arrival step +
    priority * aging_steps, priority, arrival)`` (``(priority, arrival)`` with
    ``aging_steps=0``), rows are planned in rank order over running and waiting sequences
    together, and a waiting sequence that does not fit preempts running ones that rank after
    it, least urgent first, when that makes it fit.

    Prefill-only sequences (embeddings) are planned after every other row (``acb.core.prefill_only``).

    When pages run out for a running sequence, the running sequence that ranks last and has
    no row in this step yet is preempted (``acb.core.preemption``); if there is none, the
    sequence that needs the page preempts itself.
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
        max_prefill_only_tokens: int | None = None,
    ) -> None:
        self.kv = kv
        self.kv_swa = kv_swa  # hybrid models: the sliding layers' pool (``sliding_window`` is then theirs)
        self.host_pool = host_pool
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests
        self.queues = RunQueues(policy, aging_steps)
        self.policy, self.aging_steps, self.safety_margin = policy, aging_steps, safety_margin
        self.pages = PageTables(kv, kv_swa, sliding_window)
        self.preemption = Preemption(self.queues, self.pages, host_pool)
        self.admission = Admission(self.queues, self.pages, self.preemption, safety_margin, self._start)
        self.intake = Intake(self.pages, self.finish)
        self.prefill_only = PrefillOnly(self.queues, self.admission, max_prefill_only_tokens, self._continue)
        self.plan_index = 0
        # the common decode row has a shortcut (_decode_row) without sliding windows
        self._plain_decode = sliding_window is None and kv_swa is None

    # what the engine, its stats and tests read, kept where they were
    waiting = property(lambda self: self.queues.waiting)
    running = property(lambda self: self.queues.running)
    sliding_window = property(lambda self: self.pages.sliding_window)
    num_preemptions = property(lambda self: self.preemption.num_preemptions)
    num_recomputed_tokens = property(lambda self: self.preemption.num_recomputed_tokens)
    num_generated_tokens = property(lambda self: self.intake.num_generated_tokens)

    @property
    def speculation(self) -> Any:
        """acb.core.speculative.Speculation when decode rows may carry proposals, else None."""
        return self.intake.speculation

    @speculation.setter
    def speculation(self, value: Any) -> None:
        self.intake.speculation = value

    def add(self, seq: Sequence, forks: list[Sequence] | None = None) -> None:
        """Queue a new sequence; ``forks``: the other choices of an n > 1 request, whose
        first choice ``seq`` is (they fork from it in the step that prefills its prompt)."""
        if forks:
            seq.forks = forks
            for s in forks:
                s.status = FORKING
        self.prefill_only.count += seq.prefill_only
        for s in (seq, *(seq.forks or ())):
            s.queued_plan = self.plan_index
            s.rank = self.queues.rank(s)
        self.queues.enqueue(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished, cancelled or failed) and release its pages. A
        finished sequence stays finished: finishing it again does nothing."""
        if seq.status is FINISHED:
            return
        self.prefill_only.count -= seq.prefill_only
        self.queues.remove(seq)
        if seq.forks:  # its other choices are not forked yet: the next one prefills for them
            heir, *rest = seq.forks
            heir.forks = rest or None
            self.queues.enqueue(heir, front=True)
            seq.forks = None
        self.pages.release(seq)
        self.pages.drop_row(seq)
        seq.num_recycled_pages = 0
        self.preemption.drop_offload(seq)

    def update(self, plan: StepPlan, out: StepOutput) -> StepUpdate:
        """Take a finished step's sampled tokens into its sequences (``acb.core.intake``)."""
        return self.intake.update(plan, out)

    def truncate(self, seq: Sequence, end: int) -> None:
        """End ``seq`` after its first ``end`` generated tokens (a stop string inside accepted proposals)."""
        self.intake.truncate(seq, end)

    def step_failed(self, plan: StepPlan) -> tuple[list[Sequence], list[Sequence]]:
        """The sequences a failed step fails, and those restored from its offloaded KV (``acb.core.preemption``)."""
        return self.preemption.step_failed(plan)

    def drop_offload(self, seq: Sequence) -> None:
        """Forget a preempted sequence's offloaded KV (it will be recomputed)."""
        self.preemption.drop_offload(seq)

    def sent_tables(self) -> list[tuple[int, list[int], list[int] | None]]:
        """What the runner's block-table store must hold, per running sequence (``acb.core.page_tables``)."""
        return self.pages.sent_tables(self.queues.running)

    def has_work(self) -> bool:
        return bool(self.queues.waiting or self.queues.running or self.queues.prefill_only)

    # ------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self.plan_index += 1
        if self.host_pool is not None:
            self.host_pool.end_plan()
        plan = StepPlan(index=self.plan_index)
        budget = self.max_batch_tokens
        if self.speculation is not None:
            self.speculation.begin_plan(len(self.queues.running))
        if self.queues.policy == "prefill_first":
            # admission first, but not into the pages this step's running rows need: a running
            # sequence left without them preempted itself, was admitted first in the next step
            # and took the pages the other one then lacked, and the two took turns forever
            held_back = self._running_need() if self.queues.waiting else 0
            budget = self.admission.admit(plan, budget, self.max_requests, held_back)
            budget = self._continue_running(plan, budget)
        elif self.queues.policy == "priority":
            budget = self._plan_by_rank(plan, budget)
        else:
            budget = self._continue_running(plan, budget)
            budget = self.admission.admit(plan, budget, self.max_requests)
        self.prefill_only.plan(plan, budget, self.max_requests)
        self.preemption.take_swap_outs(plan)
        return plan

    def _running_need(self) -> int:
        """Pages the running sequences' next rows take (each as if it got the whole budget:
        a chunk of a long prompt included), copies of shared partial pages counted."""
        kv, need = self.kv, 0
        for seq in self.queues.running:
            n = min(self._tokens_wanted(seq), self.max_batch_tokens)
            if n > 0:
                need += max(kv.pages_for(seq.num_computed + n) - len(seq.block_table), 0) + \
                    self.pages.shares_partial_page(seq)
        return need

    def _start(self, plan: StepPlan, seq: Sequence, n: int, start: int | None = None) -> None:
        """``seq`` starts running (admitted, resumed or forked) with its first row of ``n`` tokens."""
        self.pages.take_row(seq)
        self.queues.start(seq)
        self._add_row(plan, seq, n, start)

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
        sample = end - d == seq.num_tokens and not seq.prefill_only
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
        self.pages.send(inp, seq)
        inp.add_table_row(tokens, start, seq.table_row, carry_from, sample, seq.adapter, d,
                          start < len(seq.prompt_ids))
        if sample:
            seq.sampled_plan = plan.index
            seq.sampled_row = plan.num_sampled
            plan.num_sampled += 1 + d
            if seq.forks and seq.num_generated == 0:
                self._fork(plan, seq, end)
            seq.num_inflight += 1
        seq.num_computed += n

    def _decode_row(self, plan: StepPlan, seq: Sequence) -> bool:
        """The common row, planned in one go: one token, a sampled one (known or in
        flight), at most one new page and none shared (no copy-on-write), no sliding
        window, no choices to fork. False (and nothing done) for any other row: the caller
        takes the general path. What it plans is what that path would."""
        c = seq.num_computed
        out = seq.output_ids
        generated = len(out) + seq.num_inflight
        if len(seq.prompt_ids) + generated - c != 1 or not 0 < generated < seq.max_new_tokens or seq.forks:
            return False  # (none generated: the prompt's last token, a prefill row: StepInput.prompt_singles)
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
            inp.add_table_row((out[-1],), c, seq.table_row, -1, True, seq.adapter)
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
            self.pages.share(leader, seq)
            seq.num_computed = end
            seq.num_cached_prompt_tokens = leader.num_cached_prompt_tokens
            plan.admitted.append(seq)
            self._start(plan, seq, 0, end)
        leader.forks = None

    def _continue_running(self, plan: StepPlan, budget: int) -> int:
        scheduled: set[int] = {id(seq) for seq in plan.seqs}
        for seq in [s for s in self.queues.running if not s.prefill_only]:  # (those: acb.core.prefill_only)
            if budget <= 0 or len(plan.seqs) >= self.max_requests:
                break
            budget = self._continue(plan, seq, budget, scheduled)
        return budget

    def _continue(self, plan: StepPlan, seq: Sequence, budget: int, scheduled: set[int]) -> int:
        """Give running ``seq`` its next row (preempting to find its pages); the budget left."""
        if seq.status is not RUNNING or id(seq) in scheduled:
            return budget
        drafts = 0  # speculative proposals (a decode row whose last token is known)
        # not the row that ends a prompt its other choices fork from: they start from its
        # prompt, not from what it proposes (their rows computed past the prompt and stalled)
        if seq.spec is not None and self.speculation is not None and self._tokens_wanted(seq) == 1 and \
                not seq.forks:
            drafts = self._propose(seq, budget - 1, self.pages.shares_partial_page(seq))
        if not drafts and self._plain_decode and self._decode_row(plan, seq):
            scheduled.add(id(seq))
            return budget - 1
        n = min(self._tokens_wanted(seq), budget)
        if n <= 0:
            return budget
        if self.pages.sliding_window:
            self.pages.recycle_out_of_window(seq)
        cow = self.pages.shares_partial_page(seq)
        n += drafts
        need = self.kv.pages_for(seq.num_computed + n) - len(seq.block_table)
        while not self.pages.fits(need + cow):
            victim = self.preemption.pick_victim(scheduled)
            self.preemption.preempt(victim, plan)
            if victim is seq:
                break
        if seq.status is not RUNNING:
            return budget
        if cow:
            self.pages.copy_on_write(seq, plan.input)
        if need > 0:
            self.pages.allocate(seq, need)
        before = len(plan.seqs)
        self._add_row(plan, seq, n)
        if len(plan.seqs) == before + 1:
            scheduled.add(id(seq))
        else:
            scheduled.update(id(s) for s in plan.seqs[before:])  # with the choices forked from it
        return budget - n

    def _propose(self, seq: Sequence, budget: int, cow: bool) -> int:
        """Decode row ``seq``'s proposals (``seq.drafts``), as many as pay (acb.core.speculative),
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
        running = list(self.queues.running)  # in rank order
        k = 0
        admitting = True
        while budget > 0 and len(plan.seqs) < self.max_requests:
            while k < len(running) and (running[k].status is not RUNNING or id(running[k]) in scheduled
                                        or running[k].prefill_only):
                k += 1
            seq = running[k] if k < len(running) else None
            waiting = self.queues.waiting
            if admitting and waiting and (seq is None or waiting[0].rank < seq.rank):
                before = len(plan.seqs)
                left = self.admission.admit_one(plan, waiting[0], budget, scheduled)
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


_PLACEHOLDER = (0,)  # a decode row's token while it is in flight (the runner carries it in)
