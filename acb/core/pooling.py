"""Embeddings (``Engine.embed``): a prompt's final hidden states (after the model's final
norm, what transformers' ``model.model(...).last_hidden_state`` holds) pooled into one
vector, computed by prefill-only requests in the steps the engine runs anyway.

The path of one request's vector:

1. Its sequence is prefill-only (``Sequence.prefill_only``): it waits in a queue of its own
   and its rows are planned after every other row of a step, within the embedding share
   (``EngineConfig.max_embedding_tokens``), so embeddings never starve generation
   (``acb.core.scheduler``). Its rows sample nothing.
2. ``plan_pooling`` (loop thread, after ``Scheduler.schedule``): each row of such a request
   pools the positions it computes that its pooling wants and no earlier row has pooled
   (``PoolSink.planned``, a watermark: a preempted and recomputed prompt is not pooled
   twice), named in a ``PoolingRows`` on the ``StepInput``.
3. The runner (``acb.worker.runner``) keeps those positions' final hidden states, sums them
   per entry in float32 and returns the sums (``StepOutput.pooled``).
4. ``PoolSink.take`` (loop thread): the sums add up; when the last wanted position has
   arrived the request's vector is complete (divided by the count, L2-normalized if asked:
   ``acb.engine.embeddings``) and the request ends.

What each pooling wants: ``last`` the last prompt position (how Qwen3-Embedding and other
decoder embedders pool), ``mean`` every position, ``cls`` the first. A request pooling
``mean`` or ``cls`` does not read the prefix cache (a cached page holds keys and values, not
the hidden states of its positions), so its prompt is computed whole; ``last`` may start
from the cache, which always leaves the last prompt token to compute. ``cls`` ends on its first
position, which in a causal decoder sees the first token only: that token is all such a
request computes (``acb.engine.embeddings``). Plain
Python: the sums are the runner's tensors, only added here.
"""

from __future__ import annotations

from typing import Any

from .step import PoolingRows, StepPlan

POOLINGS = ("last", "mean", "cls")


class PoolSink:
    """One request's pooled positions as they arrive: it wants positions [``lo``, ``hi``) of
    its prompt; ``total`` is the sum of their hidden states so far."""

    __slots__ = ("pooling", "normalize", "lo", "hi", "planned", "filled", "total")

    def __init__(self, pooling: str, num_tokens: int, normalize: bool = True) -> None:
        self.pooling = pooling
        self.normalize = normalize  # the vector is L2-normalized once complete
        self.lo, self.hi = {"last": (num_tokens - 1, num_tokens), "cls": (0, 1), "mean": (0, num_tokens)}[pooling]
        self.planned = self.lo  # positions [lo, planned) are pooled by a planned step
        self.filled = 0
        self.total: Any = None

    @property
    def count(self) -> int:
        """Positions pooled in all."""
        return self.hi - self.lo

    @property
    def complete(self) -> bool:
        return self.filled >= self.count

    def take(self, count: int, total: Any) -> bool:
        """Add ``count`` positions' summed hidden states ``total``; True when that completes it."""
        self.total = total if self.total is None else self.total + total
        self.filled += count
        return self.complete


def plan_pooling(plan: StepPlan, live: dict[str, Any]) -> tuple[PoolingRows | None, list[Any]]:
    """The positions ``plan`` pools (None: none), and per entry its live request (whose
    ``pool_sink`` takes them), in row order (what ``StepPlan.pooled_requests`` keeps for delivery)."""
    rows = PoolingRows()
    sinks: list[Any] = []
    inp = plan.input
    offsets = inp.token_offsets
    for i, seq in enumerate(plan.seqs):
        if not seq.prefill_only:
            continue
        req = live.get(seq.seq_id)
        if req is None or req.seq is not seq or req.pool_sink is None:
            continue
        sink = req.pool_sink
        start = inp.starts[i]
        lo = max(start, sink.planned)
        hi = min(start + offsets[i + 1] - offsets[i], sink.hi)
        if hi <= lo:
            continue
        rows.add(i, lo - start, hi - lo)
        sink.planned = hi
        sinks.append(req)
    return (rows if sinks else None), sinks


__all__ = ["POOLINGS", "PoolSink", "PoolingRows", "plan_pooling"]
