"""The int8 GEMM candidates on SmolLM2's shapes, against oneDNN's prepacked fp32 and bf16.

    python benchmarks/kernels/int8_gemm.py              # prints GOPS per shape and row count
    python benchmarks/kernels/int8_gemm.py --out bench-results/int8_gemm.json

Each GEMM computes [M, K] x [K, N]; M is a step's rows (1-64: decode batches, 256-1024:
prefill chunks), (K, N) SmolLM2-135M's projections: q+k+v joined (576 -> 960), o
(576 -> 576), gate or up (576 -> 1536), down (1536 -> 576), lm_head (576 -> 49152, decode
rows only). Candidates, each timed with the inputs it needs already made (the quantization
of the activations is timed separately, as acb pays it once per GEMM input):

- ``fp32``, ``bf16``: ``torch.ops.mkldnn._linear_pointwise`` over prepacked weights (acb's
  fused forward in those dtypes);
- ``acb_int8``: acb's VNNI kernel (``acb/kernels/csrc/int8_cpu.cpp``) as the engine runs it: int8
  activations per token and group of 64 channels (``acb.model.int8_weights.activation_group``), weights
  per channel; ``acb_int8+q``: with the quantization of its input; ``acb_int8_tok``: the same kernel
  with one activation scale per token (what the groups cost);
- ``onednn_int8``: ``torch.ops.onednn.qlinear_pointwise`` (what PyTorch's x86 inductor
  quantization runs), one activation scale per tensor (it cannot take per-token scales);
- ``w8_bf16``: ``torch._weight_int8pack_mm``, weight-only int8 with bf16 activations.
"""

# ruff: noqa: B023  (each lambda is timed in the iteration that makes it)
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SHAPES = {  # (K, N) of q+k+v joined, o, gate or up, down, lm_head
    "smollm2": [(576, 960), (576, 576), (576, 1536), (1536, 576), (576, 49152)],
    "qwen2.5-0.5b": [(896, 1152), (896, 896), (896, 4864), (4864, 896), (896, 151936)],
    "qwen2.5-1.5b": [(1536, 2048), (1536, 1536), (1536, 8960), (8960, 1536)],
}
ROWS = [1, 16, 64, 256, 1024]


def timed(fn, seconds: float) -> float:
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=0.3, help="per measurement")
    p.add_argument("--shape", default="smollm2", choices=sorted(SHAPES), help="whose projections")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of M")
    p.add_argument("--only", default=None, help="comma list of candidates (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: its acb
    from acb.kernels.cpu import int8_kernels
    from acb.model.int8_weights import Int8Linear, quantize_weight

    q8 = int8_kernels()
    torch.manual_seed(0)
    rows = []
    names = ["fp32", "bf16", "acb_int8", "acb_int8+q", "acb_int8_g64", "acb_int8_tok", "onednn_int8", "w8_bf16"]
    print(f"load {os.getloadavg()[0]:.2f}; GOPS (2*M*K*N / s), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    wanted = args.only.split(",") if args.only else names
    names = [n for n in names if n in wanted]
    print(f"{'M':>5}{'K':>6}{'N':>7}" + "".join(f"{n:>12}" for n in names))
    with torch.inference_mode():
        for k, n in SHAPES[args.shape]:
            w = torch.randn(n, k) * 0.05
            layer = Int8Linear.from_int8(*quantize_weight(w))  # groups of activation_group(k) channels (32)
            g64 = Int8Linear.from_int8(*quantize_weight(w, 64))  # the groups before 2026-12-04
            wq, ws = quantize_weight(w, k)  # one scale per output channel: oneDNN's and w8_bf16's layout
            ws = ws[:, 0].contiguous()
            per_token = Int8Linear.from_int8(wq, ws, group=k)
            pf = torch.ops.mkldnn._reorder_linear_weight(w, None)
            # oneDNN's bf16 linear needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
            pb = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), None) if "bf16" in wanted else None
            qw = torch.ops.onednn.qlinear_prepack(wq, None)
            zeros = torch.zeros(n, dtype=torch.int64)
            for m in [int(r) for r in args.rows.split(",")]:
                if n > 4096 and m > 64:
                    continue
                x = torch.randn(m, k)
                xb = x.bfloat16()
                h = q8.quantize_rows(x, None, False, 1e-6, layer.group)
                h64 = q8.quantize_rows(x, None, False, 1e-6, 64)
                t = q8.quantize_rows(x)  # one scale per token
                tu = (t[0].to(torch.int16) + 128).to(torch.uint8)  # oneDNN's: unsigned, zero point 128
                cands = {
                    "fp32": lambda: torch.ops.mkldnn._linear_pointwise(x, pf, None, "none", [], ""),
                    "bf16": lambda: torch.ops.mkldnn._linear_pointwise(xb, pb, None, "none", [], ""),
                    "acb_int8": lambda: q8.linear(*h, *layer.args, None, torch.float32),
                    "acb_int8+q": lambda: q8.linear(*q8.quantize_rows(x, None, False, 1e-6, layer.group),
                                                    *layer.args, None, torch.float32),
                    "acb_int8_g64": lambda: q8.linear(*h64, *g64.args, None, torch.float32),
                    "acb_int8_tok": lambda: q8.linear(*t, *per_token.args, None, torch.float32),
                    "onednn_int8": lambda: torch.ops.onednn.qlinear_pointwise(
                        tu, 1.0, 128, qw, ws, zeros, None, 1.0, 0, torch.float32, "none", [], ""),
                    "w8_bf16": lambda: torch._weight_int8pack_mm(xb, wq, ws.bfloat16()),
                }
                gops = {name: 2 * m * k * n / timed(fn, args.seconds) / 1e9 for name, fn in cands.items()
                        if name in wanted}
                rows.append({"m": m, "k": k, "n": n, **gops})
                print(f"{m:>5}{k:>6}{n:>7}" + "".join(f"{gops[name]:>12.0f}" for name in names), flush=True)
    print(f"load {os.getloadavg()[0]:.2f} at the end")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg()[0],
                                   "source": "python benchmarks/kernels/int8_gemm.py " + " ".join(sys.argv[1:]),
                                   "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
