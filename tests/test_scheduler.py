"""The scheduler on plain data: budgets, chunked prefill, FIFO order, preemption."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acb.core.kv_cache import HostPool, KVCacheManager
from acb.core.scheduler import FINISHED, RUNNING, WAITING, Scheduler, Sequence
from acb.core.step import StepOutput

EOS = 2


def _seq(i, n_prompt, max_new=4):
    return Sequence(f"r{i}", list(range(100 * i, 100 * i + n_prompt)), max_new, arrival=i, eos_ids=frozenset({EOS}))


def _finish_step(sched, plan, rng=None, eos_p=0.0):
    """Pretend the device ran the plan: token 7 per sampled row (EOS with probability
    ``eos_p``), taken in by ``Scheduler.update``; the sequences it finished."""
    tokens = [EOS if rng and rng.random() < eos_p else 7 for _ in range(plan.num_sampled)]
    return [seq for seq, _ in sched.update(plan, StepOutput(tokens, None)).finished()]


class _TableStore:
    """What the runner's block-table store does with a plan's deltas (acb.attention.block_tables),
    in plain Python: the scheduler's tests check the deltas without torch."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[int, int]] = {}
        self.swa: dict[int, dict[int, int]] = {}

    def apply(self, plan) -> None:
        inp = plan.input
        for k, (row, col, page) in enumerate(zip(inp.delta_rows, inp.delta_cols, inp.delta_pages, strict=True)):
            self.rows.setdefault(row, {})[col] = page
            if inp.delta_swa:
                self.swa.setdefault(row, {})[col] = inp.delta_swa[k]

    def check(self, sched, plan, page_size: int) -> None:
        """Every row of ``plan`` reads, from its store row, the pages its sequence's tables
        hold for the row's positions (what steps carried whole before deltas); and the
        store holds what the scheduler says it sent."""
        inp = plan.input
        for i, (seq, count) in enumerate(zip(plan.seqs, inp.counts(), strict=True)):
            npages = -(-(inp.starts[i] + count) // page_size)
            if count:
                row = inp.table_rows[i]
                assert row == seq.table_row >= 0
                assert [self.rows[row][c] for c in range(npages)] == seq.block_table[:npages]
                if sched.kv_swa is not None:
                    assert [self.swa[row][c] for c in range(npages)] == seq.swa_table[:npages]
        for row, pages, swa_pages in sched.sent_tables():
            assert [self.rows.get(row, {}).get(c) for c in range(len(pages))] == pages
            if swa_pages is not None:
                assert [self.swa.get(row, {}).get(c) for c in range(len(swa_pages))] == swa_pages


def test_rows_send_only_the_block_table_entries_that_changed():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_batch_tokens=100, max_requests=8)
    a, b = _seq(0, 6, max_new=8), _seq(1, 3, max_new=8)
    s.add(a)
    s.add(b)
    store = _TableStore()
    sent = []
    for _ in range(6):
        plan = s.schedule()
        store.apply(plan)
        store.check(s, plan, 4)
        sent.append(plan.input.tables())
        _finish_step(s, plan)
    assert (a.table_row, b.table_row) == (0, 1)
    assert sent[0] == {0: ({0: a.block_table[0], 1: a.block_table[1]}, {}), 1: ({0: b.block_table[0]}, {})}
    # decode rows: nothing, until a row's next token starts a page
    assert sent[1] == {} and sent[2] == {1: ({1: b.block_table[1]}, {})}
    assert sent[3] == {0: ({2: a.block_table[2]}, {})} and sent[4] == sent[5] == {}
    a_row = a.table_row
    s.finish(a)  # its row goes back, and the next sequence to run takes it, sending its table whole
    c = _seq(2, 5)
    s.add(c)
    plan = s.schedule()
    store.apply(plan)
    store.check(s, plan, 4)
    assert c.table_row == a_row and plan.input.tables()[a_row] == ({0: c.block_table[0], 1: c.block_table[1]}, {})


def test_budget_splits_a_long_prompt_into_chunks():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_batch_tokens=10, max_requests=8)
    seq = _seq(0, 25)
    s.add(seq)
    sizes = []
    for _ in range(3):
        plan = s.schedule()
        sizes.append(list(zip(plan.input.counts(), plan.input.sample, strict=True)))
        _finish_step(s, plan)
    assert sizes == [[(10, False)], [(10, False)], [(5, True)]]


