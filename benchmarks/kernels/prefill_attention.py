"""The native prefill attention kernel alone, per layer call, on SmolLM2's heads (9 over 3, d=64):

    python benchmarks/prefill_attention.py                       # bf16, 12 fresh prompts of 330 tokens
    python benchmarks/prefill_attention.py --dtype float32 --prompts 4 --tokens 1024
    python benchmarks/prefill_attention.py --dtype float32 --torch   # and PyTorch's path, alternated
    python benchmarks/prefill_attention.py --bf16-weights    # bf16: the softmax weights rounded to bf16 too

Times ``prefill_attention`` (acb/kernels/csrc/paged_decode_cpu.cpp) over random queries, keys and values,
median of --repeats calls after three warm-ups; prints milliseconds a call and the attention's
GFLOP/s (causal: the half of the score and value products each row sees). ``--torch`` also times
what the engine runs where the kernel declines (acb.attention.torch_backend.prefill_torch per prompt: PyTorch's
scaled_dot_product_attention, causal), the two calls alternated. ``--bf16-weights`` (bf16) also times
the kernel with its value product over the softmax weights rounded to bf16 (``bf16_weights=True``, what
acb's int8 forward runs) beside hi + lo (bf16's), alternated, and prints how far the two outputs differ.
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
    p.add_argument("--torch", action="store_true", help="also time PyTorch's attention (the fallback)")
    p.add_argument("--bf16-weights", action="store_true",
                   help="also time the value product over bf16-rounded softmax weights (int8's)")
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
    from acb.attention.torch_backend import prefill_torch

    def native():
        kernel.prefill_attention(q, k, v, spans, out, d**-0.5, 0.0, 0)

    def pytorch():  # the engine's fallback: one call per prompt, float32 inputs
        for first, end, _, _ in spans.tolist():
            out[first:end] = prefill_torch(q[:, first:end].float(), k[:, first:end].float(),
                                           v[:, first:end].float(), 0, d**-0.5, None, None).transpose(0, 1)

    out16 = torch.zeros(total, h, d)

    def native16():
        kernel.prefill_attention(q, k, v, spans, out16, d**-0.5, 0.0, 0, bf16_weights=True)

    calls = {"acb": native}
    if args.bf16_weights:
        if dtype != torch.bfloat16:
            sys.exit("--bf16-weights: bf16 inputs only (--dtype bfloat16)")
        calls["acb_bf16_weights"] = native16
    if args.torch:
        calls["pytorch"] = pytorch
    for call in calls.values():
        for _ in range(2):
            call()
    times = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    if args.bf16_weights:
        diff = (out16 - out).abs()
        print(f"bf16 weights against hi + lo: max |difference| {diff.max():.2e}, mean {diff.mean():.2e} "
              f"(outputs' mean |x| {out.abs().mean():.2e})")
    flop = args.prompts * h * 2 * 2 * d * args.tokens * (args.tokens + 1) / 2
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        print(f"{name} {args.dtype} prefill attention, {args.prompts} x {args.tokens} tokens, {h}/{kvh} heads, "
              f"d={d}: {ms:.2f} ms a call (min {min(ts) * 1e3:.2f}), {flop / ms / 1e6:.0f} GFLOP/s")

if __name__ == "__main__":
    main()
