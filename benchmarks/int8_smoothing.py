"""What would bring acb's W8A8 to issue 28's 97 % top-1 agreement: finer weight groups, finer
activation groups, the lm_head in bf16, SmoothQuant-style smoothing (fake quantization, SmolLM2-135M).

    python benchmarks/int8_smoothing.py                 # 8192 held-out tokens, windows of 512
    python benchmarks/int8_smoothing.py --tokens 4096 --out bench-results/int8_smoothing.json

transformers' float32 forward with each linear layer's weight rounded to int8 (symmetric, one scale
per output channel or per group of input channels) and its input quantized at run time (per token
and group of channels), or kept bf16; scored as top-1 next-token agreement with the exact float32
forward on held-out text (benchmarks/quality.py's). Smoothing (SmoothQuant, Xiao et al. 2022): each
linear's input channel j divided by s_j = max|x_j|^a / max|w_j|^(1-a) and the weight's column j
multiplied by it (exact in real arithmetic; it moves activation outliers into the weights), with
max|x_j| calibrated on other text (docstrings of Python's standard library, 4096 tokens), never the
held-out text. SmolLM2's embedding stays bf16 here (untied from the lm_head) in every row.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int8_sensitivity import fake_act, fake_weight  # noqa: E402
from quality import fp32_probe, score_and_restore, write_probe_rows  # noqa: E402

# (label, weight group (0: per output channel), activation group (None: bf16 input), smoothing a, bf16 parts)
CONFIGS = [
    ("acb's first int8 (2026-12-01): W per channel, A per 64, lm_head int8", 0, 64, None, ()),
    ("W per 32, A per 64, lm_head int8", 32, 64, None, ()),
    ("W per channel, A per 64, lm_head bf16", 0, 64, None, ("lm_head",)),
    ("W per 32, A per 32, lm_head bf16", 32, 32, None, ("lm_head",)),
    ("W per 32, A per 16, lm_head bf16", 32, 16, None, ("lm_head",)),
    ("W per 32 only (A bf16), lm_head bf16", 32, None, None, ("lm_head",)),
    ("W per channel only (A bf16), lm_head bf16", 0, None, None, ("lm_head",)),
    ("W per channel, A per 64, smoothed 0.5, lm_head bf16", 0, 64, 0.5, ("lm_head",)),
    ("W per 32, A per 64, smoothed 0.5, lm_head bf16", 32, 64, 0.5, ("lm_head",)),
    ("W per 64, A per 64, smoothed 0.7, lm_head bf16", 64, 64, 0.7, ("lm_head",)),
    ("W per 32, A per 32, smoothed 0.5, lm_head bf16", 32, 32, 0.5, ("lm_head",)),
    ("W per 32, A per 32, smoothed 0.7, lm_head bf16", 32, 32, 0.7, ("lm_head",)),
    ("W per 32, A per 32, smoothed 0.7, lm_head int8", 32, 32, 0.7, ()),
]


def calibration_ids(tokenizer, tokens: int) -> list[int]:
    docs = []
    for name in ("json", "asyncio", "collections", "itertools", "functools", "argparse", "logging", "pathlib",
                 "subprocess", "dataclasses", "unittest", "email", "http.client", "csv", "re", "datetime",
                 "decimal", "textwrap", "shutil"):
        mod = importlib.import_module(name)
        for obj in [mod] + [getattr(mod, a) for a in dir(mod) if not a.startswith("_")]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 200:
                docs.append(doc)
    return tokenizer("\n\n".join(dict.fromkeys(docs)))["input_ids"][:tokens]


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def calibrated_probe(tokens: int, window: int):
    """:func:`quality.fp32_probe` with SmolLM2's embedding untied from the lm_head and rounded to
    bf16 (as acb keeps it), and {linear's name: max |input| per channel} over the calibration text."""
    from acb.loading import load, smollm2

    model, linears, top1 = fp32_probe(tokens, window)
    embed = model.model.embed_tokens
    table = embed.weight.data.clone()
    embed.weight = torch.nn.Parameter(table.clone(), requires_grad=False)  # untied: the lm_head's own rows
    embed.weight.data = bf16(table)

    _, tokenizer = load(*smollm2(), dtype=torch.float32)
    cal = calibration_ids(tokenizer, 4096)
    amax: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(mod, a):
            x = a[0].reshape(-1, a[0].shape[-1]).abs().amax(0)
            amax[name] = torch.maximum(amax[name], x) if name in amax else x
        return hook

    hooks = [m.register_forward_pre_hook(record(name)) for name, (m, _) in linears.items()]
    with torch.no_grad():
        for i in range(0, len(cal) - window + 1, window):
            model(torch.tensor([cal[i: i + window]]))
    for h in hooks:
        h.remove()
    return model, linears, top1, amax


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default="bench-results/int8_smoothing.json")
    args = p.parse_args()

    model, linears, top1, amax = calibrated_probe(args.tokens, args.window)
    exact = top1()
    rows = []
    for label, wgroup, agroup, alpha, keep in CONFIGS:
        hooks = []
        for name, (m, w) in linears.items():
            if name.split(".")[-1] in keep:
                m.weight.data = bf16(w)
                hooks.append(m.register_forward_pre_hook(lambda mod, a: (bf16(a[0]),)))
                continue
            s = torch.ones(w.shape[1]) if alpha is None else \
                (amax[name].clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)
            m.weight.data = fake_weight(w * s, wgroup)
            quant = (lambda x, g: fake_act(x, g)) if agroup else (lambda x, g: bf16(x))
            hooks.append(m.register_forward_pre_hook(lambda mod, a, s=s, g=agroup, q=quant: (q(a[0] / s, g),)))
        agreement, seconds = score_and_restore(top1, exact, hooks, linears)
        rows.append({"config": label, "weight_group": wgroup, "activation_group": agroup, "smoothing": alpha,
                     "bf16": list(keep), "top1_agreement": agreement})
        print(f"{label:60s} top-1 {agreement * 100:6.2f} %  ({seconds:.0f} s)", flush=True)
    write_probe_rows(args.out, "int8_smoothing.py", args.tokens, exact, rows)


if __name__ == "__main__":
    main()
