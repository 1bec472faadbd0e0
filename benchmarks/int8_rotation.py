"""Would rotating each int8 GEMM's input (QuaRot-style) let acb drop its groups of 32 channels
(one scale per token and per output channel: the VNNI kernel's fastest form) without losing top-1?

    python benchmarks/int8_rotation.py                  # 8192 held-out tokens, windows of 512
    python benchmarks/int8_rotation.py --tokens 4096 --out bench-results/int8_rotation.json

Fake quantization as benchmarks/int8_smoothing.py does it (transformers' float32 forward, SmolLM2's
lm_head and embedding bf16, smoothing calibrated on the standard-library docstrings), with one more
exact-in-real-arithmetic step: each linear's (smoothed) input x and weight W are both multiplied by an
orthogonal K x K matrix R (x R, W R: x W^T unchanged) before they are rounded. R spreads a channel's
outlier over many channels, so one scale per token loses less. R is a Kronecker product Q_m (x) H_b:
H_b the normalized Walsh-Hadamard matrix over the largest power of two b dividing K (what acb's
``hadamard`` kernel applies), Q_m (m = K / b) an orthogonal m x m matrix (identity: blocks only;
"dct": the orthonormal DCT-II, so every channel reaches all K).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_sensitivity import fake_act, fake_weight  # noqa: E402
from int8_smoothing import bf16, calibrated_probe  # noqa: E402
from quality import score_and_restore, write_probe_rows  # noqa: E402

# (label, weight group (0: per channel), activation group (0: per token), smoothing a, rotation)
CONFIGS = [
    ("before 2026-12-04 21:00: W/A per 32, smoothed 0.5", 32, 32, 0.5, None),
    ("W per channel, A per token, smoothed 0.5", 0, 0, 0.5, None),
    ("W per channel, A per token, Hadamard blocks", 0, 0, None, "blocks"),
    ("W per channel, A per token, Hadamard (x) DCT", 0, 0, None, "dct"),
    ("W per channel, A per token, smoothed 0.5, Hadamard blocks", 0, 0, 0.5, "blocks"),
    ("W per channel, A per token, smoothed 0.5, Hadamard (x) DCT", 0, 0, 0.5, "dct"),
    ("W/A per 32, smoothed 0.5, Hadamard blocks", 32, 32, 0.5, "blocks"),
    ("W/A per 32, Hadamard (x) DCT", 32, 32, None, "dct"),
    ("W/A per 32, Hadamard blocks", 32, 32, None, "blocks"),
    ("W/A per 32, smoothed 0.5, Hadamard (x) DCT", 32, 32, 0.5, "dct"),
    ("W/A per 64, smoothed 0.5", 64, 64, 0.5, None),
    ("acb now: W/A per 64, smoothed 0.5, Hadamard blocks", 64, 64, 0.5, "blocks"),
    ("W/A per 64, smoothed 0.5, Hadamard (x) DCT", 64, 64, 0.5, "dct"),
    ("W/A per 64, smoothed 0.3, Hadamard blocks", 64, 64, 0.3, "blocks"),
    ("W/A per 64, smoothed 0.4, Hadamard blocks", 64, 64, 0.4, "blocks"),
    ("W/A per 64, smoothed 0.6, Hadamard blocks", 64, 64, 0.6, "blocks"),
    ("W/A per 64, smoothed 0.7, Hadamard blocks", 64, 64, 0.7, "blocks"),
]


def hadamard(b: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(b)


def dct(m: int) -> torch.Tensor:
    n = torch.arange(m, dtype=torch.float64)
    c = torch.cos(math.pi * (n[None, :] + 0.5) * n[:, None] / m) * math.sqrt(2 / m)
    c[0] /= math.sqrt(2)
    return c.float()


def rotation(k: int, kind: str) -> torch.Tensor:
    b = k & -k
    q = torch.eye(k // b) if kind == "blocks" else dct(k // b)
    return torch.kron(q, hadamard(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--configs", default="", help="comma-separated indices into CONFIGS (default: all)")
    p.add_argument("--out", default="bench-results/int8_rotation.json")
    args = p.parse_args()

    model, linears, top1, amax = calibrated_probe(args.tokens, args.window)
    exact = top1()
    rows = []
    picked = [CONFIGS[int(i)] for i in args.configs.split(",")] if args.configs else CONFIGS
    for label, wgroup, agroup, alpha, rot in picked:
        hooks = []
        for name, (m, w) in linears.items():
            if name.endswith("lm_head"):
                m.weight.data = bf16(w)
                hooks.append(m.register_forward_pre_hook(lambda mod, a: (bf16(a[0]),)))
                continue
            k = w.shape[1]
            s = torch.ones(k) if alpha is None else \
                (amax[name].clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)
            r = rotation(k, rot) if rot else torch.eye(k)
            m.weight.data = fake_weight((w * s) @ r, wgroup) @ r.T  # rounded in the rotated basis
            hooks.append(m.register_forward_pre_hook(
                lambda mod, a, s=s, g=agroup, r=r: (fake_act((a[0] / s) @ r, g or a[0].shape[-1]) @ r.T,)))
        agreement, seconds = score_and_restore(top1, exact, hooks, linears)
        rows.append({"config": label, "weight_group": wgroup, "activation_group": agroup, "smoothing": alpha,
                     "rotation": rot, "top1_agreement": agreement})
        print(f"{label:62s} top-1 {agreement * 100:6.2f} %  ({seconds:.0f} s)", flush=True)
    write_probe_rows(args.out, "int8_rotation.py", args.tokens, exact, rows)


if __name__ == "__main__":
    main()
