"""int8 weights on the CPU (``EngineConfig(quantization="int8")``): W8A8 on AVX-512 VNNI, or on AVX2
(the same kernel's AVX2 form: both operands widened to int16, ``vpmaddwd``; the same int32 sums and
outputs).

Every linear layer of the decoder (the attention's and the MLP's projections) keeps its
weights as int8, symmetric, one scale per output channel and group of 64 input channels
(:data:`GROUP`); the ``lm_head`` and the embedding (one table when tied: SmolLM2, Gemma) stay
bfloat16 and run on acb's bf16 GEMM (:class:`Bf16Linear`). The activations going into each int8
GEMM are smoothed, rotated (:data:`ROTATION`) and quantized at run time per token and per the
same groups of 64 channels (``max|x| / 127`` over the group), and the GEMM runs in acb's own kernel
(``acb/kernels/int8_cpu.cpp``): byte dot products (``vpdpbusd``) accumulated in int32 within a
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

Why W8A8 and this kernel (measured 2026-12-01 on this project's 2-core AVX-512 VNNI
machine, best of 5 x 20 calls, load 1.9, per-64 groups; ``benchmarks/int8_gemm.py`` runs the
comparison), in GOPS on SmolLM2's shapes (rows x K x N):

    shape            acb int8   oneDNN int8   oneDNN int8 + row rescale   oneDNN bf16
    16 x 576 x 960      898         545               443                    511
    64 x 576 x 576     1137         838               718                    617
    64 x 1536 x 576    1308        1338              1197                    781
    1024 x 576 x 1536  1320        1808              1631                    942

- weight-only int8 with bf16 compute (``torch._weight_int8pack_mm``) ran at 50-270 GOPS,
  slower than oneDNN's prepacked bf16 at every row count: the weights are widened on
  every call and the arithmetic stays bf16's;
- oneDNN's int8 matmul through PyTorch (``onednn.qlinear_pointwise``) takes one scale for
  the whole activation tensor and one per output channel for the weight: per-token,
  per-group scales cannot be expressed, and its epilogues (SiLU times up, the residual add)
  then cannot be fused;
- per-token (not per-tensor) activation scales because one scale per step lets one
  outlier token flatten every other token's precision; and per group of channels within
  a token because one outlier channel does the same to the rest of its token. The groups
  cost the kernel a float flush per group (a fused multiply-subtract and a multiply-add
  per 8 dot-product steps).

The model is quantized in place (the dense weights are freed: that is the memory
saving); :class:`Int8Linear`, :class:`Bf16Linear` and :class:`Bf16Embedding` stand in for
the modules, so the model's own (transformers') forward also computes with the quantized
weights, and ``state_dict`` holds the packed tensors. ``Engine.reload_weights`` and the
weight-change detection keep working: acb's forward reads the modules' own tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import fused
from .fused import FusedForward, _Layer, _Logits, kept_rows

if TYPE_CHECKING:
    from ..attention.context import ForwardContext
    from ..attention.metadata import StepAttention

log = logging.getLogger("acb")

METHODS = ("int8",)

# Input channels per weight scale and per activation scale (the two must match: the kernel
# flushes its int32 sums once per group). SmolLM2-135M, 8,192 held-out tokens, lm_head bf16
# (benchmarks/int8_smoothing.py, int8_rotation.py): weights per channel / activations per 64
# 94.7 %; weights and activations per 32 95.9 %; with smoothing 97.4 %; rotated too 98.1 %; per 64,
# smoothed and rotated 97.7 %. The engine (benchmarks/quality.py, 24,000 tokens): per 32 97.81 %,
# per 64 97.53 % (97.51 / 97.22 % beside int8 KV pages). Groups of 32 cost the GEMM 6-18 % of its
# rate against 64 in a real-text prefill (one flush per 8 dot-product steps instead of 16), so 64.
GROUP = 64

# SmoothQuant's migration strength a: s_j = max|x_j|^a / max|w_j|^(1-a). On SmolLM2 (weights and
# activations per 32, lm_head bf16) a = 0.5: 97.4 % top-1, 0.7: 97.0 %, none: 95.9 %; per 64 and
# rotated (benchmarks/int8_rotation.py) 0.3: 97.23 %, 0.4: 97.67, 0.5: 97.67, 0.6: 97.63, 0.7: 97.55.
SMOOTHING = 0.5

# Each int8 GEMM's input is rotated before it is quantized (QuaRot-style, Ashkboos et al. 2024):
# after the norm and the smoothing, x <- x H, H the +-1 Walsh-Hadamard matrix over blocks of the
# largest power of two b dividing K (64 for SmolLM2's 576, 512 for its 1536: the kernel's
# ``hadamard_row``), and the weight's columns are rotated alike, W <- W H / b, before they are
# rounded (x H (W H / b)^T = x W^T: exact in real arithmetic). The rotation spreads the channels
# that still carry outliers after smoothing over their block, so a group's one scale fits its
# values better. SmolLM2, weights and activations per 32 and smoothed 0.5, lm_head bf16, 8,192
# held-out tokens (``benchmarks/int8_rotation.py``, fake quantization): 97.42 % top-1 without,
# 98.10 % with; without smoothing 97.30 %; one scale per token instead of groups 97.01 %.
ROTATION = True

CALIBRATION = Path(__file__).parent.parent / "data" / "calibration.txt"
CALIBRATION_WINDOW = 512  # tokens per calibration forward


def _kernels():
    from ..kernels.cpu import int8_kernels

    k = int8_kernels()
    return k if k is not None and k.available() else None


def activation_group(k: int) -> int:
    """Input channels per weight and activation scale for a GEMM input of width ``k``:
    :data:`GROUP` where it divides ``k``, else the largest of 32, 16, 8, 4 that does (``k`` is a
    multiple of 4)."""
    return next((g for g in (GROUP, 32, 16, 8, 4) if k % g == 0), k)


def quantize_weight(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N, K / group]): symmetric, one scale per output channel
    (row) and group of ``group`` input channels (default :func:`activation_group` of K)."""
    n, k = w.shape
    group = group or activation_group(k)
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(n, k // group, dtype=torch.float32)
    for i in range(0, n, 4096):  # in slices: never a float32 copy of a whole vocabulary
        rows = w[i: i + 4096].float().view(-1, k // group, group)
        s = rows.abs().amax(2) / 127
        scale[i: i + 4096] = s
        q[i: i + 4096] = torch.round(rows / s.clamp_min(torch.finfo(torch.float32).tiny)[:, :, None]) \
            .clamp_(-127, 127).view(-1, k)
    return q, scale


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> VNNI's layout [N/16, K/4, 16, 4] as unsigned bytes q + 128 (the kernel's
    operand order: vpdpbusd multiplies unsigned bytes, the weights, by signed ones, the activations)."""
    n, k = q.shape
    return (q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).to(torch.int16) + 128).to(torch.uint8).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack`: int8 [N, K]."""
    nb, k4 = packed.shape[:2]
    return (packed.permute(0, 2, 1, 3).reshape(nb * 16, k4 * 4).to(torch.int16) - 128).to(torch.int8)


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, groups] -> the kernel's [N/16, groups, 16]."""
    n, groups = scale.shape
    return scale.float().view(n // 16, 16, groups).permute(0, 2, 1).contiguous()


def unpack_scales(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_scales`: float32 [N, groups]."""
    nb, groups, _ = packed.shape
    return packed.permute(0, 2, 1).reshape(nb * 16, groups)


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (per output channel and group of ``group`` input
    channels) and int8 activations (per token and the same groups), computed by acb's VNNI
    kernel. ``weight``: packed uint8 (int8 + 128) [N/16, K/4, 16, 4]; ``weight_scale``: float32
    [N/16, K/group, 16]; ``bias``: float32 [N] or None; ``input_scale``: float32 [K] or None,
    the smoothing 1/s each input channel is multiplied by before it is quantized (the weight's
    columns were multiplied by s); ``rotated``: the input is then rotated by the Hadamard matrix H
    (:data:`ROTATION`; the weight was rounded as W H / b).

    Example::

        layer = Int8Linear.from_dense(torch.nn.Linear(64, 32))
        y = layer(torch.randn(4, 64))  # float32 in, float32 out
    """

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int | None = None, input_scale: torch.Tensor | None = None,
                 rotated: bool = False) -> None:
        super().__init__()
        self.rotated = bool(rotated)
        self.in_features = packed.shape[1] * 4
        # the packed rows beyond out_features (a vocabulary not a multiple of 16) are zeros
        self.out_features = out_features or packed.shape[0] * 16
        self.register_buffer("weight", packed)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)
        self.register_buffer("input_scale", input_scale)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  group: int | None = None, input_scale: torch.Tensor | None = None,
                  rotated: bool = False) -> Int8Linear:
        """From an int8 [N, K] and its float32 scales ([N, K / group], or [N]: one per channel);
        N is padded to a multiple of 16 with zero rows (their outputs are dropped), K must be a
        multiple of 4. ``group``: input channels per scale (default: as ``scale`` has them, else
        :func:`activation_group` of K). ``rotated``: the int8 weight is W H / b (see
        :func:`rounded`), so the inputs are rotated before they are quantized."""
        n, k = q.shape
        if k % 4:
            raise ValueError(f"EngineConfig.quantization='int8' needs linear layers whose input width is a multiple "
                             f"of 4, got [N, K] = {[n, k]}")
        if scale.dim() == 2 and group is None:
            group = k // scale.shape[1]
        group = group or activation_group(k)
        if k % group or group % 4:
            raise ValueError(f"an int8 group of {group} channels does not divide K = {k} in multiples of 4")
        scale = scale.float()
        if scale.dim() == 1:
            scale = scale[:, None].expand(n, k // group)
        if scale.shape != (n, k // group):
            raise ValueError(f"int8 scales of shape {list(scale.shape)} for a weight {[n, k]} in groups of {group}")
        pad = -n % 16
        if pad:
            q = torch.cat([q, q.new_zeros(pad, k)])
            scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
            if bias is not None:
                bias = torch.cat([bias.detach().float(), bias.new_zeros(pad, dtype=torch.float32)])
        return cls(pack(q), pack_scales(scale), None if bias is None else bias.detach().float().contiguous(), n,
                   None if input_scale is None else input_scale.float().contiguous(), rotated)

    @property
    def packed(self) -> tuple:
        """(packed, scales, input_scale, out_features, rotated): what :meth:`from_packed` takes
        back (acb.model.gguf_int8 caches it)."""
        return self.weight, self.weight_scale, self.input_scale, self.out_features, self.rotated

    @classmethod
    def from_packed(cls, packed: tuple, bias: torch.Tensor | None = None) -> Int8Linear:
        weight, scale, input_scale, n, rotated = packed
        if bias is not None:
            bias = torch.cat([bias.detach().float(), bias.new_zeros(weight.shape[0] * 16 - n, dtype=torch.float32)])
        return cls(weight, scale, bias, n, input_scale, rotated)

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, smoothing: torch.Tensor | None = None,
                    rotate: bool = ROTATION) -> Int8Linear:
        """A dense weight [N, K] quantized: its columns multiplied by ``smoothing`` (s, float32
        [K]; its inputs will be divided by it) and rotated (``rotate``), see :func:`rounded`."""
        return cls.from_rounded(*quantize_weight(rounded(w, smoothing, rotate)), bias, smoothing, rotate)

    @classmethod
    def from_rounded(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                     smoothing: torch.Tensor | None = None, rotate: bool = ROTATION) -> Int8Linear:
        """From the int8 rounding of ``rounded(w, smoothing, rotate)`` and its scales (made whole or
        in slices of rows): its inputs divided by ``smoothing`` and rotated alike."""
        return cls.from_int8(q, scale, bias, input_scale=None if smoothing is None else 1 / smoothing,
                             rotated=rotate)

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, smoothing: torch.Tensor | None = None,
                   rotate: bool = ROTATION) -> Int8Linear:
        """``linear`` quantized (:meth:`from_weight`)."""
        return cls.from_weight(linear.weight.detach(), linear.bias, smoothing, rotate)

    @property
    def group(self) -> int:
        """Input channels per weight and activation scale (what ``quantize_rows`` must be given)."""
        return group_of(self.args)

    @property
    def args(self) -> tuple:
        """The kernel's weight arguments: (packed, scales, bias)."""
        return self.weight, self.weight_scale, self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight the GEMM computes with, as float32 [N, K] (on inputs already multiplied by
        ``input_scale`` and rotated: :meth:`effective` is the layer's weight on its own inputs)."""
        n, group = self.out_features, self.group
        return unpack(self.weight)[:n].float() * unpack_scales(self.weight_scale)[:n].repeat_interleave(group, 1)

    def effective(self) -> torch.Tensor:
        """The layer's float32 weight [N, K] on its own inputs: :meth:`dequantize` rotated back
        (times H: (W H / b) H = W) and times ``input_scale``."""
        w = self.dequantize()
        if self.rotated:
            w = hadamard(w)
        return w if self.input_scale is None else w * self.input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = _kernels()
        dtype = x.dtype if x.dtype in fused.DTYPES else torch.float32
        rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
        xq = k.quantize_rows(rows, None, False, 1e-6, self.group, self.input_scale, self.rotated)
        out = k.linear(*xq, *self.args, None, dtype)[:, : self.out_features]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        smoothed = ", smoothed" if self.input_scale is not None else ""
        rotated = ", rotated" if self.rotated else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, int8 per {self.group}"
                f"{smoothed}{rotated}")


def rounded(w: torch.Tensor, smoothing: torch.Tensor | None = None, rotate: bool = ROTATION) -> torch.Tensor:
    """The float32 weight [N, K] that is rounded to int8: columns times ``smoothing`` (s [K]),
    then, with ``rotate``, times H / b (H the +-1 Walsh-Hadamard matrix over blocks of b, the
    largest power of two dividing K, as the kernel rotates the inputs: :data:`ROTATION`). Rows
    are independent: a GGUF tensor may pass in slices of rows."""
    w = w.float()
    if smoothing is not None:
        w = w * smoothing
    return hadamard(w) / (w.shape[1] & -w.shape[1]) if rotate else w


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ H``: the +-1 Walsh-Hadamard matrix (Sylvester's order, symmetric, H H = b I)
    over blocks of b, the largest power of two dividing K, by butterflies (what the kernel's
    ``hadamard_row`` computes on each input row), float32."""
    shape, b = x.shape, x.shape[-1] & -x.shape[-1]
    x = x.float().reshape(-1, b)
    h = 1
    while h < b:
        pairs = x.view(-1, b // (2 * h), 2, h)
        x = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]], 2).view(-1, b)
        h *= 2
    return x.view(shape)


def group_of(args: tuple) -> int:
    """Input channels per scale of a kernel weight tuple (packed, scales, bias)."""
    packed, scale = args[0], args[1]
    return packed.shape[1] * 4 // scale.shape[1]


class Bf16Linear(torch.nn.Module):
    """A bias-free linear layer (the ``lm_head``) with bfloat16 weights packed for acb's bf16 GEMM
    (``acb/kernels/bf16_cpu.cpp``: [ceil(N/16), K/2, 16, 2]), float32 logits out. Where the CPU
    lacks AVX-512 BF16 the same kernel widens the weights to float32 as it reads them (AVX2), and
    without either PyTorch's float32 matmul computes over slices of the weight (correct, slower)."""

    def __init__(self, packed: torch.Tensor, out_features: int) -> None:
        super().__init__()
        self.in_features = packed.shape[1] * 2
        self.out_features = out_features
        self.register_buffer("weight", packed)
        self.bias = None

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> Bf16Linear:
        """From a [N, K] weight of any float dtype (rounded to bf16 in slices of rows)."""
        n, k = w.shape
        if k % 2:
            raise ValueError(f"a bf16 lm_head needs an even input width, got {k}")
        nb = -(-n // 16)
        packed = torch.zeros(nb * 16, k, dtype=torch.bfloat16)
        for i in range(0, n, 4096):
            packed[i: min(i + 4096, n)] = w[i: i + 4096].to(torch.bfloat16)
        return cls(packed.view(nb, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous(), n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """bf16 [T, K]: the weight's rows ``ids`` (the tied embedding's lookup)."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"token id out of range [0, {self.out_features})")
        return self.weight[ids // 16, :, ids % 16, :].reshape(ids.shape[0], self.in_features)

    def dense(self) -> torch.Tensor:
        """bf16 [N, K]: the weight unpacked."""
        nb = self.weight.shape[0]
        return self.weight.permute(0, 2, 1, 3).reshape(nb * 16, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        bf16 = fused.native_bf16()
        if bf16 is not None:
            out = bf16.linear(rows, self.weight, self.out_features, None, None, torch.float32)
        else:  # float32 sums (a bf16 matmul would round the logits), a slice of the weight at a time
            x = rows.float()
            out = torch.cat([x @ part.float().T for part in self.dense().split(4096)], dim=1)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16"


class Bf16Embedding(torch.nn.Module):
    """An embedding whose rows are read from a :class:`Bf16Linear`'s weight (the tied
    ``lm_head``'s, or its own), times ``scale`` (Gemma's ``sqrt(hidden)``, rounded to the
    model's dtype as its module rounds it), in ``dtype``."""

    def __init__(self, table: Bf16Linear, dtype: torch.dtype, scale: float = 1.0) -> None:
        super().__init__()
        self.table = table  # a submodule: shared with lm_head when tied (one copy of the bytes)
        self.num_embeddings = table.out_features
        self.embedding_dim = table.in_features
        self.scale = scale
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.table.rows(ids.reshape(-1)).to(self.dtype)
        if self.scale != 1.0:
            out = out * torch.tensor(self.scale, dtype=self.dtype)
        return out.view(*ids.shape, self.embedding_dim)


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds acb's int8 layers (:func:`quantize_` ran on it)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    return isinstance(getattr(getattr(layers[0], "self_attn", None), "q_proj", None), Int8Linear)


def _projections(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
            (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]


# The projections that share one input (and so one smoothing): the first of each names the group
_SHARED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
           ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


def _input_groups(model: torch.nn.Module):
    """(weight-name prefix, owner module, projection names) of every group of projections that
    share one input, layer by layer; the group's key is its first projection's weight name."""
    for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        for owner, names in _SHARED:
            yield f"model.layers.{i}.{owner}.", getattr(layer, owner), names


def why_not(model: torch.nn.Module) -> str | None:
    """Why ``model`` (dense, as loaded) cannot run with int8 weights here, or None."""
    if _kernels() is None:
        return "acb's int8 kernels need a CPU with AVX-512 VNNI or AVX2 and a C++ compiler (they did not build here)"
    from ..kernels.cpu import fused_kernels

    if fused_kernels() is None:
        return "acb's native CPU kernels did not build"
    reason = fused.unsupported(model)
    if reason:
        return reason
    layers = model.model.layers[: model.config.num_hidden_layers]
    linears = [getattr(owner, name) for layer in layers for owner, name in _projections(layer)]
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


def calibration_ids(tokenizer, vocab_size: int, tokens: int = 4096) -> list[int]:
    """The token ids the smoothing is calibrated on: :data:`CALIBRATION` tokenized, or (no
    tokenizer) a fixed pseudo-random draw from the vocabulary, said in the log."""
    why = "no tokenizer to read it with"
    if tokenizer is not None:
        try:
            ids = tokenizer(CALIBRATION.read_text())["input_ids"]
        except Exception as e:  # a tokenizer-like object that cannot read plain text: calibrate without it
            ids, why = [], f"the tokenizer could not read it: {type(e).__name__}: {e}"
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        ids = [i for i in ids if 0 <= i < vocab_size]
        if len(ids) >= CALIBRATION_WINDOW:
            return ids[:tokens]
        if ids:
            why = f"it reads as {len(ids)} tokens of the model's vocabulary"
    log.warning("acb: int8 smoothing calibrated on random token ids instead of %s (%s)", CALIBRATION.name, why)
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (min(tokens, 2048),), generator=g).tolist()


def input_maxima(model: torch.nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """{projection group's first weight name: max |input| per channel (float32 [K])} over the
    model's own forward on ``ids`` in windows of :data:`CALIBRATION_WINDOW` tokens."""
    maxima: dict[str, torch.Tensor] = {}
    hooks = []

    def record(name):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()
            maxima[name] = torch.maximum(maxima[name], x) if name in maxima else x
        return hook

    for prefix, owner, names in _input_groups(model):
        hooks.append(getattr(owner, names[0]).register_forward_pre_hook(record(f"{prefix}{names[0]}.weight")))
    try:
        with torch.inference_mode():
            for start in range(0, max(len(ids) - CALIBRATION_WINDOW, 0) + 1, CALIBRATION_WINDOW):
                model(torch.tensor([ids[start: start + CALIBRATION_WINDOW]]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return maxima


def _weight_of(module: torch.nn.Module) -> torch.Tensor:
    """A projection's float32 weight on its own inputs (an Int8Linear's dequantized)."""
    if isinstance(module, Int8Linear):
        return module.effective()
    return module.weight.detach().float()


def smoothing_factors(model: torch.nn.Module, maxima: dict[str, torch.Tensor],
                      alpha: float = SMOOTHING) -> dict[str, torch.Tensor]:
    """{weight name: s (float32 [K])} for every projection: s_j = max|x_j|^a / max|w_j|^(1-a)
    over the group sharing the input (see the module's docstring); the group's projections
    share one tensor."""
    factors: dict[str, torch.Tensor] = {}
    for prefix, owner, names in _input_groups(model):
        key = f"{prefix}{names[0]}.weight"
        if key not in maxima:
            continue
        wmax = torch.stack([_weight_of(getattr(owner, n)).abs().amax(0) for n in names]).amax(0)
        s = (maxima[key].clamp_min(1e-5) ** alpha / wmax.clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)
        for n in names:
            factors[f"{prefix}{n}.weight"] = s
    return factors


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
        scale = _embed_scale(base.embed_tokens, dtype)
        model.lm_head = lm_head
        base.embed_tokens = Bf16Embedding(table, dtype, scale)
    from ..kernels.cpu_linear import trim_heap

    trim_heap()
    smoothed = any(p.input_scale is not None for p in model.modules() if isinstance(p, Int8Linear))
    rotated = any(p.rotated for p in model.modules() if isinstance(p, Int8Linear))
    log.info("acb: int8 weights and activations (per token and %d channels%s%s), bf16 lm_head and embedding: %s",
             GROUP, ", smoothed" if smoothed else "", ", Hadamard-rotated" if rotated else "", weight_summary(model))


def _embed_scale(embed: torch.nn.Module, dtype: torch.dtype) -> float:
    """The factor the embedding module multiplies its rows by (Gemma: sqrt(hidden) in the model's dtype)."""
    scale = getattr(embed, "embed_scale", None)
    if scale is None:
        return 1.0
    return float(torch.as_tensor(scale).to(dtype))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (shared tensors counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def weight_summary(model: torch.nn.Module) -> str:
    return f"{weight_bytes(model) / 2**20:.1f} MiB of weights"


def why_not_forward(model: torch.nn.Module, packed, kernels) -> str | None:
    """Why :class:`Int8Forward` cannot run ``model`` (already quantized) now, or None."""
    if kernels is None or _kernels() is None:
        return "the native CPU kernels are not built"
    if not isinstance(model.model.embed_tokens, Bf16Embedding) or not isinstance(model.lm_head, Bf16Linear):
        return "the embedding or the lm_head is not acb's bf16 one"
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        if any(not isinstance(getattr(owner, name), Int8Linear) for owner, name in _projections(layer)):
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

    def __init__(self, model: torch.nn.Module, layers: list[_Layer], kernels, qkv: list, smooth: list,
                 rotated: list) -> None:
        super().__init__(model, layers, kernels)
        self.q8 = _kernels()
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
        layers = fused.describe(model, lambda m: m.args)
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

    def _quantized(self, x: torch.Tensor, w: tuple, norm: fused.Norm | None = None,
                   mult: torch.Tensor | None = None, rotate: bool = False) -> tuple[torch.Tensor, ...]:
        """x's rows quantized in the groups weight ``w`` takes: RMS-normed first with ``norm``,
        then multiplied by ``mult`` (the smoothing), then rotated (``rotate``), in one pass."""
        weight, eps, gemma = norm or (None, 1e-6, False)
        return self.q8.quantize_rows(x, weight, gemma, eps, group_of(w), mult, rotate)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of the kept rows ``x``: the final norm into bf16, the bf16 lm_head."""
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


def prepare(model: torch.nn.Module, config, tokenizer=None) -> None:
    """The engine's hook: check that ``config.quantization`` can run where ``model`` is,
    and quantize the model in place (once: a model already quantized is taken as it is;
    ``tokenizer`` reads the smoothing's calibration text). ValueError naming
    ``EngineConfig.quantization`` otherwise. A model that already holds int8 layers (an
    earlier engine quantized this model object, or ``acb.model.loading.load(quantization="int8")``)
    is checked as if ``quantization="int8"`` were set: it runs nowhere else."""
    if config.quantization is None:
        if not is_quantized(model):
            return
        try:
            config = dataclasses.replace(config, quantization="int8")
        except ValueError as e:
            raise ValueError(f"the model holds acb's int8 layers (quantized in place by an earlier engine, or "
                             f"loaded with quantization='int8'), so it runs only where int8 can: {e}") from None
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ValueError(f"EngineConfig.quantization='int8' runs on the CPU only (acb's VNNI kernels); the model is "
                         f"on {param.device}")
    if param.dtype not in fused.DTYPES:
        raise ValueError(f"EngineConfig.quantization='int8' runs with float32 or bfloat16 activations; the model's "
                         f"other weights are {param.dtype}")
    if is_quantized(model):
        reason = why_not_forward(model, True, True)
        if reason:
            raise ValueError(f"EngineConfig.quantization='int8' cannot run this model: {reason}")
        return
    quantize_(model, tokenizer=tokenizer)
