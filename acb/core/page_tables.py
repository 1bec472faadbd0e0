"""A sequence's page tables: its pages in the cache's pool and, on hybrid models, in the
sliding layers' pool; the pages behind a sliding window given back; copy-on-write of a
shared partial page; and its row of the runner's block-table store (``acb.attention.block_tables``)
with how many entries that row holds as they are here. Plain Python over page ids.

The scheduler decides *when* (admission, growth, preemption, forks, finishes, rejected
proposals); ``PageTables`` says *how*: every write to ``Sequence.block_table``,
``swa_table``, ``num_recycled_pages``, ``table_row`` and ``num_sent_pages`` is here, except
the common decode row's shortcut (``acb.core.scheduler``, ``_decode_row``), which takes its one
page inline."""

from __future__ import annotations

import heapq

from .kv_cache import RECYCLED, KVCacheManager, chain_hash
from .sequence import Sequence
from .step import StepInput


class PageTables:
    """The page pools (``kv``; ``kv_swa`` for the sliding layers of a hybrid model) and the
    rows of the runner's block-table store. ``sliding_window`` is set only when every layer
    slides: pages wholly behind the window are then dead for all layers and go back."""

    def __init__(self, kv: KVCacheManager, kv_swa: KVCacheManager | None, sliding_window: int | None) -> None:
        self.kv = kv
        self.kv_swa = kv_swa
        self.sliding_window = sliding_window
        # rows of the runner's block-table store: given to a sequence when it starts running,
        # taken back when it stops (the lowest free first keeps the store small)
        self._free_rows: list[int] = []
        self.num_rows = 0

    # ------------------------------------------------------------------ pages
    def fits(self, need: int, reserve: float = 0.0, swa_need: int | None = None) -> bool:
        """Whether ``need`` more pages (and ``swa_need`` sliding-layer pages, by default as
        many) can be taken now, leaving ``reserve`` pages of the main pool."""
        if need > self.kv.num_free - reserve:
            return False
        return self.kv_swa is None or (need if swa_need is None else swa_need) <= self.kv_swa.num_free

    def allocate(self, seq: Sequence, need: int) -> None:
        seq.block_table.extend(self.kv.allocate(need))
        if self.kv_swa is not None:
            seq.swa_table.extend(self.kv_swa.allocate(need))

    def release(self, seq: Sequence) -> None:
        """Give back every page ``seq`` holds in both pools (finished or preempted), its full
        pages offered to the disk tier first (once released they may be evicted)."""
        self.offer_to_disk(seq)
        self.kv.release(seq.block_table)
        seq.block_table = []
        if self.kv_swa is not None:
            self.kv_swa.release(seq.swa_table)
            seq.swa_table = []

    def offer_to_disk(self, seq: Sequence) -> None:
        """Offer ``seq``'s full, computed pages to the disk tier (``acb.core.kv_disk``), if there is one:
        those not on disk yet are copied out before any later step and written in the background."""
        disk = self.kv.disk
        n = min(seq.num_registered_pages, len(seq.block_table))
        if disk is None or not disk.active or n == 0:
            return
        ps = self.kv.page_size
        tokens = seq.token_at(0, n * ps)
        chains, parent = [], seq.prefix_root
        for i in range(n):
            parent = chain_hash(parent, tokens[i * ps : (i + 1) * ps])
            chains.append(parent)
        # registered pages only: a private copy of a chain cached elsewhere (first one wins) goes
        # back to the free list on release, and its twin is offered by its own sequence
        registered = self.kv.page_key
        disk.offer([p if p in registered else -1 for p in seq.block_table[:n]], tokens, chains, seq.lora_id)

    def cut(self, seq: Sequence, keep: int) -> None:
        """Give back the entries of ``seq``'s tables from ``keep`` on (pages written for
        proposals that were rejected); the store's copies of them are sent again when refilled."""
        if len(seq.block_table) <= keep:
            return
        self.kv.release(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.table_changed(keep)
        if self.kv_swa is not None:
            self.kv_swa.release([p for p in seq.swa_table[keep:] if p >= 0])
            del seq.swa_table[keep:]

    def share(self, leader: Sequence, seq: Sequence) -> None:
        """``seq`` (a choice of an n > 1 request) takes references to ``leader``'s pages."""
        seq.block_table = list(leader.block_table)
        self.kv.share(seq.block_table)
        if self.kv_swa is not None:
            seq.swa_table = list(leader.swa_table)
            self.kv_swa.share(seq.swa_table)
        seq.num_recycled_pages = leader.num_recycled_pages

    def shares_partial_page(self, seq: Sequence) -> bool:
        """Whether the page ``seq``'s next token goes into is partly written and held by another."""
        ps = self.kv.page_size
        if seq.num_computed % ps == 0 or seq.num_computed // ps >= len(seq.block_table):
            return False
        page = seq.block_table[seq.num_computed // ps]
        return page >= 0 and self.kv.refcount[page] > 1

    def copy_on_write(self, seq: Sequence, inp: StepInput) -> None:
        """Give ``seq`` its own copy of its partial last page if another sequence holds it
        too (forked choices), before a row writes into it; on hybrid models its sliding-layer
        page as well (forks share both, so both are shared). The caller counted the pages."""
        if not self.shares_partial_page(seq):
            return
        i = seq.num_computed // self.kv.page_size
        seq.table_changed(i)
        inp.copy_pages.add(seq.block_table[i], _replace_page(self.kv, seq.block_table, i))
        if self.kv_swa is not None:
            inp.copy_swa_pages.add(seq.swa_table[i], _replace_page(self.kv_swa, seq.swa_table, i))

    def recycle_out_of_window(self, seq: Sequence) -> None:
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

    # ------------------------------------------------------------------ the store's rows
    def take_row(self, seq: Sequence) -> None:
        """``seq`` starts running: a block-table row of its own, its tables all unsent."""
        if self._free_rows:
            seq.table_row = heapq.heappop(self._free_rows)
        else:
            seq.table_row = self.num_rows
            self.num_rows += 1
        seq.num_sent_pages = 0

    def drop_row(self, seq: Sequence) -> None:
        """``seq`` stops running: its block-table row goes back (what the store holds there
        is never read again: the next owner sends its own tables from the first entry)."""
        if seq.table_row >= 0:
            heapq.heappush(self._free_rows, seq.table_row)
            seq.table_row = -1
            seq.num_sent_pages = 0

    def send(self, inp: StepInput, seq: Sequence) -> None:
        """Put the entries of ``seq``'s tables its row in the store lacks into ``inp`` (the deltas)."""
        table = seq.block_table
        sent = seq.num_sent_pages
        if sent < len(table):
            inp.send_table(seq.table_row, sent, table[sent:], seq.swa_table[sent:] if self.kv_swa is not None else None)
            seq.num_sent_pages = len(table)

    def sent_tables(self, running: list[Sequence]) -> list[tuple[int, list[int], list[int] | None]]:
        """(row, sent entries of the block table, of the sliding table) per running
        sequence: what the runner's block-table store must hold (``BlockTables.check``)."""
        rows = [seq.table_row for seq in running]
        assert len(set(rows)) == len(rows) and min(rows, default=0) >= 0, f"block-table rows held twice: {rows}"
        assert not set(rows) & set(self._free_rows), "a running sequence's block-table row is free"
        return [(seq.table_row, seq.block_table[: seq.num_sent_pages],
                 seq.swa_table[: seq.num_sent_pages] if self.kv_swa is not None else None) for seq in running]


def _replace_page(kv: KVCacheManager, table: list[int], i: int) -> int:
    """Swap entry ``i`` of ``table`` for a fresh page of ``kv``; the fresh page."""
    fresh = kv.allocate(1)[0]
    kv.release([table[i]])
    table[i] = fresh
    return fresh
