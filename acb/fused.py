"""acb's fused CPU forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3).

transformers' eager forward of one decoder layer is ~200 PyTorch calls (views,
casts, the RMSNorm's six ops, RoPE's slices and concatenations, the SiLU and the
multiply, the residual adds), each dispatched from Python and, on the CPU, each a
parallel region of its own. This forward runs the same math on the same weights (the
model's own modules hold them) in about a dozen calls per layer (measured on SmolLM2's
standard workload: decode steps 10.6 -> 9.2-9.6 s, prefill steps 15.2 -> 13.8 s):

    h = rms_norm(x)                                native kernel (acb/kernels/fused_cpu.cpp)
    q, k, v = h @ Wq, h @ Wk, h @ Wv               oneDNN, prepacked weights (+ Qwen3's q/k norms)
    rope_(q), rope_(k)                             native kernel, in place, bit-identical to HF's
    a = paged attention (acb.attention)            the same function the HF forward calls
    x = a @ Wo + x                                 one GEMM with the residual add fused
    h = rms_norm(x)
    m = (h @ Wup) * silu(h @ Wgate)                two GEMMs, SiLU and the product fused
    x = m @ Wdown + x                              one GEMM with the residual add fused

Only the rows whose logits are kept go through the final norm and ``lm_head``.

Under tensor parallelism (acb.distributed) each rank holds its share of the heads and
of the MLP's columns; the two row-parallel GEMMs (``Wo``, ``Wdown``) then give partial
sums, which ``row_reduce`` adds up over the ranks in place (rank 0's carries the
residual, so the sum is the layer's output on every rank).

It is used only where it is known to compute what the model does: float32 or
bfloat16 on CPU, every projection prepacked, decoder layers of the classes listed in
``_WINDOW``, SiLU MLPs, plain RMSNorms, and the native kernels built.

In bfloat16 the weights are prepacked bf16 (oneDNN's ``avx512_bf16``/AMX kernels, fp32
accumulation), the pages hold bf16 keys and values that the attention kernels widen
to float32 as they read them, the norms and RoPE round where transformers' bf16
modules round, and the logits handed to sampling are float32 (the ``lm_head`` GEMM
runs in bf16 like transformers' and vLLM's). The fused GEMM epilogues (SiLU times
up, the residual adds) round once where transformers rounds twice, so bf16 outputs
agree with transformers' bf16 forward within bf16's precision, not bit for bit
(``tests/test_fused_forward.py`` states the tolerance).
``ACB_CPU_FUSED=0`` turns it off (the HF forward runs, as on every other model).
Greedy parity with transformers' ``generate`` is tested with it on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from . import attention
from .kernels.cpu_linear import pad_rows, padded_rows

log = logging.getLogger("acb")

# Decoder layer classes whose forward this module reproduces, and where each keeps the
# attention's sliding window (transformers passes it to the attention function).
_WINDOW = {
    "LlamaDecoderLayer": lambda attn, config: None,
    "MistralDecoderLayer": lambda attn, config: getattr(config, "sliding_window", None),
    "Qwen2DecoderLayer": lambda attn, config: attn.sliding_window,
    "Qwen3DecoderLayer": lambda attn, config: attn.sliding_window,
}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}


class _Logits:
    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


@dataclass(slots=True)
class _Layer:
    attn: torch.nn.Module  # passed to the attention function (its layer_idx picks the cache)
    ln1: tuple[torch.Tensor, float]
    ln2: tuple[torch.Tensor, float]
    q: tuple[torch.Tensor, torch.Tensor | None]  # (packed weight, bias)
    k: tuple[torch.Tensor, torch.Tensor | None]
    v: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate: tuple[torch.Tensor, torch.Tensor | None]
    up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    window: int | None


# The dtypes the fused forward runs in (the native kernels' and oneDNN's prepacked ones)
DTYPES = (torch.float32, torch.bfloat16)


def _norm(module: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    if type(module).__name__ not in _NORMS or module.weight.dtype not in DTYPES:
        return None
    return module.weight.detach().contiguous(), float(module.variance_epsilon)


class FusedForward:
    """Callable like the model for acb's runner: ``(input_ids=[1, T], position_ids=[1, T],
    attention_mask=None, use_cache=False, logits_to_keep=[K]) -> .logits [1, K, vocab]``."""

    def __init__(self, model: torch.nn.Module, layers: list[_Layer], kernels, row_reduce=None) -> None:
        base = model.model
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm = _norm(base.norm)
        self.lm_head = model.lm_head
        self.layers = layers
        self.k = kernels
        self.row_reduce = row_reduce

    @classmethod
    def build(cls, model: torch.nn.Module, packed, kernels, row_reduce=None) -> FusedForward | None:
        """The fused forward over ``model`` (its linears packed by ``packed``, a
        :class:`acb.kernels.cpu_linear.Prepacked`), or None, with the reason logged,
        where it does not apply. ``row_reduce``: the tensor-parallel sum, when sharded."""
        reason = why_not(model, packed, kernels)
        if reason:
            log.info("acb: fused CPU forward not used (%s); transformers' forward runs", reason)
            return None
        config = model.config
        layers = []
        for layer in model.model.layers[: config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp

            def lin(m: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
                return packed.layers[m].packed, m.bias

            layers.append(_Layer(
                attn=attn, ln1=_norm(layer.input_layernorm), ln2=_norm(layer.post_attention_layernorm),
                q=lin(attn.q_proj), k=lin(attn.k_proj), v=lin(attn.v_proj), o=lin(attn.o_proj),
                gate=lin(mlp.gate_proj), up=lin(mlp.up_proj), down=lin(mlp.down_proj),
                q_norm=_norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
                k_norm=_norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
                heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                head_dim=attn.head_dim, scaling=float(attn.scaling),
                window=_WINDOW[type(layer).__name__](attn, config),
            ))
        log.info("acb: fused CPU forward over %d %s layers", len(layers), type(model.model.layers[0]).__name__)
        return cls(model, layers, kernels, row_reduce)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                 use_cache: bool = False, logits_to_keep: torch.Tensor | int | None = None) -> _Logits:
        k = self.k
        linear = torch.ops.mkldnn._linear_pointwise
        binary = linear.binary
        x = self.embed(input_ids[0])  # [T, hidden]
        total = x.shape[0]
        rows = padded_rows(total)  # the GEMMs run on zero-padded rows (see acb.kernels.cpu_linear)
        x = pad_rows(x, rows)
        cos, sin = self.rotary(x[:total].unsqueeze(0), position_ids)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, head_dim]
        for layer in self.layers:
            d = layer.head_dim
            h = k.rms_norm(x, *layer.ln1)
            q = linear(h, *layer.q, "none", [], "")
            kk = linear(h, *layer.k, "none", [], "")
            v = linear(h, *layer.v, "none", [], "")
            if layer.q_norm is not None:  # Qwen3: RMSNorm over each head, before RoPE
                q = k.rms_norm(q.view(-1, d), *layer.q_norm).view(rows, -1)
                kk = k.rms_norm(kk.view(-1, d), *layer.k_norm).view(rows, -1)
            q, kk, v = q[:total], kk[:total], v[:total]  # contiguous views: the padding stays out of the cache
            k.rope_(q, cos, sin, d)
            k.rope_(kk, cos, sin, d)
            a, _ = attention.paged_attention(
                layer.attn,
                q.view(total, layer.heads, d).transpose(0, 1).unsqueeze(0),
                kk.view(total, layer.kv_heads, d).transpose(0, 1).unsqueeze(0),
                v.view(total, layer.kv_heads, d).transpose(0, 1).unsqueeze(0),
                None, scaling=layer.scaling, sliding_window=layer.window,
            )
            x = self._add_projection(pad_rows(a.view(total, -1), rows), x, layer.o)
            h = k.rms_norm(x, *layer.ln2)
            g = linear(h, *layer.gate, "swish", [], "")
            m = binary(h, g, *layer.up, "mul")
            x = self._add_projection(m, x, layer.down)
        x = x[:total]
        if isinstance(logits_to_keep, int):  # transformers' convention: the last N rows, 0 = all
            x = x[-logits_to_keep:] if logits_to_keep else x
        elif logits_to_keep is not None:
            x = x.index_select(0, logits_to_keep)
        return _Logits(self.lm_head(k.rms_norm(x, *self.norm)).float().unsqueeze(0))

    def _add_projection(self, h: torch.Tensor, x: torch.Tensor, weight: tuple) -> torch.Tensor:
        """``x + h @ W`` (one GEMM, the add fused); sharded, summed over the ranks, of
        which only rank 0 adds ``x``."""
        reduce = self.row_reduce
        if reduce is None or reduce.rank == 0:
            out = torch.ops.mkldnn._linear_pointwise.binary(h, x, *weight, "add")
        else:
            out = torch.ops.mkldnn._linear_pointwise(h, *weight, "none", [], "")
        if reduce is not None:
            reduce(out)
        return out


def why_not(model: torch.nn.Module, packed, kernels) -> str | None:
    """Why the fused forward cannot stand in for ``model``'s, or None."""
    if os.environ.get("ACB_CPU_FUSED", "1") == "0":
        return "ACB_CPU_FUSED=0"
    if kernels is None:
        return "the native CPU kernels are not built"
    if packed is None:
        return "the linear layers are not prepacked"
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    config = getattr(model, "config", None)
    if base is None or layers is None or config is None or not isinstance(getattr(model, "lm_head", None),
                                                                         torch.nn.Module):
        return "not a decoder-only model with .model.layers and .lm_head"
    if any(not hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "norm")):
        return "the model lacks embed_tokens, rotary_emb or norm"
    dtype = base.embed_tokens.weight.dtype if hasattr(base.embed_tokens, "weight") else None
    if dtype not in DTYPES or any(p.dtype != dtype for p in model.parameters()):
        return f"its weights are not all float32 or all bfloat16 ({dtype})"
    if type(base.embed_tokens) is not torch.nn.Embedding or _norm(base.norm) is None:
        return "its embedding or final norm is not the plain kind"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "pretraining_tp", 1) != 1:
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} (only silu)"
    for layer in layers[: config.num_hidden_layers]:
        name = type(layer).__name__
        if name not in _WINDOW:
            return f"{name} is not a Llama-family decoder layer"
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
            return "the MLP activation is not SiLU"
        if _norm(layer.input_layernorm) is None or _norm(layer.post_attention_layernorm) is None:
            return "a layer norm is not a plain float32/bfloat16 RMSNorm"
        if name == "Qwen3DecoderLayer" and (_norm(attn.q_norm) is None or _norm(attn.k_norm) is None):
            return "Qwen3's q/k norms are not plain RMSNorms"
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if m not in packed.layers:
                return "a projection is not prepacked (shared or wrapped weight)"
    return None
