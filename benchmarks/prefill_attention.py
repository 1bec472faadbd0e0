"""The native prefill attention kernel alone, per layer call, on SmolLM2's heads (9 over 3, d=64):

    python benchmarks/prefill_attention.py                       # bf16, 12 fresh prompts of 330 tokens
    python benchmarks/prefill_attention.py --dtype float32 --prompts 4 --tokens 1024

Times ``prefill_attention`` (acb/kernels/paged_decode_cpu.cpp) over random queries, keys and values,
median of --repeats calls after three warm-ups; prints milliseconds a call and the attention's
GFLOP/s (causal: the half of the score and value products each row sees).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from acb.kernels.cpu import paged_decode_kernel  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--tokens", type=int, default=330)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    kernel = paged_decode_kernel()
    if kernel is None:
        sys.exit("the native CPU kernels are not built here")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    total, h, kvh, d = args.prompts * args.tokens, args.heads, args.kv_heads, args.dim
    q = torch.randn(total, h, d).to(dtype).transpose(0, 1)
    k = torch.randn(total, kvh, d).to(dtype).transpose(0, 1)
    v = torch.randn(total, kvh, d).to(dtype).transpose(0, 1)
    spans = torch.tensor([[i * args.tokens, (i + 1) * args.tokens, 0, 0] for i in range(args.prompts)])
    out = torch.zeros(total, h, d)
    if not kernel.prefill_attention(q, k, v, spans, out, d**-0.5, 0.0, 0):
        sys.exit(f"the kernel does not take {args.dtype} here")
    for _ in range(2):
        kernel.prefill_attention(q, k, v, spans, out, d**-0.5, 0.0, 0)
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        kernel.prefill_attention(q, k, v, spans, out, d**-0.5, 0.0, 0)
        times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    flop = args.prompts * h * 2 * 2 * d * args.tokens * (args.tokens + 1) / 2
    print(f"{args.dtype} prefill attention, {args.prompts} x {args.tokens} tokens, {h}/{kvh} heads, d={d}: "
          f"{ms:.2f} ms a call (min {min(times) * 1e3:.2f}), {flop / ms / 1e6:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
