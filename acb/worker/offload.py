"""CPU offload's memory and copies: a preempted sequence's KV pages to host slots and back.

:class:`HostOffload` owns the host pool, one contiguous ``[layers, k/v, kv heads, page]``
block per slot (pinned on CUDA, where the copies are asynchronous on the runner's
stream; on CPU backed by memory only where written, like the cache). Hybrid models copy
an entry's sliding-layer page, when it has one, with its full one. The runner holds one
and calls it before a step's forward: swap-outs first, then swap-ins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..core.step import PageMoves


class HostOffload:
    """The host pool of ``num_slots`` page slots for the KV tensors ``k_cache`` /
    ``v_cache`` (per layer ``[kv heads, slots, head dim]``), and the copies between them.

    ``to_device`` turns a list of ints into a long tensor on the cache's device (the
    runner's, so index uploads go through pinned memory on CUDA). ``sliding_layers``
    use the second page pool whose zero page is ``sliding_zero_page`` (hybrid models)."""

    def __init__(self, num_slots: int, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], page_size: int,
                 to_device: Callable[[list[int]], torch.Tensor], sliding_layers: frozenset[int] = frozenset(),
                 sliding_zero_page: int = 0) -> None:
        kv_heads, _, head_dim = k_cache[0].shape
        self.device = k_cache[0].device
        self.asynchronous = self.device.type == "cuda"
        self.pool = torch.empty(num_slots, len(k_cache), 2, kv_heads, page_size * head_dim, dtype=k_cache[0].dtype,
                                pin_memory=self.asynchronous)
        self.to_device = to_device
        self.sliding_layers = sliding_layers
        self.sliding_zero_page = sliding_zero_page
        # per layer, K then V, viewed as [kv heads, pages, page_size * head_dim]
        self.page_views = [cache.view(kv_heads, cache.shape[1] // page_size, page_size * head_dim)
                           for k, v in zip(k_cache, v_cache, strict=True) for cache in (k, v)]

    def swap_out(self, moves: PageMoves) -> None:
        """Copy device pages (``moves.src``, with their sliding pages ``moves.swa`` on hybrid
        models) into host slots (``moves.dst``); the pages may be reused right after."""
        full = self.to_device(moves.src)
        # hybrid models: an entry without a sliding page reads the sliding pool's zero page
        swa = self.to_device([p if p >= 0 else self.sliding_zero_page for p in moves.swa]) \
            if self.sliding_layers else None
        # [2L, kvh, n, ps*d] -> [n, L, 2, kvh, ps*d]: one contiguous block per page
        staged = torch.stack([view.index_select(1, swa if i // 2 in self.sliding_layers else full)
                              for i, view in enumerate(self.page_views)])
        staged = staged.permute(2, 0, 1, 3).reshape(len(moves), *self.pool.shape[1:])
        if not self.asynchronous:
            self.pool.index_copy_(0, torch.tensor(moves.dst), staged)
            return
        staged = staged.contiguous()
        for j, slot in enumerate(moves.dst):
            self.pool[slot].copy_(staged[j], non_blocking=True)

    def swap_in(self, moves: PageMoves) -> None:
        """Copy host slots (``moves.src``) back into (fresh) device pages (``moves.dst``,
        and sliding pages ``moves.swa`` where >= 0 on hybrid models)."""
        n = len(moves)
        if not self.asynchronous:
            staged = self.pool.index_select(0, torch.tensor(moves.src))
        else:
            staged = torch.empty((n, *self.pool.shape[1:]), dtype=self.pool.dtype, device=self.device)
            for j, slot in enumerate(moves.src):
                staged[j].copy_(self.pool[slot], non_blocking=True)
        full = self.to_device(moves.dst)
        layers, _, kvh, width = staged.shape[1:]
        per_view = staged.view(n, 2 * layers, kvh, width).permute(1, 2, 0, 3)  # [2L, kvh, n, ps*d]
        with_swa = [j for j, p in enumerate(moves.swa) if p >= 0]
        if with_swa:
            swa_idx = self.to_device([moves.swa[j] for j in with_swa])
            swa_rows = self.to_device(with_swa)
        for i, view in enumerate(self.page_views):
            if i // 2 not in self.sliding_layers:
                view.index_copy_(1, full, per_view[i])
            elif with_swa:
                view.index_copy_(1, swa_idx, per_view[i].index_select(1, swa_rows))
