"""acb's int8 and bf16 weight formats (``EngineConfig(quantization="int8")``; the method is
:mod:`acb.model.quantization`'s docstring): int8 weights in groups of :data:`GROUP` input channels with
their scales packed for the kernel, the Hadamard rotation, the modules that stand in for the model's
linears, lm_head and embedding (:class:`Int8Linear`, :class:`Bf16Linear`, :class:`Bf16Embedding`),
and the weight accounting."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from . import fused, fused_layers

if TYPE_CHECKING:
    pass


log = logging.getLogger("acb")

# Input channels per weight scale and per activation scale (the two must match: the kernel
# flushes its int32 sums once per group). SmolLM2-135M, 8,192 held-out tokens, lm_head bf16
# (benchmarks/int8_smoothing.py, int8_rotation.py): weights per channel / activations per 64
# 94.7 %; weights and activations per 32 95.9 %; with smoothing 97.4 %; rotated too 98.1 %; per 64,
# smoothed and rotated 97.7 %. The engine (benchmarks/quality.py, 24,000 tokens): per 32 97.81 %,
# per 64 97.53 % (97.51 / 97.22 % beside int8 KV pages). Groups of 32 cost the GEMM 6-18 % of its
# rate against 64 in a real-text prefill (one flush per 8 dot-product steps instead of 16), so 64.
GROUP = 64

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


def native_kernels():
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

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [T, K]: rows ``ids`` widened (a quantized table's lookup: a GGUF file's Q8_0 embedding)."""
        check_ids(ids, self.out_features)
        b, c = ids // 16, ids % 16
        q = self.weight[b, :, c, :].reshape(ids.shape[0], -1).to(torch.int16) - 128
        s = self.weight_scale[b, :, c]  # [T, groups]
        return s.repeat_interleave(self.in_features // s.shape[1], 1) * q.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = native_kernels()
        dtype = x.dtype if x.dtype in fused_layers.DTYPES else torch.float32
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


def check_ids(ids: torch.Tensor, rows: int) -> None:
    """IndexError where a token id is outside a table of ``rows`` rows."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise IndexError(f"token id out of range [0, {rows})")


def group_of(args: tuple) -> int:
    """Input channels per scale of a kernel weight tuple (packed, scales, bias)."""
    packed, scale = args[0], args[1]
    return packed.shape[1] * 4 // scale.shape[1]


class Bf16Linear(torch.nn.Module):
    """A bias-free linear layer (the ``lm_head``) with bfloat16 weights packed for acb's bf16 GEMM
    (``acb/kernels/csrc/bf16_cpu.cpp``: [ceil(N/16), K/2, 16, 2]), float32 logits out. Where the CPU
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
        check_ids(ids, self.out_features)
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


class QuantEmbedding(Bf16Embedding):
    """A :class:`Bf16Embedding` whose rows are widened from a quantized table (the tied lm_head's, or its
    own: an :class:`Int8Linear` of Q8_0 or an ``acb.model.gguf_native.GgufLinear``) as tokens are looked up."""


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds acb's int8 layers (:func:`quantize_` ran on it)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    return isinstance(getattr(getattr(layers[0], "self_attn", None), "q_proj", None), Int8Linear)


def quantization_of(model: torch.nn.Module) -> str:
    """``EngineConfig.quantization``'s value for the model's weights: "gguf" (a GGUF file at its own
    widths, :mod:`acb.model.gguf_native`), "int8" (acb's int8 layers) or "" (dense)."""
    if not is_quantized(model):
        return ""
    return "gguf" if isinstance(model.model.embed_tokens, QuantEmbedding) else "int8"


def embed_scale(embed: torch.nn.Module, dtype: torch.dtype) -> float:
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
