"""The ``native`` attention backend: acb's CPU kernels (``acb/kernels/csrc/paged_decode_cpu.cpp``),
which read float32, bfloat16 or float16 pages (and int8 ones, ``acb.attention.kv_quant``) in
place and compute in float32.

- The step's keys and values are written into their slots by the kernel (int8 pages: quantized,
  keys rotated, as they are written; a fresh prompt's rows handed back as stored).
- A decode-only step is one call per layer (``paged_decode_into``: the writes, the attention and
  the output in the model's dtype).
- Decode rows otherwise attend together in one call, reading keys and values straight from their
  pages; prefill rows: every fresh prompt of the step in one call (causal register tiles, only
  the key blocks a row can see), each continued one (chunked prefill, prefix hit) in its own over
  its gathered context pages.

Queries that read int8 pages are rotated as their keys were (:func:`rotate_queries`). What the
kernels do not take goes to the PyTorch paths (``acb.attention.torch_backend``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import kv_quant
from .selector import KERNELS
from .torch_backend import decode_torch, gather_pages, prefill_torch

if TYPE_CHECKING:
    from .metadata import DecodeRows, PagePool, StepAttention


def rotate_queries(x: torch.Tensor) -> torch.Tensor:
    """Queries ``x [..., d]`` that read int8 pages -> ``x H / b`` (``acb.attention.kv_quant``), contiguous, by
    the native kernel's arithmetic (the one-call decode rotates its queries in the kernel)."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    half = rows.dtype not in (torch.float32, torch.bfloat16)  # fp16: rotated in float32
    rows = rows.float().contiguous() if half else rows.contiguous()
    out = torch.empty_like(rows)
    KERNELS["native"].hadamard(rows, out, 1.0 / kv_quant.rotation_block(d))
    return (out.to(x.dtype) if half else out).view(x.shape)


def decode_native(pool: PagePool, decode: DecodeRows, page_size: int, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, scaling: float, sliding_window: int | None, softcap: float | None,
                  o: torch.Tensor | None = None) -> torch.Tensor:
    """q [Bd, H, d] -> [Bd, H, d] (into ``o`` when given), reading keys and values
    straight from their pages."""
    if o is None:
        o = torch.empty_like(q)
    KERNELS["native"].paged_decode(q, k_cache, v_cache, pool.decode_pages, decode.lengths, o, page_size, scaling,
                                   softcap or 0.0, sliding_window or 0)
    return o


def decode_rows(meta: StepAttention, pool: PagePool, q_all: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, kv_heads: int, scaling: float, sliding_window: int | None,
                softcap: float | None, out: torch.Tensor, rotated: bool = False) -> None:
    """The decode rows (native or PyTorch path): q_all [H, T, d] -> their tokens' rows of
    ``out`` [T, H, d]; ``rotated``: the pages hold rotated keys (int8), so the queries are
    rotated, as the one-call path rotates them: in the dtype the step's rows reach the kernels in
    (a bf16 step's in bf16 where the kernels have avx512_bf16, else widened to float32 first)."""
    decode = meta.decode
    turn = rotate_queries if rotated else (lambda q: q)
    if decode.kernel == "native" and not meta.prefills:
        # a decode-only step: every packed token is a decode row, in order; the
        # kernel reads the queries in place and writes straight into the output
        decode_native(pool, decode, meta.page_size, turn(q_all.transpose(0, 1)).contiguous().float(), k_cache,
                      v_cache, scaling, sliding_window, softcap, out)
        return
    idx = decode.token_idx
    if decode.kernel == "native":
        q = turn(q_all.index_select(1, idx)).transpose(0, 1).contiguous().float()
        o = decode_native(pool, decode, meta.page_size, q, k_cache, v_cache, scaling, sliding_window, softcap)
    else:
        q = turn(q_all.index_select(1, idx)).to(out.dtype)
        o = decode_torch(pool, decode, meta.page_size, q, k_cache, v_cache, kv_heads, scaling, sliding_window, softcap)
    out.index_copy_(0, idx, o.to(out.dtype))


def prefill_rows(meta: StepAttention, pool: PagePool, q_all: torch.Tensor, k_new: torch.Tensor,
                 v_new: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, half: bool, scaling: float,
                 sliding_window: int | None, softcap: float | None, out: torch.Tensor, rotated: bool = False,
                 bf16_weights: bool = False) -> None:
    """The prefill rows (native or PyTorch path): q_all [H, T, d] and the new k/v
    [kvh, T, d] -> their tokens' rows of ``out`` [T, H, d]. In a half-precision step the
    native kernel gets float32 or bf16 inputs (all alike), PyTorch's attention float32.
    ``rotated``: the pages hold rotated keys (int8), so every chunk's queries are rotated (a
    fresh prompt's ``k_new``/``v_new`` are then its own rows as stored, ``write_kv_int8``'s readback).
    ``bf16_weights``: the bf16 kernel's value product over bf16-rounded softmax weights
    (:func:`paged_attention`'s ``acb_bf16_weights``)."""
    kernel = KERNELS["native"] if meta.kernel == "native" else None
    cap = softcap or 0.0
    q_read = q_all  # the queries as they read the keys
    if rotated:  # every prompt chunk reads rotated keys (a fresh one its own, as stored): all the
        # step's queries rotated in one pass, [T, H, d] as the projection wrote them (a decode row's
        # too, which nothing reads: the decode kernels rotate their own)
        q_read = rotate_queries(q_all.transpose(0, 1)).transpose(0, 1)
    fresh_done = meta.fresh_spans is not None and kernel.prefill_attention(
        q_read, k_new, v_new, meta.fresh_spans, out, scaling, cap, sliding_window or 0, bf16_weights)
    q32 = None  # q_read in float32, made once if a context chunk's pages read as float32 (int8 pages)
    for span, context_pages in zip(meta.prefills, pool.context_pages, strict=True):
        qs, qe, past = span.q_start, span.q_end, span.past
        if past == 0 and fresh_done:
            continue
        length = past + qe - qs
        if past == 0:
            k, v = k_new[:, qs:qe], v_new[:, qs:qe]  # [kvh, n, d]
        else:
            k = gather_pages(k_cache, context_pages, meta.page_size)[:, 0, :length]
            v = gather_pages(v_cache, context_pages, meta.page_size)[:, 0, :length]
            if half and k.dtype != q_read.dtype:
                if q_read.dtype == torch.bfloat16 and k_cache.dtype == torch.int8:
                    # int8 pages in a bf16 step: the context rounded to bf16 once, as bf16 pages would
                    # hold it, for the bf16 kernel (the float32 one took ~25 % longer on 2-6k contexts)
                    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
                else:  # half-precision pages widened for the float32 kernel
                    k, v = k.float(), v.float()
                    q32 = q_read.float() if q32 is None else q32
            if kernel is not None and kernel.prefill_attention(
                    q_read if k.dtype == q_read.dtype else q32, k, v, span.kernel_row, out, scaling, cap,
                    sliding_window or 0, bf16_weights):
                continue
        q = q_read[:, qs:qe]
        if half:  # PyTorch's attention on float32 inputs, as the kernels compute
            q, k, v = q.float(), k.float(), v.float()
        out[qs:qe] = prefill_torch(q, k, v, past, scaling, sliding_window, softcap).transpose(0, 1).to(out.dtype)
