"""Paged attention in Triton: the CUDA path's kernels (and, under ``TRITON_INTERPRET=1``,
the same kernels run on CPU tensors by Triton's interpreter, which is how the default
test suite checks them).

Cache layout (acb's, see :class:`acb.worker.runner.ModelRunner`): one ``[kv_heads, slots,
head_dim]`` tensor per layer for keys and one for values; slot ``page * page_size + i``
holds position ``i`` of a page. Block tables are ``[rows, pages]`` int64 page ids.

- :func:`write_kv`: the step's new keys and values into their slots, one launch for both.
- :func:`paged_decode`: one query token per row; keys and values read in place through
  the block table; one program per (row, kv head, split) attends for all the query
  heads of its group (grouped-query attention without expanding K/V); long contexts are
  split over several programs (flash-decoding) whose partial results one reduce kernel
  merges. Sliding window and logit soft-capping.
- :func:`paged_prefill`: every prefill row of the packed step in one launch (fresh
  prompts, chunked-prefill continuations and prefix hits alike: their keys are all read
  from the cache through the block table, after :func:`write_kv`); causal, sliding,
  soft-capped; key blocks past a query block's diagonal or before its window are skipped.

Scores and softmax are computed in float32; float32 models multiply in IEEE precision
(no TF32), so their tokens match PyTorch's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

WRITE_BLOCK_T = 16  # tokens per program of the k/v write
DECODE_BLOCK_N = 64  # keys per block in the decode kernel
PREFILL_BLOCK_M = 64  # queries per prefill program
PREFILL_BLOCK_N = 64  # keys per block in the prefill kernel
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # a split attends at least this many positions


def _block(n: int) -> int:
    """Power-of-two tile width >= n and >= 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(n))


# Triton's interpreter multiplies bfloat16 tiles wrongly (numpy has no bfloat16): there
# every product is taken in float32 (IEEE), which on a GPU only float32 models do.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _helper(fn):
    """``triton.jit`` for a function kernels call. Triton's interpreter re-patches
    ``triton.language`` on every call of a jitted helper (milliseconds each, per block of
    every program); there the helper is the interpreter's rewritten plain function,
    which runs inside the calling kernel's patched scope."""
    jitted = triton.jit(fn)
    return jitted.rewrite() if INTERPRETED else jitted


@_helper
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@_helper
def _cap(s, softcap):
    """softcap * tanh(s / softcap), from exp (no overflow: exp of a non-positive number)."""
    x = s / softcap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -t, t)


@_helper
def _online_block(q, acc, m_i, l_i, k_base, v_base, slot, key_ok, allowed, s_cs, d, dm, scale, softcap,
                  SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """One key block of an online softmax: scores of ``q`` [M, D] against the block's keys,
    masked by ``allowed`` [M, N]; returns the updated (acc, m_i, l_i)."""
    kv_mask = key_ok[:, None] & dm[None, :]
    k = tl.load(k_base + slot[:, None] * s_cs + d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), IEEE) * scale
    if SOFTCAP:
        s = _cap(s, softcap)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + slot[:, None] * s_cs + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, s_kh, s_kt, s_vh, s_vt, s_ch, s_cs, T, D,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    tm = t < T
    slot = tl.load(slot_ptr + t, mask=tm, other=0).to(tl.int64)
    t = t.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = tm[:, None] & (d < D)[None, :]
    dst = h * s_ch + slot[:, None] * s_cs + d[None, :]
    k = tl.load(k_ptr + h * s_kh + t[:, None] * s_kt + d[None, :], mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + h * s_vh + t[:, None] * s_vt + d[None, :], mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(q_ptr, o_ptr, kc_ptr, vc_ptr, tok_ptr, table_ptr, len_ptr, po_ptr, pm_ptr, pl_ptr,
                   s_qh, s_qt, s_ot, s_oh, s_ch, s_cs, s_tb,
                   scale, softcap, window, page_size, split_tokens, G, D, H, SPLITS,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    length = tl.load(len_ptr + row).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + heads[:, None] * s_qh + tok * s_qt + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    q = q.to(kc_ptr.dtype.element_ty)
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, length)
    if WINDOW:
        lo = tl.maximum(lo, length - window)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = kc_ptr + kvh * s_ch
    v_base = vc_ptr + kvh * s_ch
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        page = tl.load(table_ptr + row * s_tb + pos // page_size, mask=key_ok, other=0).to(tl.int64)
        slot = page * page_size + pos % page_size
        acc, m_i, l_i = _online_block(q, acc, m_i, l_i, k_base, v_base, slot, key_ok, key_ok[None, :], s_cs, d,
                                      dm, scale, softcap, SOFTCAP, IEEE)
    if SPLIT:
        part = (row * H + heads) * SPLITS + split  # [BLOCK_G]
        tl.store(pm_ptr + part, m_i, mask=gm)
        tl.store(pl_ptr + part, l_i, mask=gm)
        tl.store(po_ptr + part[:, None] * D + d[None, :], acc, mask=gm[:, None] & dm[None, :])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + tok * s_ot + heads[:, None] * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])


