"""The KV store: a runner's key and value tensors, and every write to them but attention's.

Per layer one K and one V tensor ``[kv heads, slots, head dim]``, slot ``page * page_size
+ offset``. Hybrid models (sliding and full layers) have two page pools: the sliding
layers' tensors hold ``swa_pages`` pages, the others ``num_pages``. Attention writes the
new tokens' keys and values (``acb.attention.paged``); everything else that writes the
tensors is here, done before a step's forward: zeroing pages used for the first time,
copy-on-write of shared pages, and the copies to and from the host offload pool. Beside
the tensors, the block tables that index them (``acb.attention.block_tables``), which each step's
deltas keep current.
"""

from __future__ import annotations

import math
import mmap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..attention import kv_quant
from ..attention.block_tables import BlockTables
from ..core.model_shape import ModelShape
from . import disk_pages, offload

if TYPE_CHECKING:
    from ..core.step import PageMoves, StepInput


class KVStore:
    """Owns the KV tensors (``k_cache``, ``v_cache``), which pages were ever written
    (``zeroed``, ``zeroed_swa``), the block tables (``tables``) and the host offload pool
    (``offload``, None without one). ``to_device`` turns a list of ints into a long tensor on the cache's device.
    ``dtype``: the pages' (the model's, or int8 with ``EngineConfig.kv_cache_dtype="int8"``, whose rows
    carry their scale: ``acb.attention.kv_quant``)."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device, num_pages: int, page_size: int,
                 to_device: Callable[[list[int]], torch.Tensor], host_pages: int = 0, swa_pages: int = 0,
                 swa_layers: frozenset[int] = frozenset(), zero_on_first_use: bool | None = None) -> None:
        shape = ModelShape.of(config)
        self.page_size = page_size
        self.num_pages = num_pages
        self.to_device = to_device
        # One extra page at the end holds zeros: padding reads point at it, so a
        # padded key is always finite (masked scores times NaN values would be NaN).
        self.null_slot = num_pages * page_size
        # Hybrid models: the sliding layers (``swa_layers``) have their own, smaller page
        # pool of ``swa_pages`` pages (and their own zero page at its end).
        self.swa_pages = swa_pages
        self.swa_layers = swa_layers if swa_pages else frozenset()
        # On CPU each tensor is a fresh anonymous mapping: the kernel backs its pages with memory
        # only once written, and hands them out zeroed, so no page is ever zeroed here (an
        # allocator may hand back used memory: torch.empty makes no such promise). Elsewhere
        # torch.empty, and each page is zeroed on first use (``zero_new_pages``).
        self.first_use_zeroing = device.type != "cpu" if zero_on_first_use is None else zero_on_first_use
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        for layer in range(shape.layers):
            slots = ((swa_pages if layer in self.swa_layers else num_pages) + 1) * page_size
            for caches in (self.k_cache, self.v_cache):
                size = (shape.kv_heads, slots, kv_quant.row_width(shape.head_dim, dtype))
                if device.type == "cpu":
                    caches.append(zeroed_host_tensor(size, dtype))
                else:
                    caches.append(torch.empty(size, dtype=dtype, device=device))
                    caches[-1][:, slots - page_size :].zero_()
        # Attention reads whole pages, so the unwritten tail of a row's last page is read
        # too (and masked). Masked scores are -inf, but a NaN bit pattern in never-written
        # memory would still poison ``weights @ V``: each page is zeroed on first use, unless
        # the memory came zeroed (CPU, above). (The step's deltas bring in the pages it
        # writes; :meth:`zero_new_pages` zeroes those never written.)
        self.zeroed = bytearray(num_pages)
        self.zeroed_swa = bytearray(swa_pages)
        self.tables = BlockTables(device, page_size, num_pages, to_device, swa_pages if self.swa_layers else None)
        # the CPU offload pool (EngineConfig.cpu_offload_space), None without one
        self.offload = offload.HostOffload(host_pages, self.k_cache, self.v_cache, page_size, to_device,
                                           self.swa_layers, swa_pages) if host_pages else None

    def zero(self, pages: list[int], swa_pages: list[int]) -> None:
        """Zero pages used for the first time, in every layer of their pool: ``pages`` of
        the full pool, ``swa_pages`` of the sliding one (hybrid models)."""
        self._zero(pages, sliding=False)
        self._zero(swa_pages, sliding=True)

    def update_tables(self, step: StepInput) -> None:
        """Apply the step's block-table deltas. The runner does it first, before anything
        that can fail: the next step's rows build on them even when this step fails."""
        if step.delta_rows:
            self.tables.apply(step.delta_rows, step.delta_cols, step.delta_pages, step.delta_swa)

    def zero_new_pages(self, step: StepInput) -> None:
        """Zero the pages the step's deltas bring in that were never written (after its page
        moves, which write theirs whole): every page a row writes came in by a delta, so
        none is read before it is zeroed or written whole."""
        if step.delta_rows and self.first_use_zeroing:
            self.zero(_first_use(step.delta_pages, self.zeroed),
                      _first_use(step.delta_swa, self.zeroed_swa) if self.swa_layers else [])

    def move_pages(self, step: StepInput) -> None:
        """The step's page copies, before its forward and in this order: swap-outs to the
        host pool, swap-ins from it, copy-on-write within each pool."""
        if step.swap_out:
            self.offload.swap_out(step.swap_out)
        if step.swap_in:
            self.offload.swap_in(step.swap_in)
            for page in step.swap_in.dst:  # written whole: never zero them
                self.zeroed[page] = 1
            for page in step.swap_in.swa:
                if page >= 0:
                    self.zeroed_swa[page] = 1
        if step.disk_pages:
            self.load_disk_pages(step.disk_pages, step.disk_payloads)
        if step.copy_pages:
            self._copy_pages(step.copy_pages, sliding=False)
        if step.copy_swa_pages:
            self._copy_pages(step.copy_swa_pages, sliding=True)

    def load_disk_pages(self, pages: list[int], payloads: list) -> None:
        """Write pages read from the disk tier (``acb.core.kv_disk``) whole into ``pages``."""
        disk_pages.write_pages(self.k_cache, self.v_cache, self.page_size, pages, payloads)
        for page in pages:
            self.zeroed[page] = 1  # written whole: never zero it

    def save_disk_pages(self, copies: list[tuple], disk) -> None:
        """Copy the bytes of the pages ``copies`` names ((page, key, ...) each, from
        ``DiskTier.take_copies``) out and hand them to the disk tier's writer ``disk``; on the step
        thread, ordered before any step that could overwrite them."""
        start = time.perf_counter()
        payloads = disk_pages.read_pages(self.k_cache, self.v_cache, self.page_size, [c[0] for c in copies])
        disk.submit_writes(copies, payloads, time.perf_counter() - start)

    def release(self) -> None:
        """Drop the tensors (and the offload pool, which holds them too)."""
        self.k_cache = []
        self.v_cache = []
        self.offload = None

    def _zero(self, pages: list[int], sliding: bool) -> None:
        if pages:
            idx = self.to_device(pages)
            for view in self._page_views(sliding):
                view.index_fill_(1, idx, 0.0)

    def _page_views(self, sliding: bool) -> list[torch.Tensor]:
        """K and V of every layer of one page pool (hybrid models: ``sliding`` picks the
        sliding layers'), viewed as [kv heads, pages, page_size * head_dim]."""
        ps = self.page_size
        return [cache.view(cache.shape[0], cache.shape[1] // ps, ps * cache.shape[2])
                for layer, caches in enumerate(zip(self.k_cache, self.v_cache, strict=True))
                if (layer in self.swa_layers) == sliding for cache in caches]

    def _copy_pages(self, moves: PageMoves, sliding: bool) -> None:
        """Copy-on-write of shared partial pages (forked choices): K and V of each source
        page into its fresh page, before this step writes to it, in every layer of one
        page pool (hybrid models: ``sliding`` picks the sliding layers' own pool)."""
        src = self.to_device(moves.src)
        dst = self.to_device(moves.dst)
        for pages in self._page_views(sliding):
            pages[:, dst] = pages[:, src]
        zeroed = self.zeroed_swa if sliding else self.zeroed
        for page in moves.dst:
            zeroed[page] = 1  # written whole: never zero it


def _first_use(pages: list[int], written: bytearray) -> list[int]:
    """The pages of ``pages`` never written before, each once, marked written now."""
    fresh = []
    for page in pages:
        if page >= 0 and not written[page]:
            written[page] = 1
            fresh.append(page)
    return fresh


def zeroed_host_tensor(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros over a fresh anonymous mapping: zero-filled by the kernel page
    by page as it is first touched, so it takes memory only where written (``torch.zeros``
    would write, and so back, all of it). The tensor keeps the mapping alive; it is unmapped
    when the last view of it goes."""
    count = math.prod(size)
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # (not a POSIX system)
        return torch.zeros(size, dtype=dtype)
    buf = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=count).view(size)
