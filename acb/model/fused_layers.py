"""The model as the fused forward (:mod:`acb.model.fused`) sees it: which decoder families it
reproduces (Llama, Mistral, Qwen2/3, Gemma 2/3), each layer described once (:class:`Layer`: norms,
projections packed side by side, activation, sliding window, RoPE kind), and why a model cannot run on
it (:func:`why_not`, :func:`unsupported`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# The dtypes the fused forward runs in (the native kernels' and oneDNN's prepacked ones)
DTYPES = (torch.float32, torch.bfloat16)

# Decoder layer classes whose forward this module reproduces, and where each keeps the
# attention's sliding window (transformers passes it to the attention function).
WINDOW = {
    "LlamaDecoderLayer": lambda attn, config: None,
    "MistralDecoderLayer": lambda attn, config: getattr(config, "sliding_window", None),
    "Qwen2DecoderLayer": lambda attn, config: attn.sliding_window,
    "Qwen3DecoderLayer": lambda attn, config: attn.sliding_window,
    "Gemma2DecoderLayer": lambda attn, config: attn.sliding_window,
    "Gemma3DecoderLayer": lambda attn, config: attn.sliding_window,
}
# Gemma's layers: a norm after attention and after the MLP too, GELU-tanh, norms that
# compute in float32 with a 1 + weight scale
_GEMMA = {"Gemma2DecoderLayer", "Gemma3DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
_GEMMA_NORMS = {"Gemma2RMSNorm", "Gemma3RMSNorm"}
_EMBEDDINGS = {"Embedding", "Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding"}
# the MLP activation of each family, as oneDNN's fused GEMM epilogue (name, algorithm)
_ACTIVATIONS = {"SiLU": ("swish", ""), "SiLUActivation": ("swish", ""), "GELUTanh": ("gelu", "tanh")}

# A norm: (weight, eps, gemma). Llama's: the module's weight, the row rounded to the model's
# dtype before the product; Gemma's: 1 + weight in float32, one rounding at the end.
Norm = tuple[torch.Tensor, float, bool]


@dataclass(slots=True)
class Layer:
    attn: torch.nn.Module  # passed to the attention function (its layer_idx picks the cache)
    ln1: Norm  # before attention
    ln2: Norm  # before the MLP
    q: tuple[torch.Tensor, torch.Tensor | None] | None  # (packed weight, bias); None once side by side
    k: tuple[torch.Tensor, torch.Tensor | None] | None
    v: tuple[torch.Tensor, torch.Tensor | None] | None
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate: tuple[torch.Tensor, torch.Tensor | None] | None
    up: tuple[torch.Tensor, torch.Tensor | None] | None
    down: tuple[torch.Tensor, torch.Tensor | None]
    q_norm: Norm | None
    k_norm: Norm | None
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    window: int | None
    act: tuple[str, str] = ("swish", "")  # oneDNN epilogue of the gate projection
    act_code: int = 0  # the native kernels' act (glu, glu_add, int8 glu): 0 SiLU, 1 GELU-tanh
    post_attn: Norm | None = None  # Gemma: on the attention's output, before the residual add
    post_mlp: Norm | None = None  # Gemma: on the MLP's output, before the residual add
    softcap: float | None = None  # Gemma 2: attention logit soft-capping
    rope: str | None = None  # Gemma 3: which rotary embedding (its layer type); None: the one
    qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # q/k/v packed side by side: one GEMM
    qkv_split: tuple[int, int, int] = (0, 0, 0)  # its output's column counts: q, k, v
    gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # gate/up side by side, then glu


def norm_of(module: torch.nn.Module) -> Norm | None:
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    if weight is None or weight.dtype not in DTYPES:
        return None
    if name in _NORMS:
        return weight.detach().contiguous(), float(module.variance_epsilon), False
    if name in _GEMMA_NORMS:
        return (1.0 + weight.detach().float()).contiguous(), float(module.eps), True
    return None


def side_by_side_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linears :func:`side_by_side` packs together: each layer's q/k/v and gate/up."""
    return [m for layer in model.model.layers[: model.config.num_hidden_layers]
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
                      layer.mlp.up_proj)]


