"""int8 weights on the CPU (``EngineConfig(quantization="int8")``): W8A8 on AVX-512 VNNI, or on AVX2
(the same kernel's AVX2 form: ``vpmaddubsw`` on the weights' magnitudes and the activations with their
signs, widened by ``vpmaddwd``; the same int32 sums and outputs).

Every linear layer of the decoder (the attention's and the MLP's projections) keeps its
weights as int8, symmetric, one scale per output channel and group of 64 input channels
(:data:`GROUP`); the ``lm_head`` and the embedding (one table when tied: SmolLM2, Gemma) stay
bfloat16 and run on acb's bf16 GEMM (:class:`Bf16Linear`). The activations going into each int8
GEMM are smoothed, rotated (:data:`ROTATION`) and quantized at run time per token and per the
same groups of 64 channels (``max|x| / 127`` over the group), and the GEMM runs in acb's own kernel
(``acb/kernels/csrc/int8_cpu.cpp``): byte dot products (``vpdpbusd``) accumulated in int32 within a
group, rescaled in float32 across groups, with the epilogues fused (the residual add, SiLU /
GELU-tanh times the up projection). The residual stream between the layers is float32 (the
GEMMs add into it); q/k/v, RoPE, attention and the KV pages run in the model's dtype (float32 or
bfloat16) as in acb's fused forward; the logits are float32.

Smoothing (SmoothQuant, Xiao et al. 2022): a few input channels of each projection carry
activations 10-100x the others', and int8 activations lose the most there. Each projection
group (q/k/v, gate/up, o, down) gets per-input-channel factors s_j = max|x_j|^a /
max|w_j|^(1-a) (a = :data:`SMOOTHING`): the weight's column j is multiplied by s_j before it is
quantized and the input channel divided by it at run time (one multiply in the pass that
norms and quantizes the input) - exact in real arithmetic,
it moves the outliers into the weights, whose groups absorb them. max|x_j| is calibrated once,
at quantization time, on ``acb/data/calibration.txt`` (4,096 SmolLM2 tokens of docstrings from
Python's standard library, PSF-licensed text; never the held-out text quality is measured on).

What each part buys, measured on SmolLM2-135M (``benchmarks/int8_smoothing.py`` and
``benchmarks/int8_rotation.py``: fake quantization, 8,192 held-out tokens, top-1 next-token
agreement with float32): per channel weights and per-64 activations with an int8 lm_head 93.6 %;
weights and activations per 32 with a bf16 lm_head 95.9 %; + smoothing a=0.5 97.4 %; + the
rotation 98.1 %; the same in groups of 64 96.75 % unrotated, 97.67 % rotated (the engine's own
numbers: docs/performance.md, ``benchmarks/quality.py``). The lm_head in bf16 is worth ~0.7 points
of that: its input is the whole vocabulary's decision, and it stays within issue 28's memory
budget for SmolLM2 (weights ~32 % of float32's).

Why W8A8 and this kernel rather than oneDNN's int8 or weight-only int8: the measurements are in
docs/journal/2026-performance.md ("int8 weights: the kernel").

The model is quantized in place (the dense weights are freed: that is the memory
saving); :class:`Int8Linear`, :class:`Bf16Linear` and :class:`Bf16Embedding` stand in for
the modules, so the model's own (transformers') forward also computes with the quantized
weights, and ``state_dict`` holds the packed tensors. ``Engine.reload_weights`` and the
weight-change detection keep working: acb's forward reads the modules' own tensors.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from . import fused_layers

if TYPE_CHECKING:
    pass

from .int8_calibration import SMOOTHING, calibration_ids, input_maxima, projections, smoothing_factors
from .int8_forward import why_not_forward
from .int8_weights import (
    GROUP,
    Bf16Embedding,
    Bf16Linear,
    Int8Linear,
    embed_scale,
    is_quantized,
    native_kernels,
    weight_summary,
)

log = logging.getLogger("acb")

METHODS = ("int8",)


def why_not(model: torch.nn.Module) -> str | None:
    """Why ``model`` (dense, as loaded) cannot run with int8 weights here, or None."""
    if native_kernels() is None:
        return "acb's int8 kernels need a CPU with AVX-512 VNNI or AVX2 and a C++ compiler (they did not build here)"
    from ..kernels.cpu import fused_kernels

    if fused_kernels() is None:
        return "acb's native CPU kernels did not build"
    reason = fused_layers.unsupported(model)
    if reason:
        return reason
    layers = model.model.layers[: model.config.num_hidden_layers]
    linears = [getattr(owner, name) for layer in layers for owner, name in projections(layer)]
    for m in linears + [model.lm_head]:
        if type(m) is not torch.nn.Linear:
            return f"a projection is a {type(m).__name__}, not a plain torch.nn.Linear"
        if m.weight.shape[1] % 4 or (m is not model.lm_head and m.weight.shape[0] % 16):
            return f"a linear layer of shape {list(m.weight.shape)} (int8 needs [N, K] with N % 16 == 0, K % 4 == 0)"
    if model.lm_head.bias is not None:
        return "the lm_head has a bias"
    return None


def check_dense(model: torch.nn.Module) -> None:
    """ValueError naming ``EngineConfig.quantization`` where :func:`why_not` says the
    (dense) model cannot run with int8 weights here."""
    reason = why_not(model)
    if reason:
        raise ValueError(f"EngineConfig.quantization='int8' cannot run on this model here: {reason}")


def _group(parts: list[Int8Linear]) -> list[Int8Linear]:
    """``parts`` (same input: q, k, v) moved into one buffer each for weights, scales and
    biases, each module holding its slice: one GEMM can compute them all."""
    biased = [p.bias is not None for p in parts]
    if any(biased) and not all(biased) or any(p.out_features % 16 for p in parts):
        return parts
    joined = [torch.cat([getattr(p, name) for p in parts]) for name in ("weight", "weight_scale")]
    joined.append(torch.cat([p.bias for p in parts]) if all(biased) else None)
    out, start = [], 0
    for p in parts:
        n = p.out_features
        out.append(Int8Linear(joined[0][start // 16: (start + n) // 16], joined[1][start // 16: (start + n) // 16],
                              None if joined[2] is None else joined[2][start: start + n], n,
                              parts[0].input_scale, parts[0].rotated))  # one input: one smoothing, one rotation
        start += n
    return out


def quantize_(model: torch.nn.Module, weights: dict[str, tuple] | None = None, tokenizer=None,
              smoothing: float | None = SMOOTHING) -> None:
    """Replace ``model``'s decoder projections by int8 ones and its ``lm_head`` and embedding by
    bf16 ones, in place; the dense weights are freed. ``weights``: {parameter name:
    ``Int8Linear.packed``, or a bf16 ``Bf16Linear`` for the lm_head and embedding} already
    quantized (a GGUF file's, :mod:`acb.model.gguf_int8`, smoothed there); otherwise the modules' own
    weights are quantized, smoothed (``smoothing``: SmoothQuant's a, None for none) with input
    maxima calibrated on ``tokenizer``'s reading of :data:`CALIBRATION`. ValueError (naming
    ``EngineConfig.quantization``) where :func:`why_not` says it cannot run."""
    check_dense(model)
    weights = weights or {}
    base = model.model
    dtype = next(base.norm.parameters()).dtype
    factors = {}
    if not weights and smoothing is not None:
        ids = calibration_ids(tokenizer, model.config.vocab_size)
        factors = smoothing_factors(model, input_maxima(model, ids), smoothing)

    def int8(name: str, linear: torch.nn.Linear) -> Int8Linear:
        if name in weights:
            return Int8Linear.from_packed(weights[name], linear.bias)
        return Int8Linear.from_dense(linear, factors.get(name))

    with torch.no_grad():
        for i, layer in enumerate(base.layers[: model.config.num_hidden_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            attn.q_proj, attn.k_proj, attn.v_proj = _group([int8(a + "q_proj.weight", attn.q_proj),
                                                            int8(a + "k_proj.weight", attn.k_proj),
                                                            int8(a + "v_proj.weight", attn.v_proj)])
            attn.o_proj = int8(a + "o_proj.weight", attn.o_proj)
            mlp.gate_proj = int8(m + "gate_proj.weight", mlp.gate_proj)
            mlp.up_proj = int8(m + "up_proj.weight", mlp.up_proj)
            mlp.up_proj.input_scale = mlp.gate_proj.input_scale  # one input: one smoothing, one tensor
            mlp.down_proj = int8(m + "down_proj.weight", mlp.down_proj)
        if weights:
            lm_head = weights["lm_head.weight"]
            table = weights.get("model.embed_tokens.weight", lm_head)
        else:
            lm_head = Bf16Linear.from_dense(model.lm_head.weight.detach())
            tied = model.lm_head.weight is base.embed_tokens.weight
            table = lm_head if tied else Bf16Linear.from_dense(base.embed_tokens.weight.detach())
        scale = embed_scale(base.embed_tokens, dtype)
        model.lm_head = lm_head
        base.embed_tokens = Bf16Embedding(table, dtype, scale)
    from ..kernels.cpu_linear import trim_heap

    trim_heap()
    smoothed = any(p.input_scale is not None for p in model.modules() if isinstance(p, Int8Linear))
    rotated = any(p.rotated for p in model.modules() if isinstance(p, Int8Linear))
    log.info("acb: int8 weights and activations (per token and %d channels%s%s), bf16 lm_head and embedding: %s",
             GROUP, ", smoothed" if smoothed else "", ", Hadamard-rotated" if rotated else "", weight_summary(model))


def prepare(model: torch.nn.Module, config, tokenizer=None) -> None:
    """The engine's hook: check that ``config.quantization`` can run where ``model`` is,
    and quantize the model in place (once: a model already quantized is taken as it is;
    ``tokenizer`` reads the smoothing's calibration text). ValueError naming
    ``EngineConfig.quantization`` otherwise. A model that already holds int8 layers (an
    earlier engine quantized this model object, or ``acb.model.loading.load(quantization="int8")``)
    is checked as if ``quantization="int8"`` were set: it runs nowhere else."""
    from .int8_weights import quantization_of

    held = quantization_of(model)
    if config.quantization is None:
        if not held:
            return
        try:
            config = dataclasses.replace(config, quantization=held)
        except ValueError as e:
            raise ValueError(f"the model holds acb's {held} layers (quantized in place by an earlier engine, or "
                             f"loaded with quantization={held!r}), so it runs only where {held} can: {e}") from None
    if config.quantization == "gguf" and held != "gguf":
        raise ValueError("EngineConfig.quantization='gguf' runs a GGUF file at its own widths: load it with "
                         "Engine.from_pretrained(folder, gguf_file=..., quantization='gguf') (or acb.loading.load("
                         "..., quantization='gguf')); this model " + ("holds acb's int8 layers" if held else
                                                                       "is dense"))
    if config.quantization == "int8" and held == "gguf":
        raise ValueError("EngineConfig.quantization='int8' was set, but the model holds a GGUF file's weights at "
                         "their own widths (quantization='gguf'); set quantization='gguf' or load the file with "
                         "quantization='int8'")
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ValueError(f"EngineConfig.quantization={config.quantization!r} runs on the CPU only (acb's kernels); "
                         f"the model is on {param.device}")
    if param.dtype not in fused_layers.DTYPES:
        raise ValueError(f"EngineConfig.quantization={config.quantization!r} runs with float32 or bfloat16 "
                         f"activations; the model's other weights are {param.dtype}")
    if is_quantized(model):
        reason = why_not_forward(model, True, True)
        if reason:
            raise ValueError(f"EngineConfig.quantization={config.quantization!r} cannot run this model: {reason}")
        return
    quantize_(model, tokenizer=tokenizer)
