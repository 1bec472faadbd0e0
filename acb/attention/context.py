"""One step's forward context: what a forward needs beside its input ids and positions.

The runner builds a :class:`ForwardContext` per forward (``acb.worker.runner``, the draft model's
runner and the CUDA-graph capture, ``acb.worker.cuda_graphs``) and hands it over with
:func:`run`, the one place that passes it on:

- acb's own forwards (the fused CPU forward ``acb.model.fused`` and the int8 one built on it,
  which say so with ``takes_context = True``) take it as their first argument and hand its
  ``attention`` to :func:`acb.attention.paged.attend` themselves;
- any other forward (transformers' model, a compiled one) runs with the context in a context
  variable for as long as it runs. transformers' unmodified modules call acb's attention through
  ``AttentionInterface`` with transformers' own signature (and the LoRA forward hooks get only a
  module's input and output), so there is no argument to carry it: the attention function
  (:func:`acb.attention.paged.paged_attention`), the LoRA hooks (``acb.model.lora``) and the
  config routing (``acb.attention.routing``) read it with :func:`current`. The variable is set on
  the thread that runs the forward (the engine's worker thread) right before the forward and reset
  after it, so a copy of the model run elsewhere meanwhile (another thread, another engine) sees
  no acb step.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .metadata import StepAttention


class StepAdapters(Protocol):
    """The step's LoRA rows, as the context holds them: ``acb.model.lora.StepLora`` (a layer above
    this one). ``token`` names the adapter bank whose forward hooks add its deltas."""

    token: object


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """What one forward of an acb step reads beside its inputs: the step's attention metadata and,
    when the step has rows that run LoRA adapters, their rows (``acb.model.lora.StepLora``)."""

    attention: StepAttention
    lora: StepAdapters | None = None


# The context of the forward running transformers' modules, for the functions transformers calls
# with its own signature (see the module's text). Set only by run().
_hooked: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("acb_forward_context",
                                                                                default=None)


def run(forward, context: ForwardContext, **inputs):
    """``forward(**inputs)`` within ``context``: acb's own forwards (``takes_context``) get it as
    their first argument; any other runs with it readable by :func:`current` until it returns."""
    if getattr(forward, "takes_context", False):
        return forward(context, **inputs)
    token = _hooked.set(context)
    try:
        return forward(**inputs)
    finally:
        _hooked.reset(token)


def current() -> ForwardContext | None:
    """The context of the forward that :func:`run` is running here through transformers' modules;
    None outside one (and inside acb's own forwards, which hold theirs as an argument)."""
    return _hooked.get()
