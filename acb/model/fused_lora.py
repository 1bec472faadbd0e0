"""A layer of the fused CPU forward (``acb.model.fused``) in a step with adapter rows: the same
GEMMs (q/k/v and gate/up each one, ``acb.model.fused_layers.side_by_side``), the step's LoRA deltas
(``acb.model.lora``) added in place on each projection's columns of their output.

Float32 (the bank holds the native kernels, ``acb/kernels/csrc/lora_cpu.cpp``): one kernel call per
projection group (q/k/v, o, gate/up, down) adds every adapter's deltas on its rows, the
shrink one GEMM over the group's concatenated A; o's and down's deltas land on their fused
residual sums; when a delta lands in gate/up, the activation and the product run in one
native pass with the deltas (``glu_add``), else in the base model's (``glu``). Other
dtypes: the same with PyTorch ops (``StepLora.add``). An MLP that no adapter of the step
targets runs as the base model's (PEFT's default targets q/v only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from ..attention.metadata import StepAttention
    from .lora import StepLora

# the gate activations as functions, for the PyTorch path's unfused MLP
_ACTIVATION_FNS = {"swish": torch.nn.functional.silu,
                   "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


class LayerOps(Protocol):
    """What a layer with adapter rows uses of the forward it runs in (``acb.model.fused``'s
    ``FusedForward``, or the int8 forward built on it): its norms, GEMMs, attention and kernels."""

    k: Any

    def rms(self, x: torch.Tensor, norm: Any) -> torch.Tensor: ...
    def linear(self, h: torch.Tensor, weight: tuple, dtype: torch.dtype = ...) -> torch.Tensor: ...
    def attend(self, meta: StepAttention, layer: Any, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor,
               total: int, cos: torch.Tensor, sin: torch.Tensor, rows: int | None = ...) -> torch.Tensor: ...
    def projection(self, h: torch.Tensor, weight: tuple) -> torch.Tensor: ...
    def add_projection(self, h: torch.Tensor, x: torch.Tensor, weight: tuple) -> torch.Tensor: ...


class LoraLayer:
    """A decoder layer of the fused forward in a step with adapter rows, composed over the
    forward's own operations (``ops``)."""

    def __init__(self, ops: LayerOps) -> None:
        self.ops = ops

    def __call__(self, meta: StepAttention, layer: Any, i: int, x: torch.Tensor, rows: int, total: int,
                 cos: torch.Tensor, sin: torch.Tensor, adapters: StepLora) -> torch.Tensor:
        """One decoder layer of the step of attention metadata ``meta`` with the step's LoRA deltas;
        ``x`` [rows, hidden] padded."""
        native = adapters.native is not None
        h = self.ops.rms(x, layer.ln1)
        q, kk, v = self.ops.linear(h, layer.qkv).split(layer.qkv_split, dim=1)  # column views
        if native:
            adapters.add_group([q, kk, v], h, i, "qkv")
        else:
            for out, proj in ((q, "q_proj"), (kk, "k_proj"), (v, "v_proj")):
                adapters.add(out, h, i, proj)
        a = self.ops.attend(meta, layer, q, kk, v, total, cos, sin, rows)
        if layer.post_attn is None:  # the residual add stays fused; the delta lands on the sum
            x = self.ops.add_projection(a, x, layer.o)
            _add(adapters, native, x, a, i, "o")
        else:
            o = self.ops.projection(a, layer.o)
            _add(adapters, native, o, a, i, "o")
            x = x + self.ops.rms(o, layer.post_attn)
        h = self.ops.rms(x, layer.ln2)
        m = self._mlp(layer, i, h, adapters, native)
        if layer.post_mlp is None:
            x = self.ops.add_projection(m, x, layer.down)
            _add(adapters, native, x, m, i, "down")
            return x
        d = self.ops.projection(m, layer.down)
        _add(adapters, native, d, m, i, "down")
        return x + self.ops.rms(d, layer.post_mlp)

    def _mlp(self, layer: Any, i: int, h: torch.Tensor, adapters: StepLora, native: bool) -> torch.Tensor:
        """act(gate) * up, with the deltas of gate and up added before the activation and the product."""
        gu = self.ops.linear(h, layer.gate_up)  # gate | up, one GEMM (acb.model.fused_layers.side_by_side)
        if not (adapters.touches(i, "gate_proj") or adapters.touches(i, "up_proj")):
            # no delta inside the MLP (PEFT's default targets q/v only): the base model's one pass
            return self.ops.k.glu(gu, layer.act_code)
        g, u = gu.split(gu.shape[1] // 2, dim=1)
        if native:  # the deltas, the activation and the product in one pass over g and u
            return adapters.glu_add(g, u, h, i, layer.act_code)
        adapters.add(g, h, i, "gate_proj")
        adapters.add(u, h, i, "up_proj")
        return _ACTIVATION_FNS[layer.act[0]](g) * u


def _add(adapters: StepLora, native: bool, y: torch.Tensor, x: torch.Tensor, i: int, group: str) -> None:
    """The delta of a one-projection group (o, down) on ``y`` in place."""
    if native:
        adapters.add_group([y], x, i, group)
    else:
        adapters.add(y, x, i, f"{group}_proj")


