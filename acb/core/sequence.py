"""A sequence as the scheduler sees it (``Sequence``: its tokens, pages and progress) and
where it is (``SeqStatus``). Plain data, written only by the scheduler and its parts
(``acb.core.scheduler``, ``acb.core.page_tables``, ``acb.core.run_queues``, ``acb.core.preemption``,
``acb.core.admission``, ``acb.core.intake``); everything else reads it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


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
    only), pages and progress. The scheduler and its parts own it."""

    seq_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival: int = 0
    priority: int = 0  # lower = more urgent (scheduler="priority")
    slot: int = -1  # its request's row in the request table's sampling columns (acb.engine.live.SamplingColumns)
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
    # its row in the runner's block-table store (acb.attention.block_tables) while running, and how many
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
    # an embedding request's (acb.core.pooling): its prompt is computed and nothing is sampled; it
    # waits in its own queue and its rows take the embedding share of a step (Scheduler._plan_prefill_only)
    prefill_only: bool = False
    # LoRA: the adapter's slot in the runner's stacked weights (-1: the base model) and the
    # parent hash of its prefix chain's first page (acb.core.kv_cache.adapter_root; None: base)
    adapter: int = -1
    prefix_root: int | None = None
    lora_id: int | None = None  # the adapter's (its registered pages' kv_events carry it)
    # speculative decoding (acb.core.speculative.RowState; None: this sequence never proposes)
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


def finish_reason(seq: Sequence, token: int) -> str | None:
    """Why ``token``, just taken into ``seq``, ends it: a stop token, EOS, its length; or None."""
    if token in seq.stop_ids:
        return "stop"
    if token in seq.eos_ids:
        return "eos"
    if len(seq.output_ids) >= seq.max_new_tokens:
        return "length"
    return None


def current(seq: Sequence, epoch: int) -> bool:
    """Whether a row planned for ``seq`` at ``epoch`` still belongs to it: not finished,
    cancelled or preempted since the plan was made (the one place this is decided)."""
    return seq.status is RUNNING and epoch == seq.epoch
