"""int8 KV pages: ``EngineConfig.kv_cache_dtype="int8"`` (named like vLLM's ``kv_cache_dtype``).

Each cached key (or value) row of one token and one kv head is stored as its ``head_dim``
int8 values followed by its float32 scale, ``head_dim + 4`` bytes: value = q * scale,
scale = max|x| / 127, q = round(x / scale) (ties to even; a row of zeros: scale 0). The
cache tensors keep their usual ``[kv heads, slots, row]`` layout with a row of
``head_dim + 4`` int8, so every page move (zeroing, copy-on-write, the CPU offload pool's
copies) carries a page's scales with its values, by construction. Per token, a bf16
cache takes ``2 * head_dim`` bytes per kv head and an int8 one ``head_dim + 4``: 1.88x
the pages for the same memory at head_dim 64, 1.94x at 128.

The new tokens' keys and values are quantized as they are written (the native kernel
``write_kv_int8``, or ``paged_decode_into`` in a decode-only step); the native decode kernel
reads int8 rows and widens ``q * scale`` to float32 (a bf16 model's keys to bf16, exactly, for
``vdpbf16ps``; scores, softmax and accumulators stay float32); a continued prompt chunk
(chunked prefill, prefix hit) attends to its context dequantized (and, in a bf16 model, rounded
to bf16 as bf16 pages would hold it, for the bf16 prefill kernel). A fresh prompt's own
tokens attend to each other's keys and values as stored too (its new rows as the pages now
hold them, dequantized: ``write_kv_int8`` hands them back as it writes them): every position
of a prompt sees the same keys however the prompt was chunked, so its logits, to the bit, do
not depend on what else shared its steps. (Until
2026-12-05 a fresh prompt attended to its exact keys: a prompt split over two steps then
read its first chunk's keys rounded and sampled differently, found by ``benchmarks/fuzz.py``.)

Keys are stored **rotated**: each key row is multiplied by a Walsh-Hadamard matrix (entries +-1,
block-diagonal in blocks of the largest power of two dividing ``head_dim``) before it is rounded,
and every query that reads the pages by the same matrix over the block size, a power of two, so
``(q H / b) . (k H) = q . k``: attention is unchanged up to rounding, and the rotation spreads the
few channels that carry most of a key's magnitude over all of them, so one scale per row wastes far
fewer of its 255 steps. Simulated on SmolLM2-135M in float32 (``python benchmarks/kv8_schemes.py``,
12k held-out tokens): int8 keys per row moved 2.16 % of next tokens, rotated ones 0.95 %; in the
engine (``benchmarks/quality.py``, 24k held-out tokens, every token read from the pages) top-1
agreement with float32 went from 97.64 to 98.40 % beside bf16 weights (bf16 pages: 99.05 %) and
from 96.66 to 96.90 % beside int8 weights (bf16 pages: 97.13 %). Values are stored as they are
(they cost 0.1-0.4 %). Keys are rotated as they are written (the native ``write_kv_int8`` and
``paged_decode_into`` rotate each key row in registers before rounding it), queries where they read
the pages (inside ``paged_decode_into``; the native ``hadamard`` for decode rows on the other paths
and for every prompt chunk, ``acb.attention.native``). The rotation costs the one-call decode kernel 2-5 %
(45 rows x 370 keys, SmolLM2's heads: 232 -> 235-255 us). Every page move (copy-on-write, offload,
prefix reuse) carries ordinary int8 rows. :func:`rotate_keys` / :func:`rotate_queries` are the
reference the kernels are tested against.

Only acb's native CPU attention reads int8 pages: on CUDA (Triton), with the PyTorch
backend, or with the native kernels off, the engine refuses ``kv_cache_dtype="int8"``
naming it (:func:`check`).
"""

from __future__ import annotations

import functools

import torch

KV_CACHE_DTYPES = (None, "auto", "int8")
SCALE_BYTES = 4  # the float32 scale after each int8 row


def cache_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The KV tensors' dtype: int8, or the model's (None / "auto")."""
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cached row (one token, one kv head) in a cache of ``dtype``."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes over every layer in a cache of ``dtype``, scales included."""
    return 2 * layers * kv_heads * row_width(head_dim, dtype) * dtype.itemsize


def check(kv_cache_dtype: str | None, backend: str) -> None:
    """Refuse (ValueError naming ``kv_cache_dtype``) int8 pages where the attention
    backend ``backend`` (``acb.attention.selector.resolve_backend``'s answer) cannot read them."""
    if kv_cache_dtype == "int8" and backend != "native":
        raise ValueError(
            f"EngineConfig.kv_cache_dtype='int8' cannot run here: int8 KV pages are read by acb's native CPU "
            f"attention kernels only, and this engine's attention backend is {backend!r} (CUDA, "
            f"attn_backend='torch', or cpu_kernels=False / ACB_CPU_KERNEL=0 / no compiler); use "
            f"kv_cache_dtype=None")


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows ``x [..., D]`` (float) -> int8 rows ``[..., D + 4]`` as the kernel writes them
    (the reference for tests; the engine uses the native ``write_kv_int8``)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).clamp_(-127, 127).to(torch.int8)
    scale = (amax * (1.0 / 127.0)).contiguous().view(torch.int8)  # [..., 4]
    return torch.cat([q, scale], dim=-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows ``[..., D + 4]`` -> float32 ``[..., D]`` (q * scale)."""
    d = rows.shape[-1] - SCALE_BYTES
    return rows[..., :d].float() * rows[..., d:].contiguous().view(torch.float32)


def rotation_block(head_dim: int) -> int:
    """The Hadamard block: the largest power of two dividing ``head_dim``."""
    return head_dim & -head_dim


@functools.cache
def _rotations(head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    b = rotation_block(head_dim)
    h = torch.ones(1, 1)
    while h.shape[0] < b:  # Sylvester's construction: symmetric, entries +-1, h @ h == b * I
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    keys = torch.block_diag(*[h] * (head_dim // b))
    return keys.to(dtype=dtype, device=device), (keys / b).to(dtype=dtype, device=device)  # both exact


def rotate_keys(x: torch.Tensor) -> torch.Tensor:
    """Keys ``x [..., d]`` -> ``x @ Hd`` (see the module's docstring), contiguous."""
    m = _rotations(x.shape[-1], x.dtype, x.device)[0]
    return torch.mm(x.reshape(-1, x.shape[-1]), m).view(x.shape)


def rotate_queries(x: torch.Tensor) -> torch.Tensor:
    """Queries ``x [..., d]`` -> ``x @ Hd / b``, contiguous: their products with rotated keys are
    their products with the keys."""
    m = _rotations(x.shape[-1], x.dtype, x.device)[1]
    return torch.mm(x.reshape(-1, x.shape[-1]), m).view(x.shape)
