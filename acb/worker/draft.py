"""Speculative decoding with a draft model (``EngineConfig(speculative_method="draft",
draft_model=...)``): a smaller model that shares the target's tokenizer proposes each
row's next tokens, and the target's step verifies them exactly as it verifies n-gram
proposals (``acb.core.speculative``; docs/speculative.md).

The draft's cache mirrors the target's. It has its own KV tensors (the draft's layers,
heads and head size) over the same page ids and block tables: the same number of pages
of the same size, the same block-table deltas, page copies (copy-on-write), swaps to and
from its own host offload pool and first-use zeroing as the target's store, all applied
from the same ``StepInput``. Every step the draft runs its forward over the step's very
tokens and positions, so whatever the target's cache holds at a page and offset (a
prefix-cache hit, a forked choice's shared pages, a restored offload), the draft's cache
holds the draft's KV of the same tokens there. Nothing on the host tracks the draft.

A row that proposes ``k`` tokens is planned like an n-gram row, its ``k`` proposals
being placeholders, with pages for every position; on the step thread, after the
target's inputs are built and before its forward, the draft runs ``k`` greedy decode
steps over the proposing rows (each reads the positions before it, written by earlier
steps' mirrors and the steps of this chain) and writes its tokens over the placeholders
on the device; then its mirror forward, then the target's. The proposals come back with
the step's sampled ids (``StepOutput.proposals``) for the scheduler to verify. The KV the
draft wrote for rejected proposals is overwritten by the next row, as the target's is.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from ..attention import context
from ..attention import metadata as packing
from ..attention import routing as attention_routing

log = logging.getLogger("acb")

_PLACEHOLDER = 0  # a proposal's token id until the draft computes it on the device (acb.core.speculative)


def _attention_kind(config) -> tuple[int | None, str]:
    """(sliding window or None, "full" | "hybrid" | "sliding"), as ``acb.worker.sizing.layout``
    decides a model's page pools."""
    from ..core.model_shape import text_config

    text = text_config(config)
    window = getattr(text, "sliding_window", None)
    types = list(getattr(text, "layer_types", None) or [])
    if window is None or not any(t == "sliding_attention" for t in (types or ["sliding_attention"])):
        return None, "full"
    if types and not all(t == "sliding_attention" for t in types):
        return window, "hybrid"
    return window, "sliding"


def prepare(target: torch.nn.Module, config) -> torch.nn.Module:
    """The draft model of ``config.draft_model`` (a local folder, loaded like the target,
    or a model object), on the target's device and in its dtype; ValueError naming
    ``draft_model`` when it cannot propose for ``target``: another vocabulary, or another
    attention layout (its cache mirrors the target's page pools, which the target's
    sliding window, if any, recycles)."""
    source = config.draft_model
    param = next(target.parameters())
    if isinstance(source, str | os.PathLike):
        from ..model.loading import load

        try:
            draft, _ = load(source, dtype=param.dtype, device=str(param.device))
        except (OSError, ValueError) as e:
            raise ValueError(f"EngineConfig.draft_model {str(source)!r} could not be loaded: {e}") from None
    elif isinstance(source, torch.nn.Module) and hasattr(source, "config"):
        draft = source
        own = next(draft.parameters())
        if own.device != param.device or own.dtype != param.dtype:
            log.info("acb: moving the draft model to %s, %s (the target's)", param.device, param.dtype)
            draft.to(device=param.device, dtype=param.dtype)
    else:
        raise ValueError(f"EngineConfig.draft_model must be a model folder or a transformers model object, "
                         f"got {type(source).__name__}")
    draft.eval()
    vocab, own_vocab = target.get_input_embeddings().num_embeddings, draft.get_input_embeddings().num_embeddings
    if vocab != own_vocab:
        raise ValueError(f"EngineConfig.draft_model has a vocabulary of {own_vocab} tokens, the model {vocab}: "
                         f"the draft must share the model's tokenizer")
    if _attention_kind(draft.config) != _attention_kind(target.config):
        raise ValueError(f"EngineConfig.draft_model's attention layout (sliding window, layers) "
                         f"{_attention_kind(draft.config)} differs from the model's {_attention_kind(target.config)}: "
                         f"the draft's cache mirrors the model's page pools")
    return draft


