"""A step that pools prompt positions (embeddings, ``acb.core.pooling``): the final hidden
states of those positions beside the logits of the step's other kept rows, from the one
forward that computes the step (no second pass, no second model).

- acb's fused CPU forwards (``acb.model.fused``, ``acb.model.int8_forward``) compute the final
  norm over the kept rows only and hand them to their ``lm_head``: a shallow copy of the
  forward whose ``lm_head`` is a tap keeps the pooled rows' normed hidden states and hands
  the others to the real head (the same head call the forward makes, so those rows' logits
  are what it computes). The copy shares the forward's weights and kernels.
- any other forward (transformers' model, a compiled one, a hooked model): transformers'
  base model runs (eagerly) and its ``last_hidden_state`` (after the final norm) gives both,
  the logits of the other kept rows through the model's ``lm_head`` and final soft-capping.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..attention import context
from ..core.step import PoolingRows


class _HeadTap(torch.nn.Module):
    """The ``lm_head`` of a copy of acb's fused forward: of the kept rows' normed hidden states
    ``h``, the last ``pooled`` are kept (``hidden``), the others go through ``head``."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], pooled: int, vocab: int) -> None:
        super().__init__()
        self.head, self.pooled, self.vocab = head, pooled, vocab
        self.hidden: torch.Tensor | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[0] - self.pooled
        self.hidden = h[n:]
        return self.head(h[:n]) if n else h.new_zeros((0, self.vocab), dtype=torch.float32)


def pooled_forward(forward, model: torch.nn.Module, ctx: context.ForwardContext, input_ids: torch.Tensor,
                   position_ids: torch.Tensor, keep: torch.Tensor,
                   pooling: PoolingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the step: (the logits of the kept rows before the pooled ones [K, vocab], the pooled
    entries' sums of final hidden states, float32 on the host [entries, hidden]). ``keep``
    ends with the pooled positions (``PoolingRows.keep``)."""
    pooled = sum(pooling.counts)
    n = keep.shape[0] - pooled
    vocab = model.get_output_embeddings().out_features
    inputs = dict(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), attention_mask=None,
                  use_cache=False)
    if getattr(forward, "takes_context", False):  # acb's fused forward (or the int8 one built on it)
        tapped = copy.copy(forward)
        tap = _HeadTap(_fused_head(forward), pooled, vocab)
        tapped.lm_head, tapped.head = tap, None
        logits = context.run(tapped, ctx, **inputs, logits_to_keep=keep).logits[0]
        hidden = tap.hidden
    else:
        base = getattr(model, model.base_model_prefix)
        states = context.run(base, ctx, **inputs).last_hidden_state[0].index_select(0, keep)
        logits, hidden = _logits(model, states[:n]), states[n:]
    entries = torch.tensor(pooling.entries(), device=hidden.device)
    sums = torch.zeros((len(pooling), hidden.shape[-1]), dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, entries, hidden.float())
    return logits, sums.cpu()  # (on CUDA this waits for the step, on the worker thread)


def _fused_head(forward) -> Callable[[torch.Tensor], torch.Tensor]:
    """The head call acb's fused forward makes on its kept rows' normed hidden states (its
    soft-capping follows in the forward itself): acb's bf16 GEMM over the packed ``lm_head``
    where it has one, else the ``lm_head`` module."""
    packed, gemm = getattr(forward, "head", None), getattr(forward, "bf16", None)
    if packed is None:
        return forward.lm_head
    return lambda h: gemm.linear(h, *packed, dtype=torch.float32)


def _logits(model: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """What transformers' causal LM computes from its base model's hidden states ``h``: the
    ``lm_head``, then the final soft-capping of the models that have one (Gemma 2/3)."""
    logits = model.lm_head(h)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
