"""Reading a PEFT LoRA adapter and checking it against the model it will run on.

A source is a PEFT adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``
or ``.bin``), a ``peft`` model (its active adapter), or a pair ``(LoraConfig or its dict,
state dict)``. What acb computes is PEFT's plain LoRA on a decoder's attention and MLP
projections: ``y = W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``). Everything else PEFT can put in an adapter is refused by name
(``InvalidRequestError`` naming ``adapter``): DoRA, trained biases, ``modules_to_save``,
per-module rank or alpha patterns, other PEFT types, LoRA on embeddings or ``lm_head``.

Runs on a worker thread (``Engine.load_adapter``): nothing here touches the engine.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import InvalidRequestError

# The projections acb adds LoRA to, as PEFT names them (Llama, Qwen, Mistral and Gemma alike)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
# "...layers.3.self_attn.q_proj.lora_A.weight" (saved) or "...lora_A.default.weight" (in memory)
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# PEFT config fields whose non-default value changes what the adapter computes in a way acb does not
_REFUSED = {
    "use_dora": "DoRA (use_dora=True) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
    "rank_pattern": "per-module ranks (rank_pattern) are not supported",
    "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    "fan_in_fan_out": "fan_in_fan_out=True (Conv1D-style weights) is not supported",
    "layer_replication": "layer_replication is not supported",
    "lora_bias": "lora_bias=True is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "use_qalora": "QALoRA is not supported",
}


@dataclass(slots=True)
class AdapterWeights:
    """One adapter, checked: per (layer, projection), PEFT's ``A`` [r, in] and ``B``
    [out, r] in the model's dtype, on the model's device."""

    name: str
    rank: int
    scaling: float
    lora_id: int  # a digest of the weights and scaling, the same in every process (prefix-cache key)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _bad(name: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"adapter {name!r}: {why}", param="adapter")


def _from_source(source: Any, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the adapter's config as a dict, its state dict) from any kind of source."""
    if isinstance(source, (str, os.PathLike)):
        return _from_folder(os.fspath(source), name)
    if isinstance(source, tuple) and len(source) == 2:
        config, state = source
        return _config_dict(config), dict(state)
    peft_config = getattr(source, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        from peft import get_peft_model_state_dict

        active = getattr(source, "active_adapter", None) or next(iter(peft_config))
        if isinstance(active, (list, tuple)):
            active = active[0]
        # save_embedding_layers=False: the LoRA weights only (acb adapts no embedding, and refuses
        # LoRA on one by name); peft's "auto" default warns when one is targeted, and looks for
        # the base model's config to see whether its vocabulary grew
        return _config_dict(peft_config[active]), get_peft_model_state_dict(source, adapter_name=active,
                                                                            save_embedding_layers=False)
    raise _bad(name, f"the source must be a PEFT adapter folder, a peft model or (LoraConfig, state dict), got "
               f"{type(source).__name__}")


def _config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(vars(config))


def _from_folder(folder: str, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        raise _bad(name, f"{folder!r} is not a PEFT adapter folder (no adapter_config.json)")
    with open(path) as f:
        config = json.load(f)
    tensors = os.path.join(folder, "adapter_model.safetensors")
    if os.path.isfile(tensors):
        from safetensors.torch import load_file

        return config, load_file(tensors)
    tensors = os.path.join(folder, "adapter_model.bin")
    if os.path.isfile(tensors):
        return config, torch.load(tensors, map_location="cpu", weights_only=True)
    raise _bad(name, f"{folder!r} has no adapter_model.safetensors or adapter_model.bin")


def _scaling(config: dict[str, Any], name: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a LoRA config, or the reason it is refused."""
    kind = config.get("peft_type", "LORA")
    kind = getattr(kind, "value", kind)
    if str(kind).upper() != "LORA":
        raise _bad(name, f"peft_type {kind!r} is not supported (LoRA only)")
    for field, why in _REFUSED.items():
        if config.get(field):
            raise _bad(name, why)
    if config.get("bias", "none") != "none":
        raise _bad(name, f"bias={config['bias']!r} (trained biases) is not supported; only bias='none'")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise _bad(name, f"r must be an int >= 1 and lora_alpha a number, got r={rank!r}, lora_alpha={alpha!r}")
    if rank > max_rank:
        raise InvalidRequestError(f"adapter {name!r}: rank {rank} is above EngineConfig.max_adapter_rank="
                                  f"{max_rank}", param="max_adapter_rank")
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read(source: Any, name: str, model: torch.nn.Module, max_rank: int) -> AdapterWeights:
    """Read and check an adapter for ``model``; ``InvalidRequestError`` naming what is
    wrong (a refused PEFT feature, a module acb does not adapt, a shape that does not fit)."""
    config, state = _from_source(source, name)
    rank, scaling = _scaling(config, name, max_rank)
    layers = model.model.layers
    param = next(model.parameters())
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.search(key)
        if m is None or m.group(3) not in TARGETS or (m.group(2) == "self_attn") != (m.group(3) in _ATTN):
            raise _bad(name, f"{key!r} is not LoRA on one of {', '.join(TARGETS)} (acb adapts those only)")
        layer = int(m.group(1))
        if layer >= len(layers):
            raise _bad(name, f"{key!r}: the model has {len(layers)} layers")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = tensor
    if not pairs:
        raise _bad(name, "it holds no LoRA weights")
    weights = {}
    for (layer, proj), ab in sorted(pairs.items()):
        a, b = _checked(name, layers[layer], layer, proj, ab, rank)
        weights[(layer, proj)] = (a.to(param.device, param.dtype).contiguous(),
                                  b.to(param.device, param.dtype).contiguous())
    return AdapterWeights(name, rank, scaling, _digest(weights, scaling), weights)


def _checked(name: str, block: torch.nn.Module, layer: int, proj: str, ab: dict[str, torch.Tensor],
             rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    where = f"layers.{layer}.{proj}"
    if set(ab) != {"A", "B"}:
        raise _bad(name, f"{where} has lora_{''.join(ab)} without its pair")
    module = getattr(block.self_attn if proj in _ATTN else block.mlp, proj, None)
    weight = getattr(module, "weight", None)
    if weight is None or weight.dim() != 2:
        raise _bad(name, f"the model has no linear {where}")
    out_features, in_features = weight.shape
    a, b = ab["A"], ab["B"]
    if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise _bad(name, f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the model's "
                   f"projection ({in_features} -> {out_features}) at rank {rank}: expected lora_A "
                   f"[{rank}, {in_features}] and lora_B [{out_features}, {rank}]")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise _bad(name, f"{where}: the LoRA weights are not floating point ({a.dtype})")
    return a, b


def _digest(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], scaling: float) -> int:
    """A 63-bit digest of the adapter as it computes (weights in the model's dtype, scaling)."""
    h = hashlib.sha256(repr(scaling).encode())
    for (layer, proj), (a, b) in weights.items():
        h.update(f"{layer}.{proj}".encode())
        for t in (a, b):
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") & (2**63 - 1)