class DraftRunner:
    """The draft model's side of the step thread: its KV store (mirroring the target
    runner's), its attention metadata and forwards. ``prepare`` applies a step's table
    deltas and page moves to its store; ``run`` proposes into the step's input ids and
    mirrors the step. Built by the target ``ModelRunner`` (``attach``)."""

    def __init__(self, model: torch.nn.Module, target: Any, config) -> None:
        from .fast_paths import FastPaths
        from .kv_store import KVStore

        tkv = target.kv
        self.model = model
        self._tensor = tkv.to_device
        self.kv = KVStore(model.config, target.dtype, target.device, tkv.num_pages, tkv.page_size, self._tensor,
                          tkv.offload.pool.shape[0] if tkv.offload is not None else 0, tkv.swa_pages,
                          _swa_layers(model.config) if tkv.swa_layers else frozenset())
        self.attention = packing.AttentionBuilder(target.attn_backend, tkv.page_size, self._tensor, self.kv.k_cache,
                                                  self.kv.v_cache, self.kv.tables, self.kv.swa_layers)
        self._routed = attention_routing.route_model(model.config)
        if model is target.model:  # a self-draft: the target's fast paths serve it too
            self.paths, self._own_paths = target.fast_paths, False
        else:
            self.paths, self._own_paths = FastPaths(model, self.kv, target.attn_backend, target.stream,
                                                    target.generator), True
            # never padded, never from a CUDA graph: the draft's steps run eagerly
            self.paths.configure(dataclasses.replace(config, use_cuda_graph=False, q_padding_interval_size=0,
                                                     kv_padding_interval_size=0), 1)
        self.cpu = target.stream is None
        self.chain_steps = 0  # decode steps of the last step's chain
        self.chain_s = 0.0  # and their time (CPU: wall time on the step thread; CUDA: not measured, 0)

    def prepare(self, step) -> None:
        """The step's block-table deltas, page moves and first-use zeroing, on the draft's store."""
        self.kv.update_tables(step)
        self.kv.move_pages(step)
        self.kv.zero_new_pages(step)

    def run(self, step, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Fill the step's proposal placeholders in ``input_ids`` (the target's packed ids,
        carried tokens in place) with the draft's greedy tokens, then run the draft over
        the whole step (its cache stays in step). The packed index of each proposal, in
        row order (None: no row proposes)."""
        start = time.perf_counter()
        self.chain_steps = 0
        index = self._chain(step, input_ids) if any(step.drafts) else None
        self.chain_s = time.perf_counter() - start if self.cpu else 0.0
        self._mirror(step, input_ids)
        return index

    def release(self) -> None:
        if self._own_paths:
            self.paths.release()
        self.paths = None
        self.kv.release()
        self.attention = None
        for config in self._routed:
            attention_routing.unroute(config)
        self._routed = []

    # ------------------------------------------------------------------------------
    def _chain(self, step, input_ids: torch.Tensor) -> torch.Tensor:
        """``max(drafts)`` greedy decode steps of the draft over the proposing rows: step
        ``j`` reads each row's token at position ``start + j`` (its known last token, then
        its proposals) and writes its argmax over the proposal after it."""
        rows = [(step.token_offsets[i], step.starts[i], step.table_rows[i], d)
                for i, d in enumerate(step.drafts) if d]
        index = self._tensor([q0 + 1 + t for q0, _, _, d in rows for t in range(d)])
        token = input_ids[self._tensor([q0 for q0, _, _, _ in rows])]
        for j in range(max(d for *_, d in rows)):
            live = [r for r, (*_, d) in enumerate(rows) if d > j]
            if len(live) < len(rows):
                token = token[self._tensor(live)]
                rows = [rows[r] for r in live]
            p = packing.Packed(tokens=[_PLACEHOLDER] * len(rows), positions=[s + j for _, s, _, _ in rows],
                               token_rows=[t for _, _, t, _ in rows], keep=list(range(len(rows))),
                               decode_q=list(range(len(rows))), lengths=[s + j + 1 for _, s, _, _ in rows],
                               table_rows=[t for _, _, t, _ in rows])
            logits = self._forward(p, token)
            token = logits.argmax(-1)
            input_ids[self._tensor([q0 + 1 + j for q0, _, _, _ in rows])] = token
            self.chain_steps += 1
        return index

    def _mirror(self, step, input_ids: torch.Tensor) -> None:
        """The draft's forward over the step's tokens (its logits unused: one row kept)."""
        p = packing.pack(step)
        if not p.tokens:
            return
        p.keep = [len(p.tokens) - 1]
        self._forward(p, input_ids[: len(p.tokens)])

    def _forward(self, p: packing.Packed, ids: torch.Tensor) -> torch.Tensor:
        """The draft's logits at ``p.keep`` for the packed step ``p`` with input ids ``ids``."""
        positions = self._tensor(p.positions)
        rows = self._tensor(p.token_rows)
        tables = self.kv.tables
        slots = tables.slots(rows, positions)
        swa = tables.slots(rows, positions, sliding=True) if self.kv.swa_layers else None
        meta = self.attention.build(p, slots, swa, max(p.lengths, default=0), False, self.paths.max_decode_blocks)
        out = context.run(self.paths.forward_for(meta), context.ForwardContext(meta), input_ids=ids.unsqueeze(0),
                          position_ids=positions.unsqueeze(0), attention_mask=None, use_cache=False,
                          logits_to_keep=self._tensor(p.keep))
        return out.logits[0]


def fill_penalty_history(step, proposals: list[int]) -> None:
    """Put the draft's ``proposals`` (the step's, in row order) over the placeholders at
    the end of each penalised sampling entry's history: the entry at a row's ``t``-th
    proposal position was planned with the ``t`` proposals before it as placeholders
    (``acb.engine.live``), so that penalties count them as a step without speculation would
    count those tokens."""
    where: list[tuple[int, int]] = []  # per sampling entry: (its row's first proposal, proposals before it)
    at = 0
    for i, sample in enumerate(step.sample):
        if sample:
            d = step.drafts[i]
            where += [(at, t) for t in range(d + 1)]
            at += d
    c = step.sampling.controls
    for entry, history in zip(c.penalized, c.history, strict=True):
        first, t = where[entry]
        if t:
            history[-t:] = proposals[first : first + t]


def _swa_layers(config) -> frozenset[int]:
    """The sliding-window layers of a hybrid model (``acb.worker.sizing.layout``'s rule)."""
    from ..core.model_shape import text_config

    types = list(getattr(text_config(config), "layer_types", None) or [])
    return frozenset(i for i, t in enumerate(types) if t == "sliding_attention")
