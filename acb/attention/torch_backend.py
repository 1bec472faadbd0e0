"""The ``torch`` attention backend: PyTorch's ops over gathered pages.

Decode rows attend together in one batched matmul over their gathered pages, in (kv head, row)
order, so nothing is expanded over the query groups of GQA (the gather index is built once per
step and shared by all layers); a prefill row goes through PyTorch's SDPA (a fresh prompt:
plainly causal, with no mask) or, with logit soft-capping, a masked softmax. The native and
Triton backends fall back on these paths where their kernels do not apply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import kv_quant

if TYPE_CHECKING:
    from .metadata import DecodeRows, PagePool


def gather_pages(cache: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """[kvh, slots, d] cache, [B, P] page ids -> [kvh, B, P * page_size, d]. Whole pages
    are copied (page_size * d contiguous values each), not single slots. int8 pages
    (``acb.attention.kv_quant``) come back dequantized, float32."""
    kvh, slots, d = cache.shape
    b, p = pages.shape
    paged = cache.view(kvh, slots // page_size, page_size * d)
    rows = paged.index_select(1, pages.view(-1)).view(kvh, b, p * page_size, d)
    return kv_quant.dequantize(rows) if cache.dtype == torch.int8 else rows


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scaling: float, softcap: float | None) -> torch.Tensor:
    """Masked softmax attention with optional logit soft-capping.

    q [B, M, d] against k/v [B, L, d] (B folds kv heads and rows: never expanded);
    ``allowed`` broadcasts to [B, M, L]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def prefill_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scaling: float,
                  sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """One prefill row through PyTorch: q [H, n, d] after ``past`` tokens of context,
    k/v [kvh, past + n, d] -> [H, n, d]."""
    num_heads, n, head_dim = q.shape
    kv_heads = k.shape[0]
    groups = num_heads // kv_heads
    length = past + n
    if softcap is None and past == 0 and sliding_window is None:
        # a fresh prompt is plainly causal: the flash kernel then skips the masked
        # half instead of reading a mask for every (query, key) pair
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
            is_causal=True, scale=scaling, enable_gqa=groups > 1,
        )[0]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
            attn_mask=_prefill_mask(past, length, sliding_window, q.device), scale=scaling,
            enable_gqa=groups > 1,
        )[0]
    qg = q.reshape(kv_heads, groups * n, head_dim)
    # rows ordered (group, position) like qg
    allowed = _prefill_mask(past, length, sliding_window, q.device).repeat(groups, 1)
    o = _attend(qg.to(k.dtype), k, v, allowed, scaling, softcap).to(q.dtype)
    return o.view(num_heads, n, head_dim)


def _prefill_mask(past: int, length: int, sliding_window: int | None, device) -> torch.Tensor:
    """[n, length] True where query position past+i may see key position j."""
    q_pos = torch.arange(past, length, device=device).unsqueeze(1)
    k_pos = torch.arange(length, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    return allowed


def decode_torch(pool: PagePool, decode: DecodeRows, page_size: int, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, kv_heads: int, scaling: float, sliding_window: int | None,
                 softcap: float | None) -> torch.Tensor:
    """q [H, Bd, d] -> [Bd, H, d] over gathered pages. Batch order is (kv head, row): the
    gathered keys are then one contiguous [kvh * Bd, L, d] batch and no tensor is
    expanded over the query groups."""
    num_heads, bd, head_dim = q.shape
    q = q.view(kv_heads, num_heads // kv_heads, bd, head_dim).transpose(1, 2)
    k = gather_pages(k_cache, pool.decode_pages, page_size)
    v = gather_pages(v_cache, pool.decode_pages, page_size)
    allowed = decode.valid  # [Bd, 1, Lmax]
    if sliding_window is not None:
        in_window = decode.key_pos > decode.q_pos - sliding_window  # [Bd, Lmax]
        allowed = allowed & in_window.unsqueeze(1)
    o = _attend(q.to(k.dtype), k, v, allowed, scaling, softcap)  # [kvh, Bd, G, d]
    return o.permute(1, 0, 2, 3).reshape(bd, num_heads, head_dim)
