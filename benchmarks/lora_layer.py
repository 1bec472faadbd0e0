"""One SmolLM2-shaped layer's LoRA cost, per projection group, at decode and prefill row counts.

    python benchmarks/lora_layer.py [--rows 64,2048] [--reps 30]

Float32, oneDNN-prepacked random weights of SmolLM2-135M's shapes (hidden 576, 9 heads of 64,
3 KV heads, MLP 1536), 8 adapter slots of rank 16, every row on one adapter. For each group,
the microseconds per call of:

- ``base``: the base model's GEMMs as the fused forward runs them (the MLP's SiLU and product,
  and o/down's residual add, in the GEMMs' epilogues);
- ``pytorch``: the same plus the deltas with PyTorch ops (``StepLora.add``: a GEMM pair per
  projection on the run of rows; the MLP's activation and product apart);
- ``native``: the same plus the deltas through ``acb/kernels/csrc/lora_cpu.cpp`` (one call per group:
  the shrink over the group's concatenated A; for the MLP, ``glu_add``'s one pass).

The attention itself is left out (the same in all three). Timings alternate the three kinds
``--reps`` times over and keep each kind's median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from acb.kernels.cpu import lora_kernels

HIDDEN, HEADS, KV, D, INTER, SLOTS, RANK = 576, 9, 3, 64, 1536, 8, 16


def packed(out_f: int, in_f: int, gen) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(torch.randn(out_f, in_f, generator=gen) * 0.02, None)


def cases(rows: int, k) -> dict:
    gen = torch.Generator().manual_seed(rows)
    lin = torch.ops.mkldnn._linear_pointwise
    h = torch.randn(rows, HIDDEN, generator=gen)
    a = torch.randn(rows, HEADS * D, generator=gen)
    m_in = torch.randn(rows, INTER, generator=gen)
    x = torch.randn(rows, HIDDEN, generator=gen)
    w = {"q": packed(HEADS * D, HIDDEN, gen), "k": packed(KV * D, HIDDEN, gen), "v": packed(KV * D, HIDDEN, gen),
         "o": packed(HIDDEN, HEADS * D, gen), "gate": packed(INTER, HIDDEN, gen), "up": packed(INTER, HIDDEN, gen),
         "down": packed(HIDDEN, INTER, gen)}
    outs = {"q": HEADS * D, "k": KV * D, "v": KV * D, "o": HIDDEN, "gate": INTER, "up": INTER, "down": HIDDEN}
    groups = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
    ins = {"qkv": HIDDEN, "o": HEADS * D, "gate_up": HIDDEN, "down": INTER}
    at = {g: torch.randn(SLOTS, ins[g], len(p) * RANK, generator=gen) * 0.02 for g, p in groups.items()}
    bt = {p: torch.randn(SLOTS, RANK, outs[p], generator=gen) * 0.01 for p in outs}
    scale = torch.full((SLOTS,), 2.0)
    order, rowgroups = torch.arange(rows), torch.tensor([[0, 0, rows]])

    def view(group: str, p: str):  # slot 0's A^T [in, r] and B^T [r, out], as StepLora.add takes them
        i = groups[group].index(p)
        return at[group][0, :, i * RANK:(i + 1) * RANK], bt[p][0]

    def delta(y, inp, group, p):
        aa, bb = view(group, p)
        y.addmm_(torch.mm(inp, aa), bb, alpha=2.0)

    def native(ys, inp, group):
        k.add_(ys, inp, at[group], [bt[p] for p in groups[group]], [scale] * len(ys), order, rowgroups)

    def qkv(kind):
        ys = [lin(h, w[p], None, "none", [], "") for p in ("q", "k", "v")]
        if kind == "pytorch":
            for y, p in zip(ys, ("q", "k", "v")):
                delta(y, h, "qkv", p)
        elif kind == "native":
            native(ys, h, "qkv")

    def residual(name, inp):
        def run(kind):
            y = lin.binary(inp, x, w[name], None, "add")
            if kind == "pytorch":
                delta(y, inp, name, name)
            elif kind == "native":
                native([y], inp, name)
        return run

    def mlp(kind):
        if kind == "base":
            return lin.binary(h, lin(h, w["gate"], None, "swish", [], ""), w["up"], None, "mul")
        g, u = lin(h, w["gate"], None, "none", [], ""), lin(h, w["up"], None, "none", [], "")
        if kind == "native":
            return k.glu_add(g, u, h, at["gate_up"], [bt["gate"], bt["up"]], [scale, scale], order, rowgroups, 0)
        delta(g, h, "gate_up", "gate")
        delta(u, h, "gate_up", "up")
        return torch.nn.functional.silu(g) * u

    return {"qkv": qkv, "o": residual("o", a), "gate_up (MLP)": mlp, "down": residual("down", m_in)}


def show(rows: int, name: str, us: dict[str, float]) -> None:
    cost = {kind: "" if kind == "base" else f" ({100 * (t / us['base'] - 1):+.0f} %)" for kind, t in us.items()}
    print(f"rows {rows:5d} {name:15s} " + "  ".join(f"{kind} {t:8.0f}{cost[kind]}" for kind, t in us.items()),
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,2048")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the process's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    k = lora_kernels()
    kinds = ("base", "pytorch", "native")
    print(f"threads {torch.get_num_threads()}; microseconds per call (median of {args.reps}); cost against base")
    for rows in map(int, args.rows.split(",")):
        total = dict.fromkeys(kinds, 0.0)
        for name, fn in cases(rows, k).items():
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            for kind in kinds:  # warm-up: oneDNN builds its primitives
                fn(kind)
            for _ in range(args.reps):
                for kind in kinds:
                    t = time.perf_counter()
                    fn(kind)
                    times[kind].append(time.perf_counter() - t)
            med = {kind: 1e6 * statistics.median(v) for kind, v in times.items()}
            for kind in kinds:
                total[kind] += med[kind]
            show(rows, name, med)
        show(rows, "layer (no attn)", total)


if __name__ == "__main__":
    main()
