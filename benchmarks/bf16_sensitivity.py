"""Where bf16 loses its top-1 agreement with float32: chosen roundings to bf16 in SmolLM2-135M.

    python benchmarks/bf16_sensitivity.py               # 4096 held-out tokens, windows of 512
    python benchmarks/bf16_sensitivity.py --tokens 8192 --out bench-results/bf16_sensitivity.json

transformers' float32 forward with chosen values rounded to bf16 (round to nearest even, as PyTorch
rounds) and everything else float32, scored as top-1 next-token agreement with the exact float32
forward on held-out text (benchmarks/quality.py's): the linear layers' weights (SmolLM2 ties its
embedding to the ``lm_head``: both), their inputs, their outputs (each projection apart), the residual
stream (each decoder layer's output), RoPE's cos/sin and q/k after it. What decided acb's bf16 layout
(``acb/kernels/csrc/bf16_cpu.cpp``, docs/design.md): oneDNN's bf16 linear rounds every GEMM's output, the
logits among them; acb's GEMMs write float32 where it matters. quality.py measures the engine itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import fp32_probe, write_probe_rows  # noqa: E402

_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
# (label, options): weights / inputs: round every linear's weight / input; outputs: the linears whose
# output is rounded; residual: each decoder layer's output; cos_sin: RoPE's tables; rotated: q and k
# after RoPE
CONFIGS = [
    ("a bf16 model (everything rounded, as oneDNN's bf16 linears and transformers' bf16 modules)",
     {"weights": True, "inputs": True, "outputs": _ALL, "residual": True, "cos_sin": True, "rotated": True}),
    ("weights only", {"weights": True}),
    ("weights and GEMM inputs (the floor: everything between the GEMMs float32)", {"weights": True, "inputs": True}),
    ("weights, inputs, every output, residual bf16 (RoPE float32)",
     {"weights": True, "inputs": True, "outputs": _ALL, "residual": True}),
    ("... the logits float32", {"weights": True, "inputs": True, "outputs": _ALL[:-1], "residual": True}),
    ("... the logits and the residual stream float32", {"weights": True, "inputs": True, "outputs": _ALL[:-1]}),
    ("... and o/down out float32 (into the stream), cos/sin and q/k bf16",
     {"weights": True, "inputs": True, "outputs": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
      "cos_sin": True, "rotated": True}),
    ("acb's bf16 GEMMs: q/k/v out float32, RoPE in float32, q/k/v rounded once after (for bf16 pages)",
     {"weights": True, "inputs": True, "outputs": ("v_proj", "gate_proj", "up_proj"), "rotated": True}),
    ("acb's bf16 forward now: v out and q/k after RoPE rounded (gate/up float32 into the product)",
     {"weights": True, "inputs": True, "outputs": ("v_proj",), "rotated": True}),
    ("... q float32 into the attention (k and v rounded: the bf16 pages)",
     {"weights": True, "inputs": True, "outputs": ("v_proj",), "rotated": ("k",)}),
    ("... q float32, and the lm_head float32 (its weight and input)",
     {"weights": True, "inputs": True, "outputs": ("v_proj",), "rotated": ("k",), "float32": ("lm_head",)}),
    ("... the lm_head float32 only (q rounded)",
     {"weights": True, "inputs": True, "outputs": ("v_proj",), "rotated": True, "float32": ("lm_head",)}),
    ("acb's bf16 forward now, with the norms' weights bf16 (a bf16 model's)",
     {"weights": True, "inputs": True, "outputs": ("v_proj",), "rotated": True, "norms": True}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default="bench-results/bf16_sensitivity.json")
    p.add_argument("--configs", default="", help="only these configurations (indices into CONFIGS, comma-separated)")
    args = p.parse_args()

    import transformers.models.llama.modeling_llama as llama

    model, linears, top1 = fp32_probe(args.tokens, args.window)

    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    exact = top1()
    rope = llama.apply_rotary_pos_emb

    rotated = ("q", "k")  # which of q and k rounded_rope rounds (a config's "rotated", when a tuple)

    def rounded_rope(q, k, cos, sin, *a, **kw):
        q, k = rope(q, k, cos, sin, *a, **kw)
        return (r(q) if "q" in rotated else q), (r(k) if "k" in rotated else k)

    rows = []
    chosen = [CONFIGS[int(i)] for i in args.configs.split(",")] if args.configs else CONFIGS
    for name, o in chosen:
        hooks = []
        for full, (m, w) in linears.items():
            part = full.split(".")[-1]
            if part in o.get("float32", ()):  # this projection's weight and input kept float32
                continue
            if o.get("weights"):
                m.weight.data = r(w)
            if o.get("inputs"):
                hooks.append(m.register_forward_pre_hook(lambda mod, a: (r(a[0]),)))
            if part in o.get("outputs", ()):
                hooks.append(m.register_forward_hook(lambda mod, a, out: r(out)))
        norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")] if o.get("norms") else []
        kept = [m.weight.data for m in norms]
        for m in norms:  # a bf16 model's norm weights are bf16 too
            m.weight.data = r(m.weight.data)
        if o.get("residual"):
            hooks += [layer.register_forward_hook(
                lambda mod, a, out: (r(out[0]), *out[1:]) if isinstance(out, tuple) else r(out))
                for layer in model.model.layers]
        if o.get("cos_sin"):
            hooks.append(model.model.rotary_emb.register_forward_hook(lambda mod, a, out: (r(out[0]), r(out[1]))))
        rotated = o["rotated"] if isinstance(o.get("rotated"), tuple) else ("q", "k")
        llama.apply_rotary_pos_emb = rounded_rope if o.get("rotated") else rope
        t0 = time.perf_counter()
        try:
            agreement = (top1() == exact).float().mean().item()
        finally:
            llama.apply_rotary_pos_emb = rope
            for h in hooks:
                h.remove()
            for m, w in linears.values():
                m.weight.data = w
            for m, w in zip(norms, kept):
                m.weight.data = w
        rows.append({"config": name, "options": {k: list(v) if isinstance(v, tuple) else v for k, v in o.items()},
                     "top1_agreement": agreement})
        print(f"{name:100s} top-1 {agreement * 100:6.2f} %  ({time.perf_counter() - t0:.0f} s)", flush=True)
    with torch.no_grad():
        model.to(torch.bfloat16)
    agreement = (top1() == exact).float().mean().item()
    name = "transformers' own bf16 forward"
    rows.append({"config": name, "options": {}, "top1_agreement": agreement})
    print(f"{name:100s} top-1 {agreement * 100:6.2f} %", flush=True)
    write_probe_rows(args.out, "bf16_sensitivity.py", args.tokens, exact, rows)


if __name__ == "__main__":
    main()