@triton.jit
def _reduce_kernel(o_ptr, tok_ptr, po_ptr, pm_ptr, pl_ptr, s_ot, s_oh, D, H, SPLITS,
                   BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = s < SPLITS
    dm = d < D
    part = (row * H + h) * SPLITS + s
    m = tl.load(pm_ptr + part, mask=sm, other=float("-inf"))
    l_s = tl.load(pl_ptr + part, mask=sm, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)
    o = tl.load(po_ptr + part[:, None] * D + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    num = tl.sum(w[:, None] * o, 0)
    den = tl.sum(w * l_s, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    tl.store(o_ptr + tok * s_ot + h * s_oh + d, out.to(o_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _prefill_kernel(q_ptr, o_ptr, kc_ptr, vc_ptr, table_ptr, rows_ptr, prog_ptr,
                    s_qh, s_qt, s_ot, s_oh, s_ch, s_cs, s_tb,
                    scale, softcap, window, page_size, G, D,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    row = tl.load(prog_ptr + 2 * pid).to(tl.int64)
    m0 = tl.load(prog_ptr + 2 * pid + 1).to(tl.int32)  # first query of this block, within the row
    q_start = tl.load(rows_ptr + 3 * row).to(tl.int64)
    n = tl.load(rows_ptr + 3 * row + 1).to(tl.int32)
    past = tl.load(rows_ptr + 3 * row + 2).to(tl.int32)
    i = m0 + tl.arange(0, BLOCK_M)
    qm = i < n
    q_pos = past + i
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    tok = q_start + i
    q = tl.load(q_ptr + h * s_qh + tok[:, None] * s_qt + d[None, :], mask=qm[:, None] & dm[None, :], other=0.0)
    q = q.to(kc_ptr.dtype.element_ty)
    kvh = h // G
    k_base = kc_ptr + kvh * s_ch
    v_base = vc_ptr + kvh * s_ch
    hi = past + tl.minimum(m0 + BLOCK_M, n)  # past the block's last query: the diagonal
    lo = 0
    if WINDOW:
        lo = tl.maximum(past + m0 - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        page = tl.load(table_ptr + row * s_tb + pos // page_size, mask=key_ok, other=0).to(tl.int64)
        slot = page * page_size + pos % page_size
        allowed = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _online_block(q, acc, m_i, l_i, k_base, v_base, slot, key_ok, allowed, s_cs, d, dm,
                                      scale, softcap, SOFTCAP, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * s_ot + h * s_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=qm[:, None] & dm[None, :])


# ---------------------------------------------------------------------------------- host side
def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be [kv_heads, slots, head_dim] with the same strides")


def write_kv(k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k_new``/``v_new`` ``[kv_heads, T, head_dim]`` (any strides but a unit last
    one) into the caches at ``slot_mapping`` ``[T]``."""
    _check_cache(k_cache, v_cache)
    kvh, total, d = k_new.shape
    if total == 0:
        return
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    if v_new.stride(-1) != 1:
        v_new = v_new.contiguous()
    _write_kv_kernel[(triton.cdiv(total, WRITE_BLOCK_T), kvh)](
        k_new, v_new, k_cache, v_cache, slot_mapping, k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), k_cache.stride(0), k_cache.stride(1), total, d, BLOCK_T=WRITE_BLOCK_T, BLOCK_D=_block(d))


def num_splits(rows: int, kv_heads: int, width: int, programs_wanted: int = 264) -> int:
    """How many programs share one row's context in :func:`paged_decode`: enough to give
    the device ``programs_wanted`` programs, each over at least ``MIN_SPLIT_TOKENS``
    positions, at most ``MAX_SPLITS``. Depends only on host numbers (no device sync)."""
    by_load = -(-programs_wanted // max(1, rows * kv_heads))
    by_width = -(-width // MIN_SPLIT_TOKENS)
    return max(1, min(by_load, by_width, MAX_SPLITS))


def paged_decode(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 token_idx: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, page_size: int,
                 scale: float, softcap: float | None = None, window: int | None = None,
                 splits: int | None = None) -> None:
    """Decode attention for ``token_idx`` ``[B]`` (packed token of each row): queries from
    ``q`` ``[heads, T, head_dim]``, results into ``out`` ``[T, heads, head_dim]``; row b
    attends to positions ``[0, lengths[b])`` (the last ``window`` of them when given)
    through ``block_table[b]``. ``splits`` (default :func:`num_splits`) > 1 runs
    flash-decoding: partial softmaxes over slices of the context, then one reduce."""
    _check_cache(k_cache, v_cache)
    heads, _, d = q.shape
    kvh = k_cache.shape[0]
    rows, width_pages = block_table.shape
    if rows == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    groups = heads // kvh
    width = width_pages * page_size
    if splits is None:
        splits = num_splits(rows, kvh, width)
    split_tokens = -(-max(width, 1) // splits)
    split_tokens = -(-split_tokens // DECODE_BLOCK_N) * DECODE_BLOCK_N
    splits = max(1, -(-width // split_tokens))
    ieee = k_cache.dtype == torch.float32 or INTERPRETED
    common = dict(BLOCK_G=_block(groups), BLOCK_N=DECODE_BLOCK_N, BLOCK_D=_block(d), SOFTCAP=bool(softcap),
                  WINDOW=bool(window), IEEE=ieee)
    args = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            block_table.stride(0), scale, float(softcap or 1.0), int(window or 0), page_size, split_tokens,
            groups, d, heads, splits)
    if splits == 1:
        _decode_kernel[(rows, kvh, 1)](q, out, k_cache, v_cache, token_idx, block_table, lengths, out, out, out,
                                       *args, SPLIT=False, **common)
        return
    part_o = torch.empty(rows, heads, splits, d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(rows, kvh, splits)](q, out, k_cache, v_cache, token_idx, block_table, lengths, part_o, part_m,
                                        part_l, *args, SPLIT=True, **common)
    _reduce_kernel[(rows, heads)](out, token_idx, part_o, part_m, part_l, out.stride(0), out.stride(1), d, heads,
                                  splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=_block(d))


@dataclass(slots=True)
class PrefillRows:
    """A step's prefill rows for :func:`paged_prefill` (built once per step, shared by
    every layer): ``rows`` ``[R, 3]`` (first packed token, query tokens, past tokens),
    ``tables`` ``[R, pages]`` covering each row's past and new tokens, and ``programs``
    ``[blocks, 2]`` (row, first query) of each ``PREFILL_BLOCK_M`` block of queries."""

    rows: torch.Tensor
    tables: torch.Tensor
    programs: torch.Tensor

    @staticmethod
    def programs_for(q_lens: list[int]) -> list[tuple[int, int]]:
        """(row, first query) of every query block, rows in order; empty rows get none."""
        return [(r, m) for r, n in enumerate(q_lens) for m in range(0, n, PREFILL_BLOCK_M)]


def paged_prefill(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  prefill: PrefillRows, page_size: int, scale: float, softcap: float | None = None,
                  window: int | None = None) -> None:
    """Causal attention for every prefill row in one launch: row r's queries are packed
    tokens ``[start, start + n)`` of ``q`` ``[heads, T, head_dim]`` at positions
    ``[past, past + n)``; its keys (past and new, already in the cache) are read through
    ``prefill.tables[r]``. Results go to ``out`` ``[T, heads, head_dim]``."""
    _check_cache(k_cache, v_cache)
    heads, _, d = q.shape
    blocks = prefill.programs.shape[0]
    if blocks == 0:
        return
    if q.stride(-1) != 1:
        q = q.contiguous()
    _prefill_kernel[(blocks, heads)](
        q, out, k_cache, v_cache, prefill.tables, prefill.rows, prefill.programs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        prefill.tables.stride(0), scale, float(softcap or 1.0), int(window or 0), page_size,
        heads // k_cache.shape[0], d,
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, BLOCK_D=_block(d), SOFTCAP=bool(softcap),
        WINDOW=bool(window), IEEE=k_cache.dtype == torch.float32 or INTERPRETED)


__all__ = ["write_kv", "paged_decode", "paged_prefill", "PrefillRows", "num_splits"]
