"""How a Llama-family decoder is split over the ranks of a tensor-parallel group.

The split is the model's own tensor-parallel plan (transformers' ``base_model_tp_plan``:
q/k/v, gate and up projections ``colwise``, o and down projections ``rowwise``),
applied to plain tensors rather than transformers' DTensors, so each rank's model is an
ordinary model whose projections are just narrower. That keeps acb's CPU fast paths
(prepacked oneDNN weights, the fused forward, the native attention kernels) working
unchanged on every rank:

- a ``colwise`` projection keeps a contiguous block of output rows (its heads, or its
  slice of the MLP's columns), bias included;
- a ``rowwise`` projection keeps the matching block of input columns; its output is a
  partial sum that :class:`RowReduce` adds up over the ranks in place (one all-reduce
  after attention, one after the MLP); only rank 0 keeps its bias;
- everything else (embeddings, norms, ``lm_head``) is replicated. Only rank 0 computes
  logits: the other ranks keep no rows for ``lm_head``.

Each rank's model is built from a *sharded config* (heads, KV heads and intermediate
size divided by N, ``head_dim`` pinned), so transformers' own modules come out with the
shard's shapes and the KV cache of each rank holds its own KV heads.
"""

from __future__ import annotations

import copy
import re
from datetime import timedelta

import torch
import torch.distributed as dist

from ..attention import paged as attention
from ..core.model_shape import ModelShape, text_config

# model_type -> the decoder families whose sharded config is their per-rank shape
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# the plan of those families, for a config that carries none
_DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


def check(config, size: int) -> None:
    """Raise ``ValueError`` naming ``tensor_parallel_size`` when ``config``'s model
    cannot be split ``size`` ways."""
    model_type = getattr(text_config(config), "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"tensor_parallel_size={size}: acb shards Llama-family decoders ({', '.join(SUPPORTED)}); "
                         f"got model_type {model_type!r}")
    shape = ModelShape.of(config)
    for name, value in (("attention heads", shape.heads), ("KV heads", shape.kv_heads),
                        ("MLP intermediate size", shape.intermediate)):
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the model's {name} ({value})")
    for style in plan(config).values():
        if style not in ("colwise", "rowwise") and not style.startswith("replicated"):
            raise ValueError(f"tensor_parallel_size={size}: the model's tensor-parallel plan uses {style!r}, "
                             f"which acb does not implement")


def plan(config) -> dict[str, str]:
    """The model's tensor-parallel plan (module pattern -> style)."""
    return dict(getattr(text_config(config), "base_model_tp_plan", None) or _DEFAULT_PLAN)


def shard_config(config, size: int):
    """A copy of ``config`` with each rank's share of heads, KV heads and MLP width."""
    config = copy.deepcopy(config)
    text = text_config(config)
    shape = ModelShape.of(text)
    text.head_dim = shape.head_dim
    text.num_key_value_heads = shape.kv_heads // size
    text.num_attention_heads = shape.heads // size
    text.intermediate_size //= size
    return config


class Splitter:
    """Which slice of each full tensor a rank holds, by parameter name."""

    def __init__(self, config, prefix: str, size: int) -> None:
        self.size = size
        self._rules = [(re.compile(re.escape(f"{prefix}.{pattern}" if prefix else pattern).replace(r"\*", r"\d+")
                                   + r"\.(weight|bias)$"), style) for pattern, style in plan(config).items()]

    def style(self, name: str) -> str | None:
        for rule, style in self._rules:
            if rule.match(name):
                return style
        return None

    def piece(self, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of the full tensor ``name`` (a view where it can be)."""
        style = self.style(name)
        is_bias = name.endswith(".bias")
        if style == "colwise":
            return full.chunk(self.size, dim=0)[rank]
        if style == "rowwise":
            if is_bias:  # added once, by rank 0, before the sum over the ranks
                return full if rank == 0 else torch.zeros_like(full)
            return full.chunk(self.size, dim=1)[rank]
        return full


def tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, tied ones once, in a fixed order (all ranks agree)."""
    return list(model.named_parameters()) + list(model.named_buffers())


def full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model's tensors by name (dense even while another engine holds its linear
    weights prepacked: prepacking keeps the model's own weights)."""
    return dict(tensors(model))


def skeleton(model_class: type, config, dtype: torch.dtype) -> torch.nn.Module:
    """``model_class`` built from ``config`` with uninitialised CPU tensors (no random
    init: every tensor is about to be overwritten)."""
    attention.register()  # the config may name acb's attention (a model an engine holds)
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied parameters separate storage
    return model.eval()


def build_local(model: torch.nn.Module, size: int, rank: int, device: torch.device) -> torch.nn.Module:
    """Rank ``rank``'s model from the full ``model`` in this process. Replicated tensors
    are shared with ``model`` (no copy on the same device); sharded ones are copies."""
    local = skeleton(type(model), shard_config(model.config, size), next(model.parameters()).dtype)
    splitter = Splitter(model.config, model.base_model_prefix, size)
    full = full_tensors(model)
    with torch.no_grad():
        for name, target in tensors(local):
            # in the skeleton's dtype: a bf16 model's rotary inv_freq buffers are bf16 (model.to(bfloat16)),
            # a skeleton built in bf16 makes them float32; every rank must hold the same values and size
            piece = splitter.piece(name, full[name], rank).to(device=device, dtype=target.dtype)
            if piece.shape != target.shape:
                raise ValueError(f"tensor_parallel_size={size}: cannot shard {name} {tuple(full[name].shape)} "
                                 f"into {tuple(target.shape)}")
            target.data = piece.contiguous() if splitter.style(name) else piece
    local.generation_config = model.generation_config
    return local


class RowReduce:
    """Sums a row-parallel projection's partial output over the group, in place."""

    def __init__(self, group, rank: int, timeout: timedelta) -> None:
        self.group = group
        self.rank = rank
        self.options = dist.AllreduceOptions()
        self.options.timeout = timeout

    def __call__(self, tensor: torch.Tensor) -> None:
        self.group.allreduce([tensor], self.options).wait()

    def hook(self, module, inputs, output: torch.Tensor) -> None:
        self(output)


def install(model: torch.nn.Module, reduce: RowReduce) -> None:
    """Make the model's row-parallel projections sum their outputs over the ranks (for
    transformers' own forward; acb's fused forward calls ``reduce`` itself)."""
    splitter = Splitter(model.config, model.base_model_prefix, 1)
    for name, module in model.named_modules():
        if splitter.style(f"{name}.weight") == "rowwise":
            module.register_forward_hook(reduce.hook)
