"""int8 weights on the CPU (``EngineConfig(quantization="int8")``): W8A8 on AVX-512 VNNI.

Every linear layer of the decoder (the attention's and the MLP's projections) and the
``lm_head`` keep their weights as int8, one scale per output channel (symmetric,
``scale = max|w| / 127``); the embedding reads its rows from the same int8 matrix when
it is tied to the ``lm_head`` (SmolLM2, Gemma), else from its own. The activations going
into each GEMM are quantized at run time per token and per group of 64 input channels
(``max|x| / 127`` over the group; :data:`GROUP`), and the GEMM runs
in acb's own kernel (``acb/kernels/int8_cpu.cpp``): unsigned-by-signed byte dot products
(``vpdpbusd``) accumulated in int32, rescaled in float32 with the epilogues fused (the
residual add, SiLU / GELU-tanh times the up projection). Norms, RoPE, attention and the
KV pages run in the model's dtype (float32 or bfloat16) as in acb's fused forward; the
logits are float32.

Why W8A8 and this kernel (measured 2026-12-01 on this project's 2-core AVX-512 VNNI
machine, best of 5 x 20 calls, load 1.9; ``benchmarks/int8_gemm.py`` runs the comparison),
in GOPS on SmolLM2's shapes (rows x K x N):

    shape            acb int8   oneDNN int8   oneDNN int8 + row rescale   oneDNN bf16
    16 x 576 x 960      898         545               443                    511
    64 x 576 x 576     1137         838               718                    617
    64 x 1536 x 576    1308        1338              1197                    781
    1024 x 576 x 1536  1320        1808              1631                    942

- weight-only int8 with bf16 compute (``torch._weight_int8pack_mm``) ran at 50-270 GOPS,
  slower than oneDNN's prepacked bf16 at every row count: the weights are widened on
  every call and the arithmetic stays bf16's;
- oneDNN's int8 matmul through PyTorch (``onednn.qlinear_pointwise``) takes one scale for
  the whole activation tensor: per-token scales need a rescale pass after it (column 3),
  and its epilogues (SiLU times up, the residual add) then cannot be fused. It is faster
  than this kernel at prefill shapes and slower at decode shapes; this kernel, with the
  epilogues fused, is what the engine runs (a hybrid is left for later);
- per-token (not per-tensor) activation scales because one scale per step lets one
  outlier token flatten every other token's precision; and per group of 64 channels within
  a token because one outlier channel does the same to the rest of its token (SmolLM2:
  perplexity +4.9 % with a scale per token, +1 % per group of 64: measured in :data:`GROUP`'s
  comment and docs/performance.md). The groups cost the kernel a float flush per group.

What int8 costs in accuracy is measured in docs/performance.md (Dtypes): on SmolLM2-135M
int8 activations cost more than the int8 weights do, and their groups win most of it back.

The model is quantized in place (the dense weights are freed: that is the memory
saving); :class:`Int8Linear` and :class:`Int8Embedding` stand in for the modules, so the
model's own (transformers') forward also computes with the int8 weights, and
``state_dict`` holds the packed int8 tensors. ``Engine.reload_weights`` and the
weight-change detection keep working: acb's forward reads the modules' own tensors.
"""

from __future__ import annotations

import logging

import torch

from . import fused
from .fused import FusedForward, _Layer, _Logits, kept_rows

log = logging.getLogger("acb")

METHODS = ("int8",)

# Channels per activation scale (each token's row is quantized in groups of this many
# channels, see activation_group). Measured on SmolLM2-135M, 4096 held-out tokens, fake
# quantization in transformers' forward (weights per channel): one scale per token +4.94 %
# perplexity / top-1 87.4 %; per 192 channels +1.26 % / 91.3 %; per 64 +0.95 % / 93.1 %; per 32
# +0.67 % / 94.2 %. 64 keeps the kernel's int32 runs 16 VNNI steps long between float flushes.
GROUP = 64


