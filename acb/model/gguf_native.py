"""A GGUF file run at its own widths (``quantization="gguf"``): its 4-6 bit blocks stay 4-6 bit.

``acb.model.loading`` otherwise dequantizes a GGUF file to float32 (and ``quantization="int8"``
requantizes it to acb's int8 groups). Here each block-quantized tensor is decoded from the file's bytes
into unsigned codes and one scale and offset per output channel and block, with no float copy of the
weight at any point, and packed for acb's low-bit kernels (``acb/kernels/csrc/int8_cpu.cpp``, "Low-bit
weights"): the codes of ``Q4_0``/``Q4_1``/``Q4_K`` as nibbles (half a byte a weight, as in the file),
those of ``Q5_0``/``Q5_1``/``Q5_K`` in 5 bits (a nibble and a bit), those of ``Q6_K`` as bytes; ``Q8_0``
(the embedding and lm_head of both real models here) is exactly acb's int8 format in groups of 32
(:class:`~acb.model.int8_weights.Int8Linear`,
no smoothing, no rotation). A tensor of another quantized type is dequantized and requantized to int8
in groups of 32, said once in the log. Norms and biases are read in the model's dtype.

Each GEMM's input is quantized per token and per the weight's block (32 channels; 16 for ``Q6_K``)
to signed bytes, as llama.cpp quantizes activations to ``Q8_0``/``Q8_K`` for its dot products; the
sums run in integers within a block and in float32 across blocks. Widened, every weight equals the
``gguf`` package's dequantization bit for bit (:meth:`GgufLinear.dequantize`; a test checks each type).

The model then runs on :class:`acb.model.int8_forward.Int8Forward` (the same fused forward, its GEMM
calls dispatching on the weight's format), its lm_head included: a tied embedding is read once, its
rows widened as tokens are looked up (:class:`QuantEmbedding`).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from . import gguf_reading
from .int8_weights import Int8Linear, QuantEmbedding, check_ids, native_kernels, pack_scales, weight_summary

log = logging.getLogger("acb")

# GGUF block types with a native kernel here: (bits, group, zero): w = d (q - zero) - m
NATIVE = {"Q4_0": (4, 32, 8), "Q4_1": (4, 32, 0), "Q4_K": (4, 32, 0), "Q5_0": (5, 32, 16), "Q5_1": (5, 32, 0),
          "Q5_K": (5, 32, 0), "Q6_K": (6, 16, 32), "Q8_0": (8, 32, 0)}
# types whose scales and offsets are the file's float16 values: kept as float16 (the K-quants' are
# products of a float16 and a 6- or 8-bit integer, which float16 cannot hold: float32)
HALF_SCALES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")


def _f16(raw: np.ndarray) -> np.ndarray:
    """float32 of little-endian float16 pairs of bytes [..., 2]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles, then the high ones (GGUF's Q4_0/Q4_1/Q5 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode(kind: str, data: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes uint8 [N, K], d float32 [N, K/G], m float32 [N, K/G]) of a GGUF tensor's bytes ``data``
    [N, row bytes] of block type ``kind`` (:data:`NATIVE`), such that the weight is
    ``d (codes - zero) - m`` group by group (``zero`` and ``G`` from :data:`NATIVE`), every product and
    difference as the ``gguf`` package computes them."""
    n = data.shape[0]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[kind]
        b = data.reshape(n, k // 32, size)
        d = _f16(b[..., 0:2])
        m = np.zeros_like(d)
        if kind == "Q8_0":
            return b[..., 2:].view(np.int8).reshape(n, k).copy().view(np.uint8), d, m
        at = 2
        if kind in ("Q4_1", "Q5_1"):
            m = -_f16(b[..., 2:4])  # w = d q + m
            at = 4
        if kind in ("Q5_0", "Q5_1"):
            qh = np.ascontiguousarray(b[..., at: at + 4]).view(np.uint32)[..., 0]
            at += 4
            high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
            codes = _nibbles(b[..., at: at + 16]) | high
        else:
            codes = _nibbles(b[..., at: at + 16])
        return codes.reshape(n, k), d, m
    if kind in ("Q4_K", "Q5_K"):
        size = 144 if kind == "Q4_K" else 176
        b = data.reshape(n, k // 256, size)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        s = b[..., 4:16].reshape(n, k // 256, 3, 4)
        lo, hi, mix = s[:, :, 0], s[:, :, 1], s[:, :, 2]
        sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
        mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
        scale = (d[..., None] * sc).reshape(n, k // 32)
        offset = (dmin[..., None] * mn).reshape(n, k // 32)
        if kind == "Q4_K":
            qs = b[..., 16:144].reshape(n, k // 256, 4, 32)
            codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [n, blocks, 4 chunks, 2 halves, 32]
        else:
            qh = b[..., 16:48]  # [n, blocks, 32]: bit j of byte l is the high bit of sub-block j, element l
            qs = b[..., 48:176].reshape(n, k // 256, 4, 32)
            low = np.stack([qs & 0x0F, qs >> 4], axis=3)
            high = ((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1).reshape(
                n, k // 256, 4, 2, 32)
            codes = low | (high << 4)
        return codes.reshape(n, k), scale, offset
    if kind == "Q6_K":
        b = data.reshape(n, k // 256, 210)
        ql = b[..., 0:128].reshape(n, k // 256, 2, 64)
        qh = b[..., 128:192].reshape(n, k // 256, 2, 32)
        scales = b[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[..., 208:210])
        low = np.stack([ql & 0x0F, ql >> 4], axis=3).reshape(n, k // 256, 2, 4, 32)  # [.., half, quarter, 32]
        high = (qh[:, :, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, None, :, None]) & 3
        codes = (low | (high << 4)).reshape(n, k)
        return codes, (d[..., None] * scales).reshape(n, k // 16), np.zeros((n, k // 16), np.float32)
    raise ValueError(f"no native kernel for GGUF type {kind}")


class GgufLinear(Int8Linear):
    """A linear layer with a GGUF file's low-bit weights (``quantization="gguf"``): unsigned codes
    (``bits`` wide, packed as nibbles or bytes for ``int8_cpu.cpp``'s low-bit GEMM) with a scale ``d``
    and an offset per output channel and block of ``group`` input channels; ``kind``: the GGUF type.
    ``weight_scale`` [N/16, K/group, 32]: 16 scales, then 16 offsets ``c = (d zero + m) / 128`` in float32,
    or (:data:`HALF_SCALES`) the file's float16 scales and offsets ``128 c`` as they are."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int | None, kind: str) -> None:
        super().__init__(packed, scale, bias, out_features)
        self.kind = kind
        self.bits, _, self.zero = NATIVE[kind]

    @classmethod
    def from_codes(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: str,
                   bias: torch.Tensor | None = None) -> GgufLinear:
        """From :func:`decode`'s codes [N, K], scales and offsets [N, K/G] of GGUF type ``kind``."""
        bits, group, zero = NATIVE[kind]
        n, k = codes.shape
        pad = -n % 16
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad, k)])
            d, m = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (d, m))
            if bias is not None:
                bias = torch.cat([bias.detach().float(), bias.new_zeros(pad, dtype=torch.float32)])
        blocked = codes.view(-1, 16, k // 4, 4).permute(0, 2, 1, 3)  # [N/16, K/4, 16, 4]
        if bits <= 4:
            packed = (blocked[:, :, :8] | (blocked[:, :, 8:] << 4)).contiguous()
        elif bits == 5:
            packed = _pack5(blocked)
        else:
            packed = blocked.contiguous()
        offset = d * zero + m  # 128 c
        scale = torch.cat([pack_scales(d), pack_scales(offset)], dim=2)
        half = scale.half()
        if kind in HALF_SCALES and torch.equal(half.float(), scale):  # the file's float16 values, exactly
            scale = half
        else:
            scale[:, :, 16:] /= 128
        return cls(packed, scale.contiguous(), None if bias is None else bias.detach().float().contiguous(), n, kind)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [N, K], d, c float32 [N, K/G]) unpacked."""
        nb, k4 = self.weight.shape[:2]
        w = _blocked(self.weight, self.bits)
        codes = w.permute(0, 2, 1, 3).reshape(nb * 16, k4 * 4)[: self.out_features]
        s = self.weight_scale.float()
        if s.dtype != self.weight_scale.dtype:
            s[:, :, 16:] /= 128  # float16 offsets hold 128 c
        d = s[:, :, :16].permute(0, 2, 1).reshape(nb * 16, -1)[: self.out_features]
        c = s[:, :, 16:].permute(0, 2, 1).reshape(nb * 16, -1)[: self.out_features]
        return codes, d, c

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: each weight as the ``gguf`` package dequantizes it, bit for bit."""
        codes, d, c = self.codes()
        group = self.group
        d, c = d.repeat_interleave(group, 1), c.repeat_interleave(group, 1)
        if self.zero:  # w = d (q - zero): no offset beyond the zero in these types
            return d * (codes.float() - self.zero)
        return d * codes.float() - c * 128

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [T, K]: rows ``ids`` widened (a table's lookup)."""
        return _rows(self, ids)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} per {self.group}"