def test_decodes_go_first_then_new_prefills_fill_the_budget():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_batch_tokens=8, max_requests=8)
    a, b = _seq(0, 3), _seq(1, 20)
    s.add(a)
    _finish_step(s, s.schedule())
    s.add(b)
    plan = s.schedule()
    assert [(seq.seq_id, n) for seq, _, n, _, _ in plan.rows()] == [("r0", 1), ("r1", 7)]


def test_prefill_first_admits_new_prompts_before_decodes():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_batch_tokens=8, max_requests=8, policy="prefill_first")
    a, b = _seq(0, 3), _seq(1, 20)
    s.add(a)
    _finish_step(s, s.schedule())
    s.add(b)
    plan = s.schedule()
    assert [(seq.seq_id, n) for seq, _, n, _, _ in plan.rows()] == [("r1", 8)]


def _run_overlapped(s, max_steps):
    """Plan step N+1 before step N's tokens come back (async batching), until nothing is left
    to run or ``max_steps`` plans were made; the number of plans."""
    pending, steps = None, 0
    while (s.has_work() or pending is not None) and steps < max_steps:
        plan = s.schedule() if s.has_work() else None
        steps += 1
        if pending is not None:
            _finish_step(s, pending)
        pending = plan
    return steps


@pytest.mark.parametrize(("prefix_caching", "a_len", "a_new", "b_len", "b_new", "budget"),
                         [(True, 22, 15, 9, 12, 7), (False, 7, 16, 16, 16, 33)])
def test_prefill_first_does_not_admit_into_the_pages_a_running_row_needs(prefix_caching, a_len, a_new, b_len,
                                                                         b_new, budget):
    # two requests that fit the cache one at a time, not together: admitted first, the
    # preempted one took the page the running one needed, which preempted itself and came
    # back first in the next step, and so on: each lost its in-flight token every time
    kv = KVCacheManager(12, 4, enable_prefix_caching=prefix_caching)
    s = Scheduler(kv, max_batch_tokens=budget, max_requests=2, policy="prefill_first")
    a, b = _seq(0, a_len, max_new=a_new), _seq(1, b_len, max_new=b_new)
    s.add(a)
    s.add(b)
    steps = _run_overlapped(s, 300)
    assert (len(a.output_ids), len(b.output_ids)) == (a_new, b_new), f"no progress after {steps} steps"
    assert steps < 100 and kv.num_free == 12


def test_request_cap_bounds_rows_per_step():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_batch_tokens=100, max_requests=3)
    for i in range(5):
        s.add(_seq(i, 2))
    assert len(s.schedule()) == 3


def test_safety_margin_holds_back_new_prefills_not_decodes():
    kv = KVCacheManager(10, 4)
    s = Scheduler(kv, max_batch_tokens=100, max_requests=8, safety_margin=0.5)
    s.add(_seq(0, 16, max_new=8))  # 4 pages (+1 later), leaves 6 free
    _finish_step(s, s.schedule())
    s.add(_seq(1, 8))  # would leave 4 free < 5 = margin
    plan = s.schedule()
    assert [seq.seq_id for seq in plan.seqs] == ["r0"]


def test_full_cache_preempts_the_newest_request_and_it_resumes_first():
    kv = KVCacheManager(4, 4)
    s = Scheduler(kv, max_batch_tokens=100, max_requests=8)
    a, b = _seq(0, 7, max_new=10), _seq(1, 7, max_new=10)
    s.add(a)
    s.add(b)
    preempted = []
    for _ in range(30):
        if not s.has_work():
            break
        plan = s.schedule()
        preempted += plan.preempted
        _finish_step(s, plan)
    assert preempted and preempted[0] is b
    assert len(a.output_ids) == 10 and len(b.output_ids) == 10
    assert kv.num_free == 4


def _check_priority_order(s, plan, waiting_before):
    """What scheduler="priority" promises of every plan: admissions in rank order (all
    of them rank before whatever still waits), and no victim more urgent than a row."""
    admitted = [q for q in plan.seqs if id(q) in waiting_before and q not in plan.preempted]
    if admitted and s.waiting:
        assert max(q.rank for q in admitted) < min(q.rank for q in s.waiting)
    for victim in plan.preempted:
        assert all(q is victim or q.rank < victim.rank for q in plan.seqs)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10_000), st.integers(6, 40), st.integers(2, 24),
       st.sampled_from(["fifo", "prefill_first", "priority"]),
       st.booleans(), st.sampled_from([0, 3, 64]), st.booleans())
