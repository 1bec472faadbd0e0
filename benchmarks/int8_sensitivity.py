"""Where W8A8 loses its top-1 agreement: fake int8 quantization of chosen parts of SmolLM2-135M.

    python benchmarks/int8_sensitivity.py               # 4096 held-out tokens, windows of 512
    python benchmarks/int8_sensitivity.py --tokens 8192 --out bench-results/int8_sensitivity.json

transformers' float32 forward with its linear layers' weights rounded to int8 and/or their inputs
quantized at run time, each part switched on or off, scored as top-1 next-token agreement with the
exact float32 forward on held-out text (benchmarks/quality.py's). Rounding is what acb's int8 path
does (``acb.quantization``): weights symmetric per output channel (or, as a candidate, per output
channel and group of input channels), activations symmetric per token and group of 64 channels;
the arithmetic in between stays float32, so this isolates the quantization from bf16's own error
(acb's ``int8_bf16`` adds that: quality.py measures the engine itself). SmolLM2 ties its embedding to
the ``lm_head``: quantizing the head's weight quantizes the embedding rows too, as acb does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import fp32_probe, score_and_restore, write_probe_rows  # noqa: E402

# (label, options): skip: parts left exact; skip_act: parts whose inputs stay exact; act/weights:
# quantize those at all; group: activation channels per scale; wgroup: weight input channels per scale
CONFIGS = [
    ("W8A8 (acb's first int8, 2026-12-01: weights per channel, activations per token and 64 channels)", {}),
    ("weights only (activations exact)", {"act": False}),
    ("activations only (weights exact)", {"weights": False}),
    ("lm_head (and tied embedding) exact", {"skip": ("lm_head",)}),
    ("down_proj exact", {"skip": ("down_proj",)}),
    ("lm_head and down_proj exact", {"skip": ("lm_head", "down_proj")}),
    ("lm_head's input exact", {"skip_act": ("lm_head",)}),
    ("down_proj's input exact", {"skip_act": ("down_proj",)}),
    ("activations per 32 channels", {"group": 32}),
    ("weights per channel and 64 input channels", {"wgroup": 64}),
    ("weights per channel and 64 input channels, lm_head exact", {"wgroup": 64, "skip": ("lm_head",)}),
    ("weights only, lm_head exact", {"act": False, "skip": ("lm_head",)}),
]


def fake_weight(w: torch.Tensor, group: int = 0) -> torch.Tensor:
    n, k = w.shape
    g = group or k
    wg = w.reshape(n, k // g, g)
    s = wg.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (torch.round(wg / s).clamp(-127, 127) * s).reshape(n, k)


def fake_act(x: torch.Tensor, group: int) -> torch.Tensor:
    shape = x.shape
    xg = x.reshape(*shape[:-1], shape[-1] // group, group)
    s = xg.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (torch.round(xg / s).clamp(-127, 127) * s).reshape(shape)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default="bench-results/int8_sensitivity.json")
    args = p.parse_args()

    model, linears, top1 = fp32_probe(args.tokens, args.window)

    exact = top1()
    rows = []
    for name, o in CONFIGS:
        hooks = []
        for full, (m, w) in linears.items():
            part = full.split(".")[-1]
            if part in o.get("skip", ()):
                continue
            if o.get("weights", True):
                m.weight.data = fake_weight(w, o.get("wgroup", 0))
            if o.get("act", True) and part not in o.get("skip_act", ()):
                g = o.get("group", 64)
                hooks.append(m.register_forward_pre_hook(lambda mod, a, g=g: (fake_act(a[0], g),)))
        agreement, seconds = score_and_restore(top1, exact, hooks, linears)
        rows.append({"config": name, "options": o, "top1_agreement": agreement})
        print(f"{name:80s} top-1 {agreement * 100:6.2f} %  ({seconds:.0f} s)", flush=True)
    write_probe_rows(args.out, "int8_sensitivity.py", args.tokens, exact, rows)


if __name__ == "__main__":
    main()
