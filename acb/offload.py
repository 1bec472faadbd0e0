"""CPU offload's copies: a preempted sequence's KV pages to host slots and back.

The host pool holds one contiguous ``[layers, k/v, kv heads, page]`` block per slot
(pinned on CUDA, where the copies are asynchronous on the runner's stream). Hybrid
models copy an entry's sliding-layer page, when it has one, with its full one.
Called by the runner before a step's forward: swap-outs first, then swap-ins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .runner import ModelRunner
    from .step import PageMoves


def _page_views(runner: ModelRunner) -> list[torch.Tensor]:
    """Per layer, K then V, viewed as [kv heads, pages, page_size * head_dim]."""
    ps = runner.page_size
    views = []
    for k, v in zip(runner.k_cache, runner.v_cache, strict=True):
        kvh, slots, d = k.shape
        views.append(k.view(kvh, slots // ps, ps * d))
        views.append(v.view(kvh, slots // ps, ps * d))
    return views


def swap_out(runner: ModelRunner, moves: PageMoves) -> None:
    """Copy device pages (``moves.src``) into host slots (``moves.dst``); the pages may be
    reused right after."""
    full = runner._tensor(moves.src)
    # hybrid models: an entry without a sliding page reads the sliding pool's zero page
    swa = runner._tensor([p if p >= 0 else runner.swa_pages for p in moves.swa]) if runner.swa_layers else None
    views = _page_views(runner)
    # [2L, kvh, n, ps*d] -> [n, L, 2, kvh, ps*d]: one contiguous block per page
    staged = torch.stack([view.index_select(1, swa if i // 2 in runner.swa_layers else full)
                          for i, view in enumerate(views)])
    staged = staged.permute(2, 0, 1, 3).reshape(len(moves), *runner.host_pool.shape[1:])
    if runner.stream is None:
        runner.host_pool.index_copy_(0, torch.tensor(moves.dst), staged)
    else:
        staged = staged.contiguous()
        for j, slot in enumerate(moves.dst):
            runner.host_pool[slot].copy_(staged[j], non_blocking=True)


def swap_in(runner: ModelRunner, moves: PageMoves) -> None:
    """Copy host slots (``moves.src``) back into (fresh) device pages (``moves.dst``)."""
    n = len(moves)
    if runner.stream is None:
        staged = runner.host_pool.index_select(0, torch.tensor(moves.src))
    else:
        staged = torch.empty((n, *runner.host_pool.shape[1:]), dtype=runner.dtype, device=runner.device)
        for j, slot in enumerate(moves.src):
            staged[j].copy_(runner.host_pool[slot], non_blocking=True)
    full = runner._tensor(moves.dst)
    layers, _, kvh, width = staged.shape[1:]
    per_view = staged.view(n, 2 * layers, kvh, width).permute(1, 2, 0, 3)  # [2L, kvh, n, ps*d]
    with_swa = [j for j, p in enumerate(moves.swa) if p >= 0]
    swa_idx = runner._tensor([moves.swa[j] for j in with_swa]) if runner.swa_layers else None
    swa_rows = runner._tensor(with_swa) if runner.swa_layers else None
    for i, view in enumerate(_page_views(runner)):
        if i // 2 in runner.swa_layers:
            if with_swa:
                view.index_copy_(1, swa_idx, per_view[i].index_select(1, swa_rows))
        else:
            view.index_copy_(1, full, per_view[i])
    for page in moves.dst:
        runner._zeroed[page] = 1
    for page in moves.swa:
        if page >= 0:
            runner._zeroed_swa[page] = 1