def side_by_side(model: torch.nn.Module, layers: list[Layer], native=None) -> list[torch.nn.Linear]:
    """Pack each layer's q/k/v weights side by side, and its gate/up weights, so the fused
    forward runs one GEMM where the model has three (or two): fewer, wider GEMMs, each
    reading its input once (on SmolLM2's shapes in bf16, 64 rows: q/k/v 285 -> 219 us a layer,
    gate/up with their epilogues 718 -> 641 us plus the act(g) * up pass; 2048 rows: gate/up
    23.5 -> 20.4 ms). Each output column is the same dot product as before. They stand in for
    the per-projection packs, which :meth:`FusedForward.build` then frees (a module's own forward,
    if transformers' ever runs, packs its weight again); rebuilt with the fused forward when
    weights change. Returns the linears it packed together."""
    for layer, module in zip(layers, model.model.layers, strict=False):
        attn, mlp = module.self_attn, module.mlp
        layer.qkv = pack_linears((attn.q_proj, attn.k_proj, attn.v_proj), native)
        layer.qkv_split = (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
        layer.gate_up = pack_linears((mlp.gate_proj, mlp.up_proj), native)
        layer.q = layer.k = layer.v = layer.gate = layer.up = None  # read through qkv / gate_up only
    return side_by_side_linears(model)


def pack_linears(linears: tuple[torch.nn.Linear, ...], native=None) -> tuple:
    """One prepacked weight (and bias) whose output columns are each linear's, in order:
    oneDNN's ``(weight, bias)``, or with ``native`` (``native_bf16()``) its
    ``(weight, columns, float32 bias)``."""
    weight = torch.cat([m.weight.detach() for m in linears]) if len(linears) > 1 else linears[0].weight.detach()
    weight = weight.contiguous()
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        bias = None
    else:  # Qwen2's q/k/v: a missing bias counts as zeros
        bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                          for m in linears]).contiguous()
    if native is not None:
        return native.pack(weight), weight.shape[0], None if bias is None else bias.float().contiguous()
    return torch.ops.mkldnn._reorder_linear_weight(weight, None), bias


def describe(model: torch.nn.Module, lin) -> list[Layer]:
    """The decoder layers of ``model`` as :class:`Layer` records; ``lin`` gives a
    projection's weights as the forward's GEMMs take them."""
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    per_type_rope = "layer_type" in inspect.signature(model.model.rotary_emb.forward).parameters
    layers = []
    for i, layer in enumerate(model.model.layers[: config.num_hidden_layers]):
        attn, mlp = layer.self_attn, layer.mlp
        gemma = type(layer).__name__ in _GEMMA
        layers.append(Layer(
            attn=attn, ln1=norm_of(layer.input_layernorm),
            ln2=norm_of(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
            q=lin(attn.q_proj), k=lin(attn.k_proj), v=lin(attn.v_proj), o=lin(attn.o_proj),
            gate=lin(mlp.gate_proj), up=lin(mlp.up_proj), down=lin(mlp.down_proj),
            q_norm=norm_of(attn.q_norm) if hasattr(attn, "q_norm") else None,
            k_norm=norm_of(attn.k_norm) if hasattr(attn, "k_norm") else None,
            heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
            head_dim=attn.head_dim, scaling=float(attn.scaling),
            window=WINDOW[type(layer).__name__](attn, config),
            act=_ACTIVATIONS[type(mlp.act_fn).__name__],
            act_code=0 if _ACTIVATIONS[type(mlp.act_fn).__name__][0] == "swish" else 1,
            post_attn=norm_of(layer.post_attention_layernorm) if gemma else None,
            post_mlp=norm_of(layer.post_feedforward_layernorm) if gemma else None,
            softcap=getattr(attn, "attn_logit_softcapping", None) if type(layer).__name__ == "Gemma2DecoderLayer"
            else None,
            rope=layer_types[i] if per_type_rope else None,
        ))
    return layers


def why_not(model: torch.nn.Module, packed, kernels, native: bool = False) -> str | None:
    """Why the fused forward cannot stand in for ``model``'s, or None. ``native``: acb's bf16
    GEMMs compute it (they pack the weights themselves: oneDNN's prepacking is not needed)."""
    if kernels is None:
        return "the native CPU kernels are not built"
    if packed is None and not native:
        return "the linear layers are not prepacked"
    reason = unsupported(model)
    if reason:
        return reason
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if native:  # packed from its own weight by acb's bf16 GEMMs: it must be a plain linear
                if type(m) is not torch.nn.Linear:
                    return f"a projection is a {type(m).__name__}, not a plain torch.nn.Linear"
                continue
            if m not in packed.layers:
                return "a projection is not prepacked (shared or wrapped weight)"
    return None


def unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model``'s architecture, modules or dtype are not what this forward computes
    (its linears aside), or None."""
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
    if type(base.embed_tokens).__name__ not in _EMBEDDINGS or norm_of(base.norm) is None:
        return "its embedding or final norm is not the plain kind"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    for layer in layers[: config.num_hidden_layers]:
        name = type(layer).__name__
        if name not in WINDOW:
            return f"{name} is not a Llama-, Qwen-, Mistral- or Gemma-family decoder layer"
        attn, mlp = layer.self_attn, layer.mlp
        if type(mlp.act_fn).__name__ not in _ACTIVATIONS:
            return f"the MLP activation {type(mlp.act_fn).__name__} is not SiLU or GELU-tanh"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if name in _GEMMA:
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        if hasattr(attn, "q_norm"):
            norms += [attn.q_norm, attn.k_norm]
        if any(norm_of(n) is None for n in norms):
            return "a norm is not a plain float32/bfloat16 RMSNorm"
    return None
