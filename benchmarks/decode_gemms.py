"""A decode step's GEMMs as an engine reads them: each layer's own weights, from memory.

    python benchmarks/decode_gemms.py                    # int8, 45 rows, SmolLM2's shapes, 30 layers
    python benchmarks/decode_gemms.py --dtype bf16 --rows 16
    PYTHONPATH=. python benchmarks/decode_gemms.py       # from a worktree: its kernels, not the installed ones

Times acb's int8 (``acb/kernels/csrc/int8_cpu.cpp``) or bf16 (``acb/kernels/csrc/bf16_cpu.cpp``) GEMMs over
--layers sets of distinct random weights of SmolLM2-135M's shapes (q+k+v joined 576 -> 960, o 576 -> 576
with the residual add, gate/up 576 -> 2 x 1536 with act(gate) * up, down 1536 -> 576 with the residual
add), one layer after another as a decode step reads them, then the bf16 lm_head (576 -> 49,152). With
one set of weights (``benchmarks/int8_gemm.py``) a layer's ~3.5 MB stay in L3 between calls; an engine's
30 layers (~106 MB int8, ~212 MB bf16) do not. Prints microseconds a layer per GEMM (mean of --repeats
steps after warm-ups) and the rate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from acb import fused, quantization  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "glu": (1536, 576), "down": (576, 1536)}  # (N, K); glu: per half


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="int8", choices=("int8", "bf16"))
    p.add_argument("--rows", type=int, default=45, help="the step's rows (decode sequences)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    bf = fused.native_bf16()
    q8 = quantization._kernels()
    if bf is None or (args.dtype == "int8" and q8 is None):
        sys.exit("acb's native int8 / bf16 kernels are not available here")
    torch.manual_seed(0)
    m = args.rows
    x, xm = torch.randn(m, 576), torch.randn(m, 1536)

    def weight(n: int, k: int):
        w = torch.randn(n, k) * 0.05
        return quantization.Int8Linear.from_weight(w).args if args.dtype == "int8" else bf.pack(w.bfloat16())

    if args.dtype == "int8":
        h, hm = (q8.quantize_rows(t, None, False, 1e-6, quantization.activation_group(t.shape[1]), None, False)
                 for t in (x, xm))
        layers = [{"qkv": weight(960, 576), "o": weight(576, 576), "gate": weight(1536, 576), "up": weight(1536, 576),
                   "down": weight(576, 1536)} for _ in range(args.layers)]
        calls = {"qkv": lambda ly: q8.linear(*h, *ly["qkv"], None, torch.bfloat16),
                 "o": lambda ly: q8.linear(*h, *ly["o"], x, torch.float32),
                 "glu": lambda ly: q8.glu(*h, *ly["gate"], *ly["up"], 0, torch.float32),
                 "down": lambda ly: q8.linear(*hm, *ly["down"], x, torch.float32)}
    else:
        hb, hmb = x.bfloat16(), xm.bfloat16()
        layers = [{"qkv": weight(960, 576), "o": weight(576, 576), "glu": weight(3072, 576), "down": weight(576, 1536)}
                  for _ in range(args.layers)]
        calls = {"qkv": lambda ly: bf.linear(hb, ly["qkv"], 960, None, None, torch.float32),
                 "o": lambda ly: bf.linear(hb, ly["o"], 576, None, x, torch.float32),
                 "glu": lambda ly: bf.glu(hb, ly["glu"], 1536, None, 0, torch.bfloat16),
                 "down": lambda ly: bf.linear(hmb, ly["down"], 576, None, x, torch.float32)}
    lm_head = bf.pack((torch.randn(49152, 576) * 0.05).bfloat16())
    xb = x.bfloat16()
    spent = dict.fromkeys([*calls, "lm_head"], 0.0)

    def step(record: bool) -> None:
        for ly in layers:
            for name, call in calls.items():
                t0 = time.perf_counter()
                call(ly)
                if record:
                    spent[name] += time.perf_counter() - t0
        t0 = time.perf_counter()
        bf.linear(xb, lm_head, 49152, None, None, torch.float32)
        if record:
            spent["lm_head"] += time.perf_counter() - t0

    for _ in range(3):
        step(False)
    for _ in range(args.repeats):
        step(True)
    per_layer = {n: spent[n] / args.repeats / args.layers for n in calls}
    ops = 2 * m * sum(n * k * (2 if name == "glu" else 1) for name, (n, k) in SHAPES.items())
    layer = sum(per_layer.values())
    head = spent["lm_head"] / args.repeats
    unit = "GOP/s" if args.dtype == "int8" else "GFLOP/s"
    print(f"{args.dtype}, {m} rows, {args.layers} layers' weights: " +
          ", ".join(f"{n} {1e6 * t:.1f}" for n, t in per_layer.items()) +
          f" us; a layer {1e6 * layer:.1f} us ({ops / layer / 1e9:.0f} {unit}); "
          f"bf16 lm_head {1e3 * head:.2f} ms ({2 * m * 576 * 49152 / head / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
