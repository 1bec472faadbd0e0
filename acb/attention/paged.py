"""acb's paged attention, registered with transformers' ``AttentionInterface``.

transformers calls :func:`paged_attention` from every attention layer with the
packed step's q/k/v (RoPE applied, shape ``[1, heads, T, dim]``). The function
writes k/v into acb's pages at the step's slot mapping, then attends:

- decode rows (one query token each) together, in one batched matmul over their
  gathered pages (the gather index is built once per step and shared by all layers);
- prefill rows: a fresh prompt attends to its own k/v (no gather; int8 pages: its rows
  read back as stored), a continued one (chunked prefill, prefix hit) gathers its context
  pages. On CPU models the native kernel (``paged_decode_cpu.cpp``: causal register tiles,
  only the key blocks a row can see) takes all fresh prompts of a step in one call and each
  continued one in its own; elsewhere PyTorch's SDPA, row by row. The native kernels read
  float32, bfloat16 or float16 pages and compute in float32.

That is the ``native`` and ``torch`` backends. The ``triton`` backend (CUDA; see
``acb/kernels/triton_attention.py``) writes the step's k/v with one kernel, then attends
every decode row in one launch (pages read in place, split-K) and every prefill row in
another (block tables, no per-prompt loop). :func:`resolve_backend` picks one per engine.

The step's metadata reaches the function through a thread-local set by the model
runner, so several engines (each with its own worker thread) can share a process.

The step's metadata types and their builders are ``acb.attention.metadata``'s; the model's config
names acb's attention only inside acb's steps (``acb.attention.routing``).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from . import kv_quant

if TYPE_CHECKING:
    from .metadata import DecodeRows, PagePool, StepAttention

ATTN_NAME = "acb_paged"
# The same function behind a graph break, for compiled forwards (acb/compiling.py): its
# per-step Python metadata would otherwise be specialised and recompiled every step.
ATTN_NAME_COMPILED = "acb_paged_compiled"
_local = threading.local()


KERNEL_PATHS = ("native", "triton", "torch")
# The kernel modules of the paths that have one, loaded by :func:`load_kernels` (the
# runner, at construction): step metadata names a path, the attention function looks
# its module up here.
KERNELS: dict[str, object] = {}
_BF16_PREFILL = [False]  # the native kernel's bf16 prefill path, once loaded (bf16_prefill)


def load_kernels(path: str) -> bool:
    """Load (build, for ``native``) the kernels of kernel path ``path``; False when they
    cannot be (``native`` without a compiler). ``torch`` needs none."""
    if path == "native":
        from ..kernels.cpu import paged_decode_kernel

        module = paged_decode_kernel()
    elif path == "triton":
        from ..kernels import triton_attention as module
    else:
        return True
    if module is None:
        return False
    KERNELS[path] = module
    if path == "native":
        _BF16_PREFILL[0] = bool(module.prefill_bf16())
    return True


BACKENDS = ("auto", "native", "torch", "triton", "flash_attn")
# the model (and so KV page) dtypes the native CPU kernels read; they compute in float32
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can: on CUDA,
    or on CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter: for tests, slow)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        from ..kernels import triton_attention

        if triton_attention.INTERPRETED:
            return None
        return "TRITON_INTERPRET=1 was set after acb's Triton kernels were imported"
    return f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests); the model is on {device}"


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, native: bool = True) -> str:
    """The attention backend that serves ``EngineConfig.attn_backend=requested`` for a
    model of ``dtype`` on ``device``: ``native`` (CPU: float32, bfloat16 or float16),
    ``triton`` or ``torch``. ``auto`` picks Triton on CUDA (PyTorch when triton is
    missing), the native kernels on CPU models, PyTorch otherwise. A backend that cannot run here raises
    ``ValueError`` naming ``attn_backend`` and why. ``native=False``
    (``EngineConfig.cpu_kernels=False``): acb's native CPU kernels are not used."""
    device = torch.device(device)

    def refuse(why: str) -> ValueError:
        return ValueError(f"EngineConfig.attn_backend={requested!r} cannot run here: {why}")

    if requested == "auto":
        if device.type == "cuda":
            return "triton" if triton_unavailable(device) is None else "torch"
        return "native" if native and device.type == "cpu" and dtype in NATIVE_DTYPES else "torch"
    if requested == "native" and not native:
        raise refuse("EngineConfig.cpu_kernels=False (or ACB_CPU_KERNEL=0) turns acb's native CPU kernels off")
    if requested == "native" and not (device.type == "cpu" and dtype in NATIVE_DTYPES):
        raise refuse(f"the native kernels serve float32, bfloat16 and float16 models on CPU; this model is "
                     f"{dtype} on {device}")
    if requested == "triton":
        why = triton_unavailable(device)
        if why is not None:
            raise refuse(why)
    if requested == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise refuse("the flash-attn package is not installed") from None
        # flash-attn's paged kernels want [pages, page_size, kv_heads, head_dim] caches with
        # page_size a multiple of 256; acb's pages are [kv_heads, slots, head_dim]
        raise refuse("acb's paged KV layout is not flash-attn's (use 'triton' or 'auto' on CUDA)")
    if requested not in BACKENDS:
        raise refuse(f"unknown backend; choose from {BACKENDS}")
    return requested


