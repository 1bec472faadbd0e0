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


def _page_views(runner: ModelRunner) -> list[torch.Tensor]:
    """Per layer, K then V, viewed as [kv heads, pages, page_size * head_dim]."""
    ps = runner.page_size
    views = []
    for k, v in zip(runner.k_cache, runner.v_cache, strict=True):
        kvh, slots, d = k.shape
        views.append(k.view(kvh, slots // ps, ps * d))
        views.append(v.view(kvh, slots // ps, ps * d))
    return views


def swap_out(runner: ModelRunner, pairs: list[tuple[int, ...]]) -> None:
    """Copy device pages into host slots (the pages may be reused right after)."""
    full = runner._tensor([pair[0] for pair in pairs])
    # hybrid models: an entry without a sliding page reads the sliding pool's zero page
    swa = runner._tensor([pair[2] if pair[2] >= 0 else runner.swa_pages for pair in pairs]) \
        if runner.swa_layers else None
    views = _page_views(runner)
    # [2L, kvh, n, ps*d] -> [n, L, 2, kvh, ps*d]: one contiguous block per page
    staged = torch.stack([view.index_select(1, swa if i // 2 in runner.swa_layers else full)
                          for i, view in enumerate(views)])
    staged = staged.permute(2, 0, 1, 3).reshape(len(pairs), *runner.host_pool.shape[1:])
    if runner.stream is None:
        runner.host_pool.index_copy_(0, torch.tensor([pair[1] for pair in pairs]), staged)
    else:
        staged = staged.contiguous()
        for j, pair in enumerate(pairs):
            runner.host_pool[pair[1]].copy_(staged[j], non_blocking=True)


def swap_in(runner: ModelRunner, pairs: list[tuple[int, ...]]) -> None:
    """Copy host slots back into (fresh) device pages."""
    n = len(pairs)
    if runner.stream is None:
        staged = runner.host_pool.index_select(0, torch.tensor([pair[0] for pair in pairs]))
    else:
        staged = torch.empty((n, *runner.host_pool.shape[1:]), dtype=runner.dtype, device=runner.device)
        for j, pair in enumerate(pairs):
            staged[j].copy_(runner.host_pool[pair[0]], non_blocking=True)
    full = runner._tensor([pair[1] for pair in pairs])
    layers, _, kvh, width = staged.shape[1:]
    per_view = staged.view(n, 2 * layers, kvh, width).permute(1, 2, 0, 3)  # [2L, kvh, n, ps*d]
    with_swa = [j for j, pair in enumerate(pairs) if len(pair) > 2 and pair[2] >= 0]
    swa_idx = runner._tensor([pairs[j][2] for j in with_swa]) if runner.swa_layers else None
    swa_rows = runner._tensor(with_swa) if runner.swa_layers else None
    for i, view in enumerate(_page_views(runner)):
        if i // 2 in runner.swa_layers:
            if with_swa:
                view.index_copy_(1, swa_idx, per_view[i].index_select(1, swa_rows))
        else:
            view.index_copy_(1, full, per_view[i])
    for pair in pairs:
        runner._zeroed[pair[1]] = 1
        if len(pair) > 2 and pair[2] >= 0:
            runner._zeroed_swa[pair[2]] = 1
