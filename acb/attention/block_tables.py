"""The device side's block tables: the runner's copy of every running sequence's page
table, kept current by the deltas each step carries (``StepInput.delta_*``).

The scheduler gives each running sequence a row (``Sequence.table_row``) and sends, in
the step that first reads them, only the entries of its table that changed since they
were last sent: new pages, copy-on-write replacements, entries recycled behind a sliding
window, a whole table after admission, a fork or a resumption. A step's rows then name
their table by row, and packing gathers the rows' tables with one index op instead of
copying page lists per row per step. ``check`` compares the store with the scheduler's
tables (the engine's integrity check).

Row -1 reads as an empty table (every entry the zero page): padding rows use it. Entries
a sequence has not sent (past its table's end, or from an earlier owner of the row) are
never read: a gather covers only the pages a row's length reaches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from ..core.kv_cache import RECYCLED


class BlockTables:
    """``[rows + 1, pages]`` long tensors on the cache's device: store row 0 is the empty
    table, sequence row ``r`` is store row ``r + 1``. ``swa`` (hybrid models): the sliding
    pool's table, same shape, its own zero page. Grows as rows and columns are sent."""

    def __init__(self, device: torch.device, page_size: int, zero_page: int,
                 to_device: Callable[[list[int]], torch.Tensor], swa_zero_page: int | None = None,
                 rows: int = 64, cols: int = 16) -> None:
        self.device = device
        self.page_size = page_size
        self.zero_page = zero_page
        self.swa_zero_page = swa_zero_page
        self.to_device = to_device
        self.pages = torch.full((rows + 1, cols), zero_page, dtype=torch.long, device=device)
        self.swa = None if swa_zero_page is None else torch.full_like(self.pages, swa_zero_page)

    def apply(self, rows: list[int], cols: list[int], pages: list[int], swa: list[int]) -> None:
        """Set entry (``rows[k]``, ``cols[k]``) to ``pages[k]`` (and the sliding table's to
        ``swa[k]``) for every k; a recycled entry (-1) reads as the zero page."""
        if not rows:
            return
        self._grow(max(rows) + 2, max(cols) + 1)
        r = self.to_device(rows).add_(1)
        c = self.to_device(cols)
        p = self.to_device(pages)
        self.pages.index_put_((r, c), p.masked_fill_(p < 0, self.zero_page))
        if self.swa is not None and swa:
            p = self.to_device(swa)
            self.swa.index_put_((r, c), p.masked_fill_(p < 0, self.swa_zero_page))

    def gather(self, rows: torch.Tensor, lengths: torch.Tensor, width: int, sliding: bool = False) -> torch.Tensor:
        """``[B, ceil(width / page_size)]``: the pages of rows ``rows`` (sequence rows, -1:
        empty) covering ``lengths`` tokens each; the zero page past a row's length."""
        npages = -(-width // self.page_size)
        if npages > self.pages.shape[1]:
            self._grow(self.pages.shape[0], npages)
        table = self.swa if sliding else self.pages
        got = table.index_select(0, rows + 1)[:, :npages]
        used = torch.arange(npages, device=self.device) * self.page_size < lengths.unsqueeze(1)
        return got.where(used, self.swa_zero_page if sliding else self.zero_page)

    def slots(self, rows: torch.Tensor, positions: torch.Tensor, sliding: bool = False) -> torch.Tensor:
        """The KV slot of each token at ``positions`` of the sequence at row ``rows`` (one
        entry per token)."""
        table = self.swa if sliding else self.pages
        ps = self.page_size
        return table[rows + 1, positions // ps] * ps + positions % ps

    def check(self, tables: Iterable[tuple[int, Sequence[int], Sequence[int] | None]]) -> None:
        """Raise AssertionError unless each (row, pages, sliding pages) given -- a sequence's
        sent entries, as the scheduler holds them -- is what the store holds."""
        host = self.pages.cpu()
        swa = self.swa.cpu() if self.swa is not None else None
        for row, pages, swa_pages in tables:
            if not pages:
                continue
            assert row >= 0 and row + 1 < host.shape[0] and len(pages) <= host.shape[1], \
                f"block-table row {row} ({len(pages)} pages) is outside the store {tuple(host.shape)}"
            want = [self.zero_page if p == RECYCLED else p for p in pages]
            got = host[row + 1, : len(pages)].tolist()
            assert got == want, f"block-table row {row}: the store holds {got}, the scheduler {want}"
            if swa is not None and swa_pages is not None:
                want = [self.swa_zero_page if p == RECYCLED else p for p in swa_pages]
                got = swa[row + 1, : len(swa_pages)].tolist()
                assert got == want, f"sliding block-table row {row}: the store holds {got}, the scheduler {want}"

    def _grow(self, rows: int, cols: int) -> None:
        old_rows, old_cols = self.pages.shape
        if rows <= old_rows and cols <= old_cols:
            return
        shape = (max(rows, 2 * old_rows - 1 if rows > old_rows else old_rows),
                 max(cols, 2 * old_cols if cols > old_cols else old_cols))
        self.pages = _widen(self.pages, shape, self.zero_page)
        if self.swa is not None:
            self.swa = _widen(self.swa, shape, self.swa_zero_page)


def _widen(table: torch.Tensor, shape: tuple[int, int], fill: int) -> torch.Tensor:
    new = torch.full(shape, fill, dtype=table.dtype, device=table.device)
    new[: table.shape[0], : table.shape[1]] = table
    return new

