"""Calibration and smoothing for int8 weights (SmoothQuant, see :mod:`acb.model.quantization`): the
projections that share an input, the calibration text, each input channel's largest activation and
the smoothing factors they give."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    pass

from .int8_weights import Int8Linear

log = logging.getLogger("acb")

# SmoothQuant's migration strength a: s_j = max|x_j|^a / max|w_j|^(1-a). On SmolLM2 (weights and
# activations per 32, lm_head bf16) a = 0.5: 97.4 % top-1, 0.7: 97.0 %, none: 95.9 %; per 64 and
# rotated (benchmarks/int8_rotation.py) 0.3: 97.23 %, 0.4: 97.67, 0.5: 97.67, 0.6: 97.63, 0.7: 97.55.
SMOOTHING = 0.5

CALIBRATION = Path(__file__).parent.parent / "data" / "calibration.txt"
CALIBRATION_WINDOW = 512  # tokens per calibration forward


def projections(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
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
                # the logits of the last token only: the lm_head over every token is no projection's
                # input (Gemma 3's 262k-word vocabulary: ~1.4 TFLOP over the calibration text)
                model(torch.tensor([ids[start: start + CALIBRATION_WINDOW]]), use_cache=False, logits_to_keep=1)
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
