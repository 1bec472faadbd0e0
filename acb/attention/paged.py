"""acb's paged attention: the function transformers calls (registered with its
``AttentionInterface``), and :func:`attend`, which acb's own fused forwards call.

Both take the packed step's q/k/v of one layer (RoPE applied, shape ``[1, heads, T, dim]``),
write k/v into acb's pages at the step's slot mapping, then attend:

- decode rows (one query token each) together, reading their pages in place (a kernel) or in one
  batched matmul over their gathered pages (the gather index is built once per step and shared
  by all layers);
- prefill rows: a fresh prompt attends to its own k/v (no gather; int8 pages: its rows read back
  as stored), a continued one (chunked prefill, prefix hit) to its context pages.

Each step's metadata names its backend's kernel path, and :func:`attend` dispatches on it: the
``native`` CPU kernels (``acb.attention.native``), PyTorch's ops (``acb.attention.torch_backend``,
also where a kernel does not apply) or the Triton kernels (``acb.attention.triton_backend``).
``acb.attention.selector`` picks the backend per engine and loads its kernels.

The step's metadata reaches :func:`attend` as an argument (acb's fused forwards hold the step's
``ForwardContext``); transformers calls :func:`paged_attention` with its own signature, so that one
reads it from the forward context's variable (``acb.attention.context``). The metadata types and
their builders are ``acb.attention.metadata``'s; the model's config names acb's attention only
inside acb's steps (``acb.attention.routing``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .context import current
from .native import decode_rows, prefill_rows
from .selector import KERNELS, bf16_prefill
from .triton_backend import triton_attention

if TYPE_CHECKING:
    from .metadata import StepAttention

ATTN_NAME = "acb_paged"
# The same function behind a graph break, for compiled forwards (acb/worker/compiling.py): its
# per-step Python metadata would otherwise be specialised and recompiled every step.
ATTN_NAME_COMPILED = "acb_paged_compiled"


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
    """transformers' attention interface, for one layer of an acb step that runs transformers'
    modules: :func:`attend` over the metadata of the forward context the runner set
    (``acb.attention.context.run``)."""
    context = current()
    if context is None:
        raise RuntimeError("acb paged attention called outside an acb engine step")
    return attend(context.attention, module, query, key, value, scaling, sliding_window, softcap)


def attend(meta: StepAttention, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
           value: torch.Tensor, scaling: float | None = None, sliding_window: int | None = None,
           softcap: float | None = None, into: torch.Tensor | None = None,
           bf16_weights: bool = False) -> tuple[torch.Tensor, None]:
    """One layer's attention in the step of ``meta`` (``module.layer_idx`` picks its pages): q
    [1, H, T, d], new k/v [1, kvh, T, d] -> ([1, T, H, d], None). ``into`` (acb's fused forwards):
    a [T, H, d] view in the query's dtype, heads contiguous, that receives the output (the returned
    tensor is then a view of it). ``bf16_weights`` (acb's int8 forward): bf16 prompt rows' value
    product takes the softmax weights rounded to bf16, as flash attention on GPUs does (one
    product; the bf16 forward's takes them to ~16 bits, in two)."""
    layer = module.layer_idx
    pool = meta.sliding if meta.sliding is not None and layer in meta.sliding_layers else meta.pool
    k_cache = pool.k_cache[layer]  # [kv_heads, slots, head_dim]
    v_cache = pool.v_cache[layer]
    _, num_heads, total, head_dim = query.shape
    if scaling is None:
        scaling = head_dim**-0.5
    if meta.kernel == "triton":
        out = triton_attention(meta, pool, query[0], key[0], value[0], k_cache, v_cache, scaling, sliding_window,
                               softcap)
        if into is not None:
            into.copy_(out[0])
            return into.unsqueeze(0), None
        return out, None

    k_new = key[0]  # [kvh, T, d]
    v_new = value[0]
    q_all = query[0]  # [H, T, d]
    # int8 pages hold rotated keys (acb.attention.kv_quant): keys are rotated as they are written, queries
    # as they read them (a fresh prompt's too: it attends to its own keys as stored)
    rotated = k_cache.dtype == torch.int8
    if (meta.kernel == "native" and not meta.prefills and meta.decode is not None and meta.decode.kernel == "native"
            and k_cache.dtype in (query.dtype, torch.int8)):
        # a decode-only step in one native call: cache writes, attention and the output in the
        # model's dtype, no copies around it (paged_decode_into; False where it does not apply)
        out = into if into is not None else q_all.new_empty(total, num_heads, head_dim)
        if KERNELS["native"].paged_decode_into(
                q_all.transpose(0, 1), k_new.transpose(0, 1), v_new.transpose(0, 1), k_cache, v_cache,
                pool.slot_mapping, pool.decode_pages, meta.decode.lengths, out, meta.page_size, scaling,
                softcap or 0.0, sliding_window or 0, rotated):
            return out.unsqueeze(0), None
    # The native kernels compute in float32 whatever the model's dtype (bf16/fp16 pages are
    # widened as they are read) and write float32 outputs, rounded to the model's dtype once at
    # the end. A bf16 step's prompt rows go to the prefill kernel as they are (its avx512_bf16
    # dot products, float32 softmax and sums); every other half-precision input is widened.
    half = meta.kernel == "native" and query.dtype != torch.float32
    widen = half and not (query.dtype == torch.bfloat16 and bf16_prefill())
    if widen:
        q_all, k_new, v_new = q_all.float(), k_new.float(), v_new.float()
    if k_cache.dtype == torch.int8:  # kv_cache_dtype="int8": quantized as written (acb.attention.kv_quant)
        write = KERNELS["native"].write_kv_int8
        # a fresh prompt attends to its own keys and values as stored (rotated, rounded), as its
        # later chunks and every later step read them: its logits do not depend on how the prompt
        # was chunked, so on what else shared its steps. The kernel hands the rows back as it
        # writes them (dequantized in float32, rounded once to a bf16 step's dtype), the bits
        # kv_quant.dequantize would read out of the pages (int8 pages run the native kernels only)
        back = q_all.dtype if q_all.dtype == torch.bfloat16 else torch.float32
        stored = []
        # float32 or bf16 rows (fp16 was widened); the keys rotated as they are rounded
        for new, cache, rotate in ((k_new, k_cache, True), (v_new, v_cache, False)):
            rows = torch.empty(new.shape, dtype=back) if meta.fresh_spans is not None else None
            write(new if new.stride(2) == 1 else new.contiguous(), cache, pool.slot_mapping, rotate, rows)
            stored.append(rows)
        if meta.fresh_spans is not None:
            k_new, v_new = stored
    elif meta.kernel == "native" and k_new.dtype == k_cache.dtype and k_new.stride(2) == v_new.stride(2) == 1:
        # row by row in the kernel: index_copy_ indexed each element (~0.13 ms a cache for a 2,048-row bf16 step)
        KERNELS["native"].write_kv(k_new, k_cache, pool.slot_mapping)
        KERNELS["native"].write_kv(v_new, v_cache, pool.slot_mapping)
    else:
        k_cache.index_copy_(1, pool.slot_mapping, k_new.to(k_cache.dtype))
        v_cache.index_copy_(1, pool.slot_mapping, v_new.to(v_cache.dtype))
    # A bf16 step with prompt rows gets its attention outputs rounded to bf16 as they are written: the
    # bf16 prefill kernel, the native decode rows and PyTorch's float32 prompt path each round once, the
    # bits the copy of a float32 output below gave (~0.14 ms a layer and a float32 buffer less at 1,667
    # rows). Not with PyTorch's decode path (it computes in the output's dtype), nor for a decode-only
    # step (the one-call kernel above, or else the float32 output and the copy).
    direct = (half and not widen and bool(meta.prefills)
              and (meta.decode is None or meta.decode.kernel == "native"))
    if into is not None and (not half or direct):
        out = into  # the kernels write the model's dtype: straight into the caller's buffer
    else:
        out = q_all.new_empty(total, num_heads, head_dim,
                              dtype=torch.float32 if half and not direct else q_all.dtype)
    if meta.decode is not None:
        decode_rows(meta, pool, q_all, k_cache, v_cache, key.shape[1], scaling, sliding_window, softcap, out,
                    rotated)
    if meta.prefills:
        prefill_rows(meta, pool, q_all, k_new, v_new, k_cache, v_cache, half, scaling, sliding_window, softcap,
                     out, rotated, bf16_weights)
    if into is not None:
        if out is not into:
            into.copy_(out)  # rounds to the model's dtype when the kernels ran in float32
        return into.unsqueeze(0), None
    return (out.to(query.dtype) if half and not direct else out).unsqueeze(0), None


def register() -> None:
    """Register acb's attention with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionInterface.register(ATTN_NAME_COMPILED, torch.compiler.disable(paged_attention))
