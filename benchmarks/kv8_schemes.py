"""What int8 KV pages cost in accuracy, per quantization scheme, before any kernel is written.

    python benchmarks/kv8_schemes.py            # SmolLM2-135M, float32, ~7 min on 2 cores
    python benchmarks/kv8_schemes.py row/row had/None center-had/None   # only these K/V schemes

transformers' own forward runs SmolLM2 with an attention function (registered through
``AttentionInterface``) that rounds each layer's keys and values (after RoPE) to int8 and back
before attending: a simulation of int8 pages, not acb's kernels (here the current token's own
key is rounded too, as in acb). It reports top-1 next-token
agreement with the unrounded forward and perplexity over 12k held-out tokens (quality.py's
text), per scheme for keys (K) and values (V):

- ``row``: one scale per token and kv head (max |x| / 127): acb's int8 pages (``acb/kv_quant.py``);
- ``gN``: one scale per N dims of the row;
- ``smoothA[gN]``: keys divided by a per-channel factor (max |k| over 4k calibration tokens, to the
  power A, the two channels RoPE rotates together sharing one) before rounding, the query
  multiplied by it (q . k unchanged); then per row or per N dims;
- ``had``: the row times a Walsh-Hadamard matrix (normalised) before rounding and its transpose
  after (acb's int8 pages rotate keys so, ``acb/kv_quant.py``; there the query is rotated instead);
- ``center[-S]``: keys only: the calibration tokens' mean post-RoPE key subtracted before rounding
  (never added back: q . c is the same for every key of a query, so softmax ignores it), then
  scheme S (default ``row``).

Measured 2026-12-04 (12,287 tokens): K/V row/row 97.84 %, row keys alone 97.85, values alone
99.57, K g32 98.52, g16 98.84, g8 99.14, smooth0.5 98.38, smooth0.5g16 98.90; center 98.65,
had 99.05, center-had 99.23, center-smooth0.5 98.76.
"""

# ruff: noqa: E402
import math
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quality import held_out_text
from systems import load_smollm2
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SCHEMES = [("row", "row"), ("row", None), (None, "row"), ("g32", "row"), ("g16", "row"), ("g8", "row"),
           ("g32", "g32"), ("smooth0.5", "row"), ("smooth0.5g16", "row"),
           ("center", None), ("center", "row"), ("had", None), ("center-had", None), ("center-had", "had"),
           ("center-smooth0.5", None), ("center-smooth0.5", "row")]
WINDOW = 512
state: dict = {"k": None, "v": None, "calibrate": False}
maxima: dict = {}  # (layer, "k" | "v") -> [kv heads, D] max |x|
sums: dict = {}  # (layer, "k" | "v") -> ([kv heads, D] sum of x, count)


def rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., D] rounded to int8 with one scale per `group` dims, and back."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    s = g.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1)), 0).clamp(-127, 127)
    return (q * s).reshape(x.shape)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def scheme(x: torch.Tensor, name: str | None, layer: int, which: str) -> torch.Tensor:
    if name is None:
        return x
    if name == "row":
        return rounded(x, x.shape[-1])
    if name.startswith("g"):
        return rounded(x, int(name[1:]))
    if name.startswith("center"):
        # keys only: q . (k - c) differs from q . k by q . c, the same for every key of a query, so
        # softmax is unchanged; the mean post-RoPE key is removed before rounding, never added back
        total, count = sums[(layer, which)]
        c = (total / count)[None, :, None, :]
        rest = name.removeprefix("center").removeprefix("-")
        return scheme(x - c, rest or "row", layer, which) + (c if which == "v" else 0)
    if name == "had":
        h = hadamard(x.shape[-1])
        return rounded(x @ h, x.shape[-1]) @ h.T
    alpha, _, group = name.removeprefix("smooth").partition("g")
    top = maxima[(layer, which)]
    half = top.shape[-1] // 2
    tied = torch.maximum(top[..., :half], top[..., half:])  # RoPE rotates channel c with c + D/2
    s = torch.cat([tied, tied], -1).clamp_min(1e-5) ** float(alpha)
    s = (s / s.mean(-1, keepdim=True))[None, :, None, :]
    return rounded(x / s, int(group) if group else x.shape[-1]) * s


def attention(module, query, key, value, attention_mask, **kw):
    layer = module.layer_idx
    if state["calibrate"]:
        for which, t in (("k", key), ("v", value)):
            m = t[0].abs().amax(1)
            maxima[(layer, which)] = torch.maximum(maxima.get((layer, which), m), m)
            total, count = sums.get((layer, which), (0, 0))
            sums[(layer, which)] = (total + t[0].sum(1), count + t.shape[2])
    else:
        key = scheme(key, state["k"], layer, "k")
        value = scheme(value, state["v"], layer, "v")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


@torch.inference_mode()
def main() -> None:
    model, tok = load_smollm2()
    AttentionInterface.register("acb_kv8_sim", attention)
    model.set_attn_implementation("acb_kv8_sim")
    ids = tok(held_out_text())["input_ids"]
    calibration, text = ids[:4096], ids[4096:4096 + 12288]
    state["calibrate"] = True
    for s in range(0, len(calibration) - WINDOW, WINDOW):
        model(input_ids=torch.tensor([calibration[s:s + WINDOW]]))
    state["calibrate"] = False

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        top1, nll = [], []
        for s in range(0, len(text) - 1, WINDOW):
            chunk = text[s:s + WINDOW + 1]
            logits = model(input_ids=torch.tensor([chunk[:-1]])).logits[0].float()
            top1.append(logits.argmax(-1))
            nll.append(torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="none"))
        return torch.cat(top1), torch.cat(nll)

    state.update(k=None, v=None)
    ref, ref_nll = run()
    print(f"float32 pages: perplexity {math.exp(ref_nll.mean()):.3f} over {len(ref)} tokens")
    only = sys.argv[1:]
    for k, v in SCHEMES:
        if only and f"{k}/{v}" not in only:
            continue
        state.update(k=k, v=v)
        top1, nll = run()
        ppl = math.exp(nll.mean()) / math.exp(ref_nll.mean()) - 1
        print(f"K {k!s:>12}  V {v!s:>5}: top-1 {100 * (top1 == ref).float().mean():.2f} %  "
              f"perplexity {100 * ppl:+.2f} %", flush=True)


if __name__ == "__main__":
    main()
