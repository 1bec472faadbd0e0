"""acb's fused CPU forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) and
Gemma 2/3.

transformers' eager forward of one decoder layer is ~200 PyTorch calls (views,
casts, the RMSNorm's six ops, RoPE's slices and concatenations, the SiLU and the
multiply, the residual adds), each dispatched from Python and, on the CPU, each a
parallel region of its own. This forward runs the same math on the same weights (the
model's own modules hold them) in about a dozen calls per layer (measured on SmolLM2's
standard workload: decode steps 10.6 -> 9.2-9.6 s, prefill steps 15.2 -> 13.8 s):

    h = rms_norm(x)                                native kernel (acb/kernels/csrc/fused_cpu.cpp)
    q | k | v = h @ [Wq | Wk | Wv]                 one oneDNN GEMM, the weights prepacked side by side
                                                   (+ Qwen3's q/k norms); q, k, v are column views
    rope_(q), rope_(k)                             native kernel, in place, bit-identical to HF's
    a = paged attention (acb.attention.paged.attend)     what the HF forward's attention calls
    x = a @ Wo + x                                 one GEMM with the residual add fused
    h = rms_norm(x)
    g | u = h @ [Wgate | Wup]                      one GEMM
    m = silu(g) * u                                native kernel, one pass (``glu``)
    x = m @ Wdown + x                              one GEMM with the residual add fused

Only the rows whose logits are kept go through the final norm and ``lm_head``.

Gemma 2/3 layers add a norm on the attention's and on the MLP's output before each
residual add (so those adds are not fused into the GEMMs), compute their norms in
float32 with a ``1 + weight`` scale (``rms_norm_f32w``), use GELU-tanh (oneDNN's
``gelu``/``tanh`` epilogue), scale the embedding (their embedding module's own forward),
soft-cap the attention logits (Gemma 2) and the final logits, and slide the windows of
their sliding layers over the hybrid page pools as transformers' forward does; Gemma 3
has one rotary embedding per layer type (local and global bases).

Under tensor parallelism (acb.distributed) each rank holds its share of the heads and
of the MLP's columns; the two row-parallel GEMMs (``Wo``, ``Wdown``) then give partial
sums, which ``row_reduce`` adds up over the ranks in place (rank 0's carries the
residual, so the sum is the layer's output on every rank).

It is used only where it is known to compute what the model does: float32 or
bfloat16 on CPU, every projection prepacked, decoder layers of the classes listed in
``WINDOW``, SiLU or GELU-tanh MLPs, plain RMSNorms, and the native kernels built.

In bfloat16 the weights are prepacked bf16 (oneDNN's ``avx512_bf16``/AMX kernels, fp32
accumulation), the pages hold bf16 keys and values that the attention kernels widen
to float32 as they read them, the residual stream, RoPE and the logits handed to
sampling are float32 (the ``lm_head`` GEMM reads bf16 like transformers' and vLLM's),
and a value is rounded to bf16 only where a GEMM or the pages read it: once, where
transformers' bf16 modules round two or three times (the norm, the SiLU times up, the
residual adds). So bf16 outputs agree with transformers' bf16 forward within bf16's
precision, not bit for bit (``tests/test_fused_forward.py`` states the tolerance), and
with float32's next token 99.05 % of the time on held-out text (docs/performance.md).

The runner calls it with the step's forward context (``acb.attention.context``: the attention
metadata, the LoRA rows) as its first argument; it hands the metadata to the attention itself.

``EngineConfig.cpu_fused_forward=False`` (or ``ACB_CPU_FUSED=0``) turns it off (the HF forward runs,
as on every other model).
Greedy parity with transformers' ``generate`` is tested with it on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..attention import paged as attention
from ..kernels.cpu_linear import pad_rows, padded_rows
from .fused_layers import (
    Layer,
    Norm,
    describe,
    norm_of,
    pack_linears,
    side_by_side,
    side_by_side_linears,
    why_not,
)
from .fused_lora import LoraLayer

if TYPE_CHECKING:
    from ..attention.context import ForwardContext
    from ..attention.metadata import StepAttention

log = logging.getLogger("acb")


class _Logits:
    __slots__ = ("logits",)

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


# Decode-only steps run their layers in one native call (DecodeLoop in bf16_cpu.cpp and int8_cpu.cpp:
# the same kernels in the same order as the Python loops below, without returning to Python, and
# taking the GIL back, ~330 times a step) where the model's layers allow it: acb's bf16 GEMMs and the
# int8 forward. benchmarks/kernel_profile.py turns it off to time each kernel from Python.
NATIVE_DECODE_LOOP = True


class FusedForward:
    """Callable like the model for acb's runner, with the step's forward context first:
    ``(context, input_ids=[1, T], position_ids=[1, T], attention_mask=None, use_cache=False,
    logits_to_keep=[K]) -> .logits [1, K, vocab]`` (``acb.attention.context.run`` calls it so)."""

    takes_context = True  # acb.attention.context.run hands it the step's ForwardContext

    # bf16 prompt attention's value product over softmax weights rounded to bf16 (acb.attention.paged.attend's
    # bf16_weights): the int8 forward's choice, not the bf16 forward's (docs/performance.md)
    bf16_weights = False

    def __init__(self, model: torch.nn.Module, layers: list[Layer], kernels, row_reduce=None) -> None:
        base = model.model
        self.embed = base.embed_tokens  # Gemma's scales its output (the module's own forward)
        self.rotary = base.rotary_emb
        self.norm = norm_of(base.norm)
        self.lm_head = model.lm_head
        self.final_softcap = getattr(model.config, "final_logit_softcapping", None)
        self.rope_types = sorted({layer.rope for layer in layers if layer.rope is not None})
        self.layers = layers
        self.k = kernels
        self.row_reduce = row_reduce
        self.bf16 = None  # the native bf16 GEMMs (``native_bf16``), when they compute this forward
        self.head = None  # the lm_head packed for them: (weight, columns, bias)
        self.loop = None  # the decode-only steps' layers as one native call (_native_loop), or None
        self.lora_layer = LoraLayer(self)  # a layer of a step with adapter rows, over this forward's ops

    @classmethod
    def build(cls, model: torch.nn.Module, packed, kernels, row_reduce=None,
              bf16_gemm: bool = True) -> FusedForward | None:
        """The fused forward over ``model`` (its linears packed by ``packed``, a
        :class:`acb.kernels.cpu_linear.Prepacked`), or None, with the reason logged,
        where it does not apply. ``row_reduce``: the tensor-parallel sum, when sharded.
        ``bf16_gemm`` (``EngineConfig.cpu_bf16_gemm``): a bf16 model's GEMMs on acb's own bf16
        kernels where they are built (:func:`native_bf16`), else on oneDNN's prepacked linears."""
        dtype = next(model.parameters()).dtype
        native = native_bf16(bf16_gemm) if dtype == torch.bfloat16 and cls is FusedForward else None
        reason = why_not(model, packed, kernels, native=native is not None)
        if reason:
            log.info("acb: fused CPU forward not used (%s); transformers' forward runs", reason)
            return None
        joined = set(side_by_side_linears(model))  # packed side by side below, never on their own
        if native is not None:  # every GEMM in acb's own bf16 kernel, packed in its layout
            layers = describe(model, lambda m: None if m in joined else pack_linears((m,), native))
            side_by_side(model, layers, native)
            if packed is not None:
                packed.drop(list(packed.layers))  # oneDNN's copies (if transformers' forward ran): not read
        else:
            layers = describe(model, lambda m: (None if m in joined else packed.layers[m].weight(), m.bias))
            packed.drop(side_by_side(model, layers))  # their own copies (if any ran): the side-by-side ones serve
            if model.lm_head in packed.layers:  # packed before the first step, not during it
                packed.layers[model.lm_head].weight()
        log.info("acb: fused CPU forward over %d %s layers (%s%s)", len(layers), type(model.model.layers[0]).__name__,
                 str(dtype).removeprefix("torch."), ", acb's bf16 GEMMs, float32 residual stream and logits"
                 if native is not None else "")
        forward = cls(model, layers, kernels, row_reduce)
        if native is not None:
            forward.bf16, forward.head = native, pack_linears((model.lm_head,), native)
            forward.loop = forward._native_loop()
        return forward

    def _native_loop(self):
        """bf16_cpu.cpp's DecodeLoop over these layers: on acb's bf16 GEMMs, on one device, where
        :func:`loop_kernels` finds the layers it takes and the kernels it calls, q/k/v and gate/up
        joined; else None."""
        decode = loop_kernels(self)
        if decode is None or self.bf16 is None or self.row_reduce is not None or not hasattr(self.bf16, "DecodeLoop"):
            return None
        for layer in self.layers:
            nq, nk = layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim
            if (layer.qkv is None or tuple(layer.qkv_split) != (nq, nk, nk) or layer.gate_up is None
                    or layer.gate_up[1] % 32 != 0):
                return None
        loop = self.bf16.DecodeLoop()
        for layer in self.layers:
            weights = (layer.qkv, layer.o, layer.gate_up, layer.down)
            loop.add_layer([layer.ln1[0], layer.ln2[0]], [layer.ln1[1], layer.ln2[1]], [w[0] for w in weights],
                           [w[1] for w in weights], [w[2] for w in weights], layer.heads * layer.head_dim,
                           layer.kv_heads * layer.head_dim, layer.heads, layer.kv_heads, layer.head_dim,
                           layer.scaling, layer.window or 0, layer.act_code)
        return loop

    def _decode_layers(self, meta: StepAttention, x: torch.Tensor, ropes: dict,
                       dtype: torch.dtype) -> torch.Tensor | None:
        """The float32 residual stream ``x`` through every layer in one native call (``self.loop``)
        for a decode-only step (of metadata ``meta``) on the native one-call attention over pages of
        ``dtype`` (the model's) or int8; None where there is no loop or the step is not one (the
        Python loop then runs it)."""
        if self.loop is None or not NATIVE_DECODE_LOOP:
            return None
        if (meta.kernel != "native" or meta.prefills or meta.decode is None or meta.decode.kernel != "native"
                or meta.sliding is not None):
            return None
        pool = meta.pool
        rotate = pool.k_cache[0].dtype == torch.int8
        if not rotate and pool.k_cache[0].dtype != dtype:
            return None
        cos, sin = ropes[None]
        out = self.loop.run(x, cos, sin, pool.k_cache, pool.v_cache, pool.slot_mapping, pool.decode_pages,
                            meta.decode.lengths, meta.page_size, rotate)
        if out is None:  # the one-call attention does not take this model here (declined, nothing written)
            self.loop = None
        return out

    def rms(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        weight, eps, gemma = norm
        if x.dtype == torch.float32 and self.bf16 is not None:  # the float32 residual stream, normed into bf16
            return self.bf16.rms_norm(x, weight, eps, gemma)
        return self.k.rms_norm_f32w(x, weight, eps) if gemma else self.k.rms_norm(x, weight, eps)

    def linear(self, h: torch.Tensor, weight: tuple, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``h @ W`` (+ bias) in the model's dtype (acb's bf16 GEMMs: in ``dtype``), ``weight`` as
        :func:`describe` packed it."""
        if self.bf16 is not None:
            return self.bf16.linear(h, *weight, dtype=dtype)
        return torch.ops.mkldnn._linear_pointwise(h, *weight, "none", [], "")

    def _glu(self, h: torch.Tensor, layer: Layer) -> torch.Tensor:
        """act(gate) * up, the MLP's input to ``down``. acb's bf16 GEMMs compute it in one pass, gate
        and up float32 until the product is rounded (rounding them first cost SmolLM2 0.2 points of
        top-1 agreement with float32: benchmarks/bf16_sensitivity.py); else the GEMM, then ``glu``."""
        if self.bf16 is not None and layer.gate_up[1] % 32 == 0:
            packed, columns, bias = layer.gate_up
            return self.bf16.glu(h, packed, columns // 2, bias, layer.act_code, dtype=h.dtype)
        return self.k.glu(self.linear(h, layer.gate_up), layer.act_code)

    def __call__(self, context: ForwardContext, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask=None, use_cache: bool = False,
                 logits_to_keep: torch.Tensor | int | None = None) -> _Logits:
        meta = context.attention
        x = self.embed(input_ids[0])  # [T, hidden]
        total = x.shape[0]
        adapters = context.lora  # the step's LoRA rows (acb.model.lora.StepLora), or None
        if self.bf16 is None:
            ropes = self._ropes(x, position_ids)
            rows = padded_rows(total)  # oneDNN's GEMMs run on zero-padded rows (see acb.kernels.cpu_linear)
            x = pad_rows(x, rows)
        elif adapters is None:  # acb's bf16 GEMMs take any row count: a float32 residual stream, RoPE in float32
            rows, x = total, x.float()
            ropes = self._ropes(x, position_ids)
        else:  # a step with LoRA rows: their deltas are bf16, so is everything between the GEMMs
            rows = total
            ropes = self._ropes(x, position_ids)
        done = self._decode_layers(meta, x, ropes, torch.bfloat16) if adapters is None else None
        for i, layer in enumerate(self.layers if done is None else ()):
            cos, sin = ropes[layer.rope]
            if adapters is not None:  # the layer without the epilogues the LoRA deltas land inside
                x = self.lora_layer(meta, layer, i, x, rows, total, cos, sin, adapters)
                continue
            h = self.rms(x, layer.ln1)
            q, kk, v = self.linear(h, layer.qkv, x.dtype).split(layer.qkv_split, dim=1)  # column views
            a = self.attend(meta, layer, q, kk, v, total, cos, sin, rows)
            if layer.post_attn is None:
                x = self.add_projection(a, x, layer.o)
            else:  # Gemma: normed before the residual add, which then cannot be fused into the GEMM
                x = x + self.rms(self.projection(a, layer.o), layer.post_attn)
            h = self.rms(x, layer.ln2)
            m = self._glu(h, layer)
            if layer.post_mlp is None:
                x = self.add_projection(m, x, layer.down)
            else:
                x = x + self.rms(self.projection(m, layer.down), layer.post_mlp)
        x = x if done is None else done
        h = self.rms(kept_rows(x[:total], logits_to_keep), self.norm)
        # float32 logits from bf16 (the lm_head's bf16 output rounded them to steps of 0.125 at 16-32)
        logits = self.lm_head(h) if self.head is None else self.bf16.linear(h, *self.head, dtype=torch.float32)
        if self.final_softcap is not None:  # Gemma 2/3, in the logits' dtype
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return _Logits(logits.float().unsqueeze(0))

    def _ropes(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """{rotary type: (cos, sin)}, each [T, head_dim] contiguous, for the step's rows ``x``."""
        if self.rope_types:  # Gemma 3: one rotary embedding per layer type (local and global bases)
            ropes = {t: self.rotary(x.unsqueeze(0), position_ids, t) for t in self.rope_types}
        else:
            ropes = {None: self.rotary(x.unsqueeze(0), position_ids)}
        return {t: (cos[0].contiguous(), sin[0].contiguous()) for t, (cos, sin) in ropes.items()}

    def attend(self, meta: StepAttention, layer: Layer, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor,
               total: int, cos: torch.Tensor, sin: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The attention of one layer over its projections' first ``total`` rows (the
        rest is padding) in the step of ``meta``: q/k norms, RoPE in place, paged attention -> [rows, heads * d]
        (``rows`` >= ``total``, default ``total``: the rows after ``total`` zero), the buffer
        the next GEMM reads."""
        d = layer.head_dim
        if layer.q_norm is not None:  # Qwen3, Gemma 3: RMSNorm over each head, before RoPE
            q = self.rms(q.reshape(-1, d), layer.q_norm).view(q.shape[0], -1)
            kk = self.rms(kk.reshape(-1, d), layer.k_norm).view(kk.shape[0], -1)
        q, kk, v = q[:total], kk[:total], v[:total]  # views: the padding stays out of the cache
        if cos.dtype != q.dtype:  # acb's bf16 GEMMs: q/k/v came out float32, q/k normed (if so) into bf16
            q, kk = q.float(), kk.float()
        self.k.rope_(q, cos, sin, d)
        self.k.rope_(kk, cos, sin, d)
        if self.bf16 is not None and q.dtype == torch.float32:
            # rotated in float32 (float32 cos/sin), each rounded once for the bf16 attention and pages: RoPE
            # on bf16 with bf16 cos/sin moved 0.6 % of SmolLM2's next tokens (benchmarks/bf16_sensitivity.py)
            q, kk, v = q.to(torch.bfloat16), kk.to(torch.bfloat16), v.to(torch.bfloat16)
        rows = total if rows is None else rows
        out = q.new_empty(rows, layer.heads * d)
        if rows > total:
            out[total:].zero_()
        attention.attend(
            meta, layer.attn,
            q.view(total, layer.heads, d).transpose(0, 1).unsqueeze(0),
            kk.view(total, layer.kv_heads, d).transpose(0, 1).unsqueeze(0),
            v.view(total, layer.kv_heads, d).transpose(0, 1).unsqueeze(0),
            scaling=layer.scaling, sliding_window=layer.window, softcap=layer.softcap,
            into=out[:total].view(total, layer.heads, d), bf16_weights=self.bf16_weights,
        )
        return out

    def projection(self, h: torch.Tensor, weight: tuple) -> torch.Tensor:
        """``h @ W``; sharded, summed over the ranks."""
        out = self.linear(h, weight)
        if self.row_reduce is not None:
            self.row_reduce(out)
        return out

    def add_projection(self, h: torch.Tensor, x: torch.Tensor, weight: tuple) -> torch.Tensor:
        """``x + h @ W`` (one GEMM, the add fused); sharded, summed over the ranks, of
        which only rank 0 adds ``x``."""
        reduce = self.row_reduce
        first = reduce is None or reduce.rank == 0
        if self.bf16 is not None:  # in x's dtype: float32 (the residual stream), bf16 in LoRA steps
            out = self.bf16.linear(h, *weight, other=x if first else None, dtype=x.dtype)
        elif first:
            out = torch.ops.mkldnn._linear_pointwise.binary(h, x, *weight, "add")
        else:
            out = torch.ops.mkldnn._linear_pointwise(h, *weight, "none", [], "")
        if reduce is not None:
            reduce(out)
        return out


def native_bf16(enabled: bool = True):
    """acb's bf16 GEMM module (``acb/kernels/csrc/bf16_cpu.cpp``) where it is built with AVX-512 BF16
    (vdpbf16ps) or AVX2 (the weights widened to float32 as read), else None (oneDNN's prepacked bf16
    linears compute, with their bf16 outputs); ``enabled=False`` (``EngineConfig.cpu_bf16_gemm=False``,
    or ``ACB_CPU_BF16_GEMM=0`` through ``acb.core.defaults``) keeps to oneDNN's."""
    if not enabled:
        return None
    from ..kernels.cpu import bf16_kernels

    module = bf16_kernels()
    return module if module is not None and module.available() else None


def loop_kernels(forward: FusedForward):
    """The decode-attention module a DecodeLoop over ``forward``'s layers calls, where every layer is
    one the loops take whole (no Gemma norms, no q/k norms, no soft-capping, one rotary embedding,
    layer i reading cache i); else None."""
    from ..kernels.cpu import paged_decode_kernel

    if forward.rope_types:
        return None
    for i, layer in enumerate(forward.layers):
        if (layer.post_attn is not None or layer.post_mlp is not None or layer.q_norm is not None
                or layer.softcap is not None or layer.ln1[2] or layer.ln2[2]
                or getattr(layer.attn, "layer_idx", None) != i):
            return None
    return paged_decode_kernel()


def kept_rows(x: torch.Tensor, logits_to_keep: torch.Tensor | int | None) -> torch.Tensor:
    """The rows of ``x`` whose logits the step keeps."""
    if isinstance(logits_to_keep, int):  # transformers' convention: the last N rows, 0 = all
        return x[-logits_to_keep:] if logits_to_keep else x
    return x if logits_to_keep is None else x.index_select(0, logits_to_keep)