def _pack5(blocked: torch.Tensor) -> torch.Tensor:
    """5-bit codes [N/16, K/4, 16, 4] -> the kernel's layout [N/16, K/4, 10, 4]: per 4 k steps their low
    nibbles as the 4-bit layout has them (4 x 32 bytes), then 32 bytes of fifth bits (bit 2i of byte j: the
    fifth bit of byte j of step i's first 8 columns, bit 2i + 1: of its last 8)."""
    nb, k4 = blocked.shape[:2]
    nibbles = ((blocked[:, :, :8] & 0x0F) | ((blocked[:, :, 8:] & 0x0F) << 4)).reshape(nb, k4 // 4, 4, 32)
    lo = (blocked[:, :, :8] >> 4).reshape(nb, k4 // 4, 4, 32)
    hi = (blocked[:, :, 8:] >> 4).reshape(nb, k4 // 4, 4, 32)
    fifth = torch.zeros(nb, k4 // 4, 32, dtype=torch.uint8)
    for i in range(4):
        fifth |= (lo[:, :, i] << (2 * i)) | (hi[:, :, i] << (2 * i + 1))
    return torch.cat([nibbles.reshape(nb, k4 // 4, 128), fifth], dim=2).reshape(nb, k4, 10, 4).contiguous()


def _blocked(w: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes of packed 16-column blocks ``w`` [B, K/4, *, 4] as bytes [B, K/4, 16, 4]."""
    if bits <= 4:
        return torch.cat([w & 0x0F, w >> 4], dim=2)
    if bits == 5:
        nb, k4 = w.shape[:2]
        quads = w.reshape(nb, k4 // 4, 160)
        nibbles = quads[:, :, :128].reshape(nb, k4 // 4, 4, 32)
        fifth = quads[:, :, 128:]
        lo = torch.stack([(fifth >> (2 * i)) & 1 for i in range(4)], dim=2) << 4  # [nb, k4/4, 4, 32]
        hi = torch.stack([(fifth >> (2 * i + 1)) & 1 for i in range(4)], dim=2) << 4
        codes = torch.cat([(nibbles & 0x0F) | lo, (nibbles >> 4) | hi], dim=3)  # [nb, k4/4, 4, 64]
        return codes.reshape(nb, k4, 16, 4)
    return w


def _rows(table: GgufLinear, ids: torch.Tensor) -> torch.Tensor:
    check_ids(ids, table.out_features)
    b, c = ids // 16, ids % 16
    q = _blocked(table.weight[b], table.bits)[torch.arange(ids.shape[0]), :, c, :]  # [T, K/4, 4]
    q = q.reshape(ids.shape[0], -1)
    s = table.weight_scale
    group = table.group
    d = s[b, :, c].float().repeat_interleave(group, 1)
    if table.zero:
        return d * (q.float() - table.zero)
    offset = s[b, :, 16 + c].float().repeat_interleave(group, 1)
    return d * q.float() - (offset if s.dtype == torch.float16 else offset * 128)


def _module(kind: str, data: np.ndarray, k: int, rows: np.ndarray | None, bias: torch.Tensor | None) -> Int8Linear:
    """The kernel module of one GGUF tensor (rows reordered by ``rows`` where a processor permutes them)."""
    codes, d, m = decode(kind, data, k)
    if rows is not None:
        codes, d, m = codes[rows], d[rows], m[rows]
    codes, d, m = (torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, d, m))
    if kind == "Q8_0":
        return Int8Linear.from_int8(codes.view(torch.int8), d, bias, group=32)
    return GgufLinear.from_codes(codes, d, m, kind, bias)


def _joined(parts: list[Int8Linear]) -> list[Int8Linear]:
    """q, k, v in one buffer each (one GEMM computes all three) where they share a format; else as they are."""
    first = parts[0]
    same = all(type(p) is type(first) and getattr(p, "kind", None) == getattr(first, "kind", None)
               and p.weight.shape[1:] == first.weight.shape[1:] and p.out_features % 16 == 0 for p in parts)
    biased = [p.bias is not None for p in parts]
    if not same or (any(biased) and not all(biased)):
        return parts
    weight = torch.cat([p.weight for p in parts])
    scale = torch.cat([p.weight_scale for p in parts])
    bias = torch.cat([p.bias for p in parts]) if all(biased) else None
    out, start = [], 0
    for p in parts:
        n = p.out_features
        w, s = weight[start // 16: (start + n) // 16], scale[start // 16: (start + n) // 16]
        b = None if bias is None else bias[start: start + n]
        out.append(GgufLinear(w, s, b, n, p.kind) if isinstance(p, GgufLinear) else Int8Linear(w, s, b, n))
        start += n
    return out


FORMAT = 3  # the saved parts' layout (bump it when the packing changes)


def load(folder: str, gguf_file: str, dtype: torch.dtype):
    """(model, tokenizer) of a GGUF file with its quantized tensors at their own widths (see the
    module's docstring), the rest in ``dtype``. The first load decodes the file (SmolLM2-135M: ~4 s,
    Gemma 3 270M ~16 s on a 2-core AVX2 EPYC; the header parsed once: ``acb.model.gguf_reading``) and saves the packed
    weights, config and tokenizer under ``acb.model.files.cache_dir()/gguf``; later loads read those.
    ValueError naming ``EngineConfig.quantization`` where it cannot run here (no kernels, an
    architecture acb's fused forward does not take)."""
    with gguf_reading.parsed_once():  # the file's header parsed once, not three times
        return _load(folder, gguf_file, dtype)


def _load(folder: str, gguf_file: str, dtype: torch.dtype):
    import hashlib

    from transformers import AutoConfig, AutoTokenizer

    from . import int8_cache
    from .files import cache_dir, name_added_tokens

    path = os.path.join(folder, gguf_file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if native_kernels() is None:
        raise ValueError("EngineConfig.quantization='gguf' needs acb's native CPU kernels (AVX2 and FMA, and a C++ "
                         "compiler); they did not build here")
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT}".encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / f"{os.path.splitext(gguf_file)[0]}-{key}"
    parts = int8_cache.read(target)
    if parts is not None:
        name_added_tokens(target)
        config, tokenizer = AutoConfig.from_pretrained(target), AutoTokenizer.from_pretrained(target)
    else:
        log.info("acb: reading %s at its own widths (first load only; saved in %s)", gguf_file, target)
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
        except ValueError as e:
            raise ValueError(f"EngineConfig.quantization='gguf': {gguf_file}'s architecture cannot be read ({e})") \
                from None
        _check(config, dtype, gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        parts = _read(path, int8_cache.skeleton(config, dtype), config)
        try:
            int8_cache.save(target, config, tokenizer, parts)
        except OSError as e:
            log.warning("acb: %s's packed weights could not be saved in %s (%s); the next load reads the file "
                        "again", gguf_file, target, e)
    _check(config, dtype, gguf_file)
    model = build(config, *parts, dtype, gguf_file)
    log.info("acb: %s at its own widths (%s): %s", gguf_file, ", ".join(
        f"{k} x{v}" for k, v in sorted(_kinds(model).items())), weight_summary(model))
    return model, tokenizer


def _check(config, dtype: torch.dtype, gguf_file: str) -> None:
    from . import int8_cache, quantization

    reason = quantization.why_not(int8_cache.skeleton(config, dtype))
    if reason:
        raise ValueError(f"EngineConfig.quantization='gguf' cannot run {gguf_file} ({config.model_type}) here: "
                         f"{reason}")


def _read(path: str, model: torch.nn.Module, config) -> tuple[dict, dict]:
    """({name: float32 tensor} of the tensors kept dense (norms, biases), {weight name: (kind, packed,
    scales, out_features)} of the quantized ones, kind a GGUF type or "int8"), one tensor at a time."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    from . import int8_cache
    from .gguf_int8 import processed
    from .int8_weights import quantize_weight

    reader = gguf_reading.reader(path)
    arch = read_field(reader, "general.architecture")[0]
    settings = config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=settings)
    names = get_gguf_hf_weights_map(model, processor)
    targets = int8_cache.int8_targets(model)
    dense, weights, widened = {}, {}, set()
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        kind = tensor.tensor_type.name
        if hf_name in targets and len(tensor.shape) == 2:
            n, k = int(tensor.shape[1]), int(tensor.shape[0])
            rows = _row_order(processor, tensor.name, names, settings, n)
            if kind in NATIVE and (k % 256 == 0 or not kind.endswith("_K")):
                module = _module(kind, tensor.data, k, rows, None)
            else:  # no kernel for this type: its weight dequantized and requantized to int8 per 32
                widened.add(kind)
                w = torch.from_numpy(np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type),
                                                          dtype=np.float32).reshape(n, k))
                if rows is not None:
                    w = w[torch.from_numpy(rows)]
                module = Int8Linear.from_int8(*quantize_weight(w, 32), group=32)
            weights[hf_name] = (getattr(module, "kind", "int8"), module.weight, module.weight_scale,
                                module.out_features)
            continue
        done = processed(processor, tensor.name, dequantize(tensor.data, tensor.tensor_type), names, settings)
        if done is not None:
            dense[done[0]] = torch.from_numpy(np.array(done[1], dtype=np.float32))
    for kind in sorted(widened):
        log.info("acb: %s has %s tensors, which have no native kernel here: they run as int8 per 32 channels",
                 os.path.basename(path), kind)
    return dense, weights


def build(config, dense: dict, weights: dict, dtype: torch.dtype, source: str) -> torch.nn.Module:
    """The model from :func:`_read`'s parts: the skeleton's norms and biases set, its projections,
    lm_head and embedding replaced by the kernel modules (q/k/v joined where they share a format)."""
    from . import int8_cache
    from .int8_weights import embed_scale

    model = int8_cache.skeleton(config, dtype)
    weights = dict(weights)
    with torch.no_grad():
        for name, value in dense.items():
            int8_cache.set_parameter(model, name, value.to(dtype), source)

        def module(name: str, linear) -> Int8Linear:
            if name not in weights:
                raise ValueError(f"{source} lacks the tensor {name}")
            kind, packed, scale, n = weights.pop(name)
            bias = None if linear is None else linear.bias
            if bias is not None and bias.is_meta:
                raise ValueError(f"{source} lacks the tensor {name.removesuffix('weight')}bias")
            if bias is not None:
                bias = torch.cat([bias.float(), bias.new_zeros(packed.shape[0] * 16 - n, dtype=torch.float32)])
            if kind == "int8":
                return Int8Linear(packed, scale, bias, n)
            return GgufLinear(packed, scale, bias, n, kind)

        base = model.model
        for i, layer in enumerate(base.layers[: config.num_hidden_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            attn.q_proj, attn.k_proj, attn.v_proj = _joined([module(a + f"{p}_proj.weight", getattr(attn, f"{p}_proj"))
                                                             for p in "qkv"])
            attn.o_proj = module(a + "o_proj.weight", attn.o_proj)
            for p in ("gate", "up", "down"):
                setattr(mlp, f"{p}_proj", module(m + f"{p}_proj.weight", getattr(mlp, f"{p}_proj")))
        table = module("model.embed_tokens.weight", None)
        head = module("lm_head.weight", None) if "lm_head.weight" in weights else table
        scale = embed_scale(base.embed_tokens, dtype)
        model.lm_head = head
        base.embed_tokens = QuantEmbedding(table, dtype, scale)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{source} lacks tensors the model needs: {missing[:5]}")
    return model


def _kinds(model: torch.nn.Module) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, Int8Linear):
            kind = getattr(m, "kind", "int8")
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def _row_order(processor, name: str, names: dict, settings: dict, n: int) -> np.ndarray | None:
    """The permutation of output rows transformers' GGUF processor applies to tensor ``name`` (Llama's
    q and k), found by passing it the rows' indices; None where it keeps them. ValueError where the
    processor does more than reorder rows (no quantized form could follow it)."""
    from .gguf_int8 import processed

    probe = np.arange(n, dtype=np.float32)[:, None]
    done = processed(processor, name, probe, names, settings)
    if done is None:
        return None
    order = np.asarray(done[1], dtype=np.float32).reshape(-1)
    if order.shape[0] != n or not np.array_equal(np.sort(order), probe[:, 0]):
        raise ValueError(f"EngineConfig.quantization='gguf': transformers rewrites {name}'s values on reading it, "
                         "so it cannot stay quantized")
    order = order.astype(np.int64)
    return None if np.array_equal(order, np.arange(n)) else order
