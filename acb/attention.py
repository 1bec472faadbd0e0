"""acb's paged attention, registered with transformers' ``AttentionInterface``.

transformers calls :func:`paged_attention` from every attention layer with the
packed step's q/k/v (RoPE applied, shape ``[1, heads, T, dim]``). The function
writes k/v into acb's pages at the step's slot mapping, then attends:

- decode rows (one query token each) together, in one batched matmul over their
  gathered pages (the gather index is built once per step and shared by all layers);
- prefill rows one by one: a fresh prompt attends to its own k/v (no gather),
  a continued one (chunked prefill, prefix hit) gathers its context pages.

The step's metadata reaches the function through a thread-local set by the model
runner, so several engines (each with its own worker thread) can share a process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_NAME = "acb_paged"
_local = threading.local()


@dataclass(slots=True)
class PrefillSpan:
    q_start: int  # first packed token of this row
    q_end: int
    past: int  # tokens of context before the row (0 = fresh prompt)
    context_slots: torch.Tensor | None  # slots of all past + new tokens, when past > 0


@dataclass(slots=True)
class StepAttention:
    """Per-step attention metadata shared by every layer."""

    k_cache: list[torch.Tensor]  # per layer [num_slots, kv_heads, head_dim]
    v_cache: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] where each new token's k/v goes
    decode_token_idx: torch.Tensor | None  # [Bd] packed index of each decode row's token
    decode_slots: torch.Tensor | None  # [Bd, Lmax] slots of each decode row's context
    decode_key_pos: torch.Tensor | None  # [1, Lmax] key positions 0..Lmax-1
    decode_q_pos: torch.Tensor | None  # [Bd, 1] the query's position (context length - 1)
    decode_valid: torch.Tensor | None  # [Bd, 1, 1, Lmax] True where a key exists
    prefills: list[PrefillSpan]


def set_step(meta: StepAttention | None) -> None:
    _local.meta = meta


def current_step() -> StepAttention:
    meta = getattr(_local, "meta", None)
    if meta is None:
        raise RuntimeError("acb paged attention called outside an acb engine step")
    return meta


def _softmax_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
    scaling: float, softcap: float | None,
) -> torch.Tensor:
    """q [..., G, Q, d], k/v [..., 1, L, d] (broadcast over the G query heads of a kv head)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta = current_step()
    layer = module.layer_idx
    k_cache = meta.k_cache[layer]
    v_cache = meta.v_cache[layer]
    _, num_heads, total, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = num_heads // kv_heads
    if scaling is None:
        scaling = head_dim**-0.5

    k_new = key[0].transpose(0, 1)  # [T, kvh, d]
    v_new = value[0].transpose(0, 1)
    k_cache.index_copy_(0, meta.slot_mapping, k_new.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v_new.to(v_cache.dtype))

    out = query.new_empty(total, num_heads, head_dim)
    q_tokens = query[0].transpose(0, 1)  # [T, H, d]

    if meta.decode_token_idx is not None:
        idx = meta.decode_token_idx
        bd = idx.shape[0]
        q = q_tokens.index_select(0, idx).view(bd, kv_heads, groups, 1, head_dim)
        lmax = meta.decode_slots.shape[1]
        flat = meta.decode_slots.reshape(-1)
        k = k_cache.index_select(0, flat).view(bd, lmax, kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, flat).view(bd, lmax, kv_heads, head_dim).transpose(1, 2)
        allowed = meta.decode_valid
        if sliding_window is not None:
            in_window = meta.decode_key_pos > meta.decode_q_pos - sliding_window  # [Bd, Lmax]
            allowed = allowed & in_window.view(bd, 1, 1, lmax)
        o = _softmax_attend(q, k.unsqueeze(2), v.unsqueeze(2), allowed.unsqueeze(1), scaling, softcap)
        out.index_copy_(0, idx, o.view(bd, num_heads, head_dim))

    for span in meta.prefills:
        qs, qe, past = span.q_start, span.q_end, span.past
        n = qe - qs
        q = q_tokens[qs:qe].transpose(0, 1)  # [H, n, d]
        if past == 0:
            k = k_new[qs:qe].transpose(0, 1)  # [kvh, n, d]
            v = v_new[qs:qe].transpose(0, 1)
        else:
            k = k_cache.index_select(0, span.context_slots).transpose(0, 1)
            v = v_cache.index_select(0, span.context_slots).transpose(0, 1)
        length = past + n
        q_pos = torch.arange(past, length, device=q.device).unsqueeze(1)
        k_pos = torch.arange(length, device=q.device).unsqueeze(0)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed = allowed & (k_pos > q_pos - sliding_window)
        if softcap is None:
            o = F.scaled_dot_product_attention(
                q.unsqueeze(0), k.unsqueeze(0).to(q.dtype), v.unsqueeze(0).to(q.dtype),
                attn_mask=allowed, scale=scaling, enable_gqa=groups > 1,
            )[0]
        else:
            qg = q.reshape(kv_heads, groups, n, head_dim)
            o = _softmax_attend(qg, k.unsqueeze(1), v.unsqueeze(1), allowed, scaling, softcap)
            o = o.reshape(num_heads, n, head_dim)
        out[qs:qe] = o.transpose(0, 1)

    return out.unsqueeze(0), None


def register() -> None:
    """Register acb's attention with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