def _kernels():
    from .kernels.cpu import int8_kernels

    k = int8_kernels()
    return k if k is not None and k.has_vnni() else None


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N]): symmetric, one scale per output channel (row)."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    for i in range(0, w.shape[0], 4096):  # in slices: never a float32 copy of a whole vocabulary
        rows = w[i: i + 4096].float()
        s = rows.abs().amax(1) / 127
        scale[i: i + 4096] = s
        q[i: i + 4096] = torch.round(rows / s.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
    return q, scale


def activation_group(k: int) -> int:
    """Channels per activation scale for a GEMM input of width ``k``: :data:`GROUP` where it
    divides ``k``, else 32 or 16 where one does, else ``k`` (one scale per token: finer
    groups would flush the int32 sums too often)."""
    return next((g for g in (GROUP, 32, 16) if k % g == 0), k)


def group_sums(packed: torch.Tensor, group: int) -> torch.Tensor:
    """int32 [N/16, K/group, 16]: each output column's sum of weights over each group of
    ``group`` input channels, from a packed weight (the kernel takes the activations' +128
    offset back out with them)."""
    nb, k4 = packed.shape[:2]
    return packed.view(nb, k4 * 4 // group, group // 4, 16, 4).sum((2, 4), dtype=torch.int32).contiguous()


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> VNNI's layout [N/16, K/4, 16, 4] (the kernel's operand order)."""
    n, k = q.shape
    return q.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack`: int8 [N, K]."""
    nb, k4 = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(nb * 16, k4 * 4)


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights (per output channel) and int8 activations (per
    token and group of ``group`` input channels), computed by acb's VNNI kernel. ``weight``:
    packed int8 [N/16, K/4, 16, 4]; ``weight_colsum``: int32 [N/16, K/group, 16] (the weight's
    sums per group, :func:`group_sums`); ``weight_scale``: float32 [N]; ``bias``: float32 [N] or None.

    Example::

        layer = Int8Linear.from_dense(torch.nn.Linear(64, 32))
        y = layer(torch.randn(4, 64))  # float32 in, float32 out
    """

    def __init__(self, packed: torch.Tensor, colsum: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None, out_features: int | None = None) -> None:
        super().__init__()
        self.in_features = packed.shape[1] * 4
        # the packed rows beyond out_features (a vocabulary not a multiple of 16) are zeros
        self.out_features = out_features or packed.shape[0] * 16
        self.register_buffer("weight", packed)
        self.register_buffer("weight_colsum", colsum)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                  group: int | None = None) -> Int8Linear:
        """From an int8 [N, K] and its float32 scales [N]; N is padded to a multiple of 16
        with zero rows (their outputs are dropped), K must be a multiple of 4. ``group``:
        input channels per activation scale (default :func:`activation_group` of K)."""
        n, k = q.shape
        if k % 4:
            raise ValueError(f"EngineConfig.quantization='int8' needs linear layers whose input width is a multiple "
                             f"of 4, got [N, K] = {[n, k]}")
        pad = -n % 16
        scale = scale.float()
        if pad:
            q = torch.cat([q, q.new_zeros(pad, k)])
            scale = torch.cat([scale, scale.new_zeros(pad)])
            if bias is not None:
                bias = torch.cat([bias.detach().float(), bias.new_zeros(pad, dtype=torch.float32)])
        packed = pack(q)
        return cls(packed, group_sums(packed, group or activation_group(k)), scale.contiguous(),
                   None if bias is None else bias.detach().float().contiguous(), n)

    @property
    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(packed, colsum, scale, out_features): what :meth:`from_packed` takes back
        (acb.gguf_int8 caches it)."""
        return self.weight, self.weight_colsum, self.weight_scale, self.out_features

    @classmethod
    def from_packed(cls, packed: tuple, bias: torch.Tensor | None = None) -> Int8Linear:
        weight, _, scale, n = packed  # the sums are recomputed: a cache written with other groups stays valid
        if bias is not None:
            bias = torch.cat([bias.detach().float(), bias.new_zeros(scale.numel() - n, dtype=torch.float32)])
        return cls(weight, group_sums(weight, activation_group(weight.shape[1] * 4)), scale, bias, n)

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear) -> Int8Linear:
        q, scale = quantize_weight(linear.weight.detach())
        return cls.from_int8(q, scale, linear.bias)

    @property
    def group(self) -> int:
        """Input channels per activation scale (what ``quantize_rows`` must be given)."""
        return group_of(self.args)

    @property
    def args(self) -> tuple:
        """The kernel's weight arguments: (packed, colsum, scale, bias)."""
        return self.weight, self.weight_colsum, self.weight_scale, self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight the GEMM computes with, as float32 [N, K]."""
        n = self.out_features
        return unpack(self.weight)[:n].float() * self.weight_scale[:n, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = _kernels()
        dtype = x.dtype if x.dtype in fused.DTYPES else torch.float32
        rows = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
        xq, xs = k.quantize_rows(rows, None, False, 1e-6, self.group)
        out = k.linear(xq, xs, *self.args, None, dtype)[:, : self.out_features]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def group_of(args: tuple) -> int:
    """Input channels per activation scale of a kernel weight tuple (packed, colsum, scale, bias)."""
    packed, colsum = args[0], args[1]
    return packed.shape[1] * 4 // colsum.shape[1]


class Int8Embedding(torch.nn.Module):
    """An embedding whose rows are read from an :class:`Int8Linear`'s int8 weight (the
    tied ``lm_head``'s, or its own), times ``scale`` (Gemma's ``sqrt(hidden)``, rounded
    to the model's dtype as its module rounds it), in ``dtype``."""

    def __init__(self, linear: Int8Linear, dtype: torch.dtype, scale: float = 1.0) -> None:
        super().__init__()
        self.linear = linear  # a submodule: shared with lm_head when tied (one copy of the bytes)
        self.num_embeddings = linear.out_features
        self.embedding_dim = linear.in_features
        self.scale = scale
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = _kernels().embed(self.linear.weight, self.linear.weight_scale, ids.reshape(-1).contiguous(),
                               self.scale, self.dtype)
        return out.view(*ids.shape, self.embedding_dim)


