"""Random paged-attention cases and a PyTorch reference for acb's attention kernels:
the default suite runs them on CPU through Triton's interpreter
(tests/test_triton_kernels.py), ``benchmarks/gpu_check.py`` on the GPU.

Each check builds a cache with pages scattered at random, runs a kernel of
:mod:`acb.kernels.triton_attention` and compares every row with a float64 reference;
it raises AssertionError on a mismatch and returns the largest error."""

from __future__ import annotations

import random

import torch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}

# groups (query heads per kv head), dtype, page_size, window, softcap, splits (None: the heuristic)
DECODE_CASES = [
    (1, torch.float32, 4, None, None, 1),
    (3, torch.float32, 16, 7, None, 3),
    (8, torch.bfloat16, 4, None, 10.0, 2),
    (2, torch.float16, 16, None, None, 1),
    (3, torch.bfloat16, 16, 20, 5.0, 4),
    (8, torch.float32, 4, 5, 30.0, None),
]
# groups, dtype, page_size, window, softcap
PREFILL_CASES = [
    (1, torch.float32, 4, None, None),
    (3, torch.float32, 16, 9, None),
    (8, torch.bfloat16, 4, None, 20.0),
    (3, torch.float16, 4, 6, 10.0),
]


def make_cache(kv_heads: int, num_pages: int, page_size: int, d: int, dtype, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    slots = num_pages * page_size
    k = torch.randn(kv_heads, slots, d, generator=g).to(dtype)
    v = torch.randn(kv_heads, slots, d, generator=g).to(dtype)
    return k.to(device), v.to(device)


def tables_for(lengths: list[int], page_size: int, num_pages: int, rng: random.Random) -> list[list[int]]:
    """Disjoint, shuffled pages per row (scattered across the cache)."""
    pages = list(range(num_pages))
    rng.shuffle(pages)
    return [[pages.pop() for _ in range(-(-n // page_size))] for n in lengths]


def padded(tables: list[list[int]], device="cpu", zero: int = 0) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0) or 1
    return torch.tensor([t + [zero] * (width - len(t)) for t in tables], dtype=torch.long, device=device)


def reference(q: torch.Tensor, k_cache, v_cache, table: list[int], q_pos: list[int], page_size: int,
              scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """q [heads, n, d] at positions q_pos -> [n, heads, d], in float64 on the CPU."""
    heads, n, d = q.shape
    kvh = k_cache.shape[0]
    length = max(q_pos) + 1
    slots = torch.tensor([table[p // page_size] * page_size + p % page_size for p in range(length)])
    k = k_cache.cpu()[:, slots].double().repeat_interleave(heads // kvh, 0)  # [heads, L, d]
    v = v_cache.cpu()[:, slots].double().repeat_interleave(heads // kvh, 0)
    s = q.cpu().double() @ k.transpose(1, 2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    qp = torch.tensor(q_pos).unsqueeze(1)
    kp = torch.arange(length).unsqueeze(0)
    allowed = kp <= qp
    if window:
        allowed &= kp > qp - window
    s = s.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)


def _close(got: torch.Tensor, ref: torch.Tensor, dtype, what: str) -> float:
    err = (got.cpu().double() - ref).abs().max().item()
    tol = TOLERANCE[dtype]
    if not err <= tol * (1 + ref.abs().max().item()):
        raise AssertionError(f"{what}: max error {err:.3g} > tolerance {tol:g}")
    return err


def check_decode(groups, dtype, page_size, window, softcap, splits, device="cpu", head_dim: int = 16) -> float:
    """Decode rows of 1 token to 150 positions (across page boundaries) at scattered
    packed positions; the other packed rows must stay untouched."""
    from acb.kernels import triton_attention as tk

    rng = random.Random(groups * 100 + page_size)
    kvh, d = 2, head_dim
    heads = kvh * groups
    lengths = [1, page_size, page_size + 1, 3 * page_size - 1, 150, rng.randint(2, 90)]
    num_pages = sum(-(-n // page_size) for n in lengths) + 3
    k_cache, v_cache = make_cache(kvh, num_pages, page_size, d, dtype, groups, device)
    tables = tables_for(lengths, page_size, num_pages, rng)
    total = len(lengths) + 3
    token_idx = [1, 0, 4, 8, 2, 6]
    q = torch.randn(heads, total, d, generator=torch.Generator().manual_seed(7)).to(dtype).to(device)
    out = torch.full((total, heads, d), 7.0, dtype=dtype, device=device)
    scale = 16**-0.5
    tk.paged_decode(q, out, k_cache, v_cache, torch.tensor(token_idx, device=device), padded(tables, device),
                    torch.tensor(lengths, device=device), page_size, scale, softcap, window, splits=splits)
    err = 0.0
    for row, (tok, n) in enumerate(zip(token_idx, lengths)):
        ref = reference(q[:, tok : tok + 1], k_cache, v_cache, tables[row], [n - 1], page_size, scale, softcap,
                        window)[0]
        err = max(err, _close(out[tok], ref, dtype, f"decode row {row} (context {n})"))
    untouched = sorted(set(range(total)) - set(token_idx))
    if not (out[untouched] == 7.0).all():
        raise AssertionError("decode wrote rows that are not decode rows")
    return err


def check_prefill(groups, dtype, page_size, window, softcap, device="cpu", head_dim: int = 16) -> float:
    """Fresh prompts, continuations (chunked prefill / prefix hit), an empty row, a
    single-token row and one longer than a query block, all in one launch."""
    from acb.kernels import triton_attention as tk

    rng = random.Random(groups + page_size)
    kvh, d = 2, head_dim
    heads = kvh * groups
    # (past, new tokens) per row
    spans = [(0, 5), (2 * page_size, 3), (0, 0), (7, 1), (0, tk.PREFILL_BLOCK_M + 6),
             (page_size + 1, 2 * page_size)]
    lengths = [p + n for p, n in spans]
    num_pages = sum(-(-n // page_size) for n in lengths) + 2
    k_cache, v_cache = make_cache(kvh, num_pages, page_size, d, dtype, groups + 1, device)
    tables = tables_for(lengths, page_size, num_pages, rng)
    starts, total = [], 1  # packed token 0 belongs to no prefill row (a decode row, say)
    for _, n in spans:
        starts.append(total)
        total += n
    q = torch.randn(heads, total, d, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    out = torch.full((total, heads, d), 7.0, dtype=dtype, device=device)
    rows = torch.tensor([[s, n, p] for s, (p, n) in zip(starts, spans)], dtype=torch.long, device=device)
    programs = torch.tensor(tk.PrefillRows.programs_for([n for _, n in spans]), dtype=torch.long, device=device)
    scale = 0.3
    tk.paged_prefill(q, out, k_cache, v_cache, tk.PrefillRows(rows, padded(tables, device), programs), page_size,
                     scale, softcap, window)
    err = 0.0
    for row, (s, (p, n)) in enumerate(zip(starts, spans)):
        if n:
            ref = reference(q[:, s : s + n], k_cache, v_cache, tables[row], list(range(p, p + n)), page_size,
                            scale, softcap, window)
            err = max(err, _close(out[s : s + n], ref, dtype, f"prefill row {row} (past {p}, {n} tokens)"))
    if not (out[0] == 7.0).all():
        raise AssertionError("prefill wrote a token outside every prefill row")
    return err


def check_write(dtype, device="cpu", head_dim: int = 16) -> float:
    """The k/v write: every token into its slot, from the transposed view transformers
    hands over, and nothing else touched."""
    from acb.kernels import triton_attention as tk

    kvh, d, page_size = 3, head_dim, 4
    k_cache = torch.zeros(kvh, 10 * page_size, d, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, 0, 39, 17, 18] + list(range(20, 34)), device=device)  # more than one program
    t = len(slots)
    k_new = torch.randn(1, t, kvh, d, device=device).to(dtype).transpose(1, 2)[0]  # the model's dtype
    v_new = torch.randn(1, t, kvh, d, device=device).to(dtype).transpose(1, 2)[0]
    tk.write_kv(k_new, v_new, k_cache, v_cache, slots)
    if not (torch.equal(k_cache[:, slots], k_new) and torch.equal(v_cache[:, slots], v_new)):
        raise AssertionError("write_kv: a token's k/v is not in its slot")
    others = torch.ones(k_cache.shape[1], dtype=torch.bool, device=device)
    others[slots] = False
    if k_cache[:, others].any() or v_cache[:, others].any():
        raise AssertionError("write_kv wrote outside the step's slots")
    return 0.0
