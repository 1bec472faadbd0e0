"""The ``triton`` attention backend (CUDA; the kernels are ``acb/kernels/triton_attention.py``):
one kernel writes the step's keys and values, one attends every decode row (pages read in place,
split-K), one every prefill row (block tables, no per-prompt loop): three launches per layer,
none per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .selector import KERNELS
from .torch_backend import decode_torch

if TYPE_CHECKING:
    from .metadata import PagePool, StepAttention


def triton_attention(meta: StepAttention, pool: PagePool, q_all: torch.Tensor, k_new: torch.Tensor,
                     v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scaling: float,
                     sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """The Triton backend: q [H, T, d], new k/v [kvh, T, d] -> [1, T, H, d]. Three launches
    per layer (k/v write, decode rows, prefill rows), none per row."""
    kernels = KERNELS["triton"]
    kernels.write_kv(k_new, v_new, k_cache, v_cache, pool.slot_mapping)
    num_heads, total, head_dim = q_all.shape
    out = q_all.new_empty(total, num_heads, head_dim)
    decode = meta.decode
    if decode is not None and decode.kernel == "triton":
        kernels.paged_decode(q_all, out, k_cache, v_cache, decode.token_idx, pool.decode_pages, decode.lengths,
                             meta.page_size, scaling, softcap, sliding_window)
    elif decode is not None:  # wider than max_blocks_per_request: PyTorch's path
        o = decode_torch(pool, decode, meta.page_size, q_all.index_select(1, decode.token_idx), k_cache, v_cache,
                         k_new.shape[0], scaling, sliding_window, softcap)
        out.index_copy_(0, decode.token_idx, o.to(out.dtype))
    if pool.triton_prefill is not None:
        kernels.paged_prefill(q_all, out, k_cache, v_cache, pool.triton_prefill, meta.page_size, scaling, softcap,
                              sliding_window)
    return out.unsqueeze(0)