def is_quantized(model: torch.nn.Module) -> bool:
    lm_head = getattr(model, "lm_head", None)
    return isinstance(lm_head, Int8Linear)


def _projections(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
            (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj")]


def why_not(model: torch.nn.Module) -> str | None:
    """Why ``model`` (dense, as loaded) cannot run with int8 weights here, or None."""
    if _kernels() is None:
        return "acb's int8 kernels need a CPU with AVX-512 VNNI and a C++ compiler (they did not build here)"
    from .kernels.cpu import fused_kernels

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
    return None


def check_dense(model: torch.nn.Module) -> None:
    """ValueError naming ``EngineConfig.quantization`` where :func:`why_not` says the
    (dense) model cannot run with int8 weights here."""
    reason = why_not(model)
    if reason:
        raise ValueError(f"EngineConfig.quantization='int8' cannot run on this model here: {reason}")


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


def _group(parts: list[Int8Linear]) -> list[Int8Linear]:
    """``parts`` (same input: q, k, v) moved into one buffer each for weights, sums,
    scales and biases, each module holding its slice: one GEMM can compute them all."""
    biased = [p.bias is not None for p in parts]
    if any(biased) and not all(biased) or any(p.out_features % 16 for p in parts):
        return parts
    joined = [torch.cat([getattr(p, name) for p in parts]) for name in ("weight", "weight_colsum", "weight_scale")]
    joined.append(torch.cat([p.bias for p in parts]) if all(biased) else None)
    out, start = [], 0
    for p in parts:
        n = p.out_features
        out.append(Int8Linear(joined[0][start // 16: (start + n) // 16], joined[1][start // 16: (start + n) // 16],
                              joined[2][start: start + n], None if joined[3] is None else joined[3][start: start + n]))
        start += n
    return out


def quantize_(model: torch.nn.Module, weights: dict[str, tuple] | None = None) -> None:
    """Replace ``model``'s decoder projections, ``lm_head`` and embedding by their int8
    forms, in place; the dense weights are freed. ``weights``: {parameter name:
    ``Int8Linear.packed``} already quantized (a GGUF file's, :mod:`acb.gguf_int8`), the
    modules' own weights being quantized otherwise. ValueError (naming ``EngineConfig.quantization``)
    where :func:`why_not` says it cannot run."""
    check_dense(model)
    weights = weights or {}
    base = model.model
    dtype = next(base.norm.parameters()).dtype

    def int8(name: str, linear: torch.nn.Linear) -> Int8Linear:
        if name in weights:
            return Int8Linear.from_packed(weights[name], linear.bias)
        return Int8Linear.from_dense(linear)

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
            mlp.down_proj = int8(m + "down_proj.weight", mlp.down_proj)
        if weights:
            tied = weights.get("lm_head.weight") is weights.get("model.embed_tokens.weight")
        else:
            tied = model.lm_head.weight is base.embed_tokens.weight
        lm_head = int8("lm_head.weight", model.lm_head)
        if tied:
            table = lm_head
        elif "model.embed_tokens.weight" in weights:
            table = Int8Linear.from_packed(weights["model.embed_tokens.weight"])
        else:
            table = Int8Linear.from_int8(*quantize_weight(base.embed_tokens.weight.detach()))
        scale = _embed_scale(base.embed_tokens, dtype)
        model.lm_head = lm_head
        base.embed_tokens = Int8Embedding(table, dtype, scale)
    from .kernels.cpu_linear import trim_heap

    trim_heap()
    log.info("acb: int8 weights (per output channel) and activations (per token and %d channels): %s",
             GROUP, weight_summary(model))


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
    if not isinstance(model.model.embed_tokens, Int8Embedding):
        return "the embedding is not acb's int8 one"
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        if any(not isinstance(getattr(owner, name), Int8Linear) for owner, name in _projections(layer)):
            return "a projection is not an Int8Linear (replaced since it was quantized)"
    return None


class Int8Forward(FusedForward):
    """acb's fused forward with int8 GEMMs (see the module's docstring); callable like the
    model for the runner."""

    def __init__(self, model: torch.nn.Module, layers: list[_Layer], kernels, qkv: list) -> None:
        super().__init__(model, layers, kernels)
        self.q8 = _kernels()
        self.qkv = qkv  # per layer: the joined (packed, colsum, scale, bias) of q, k, v, or None
        self.dtype = next(model.parameters()).dtype

    @classmethod
    def build(cls, model: torch.nn.Module, packed, kernels, row_reduce=None) -> Int8Forward | None:
        reason = why_not_forward(model, packed, kernels)
        if reason:
            log.info("acb: int8 fused CPU forward not used (%s); transformers' forward runs", reason)
            return None
        layers = fused.describe(model, lambda m: m.args)
        qkv = []
        for layer in model.model.layers[: model.config.num_hidden_layers]:
            parts = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]
            names = ("weight", "weight_colsum", "weight_scale")
            joined = [_joined([getattr(p, name) for p in parts]) for name in names]
            biases = [p.bias for p in parts]
            bias = None if all(b is None for b in biases) else _joined(biases)
            ok = all(j is not None for j in joined) and (bias is not None or all(b is None for b in biases))
            qkv.append((*joined, bias) if ok else None)
        log.info("acb: int8 fused CPU forward over %d %s layers (%s activations between the GEMMs)", len(layers),
                 type(model.model.layers[0]).__name__, str(next(model.parameters()).dtype).removeprefix("torch."))
        return cls(model, layers, kernels, qkv)

    def _quantized(self, x: torch.Tensor, w: tuple, norm: fused.Norm | None = None) -> tuple[torch.Tensor, ...]:
        """x's rows quantized (RMS-normed first with ``norm``) in the groups weight ``w`` takes."""
        if norm is None:
            return self.q8.quantize_rows(x, None, False, 1e-6, group_of(w))
        weight, eps, gemma = norm
        return self.q8.quantize_rows(x, weight, gemma, eps, group_of(w))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                 use_cache: bool = False, logits_to_keep: torch.Tensor | int | None = None) -> _Logits:
        q8, dtype = self.q8, self.dtype
        linear = q8.linear
        x = self.embed(input_ids[0])  # [T, hidden]; the int8 kernels take any row count (no padding)
        total = x.shape[0]
        ropes = self._ropes(x, position_ids)
        for layer, qkv in zip(self.layers, self.qkv, strict=True):
            cos, sin = ropes[layer.rope]
            h = self._quantized(x, layer.q, layer.ln1)  # RMSNorm and quantization in one pass
            if qkv is not None:
                out = linear(*h, *qkv, None, dtype)
                nq, nk = layer.q[0].shape[0] * 16, layer.k[0].shape[0] * 16
                q, kk, v = out[:, :nq], out[:, nq: nq + nk], out[:, nq + nk:]
            else:
                q, kk, v = (linear(*h, *w, None, dtype) for w in (layer.q, layer.k, layer.v))
            a = self._quantized(self._attend(layer, q, kk, v, total, cos, sin), layer.o)
            if layer.post_attn is None:
                x = linear(*a, *layer.o, x, dtype)  # the residual add fused
            else:  # Gemma: normed before the residual add
                x = x + self._rms(linear(*a, *layer.o, None, dtype), layer.post_attn)
            h = self._quantized(x, layer.gate, layer.ln2)
            m = self._quantized(q8.glu(*h, *layer.gate, *layer.up, layer.act_code, dtype),
                                layer.down)
            if layer.post_mlp is None:
                x = linear(*m, *layer.down, x, dtype)
            else:
                x = x + self._rms(linear(*m, *layer.down, None, dtype), layer.post_mlp)
        h = self._quantized(kept_rows(x, logits_to_keep), self.lm_head.args, self.norm)
        logits = linear(*h, *self.lm_head.args, None, torch.float32)[:, : self.lm_head.out_features]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return _Logits(logits.unsqueeze(0))


def prepare(model: torch.nn.Module, config) -> None:
    """The engine's hook: check that ``config.quantization`` can run where ``model`` is,
    and quantize the model in place (once: a model already quantized is taken as it is).
    ValueError naming ``EngineConfig.quantization`` otherwise."""
    if config.quantization is None:
        return
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
    quantize_(model)