def test_random_workloads_finish_without_leaking_pages(seed, num_pages, budget, policy, overlap, host_slots,
                                                        hybrid):
    rng = random.Random(seed)
    page_size = 4
    # hybrid: a second pool for sliding layers (window 8), recycled behind the window, and
    # no prefix caching, as the engine sets it up
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=not hybrid and rng.random() < 0.5)
    host = HostPool(host_slots) if host_slots else None  # CPU offload: none, a tiny pool, a big one
    kv_swa = KVCacheManager(rng.randint(6, num_pages), page_size, enable_prefix_caching=False) if hybrid else None
    s = Scheduler(kv, max_batch_tokens=budget, max_requests=rng.randint(1, 6), policy=policy,
                  safety_margin=rng.choice([0.0, 0.15]), host_pool=host, kv_swa=kv_swa,
                  sliding_window=8 if hybrid else None, aging_steps=rng.choice([0, 5, 1000]))
    capacity = num_pages * page_size
    seqs = []
    pending = None
    store = _TableStore()
    for step in range(2000):
        if len(seqs) < 12 and rng.random() < 0.3:
            n = rng.randint(1, 20)
            m = rng.randint(1, 20)
            if n + m <= capacity:
                seq = Sequence(f"r{len(seqs)}", [rng.randrange(3) for _ in range(n)], m, arrival=len(seqs),
                               eos_ids=frozenset({EOS}), priority=rng.randrange(3))
                seqs.append(seq)
                s.add(seq)
        live = [q for q in seqs if q.status is not FINISHED]
        if live and rng.random() < 0.05:
            s.finish(rng.choice(live))  # a cancel
        waiting_before = {id(q) for q in s.waiting}
        plan = s.schedule() if s.has_work() else None
        if plan is not None and policy == "priority":
            _check_priority_order(s, plan, waiting_before)
        if plan is not None:  # the runner applies each plan's block-table deltas, in order
            store.apply(plan)
            store.check(s, plan, page_size)
        # with overlap, step N's tokens are processed after step N+1 is planned
        if overlap:
            if pending is not None:
                _finish_step(s, pending, rng, 0.1)
            pending = plan
        elif plan is not None:
            _finish_step(s, plan, rng, 0.1)
        for q in seqs:
            if q.status is RUNNING and q.num_computed > 0:
                assert len(q.block_table) * page_size >= q.num_computed
        kv.check_integrity([q.block_table for q in seqs if q.status is not FINISHED])
        if kv_swa is not None:
            kv_swa.check_integrity([q.swa_table for q in seqs if q.status is not FINISHED])
            for q in seqs:
                if q.status is RUNNING:
                    assert len(q.swa_table) == len(q.block_table)
                    live = [p for p in q.swa_table if p >= 0]
                    assert len(live) <= -(-(8 + budget) // page_size) + 1  # the window and a chunk
        if host is not None:
            host.check_integrity(q.host_table for q in seqs if q.host_table)
            for q in seqs:
                if q.host_table is not None:
                    assert q.status is WAITING and 0 < q.num_offloaded_tokens < q.num_tokens
        if not s.has_work() and len(seqs) >= 12 and pending is None:
            break
    for _ in range(20 * capacity):  # drained as it ran, bounded: a livelock (requests preempting each other
        if not s.has_work() and pending is None:  # for good) fails rather than hangs
            break
        plan = s.schedule() if s.has_work() else None
        if overlap:
            if pending is not None:
                _finish_step(s, pending)
            pending = plan
        elif plan is not None:
            _finish_step(s, plan)
    assert all(q.status is FINISHED for q in seqs)
    assert kv.num_free == num_pages
    kv.check_integrity([])
    if kv_swa is not None:
        assert kv_swa.num_free == kv_swa.num_pages
    if host is not None:
        s.schedule()  # slots read by the last swap-ins come back with the next plan
        host.check_integrity()
        assert host.num_free == host_slots
