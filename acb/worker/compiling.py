"""``compile_level``: how the model forward is wrapped in ``torch.compile``, per path.

The two paths are the *varlen* path (any step holding a prefill chunk: query lengths
vary) and the *decode* path (decode-only steps: one query token per row). Levels, as
transformers' continuous batching defines them:

- 0: off (eager);
- 1: ``mode="default"``, ``dynamic=True``;
- 2: ``mode="max-autotune-no-cudagraphs"``, ``dynamic=True``;
- 3: ``mode="max-autotune-no-cudagraphs"``, ``dynamic=False`` (a recompile per new shape:
  meant for the decode path with padded shapes; past dynamo's ``recompile_limit`` (8 by
  default) new shapes run eagerly, so on the varlen path, or with more row buckets than
  that, raise ``torch._dynamo.config.recompile_limit``).

Never ``reduce-overhead``: acb captures its own CUDA graphs (:mod:`acb.worker.cuda_graphs`)
around the compiled code. acb's paged attention is kept out of the compiled graphs (a
graph break per layer, see :data:`acb.attention.paged.ATTN_NAME_COMPILED`): it reads per-step
metadata whose Python values would otherwise be specialised and recompiled every step.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

_LEVELS: dict[int, dict[str, Any]] = {
    0: {},
    1: {"mode": "default", "dynamic": True},
    2: {"mode": "max-autotune-no-cudagraphs", "dynamic": True},
    3: {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
}


def compile_kwargs(level: int) -> dict[str, Any]:
    """The ``torch.compile`` keyword arguments of a level; ``{}`` for 0 (do not compile)."""
    if level not in _LEVELS:
        raise ValueError(f"compile level must be an int in 0..3, got {level!r}")
    return dict(_LEVELS[level])


def path_levels(compile_level: int, varlen_level: int | None, decode_level: int | None) -> tuple[int, int]:
    """(varlen level, decode level): a per-path override wins over ``compile_level``."""
    return (compile_level if varlen_level is None else varlen_level,
            compile_level if decode_level is None else decode_level)


def compiled_forward(model: torch.nn.Module, level: int):
    """``model`` itself at level 0, else ``torch.compile(model, **compile_kwargs(level))``
    (compilation happens lazily, on the first call of each new shape)."""
    kwargs = compile_kwargs(level)
    if not kwargs:
        return model
    with warnings.catch_warnings():
        # torch.compile's first call imports inductor, whose torch.utils.mkldnn still uses the
        # deprecated torch.jit.script_method (a DeprecationWarning in torch 2.13); nothing acb passes avoids it
        warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated",
                                category=DeprecationWarning)
        return torch.compile(model, **kwargs)
