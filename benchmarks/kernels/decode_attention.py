"""The native decode attention kernel alone, per layer call, on SmolLM2's heads (9 over 3, d=64):

    python benchmarks/kernels/decode_attention.py                        # bf16 pages, 48 rows of ~420 tokens
    python benchmarks/kernels/decode_attention.py --dtype float32 --rows 64 --context 1024
    python benchmarks/kernels/decode_attention.py --kv int8               # a bf16 model over int8 pages
    python benchmarks/kernels/decode_attention.py --separate --dtype float32  # paged_decode: the separate path's

Times ``paged_decode_into`` (acb/kernels/csrc/paged_decode_cpu.cpp: the new keys and values written into
their pages, then each row's attention over its pages) on a cache whose pages are scattered as a
running engine leaves them (a random permutation of a pool four times the rows' need; --pages ascending:
each row's pages in one ascending run, as a fresh engine hands them out; --pages descending: in one
descending run), or with --separate (and where paged_decode_into declines: a CPU without AVX-512)
``paged_decode``, the attention of the separate path (float32 queries and output), median of
--repeats calls after warm-ups; prints microseconds a call and the GB/s of keys and values read.
Each call reads the next of --layers caches, as a model's layers do one after another: with one
cache (--layers 1) a call's ~16 MB of keys and values stays in this host's 32 MB L3 between calls
and the kernel reads them ~2x faster than an engine step does from memory.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: its acb
from acb.kernels.cpu import paged_decode_kernel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kv", default="auto", choices=("auto", "int8"), help="the pages: the model's dtype or int8")
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--context", type=int, default=420, help="mean context length (each row +-25 %%)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--layers", type=int, default=30, help="caches read in turn (SmolLM2 has 30 layers)")
    p.add_argument("--separate", action="store_true",
                   help="time paged_decode (the separate path's attention) instead of paged_decode_into")
    p.add_argument("--pages", default="scattered", choices=("scattered", "ascending", "descending"),
                   help="how each row's pages lie in the pool")
    args = p.parse_args()
    kernel = paged_decode_kernel()
    if kernel is None:
        sys.exit("the native CPU kernels are not built here")
    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    torch.manual_seed(0)
    b, h, kvh, d, ps = args.rows, args.heads, args.kv_heads, args.dim, args.page_size
    lengths = [max(1, int(args.context * rng.uniform(0.75, 1.25))) for _ in range(b)]
    per = max(-(-n // ps) for n in lengths)
    pool = 4 * sum(-(-n // ps) for n in lengths)
    order = list(range(pool))
    if args.pages == "scattered":
        rng.shuffle(order)
    pages = torch.zeros(b, per, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lengths):
        k = -(-n // ps)
        run = order[used: used + k]
        pages[i, :k] = torch.tensor(run[::-1] if args.pages == "descending" else run)
        used += k
    def cache() -> torch.Tensor:
        c = torch.randn(kvh, pool * ps, d).to(dtype)
        if args.kv == "int8":  # rows of d int8 values and their float32 scale (acb/attention/kv_quant.py)
            q8 = torch.empty(kvh, pool * ps, d + 4, dtype=torch.int8)
            kernel.write_kv_int8(c.float(), q8, torch.arange(pool * ps))
            return q8
        return c

    caches = [(cache(), cache()) for _ in range(args.layers)]
    q = torch.randn(b, h, d).to(dtype)
    k_new = torch.randn(b, kvh, d).to(dtype)
    v_new = torch.randn(b, kvh, d).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int64)
    slots = torch.tensor([int(pages[i, (n - 1) // ps]) * ps + (n - 1) % ps for i, n in enumerate(lengths)])
    out = torch.empty(b, h, d, dtype=dtype)

    in_turn = itertools.cycle(caches)

    def call() -> bool:
        k_cache, v_cache = next(in_turn)
        return kernel.paged_decode_into(q, k_new, v_new, k_cache, v_cache, slots, pages, lens, out, ps, d**-0.5,
                                        0.0, 0)

    q32, out32 = q.float(), torch.empty(b, h, d)

    def separate() -> bool:
        k_cache, v_cache = next(in_turn)
        kernel.paged_decode(q32, k_cache, v_cache, pages, lens, out32, ps, d**-0.5, 0.0, 0)
        return True

    timed = separate if args.separate else call
    if not timed():
        if kernel.decode_into():
            sys.exit(f"the kernel does not take {args.dtype} with {args.kv} pages here")
        print("paged_decode_into runs with AVX-512 or AVX2 only: timing paged_decode, the separate path's attention")
        timed = separate
    for _ in range(len(caches) + 5):
        timed()
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        timed()
        times.append(time.perf_counter() - t)
    us = statistics.median(times) * 1e6
    read = 2 * sum(lengths) * kvh * caches[0][0].shape[2] * caches[0][0].element_size()
    pages_of = "int8" if args.kv == "int8" else args.dtype
    layout = args.pages
    what = "paged_decode" if timed is separate else "paged_decode_into"
    print(f"{what}: {args.dtype} decode attention over {layout} {pages_of} pages, {b} rows, "
          f"context {min(lengths)}-{max(lengths)} (mean {sum(lengths) / b:.0f}), {h}/{kvh} heads, d={d}, "
          f"pages of {ps}, {len(caches)} caches in turn: "
          f"{us:.0f} us a call (min {min(times) * 1e6:.0f}), {read / us / 1e3:.1f} GB/s of keys and values")


if __name__ == "__main__":
    main()