def set_step(meta: StepAttention | None) -> None:
    _local.meta = meta


def in_step() -> bool:
    """Whether this thread is running an acb step (its metadata is set)."""
    return getattr(_local, "meta", None) is not None


def current_step() -> StepAttention:
    meta = getattr(_local, "meta", None)
    if meta is None:
        raise RuntimeError("acb paged attention called outside an acb engine step")
    return meta


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, page_size: int) -> torch.Tensor:
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
    acb_out: torch.Tensor | None = None,
    acb_bf16_weights: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface, for one layer of an acb step: q [1, H, T, d],
    new k/v [1, kvh, T, d] -> ([1, T, H, d], None). ``acb_out`` (acb's fused forwards): a
    [T, H, d] view in the query's dtype, heads contiguous, that receives the output (the
    returned tensor is then a view of it). ``acb_bf16_weights`` (acb's int8 forward): bf16 prompt
    rows' value product takes the softmax weights rounded to bf16, as flash attention on GPUs
    does (one product; the bf16 forward's takes them to ~16 bits, in two)."""
    meta = current_step()
    layer = module.layer_idx
    pool = meta.sliding if meta.sliding is not None and layer in meta.sliding_layers else meta.pool
    k_cache = pool.k_cache[layer]  # [kv_heads, slots, head_dim]
    v_cache = pool.v_cache[layer]
    _, num_heads, total, head_dim = query.shape
    if scaling is None:
        scaling = head_dim**-0.5
    if meta.kernel == "triton":
        out = _triton_attention(meta, pool, query[0], key[0], value[0], k_cache, v_cache, scaling, sliding_window,
                                softcap)
        if acb_out is not None:
            acb_out.copy_(out[0])
            return acb_out.unsqueeze(0), None
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
        out = acb_out if acb_out is not None else q_all.new_empty(total, num_heads, head_dim)
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
    if acb_out is not None and (not half or direct):
        out = acb_out  # the kernels write the model's dtype: straight into the caller's buffer
    else:
        out = q_all.new_empty(total, num_heads, head_dim,
                              dtype=torch.float32 if half and not direct else q_all.dtype)
    if meta.decode is not None:
        _decode_rows(meta, pool, q_all, k_cache, v_cache, key.shape[1], scaling, sliding_window, softcap, out,
                     rotated)
    if meta.prefills:
        _prefill_rows(meta, pool, q_all, k_new, v_new, k_cache, v_cache, half, scaling, sliding_window, softcap,
                      out, rotated, acb_bf16_weights)
    if acb_out is not None:
        if out is not acb_out:
            acb_out.copy_(out)  # rounds to the model's dtype when the kernels ran in float32
        return acb_out.unsqueeze(0), None
    return (out.to(query.dtype) if half and not direct else out).unsqueeze(0), None


def bf16_prefill() -> bool:
    """Whether the native prefill kernel takes bfloat16 queries, keys and values (built with
    avx512_bf16: ``paged_decode_cpu.cpp``); else a bf16 step widens them to float32 for it.
    Read from the kernel once, when it loads (``load_kernels``)."""
    return _BF16_PREFILL[0]


def _rotate_queries(x: torch.Tensor) -> torch.Tensor:
    """Queries ``x [..., d]`` that read int8 pages -> ``x H / b`` (``acb.attention.kv_quant``), contiguous, by
    the native kernel's arithmetic (the one-call decode rotates its queries in the kernel)."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    half = rows.dtype not in (torch.float32, torch.bfloat16)  # fp16: rotated in float32
    rows = rows.float().contiguous() if half else rows.contiguous()
    out = torch.empty_like(rows)
    KERNELS["native"].hadamard(rows, out, 1.0 / kv_quant.rotation_block(d))
    return (out.to(x.dtype) if half else out).view(x.shape)


def _decode_rows(meta: StepAttention, pool: PagePool, q_all: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, kv_heads: int, scaling: float, sliding_window: int | None,
                 softcap: float | None, out: torch.Tensor, rotated: bool = False) -> None:
    """The decode rows (native or PyTorch path): q_all [H, T, d] -> their tokens' rows of
    ``out`` [T, H, d]; ``rotated``: the pages hold rotated keys (int8), so the queries are
    rotated, as the one-call path rotates them: in the dtype the step's rows reach the kernels in
    (a bf16 step's in bf16 where the kernels have avx512_bf16, else widened to float32 first)."""
    decode = meta.decode
    turn = _rotate_queries if rotated else (lambda q: q)
    if decode.kernel == "native" and not meta.prefills:
        # a decode-only step: every packed token is a decode row, in order; the
        # kernel reads the queries in place and writes straight into the output
        _decode_native(pool, decode, meta.page_size, turn(q_all.transpose(0, 1)).contiguous().float(), k_cache,
                       v_cache, scaling, sliding_window, softcap, out)
        return
    idx = decode.token_idx
    if decode.kernel == "native":
        q = turn(q_all.index_select(1, idx)).transpose(0, 1).contiguous().float()
        o = _decode_native(pool, decode, meta.page_size, q, k_cache, v_cache, scaling, sliding_window, softcap)
    else:
        q = turn(q_all.index_select(1, idx)).to(out.dtype)
        o = _decode_torch(pool, decode, meta.page_size, q, k_cache, v_cache, kv_heads, scaling, sliding_window, softcap)
    out.index_copy_(0, idx, o.to(out.dtype))


def _prefill_rows(meta: StepAttention, pool: PagePool, q_all: torch.Tensor, k_new: torch.Tensor,
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
        q_read = _rotate_queries(q_all.transpose(0, 1)).transpose(0, 1)
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
            k = _gather_pages(k_cache, context_pages, meta.page_size)[:, 0, :length]
            v = _gather_pages(v_cache, context_pages, meta.page_size)[:, 0, :length]
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
        out[qs:qe] = _prefill_torch(q, k, v, past, scaling, sliding_window, softcap).transpose(0, 1).to(out.dtype)


def _prefill_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scaling: float,
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


def _triton_attention(meta: StepAttention, pool: PagePool, q_all: torch.Tensor, k_new: torch.Tensor,
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
        o = _decode_torch(pool, decode, meta.page_size, q_all.index_select(1, decode.token_idx), k_cache, v_cache,
                          k_new.shape[0], scaling, sliding_window, softcap)
        out.index_copy_(0, decode.token_idx, o.to(out.dtype))
    if pool.triton_prefill is not None:
        kernels.paged_prefill(q_all, out, k_cache, v_cache, pool.triton_prefill, meta.page_size, scaling, softcap,
                              sliding_window)
    return out.unsqueeze(0)


def _prefill_mask(past: int, length: int, sliding_window: int | None, device) -> torch.Tensor:
    """[n, length] True where query position past+i may see key position j."""
    q_pos = torch.arange(past, length, device=device).unsqueeze(1)
    k_pos = torch.arange(length, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    return allowed


def _decode_native(pool: PagePool, decode: DecodeRows, page_size: int, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, scaling: float, sliding_window: int | None, softcap: float | None,
                   o: torch.Tensor | None = None) -> torch.Tensor:
    """q [Bd, H, d] -> [Bd, H, d] (into ``o`` when given), reading keys and values
    straight from their pages."""
    if o is None:
        o = torch.empty_like(q)
    KERNELS["native"].paged_decode(q, k_cache, v_cache, pool.decode_pages, decode.lengths, o, page_size, scaling,
                                   softcap or 0.0, sliding_window or 0)
    return o


def _decode_torch(pool: PagePool, decode: DecodeRows, page_size: int, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, kv_heads: int, scaling: float, sliding_window: int | None,
                  softcap: float | None) -> torch.Tensor:
    """q [H, Bd, d] -> [Bd, H, d] over gathered pages. Batch order is (kv head, row): the
    gathered keys are then one contiguous [kvh * Bd, L, d] batch and no tensor is
    expanded over the query groups."""
    num_heads, bd, head_dim = q.shape
    q = q.view(kv_heads, num_heads // kv_heads, bd, head_dim).transpose(1, 2)
    k = _gather_pages(k_cache, pool.decode_pages, page_size)
    v = _gather_pages(v_cache, pool.decode_pages, page_size)
    allowed = decode.valid  # [Bd, 1, Lmax]
    if sliding_window is not None:
        in_window = decode.key_pos > decode.q_pos - sliding_window  # [Bd, Lmax]
        allowed = allowed & in_window.unsqueeze(1)
    o = _attend(q.to(k.dtype), k, v, allowed, scaling, softcap)  # [kvh, Bd, G, d]
    return o.permute(1, 0, 2, 3).reshape(bd, num_heads, head_dim)


def register() -> None:
    """Register acb's attention with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionInterface.register(ATTN_NAME_COMPILED, torch.compiler.disable(paged_attention))
