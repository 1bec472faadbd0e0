"""acb's fused CPU forward with int8 GEMMs (:class:`Int8Forward`): the float32 or bf16 forward of
:mod:`acb.model.fused` with every projection an int8 GEMM of ``acb/kernels/csrc/int8_cpu.cpp`` over
activations smoothed, rotated and quantized per token and group as they are normed."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from . import fused, fused_layers
from .fused import FusedForward, _Logits, kept_rows
from .fused_layers import Layer
from .int8_calibration import projections
from .int8_weights import Bf16Embedding, Bf16Linear, Int8Linear, QuantEmbedding, group_of, native_kernels

if TYPE_CHECKING:
    from ..attention.context import ForwardContext
    from ..attention.metadata import StepAttention

log = logging.getLogger("acb")


def why_not_forward(model: torch.nn.Module, packed, kernels) -> str | None:
    """Why :class:`Int8Forward` cannot run ``model`` (already quantized) now, or None."""
    if kernels is None or native_kernels() is None:
        return "the native CPU kernels are not built"
    if not (isinstance(model.model.embed_tokens, Bf16Embedding) and isinstance(model.lm_head, Bf16Linear)
            or isinstance(model.model.embed_tokens, QuantEmbedding) and isinstance(model.lm_head, Int8Linear)):
        return "the embedding or the lm_head is not acb's bf16 or quantized one"
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        if any(not isinstance(getattr(owner, name), Int8Linear) for owner, name in projections(layer)):
            return "a projection is not an Int8Linear (replaced since it was quantized)"
    return None


class Int8Forward(FusedForward):
    """acb's fused forward with int8 GEMMs (see the module's docstring); callable like the
    model for the runner."""

    # a bf16 step's prompt attention takes its softmax weights rounded to bf16 into the value product,
    # as flash attention on GPUs does (acb.attention.paged.attend's bf16_weights): SmolLM2's real-text run 1.4 %
    # faster (the prompt kernel ~13 %), top-1 agreement with float32 97.64 -> 97.63 % (docs/performance.md).
    # The bf16 forward keeps ~16 bits of each weight: there the rounding cost ~0.1 point, at its 99 % line.
    bf16_weights = True

    def __init__(self, model: torch.nn.Module, layers: list[Layer], kernels, qkv: list, smooth: list,
                 rotated: list) -> None:
        super().__init__(model, layers, kernels)
        self.q8 = native_kernels()
        self.qkv = qkv  # per layer: the joined (packed, scales, bias) of q, k, v, or None
        self.smooth = smooth  # per layer: the input_scale of (q/k/v, o, gate/up, down), each or None
        self.rotated = rotated  # per layer: whether the inputs of (q/k/v, o, gate/up, down) are rotated
        self.dtype = next(model.parameters()).dtype
        self.loop = self._native_loop()  # int8_cpu.cpp's DecodeLoop over these layers, or None

    def _native_loop(self):
        """int8_cpu.cpp's DecodeLoop over these layers (:meth:`FusedForward._native_loop`: where every
        layer is one it takes and the kernels it calls were built, q/k/v joined), or None."""
        decode = fused.loop_kernels(self)
        if decode is None or not hasattr(self.q8, "DecodeLoop"):
            return None
        for layer, qkv in zip(self.layers, self.qkv, strict=True):
            if (qkv is None or layer.q[0].shape[0] * 16 != layer.heads * layer.head_dim
                    or layer.k[0].shape[0] * 16 != layer.kv_heads * layer.head_dim):
                return None
        loop = self.q8.DecodeLoop(self.dtype)
        for layer, qkv, smooth, rotated in zip(self.layers, self.qkv, self.smooth, self.rotated, strict=True):
            weights = (qkv, layer.o, layer.gate, layer.up, layer.down)
            loop.add_layer([layer.ln1[0], layer.ln2[0]], [layer.ln1[1], layer.ln2[1]],
                           [group_of(w) for w in (layer.q, layer.o, layer.gate, layer.down)], list(smooth),
                           list(rotated), [w[0] for w in weights], [w[1] for w in weights],
                           [w[2] for w in weights], layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim,
                           layer.heads, layer.kv_heads, layer.head_dim, layer.scaling, layer.window or 0,
                           layer.act_code)
        return loop

    @classmethod
    def build(cls, model: torch.nn.Module, packed, kernels, row_reduce=None,
              bf16_gemm: bool = True) -> Int8Forward | None:
        """As :meth:`FusedForward.build`, with int8 GEMMs (``bf16_gemm`` does not apply: the layers'
        GEMMs are int8, and the bf16 ``lm_head`` takes acb's bf16 GEMM wherever it is built)."""
        reason = why_not_forward(model, packed, kernels)
        if reason:
            log.info("acb: int8 fused CPU forward not used (%s); transformers' forward runs", reason)
            return None
        layers = fused_layers.describe(model, lambda m: m.args)
        qkv, smooth, rotated = [], [], []
        for layer in model.model.layers[: model.config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [attn.q_proj, attn.k_proj, attn.v_proj]
            joined = [_joined([getattr(p, name) for p in parts]) for name in ("weight", "weight_scale")]
            biases = [p.bias for p in parts]
            bias = None if all(b is None for b in biases) else _joined(biases)
            same_input = all(_same(p.input_scale, parts[0].input_scale) and p.rotated == parts[0].rotated
                             for p in parts)
            ok = all(j is not None for j in joined) and (bias is not None or all(b is None for b in biases))
            qkv.append((*joined, bias) if ok and same_input else None)
            smooth.append((attn.q_proj.input_scale, attn.o_proj.input_scale, mlp.gate_proj.input_scale,
                           mlp.down_proj.input_scale))
            rotated.append((attn.q_proj.rotated, attn.o_proj.rotated, mlp.gate_proj.rotated, mlp.down_proj.rotated))
            if not _same(mlp.up_proj.input_scale, mlp.gate_proj.input_scale) or \
                    mlp.up_proj.rotated != mlp.gate_proj.rotated:
                log.info("acb: int8 fused CPU forward not used (gate and up smoothed or rotated apart); "
                         "transformers' forward runs")
                return None
        log.info("acb: int8 fused CPU forward over %d %s layers (float32 residual stream, q/k/v and attention in %s)",
                 len(layers),
                 type(model.model.layers[0]).__name__, str(next(model.parameters()).dtype).removeprefix("torch."))
        return cls(model, layers, kernels, qkv, smooth, rotated)

    def _quantized(self, x: torch.Tensor, w: tuple, norm: fused_layers.Norm | None = None,
                   mult: torch.Tensor | None = None, rotate: bool = False) -> tuple[torch.Tensor, ...]:
        """x's rows quantized in the groups weight ``w`` takes: RMS-normed first with ``norm``,
        then multiplied by ``mult`` (the smoothing), then rotated (``rotate``), in one pass."""
        weight, eps, gemma = norm or (None, 1e-6, False)
        return self.q8.quantize_rows(x, weight, gemma, eps, group_of(w), mult, rotate)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the kept rows ``x``: the final norm into bf16, the bf16 lm_head."""
        if isinstance(self.lm_head, Int8Linear):  # a GGUF file's quantized lm_head (acb.model.gguf_native)
            head = self.lm_head
            logits = self.q8.linear(*self._quantized(x, head.args, self.norm), *head.args, None, torch.float32)
            return logits[:, : head.out_features]
        weight, eps, gemma = self.norm  # in float32, then rounded once (only the kept rows)
        h = (self.k.rms_norm_f32w(x, weight, eps) if gemma else self.k.rms_norm(x, weight.float(), eps)).bfloat16()
        return self.lm_head(h)  # Bf16Linear: acb's bf16 GEMM where the CPU has it

    def __call__(self, context: ForwardContext, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask=None, use_cache: bool = False,
                 logits_to_keep: torch.Tensor | int | None = None) -> _Logits:
        meta = context.attention  # (no LoRA rows: adapters do not run with quantization)
        x = self.embed(input_ids[0])  # [T, hidden]; the int8 kernels take any row count (no padding)
        ropes = self._ropes(x, position_ids)  # in the model's dtype, as q and k
        # the residual stream float32 whatever the model's dtype (the GEMMs add into it in their
        # epilogue, the quantization reads it): with a bf16 stream SmolLM2's int8_bf16 agreed with
        # float32 on 96.78 % of next tokens, with this one 97.20 % (benchmarks/quality.py, 2026-12-04)
        x = x.float()
        done = self._decode_layers(meta, x, ropes, self.dtype)
        x = self._layers(meta, x, ropes) if done is None else done
        logits = self._head(kept_rows(x, logits_to_keep))
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return _Logits(logits.unsqueeze(0))

    def _layers(self, meta: StepAttention, x: torch.Tensor, ropes: dict) -> torch.Tensor:
        """The float32 residual stream ``x`` [T, hidden] through every layer of the step of ``meta``,
        kernel by kernel (any step; :meth:`_decode_layers` runs the same calls natively for decode-only ones)."""
        q8, dtype, f32 = self.q8, self.dtype, torch.float32
        linear = q8.linear
        total = x.shape[0]
        for layer, qkv, (s_qkv, s_o, s_mlp, s_down), (r_qkv, r_o, r_mlp, r_down) in zip(
                self.layers, self.qkv, self.smooth, self.rotated, strict=True):
            cos, sin = ropes[layer.rope]
            h = self._quantized(x, layer.q, layer.ln1, s_qkv, r_qkv)  # RMSNorm, smoothing, rotation, rounding: one pass
            if qkv is not None:
                out = linear(*h, *qkv, None, dtype)
                nq, nk = layer.q[0].shape[0] * 16, layer.k[0].shape[0] * 16
                q, kk, v = out[:, :nq], out[:, nq: nq + nk], out[:, nq + nk:]
            else:
                q, kk, v = (linear(*h, *w, None, dtype) for w in (layer.q, layer.k, layer.v))
            a = self._quantized(self.attend(meta, layer, q, kk, v, total, cos, sin), layer.o, None, s_o, r_o)
            if layer.post_attn is None:
                x = linear(*a, *layer.o, x, f32)  # the residual add fused
            else:  # Gemma: normed before the residual add
                x = x + self.rms(linear(*a, *layer.o, None, dtype), layer.post_attn)
            h = self._quantized(x, layer.gate, layer.ln2, s_mlp, r_mlp)
            m = self._quantized(q8.glu(*h, *layer.gate, *layer.up, layer.act_code, f32), layer.down, None, s_down,
                                r_down)
            if layer.post_mlp is None:
                x = linear(*m, *layer.down, x, f32)
            else:
                x = x + self.rms(linear(*m, *layer.down, None, dtype), layer.post_mlp)
        return x


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over ``tensors`` when they lie end to end in one storage (the q, k, v
    projections :func:`quantize_` packs together), so one GEMM computes all three."""
    first = tensors[0]
    if any(t is None or not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           for t in tensors):
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
