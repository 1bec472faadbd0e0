"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the logprob, rank and top-k
alternatives of every prompt token after the first, computed in the prefill steps that
already run.

The path of one request's scores:

1. ``plan_rows`` (loop thread, after ``Scheduler.schedule``): each row of a request that
   wants them scores the prompt positions it computes and no earlier row has scored
   (``PromptSink.planned``, a watermark: rows run in position order, a preempted and
   recomputed prompt is not scored twice). It names, per row, the positions and their
   targets (the next prompt token of each) in a ``PromptLogprobRows`` on the
   ``StepInput``.
2. The runner (``ModelRunner``) keeps those positions' logits too (after the sampled
   rows' in ``logits_to_keep``), splits them off before sampling and ``score``s them: one
   float32 log-softmax per block of positions. ``StepOutput.prompt_logprobs`` carries the
   flat results.
3. ``PromptSink.take`` (loop thread, before the step's tokens are delivered): the scores
   land at their positions; when the last one has, the request's ``PromptLogprobs`` is
   complete and goes to each choice's mailbox, so it rides on the first ``Chunk`` of each
   choice, and to every ``Completion``.

A request that scores its prompt does not read the prefix cache: a cached page holds keys
and values, not the logits its tokens' scores need, so such a prompt is computed whole
(its pages are still registered for other requests to hit). Results of a row that went
stale (its request preempted since) are kept: the logits were computed all the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .step import PromptLogprobRows, Scores, StepPlan  # noqa: F401  (the step's payloads)

if TYPE_CHECKING:
    import torch

# positions scored per log-softmax: bounds the float32 [block, vocab] temporary
_BLOCK = 256


@dataclass(slots=True)
class PromptLogprobs:
    """The prompt's scores, one entry per prompt token (``Completion.prompt_logprobs``,
    the first ``Chunk`` of each choice). The first token has no score: its entries are
    None.

    Attributes:
        token_ids: the prompt's token ids.
        logprobs: each token's log-probability given the tokens before it.
        ranks: each token's rank among the vocabulary by that probability (1 = most likely).
        top_logprobs: each position's ``k`` most likely tokens, {token id: logprob} (empty
            dicts with ``prompt_logprobs=0``).
    """

    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top_logprobs: list[dict[int, float] | None]

    def __len__(self) -> int:
        return len(self.token_ids)


def score(logits: torch.Tensor, rows: PromptLogprobRows) -> Scores:
    """The scores of ``logits`` [positions, vocab] (one row per scored position, in the
    order of ``rows``) against their targets, with the most alternatives any row asks for."""
    import torch

    targets = torch.tensor(rows.targets, device=logits.device)
    k = min(max(rows.k), logits.shape[-1])
    lps, ranks, top_ids, top_lps = [], [], [], []
    for a in range(0, logits.shape[0], _BLOCK):
        lsm = torch.log_softmax(logits[a : a + _BLOCK].float(), dim=-1)
        lp = lsm.gather(1, targets[a : a + _BLOCK, None])
        lps.append(lp[:, 0])
        ranks.append((lsm > lp).sum(dim=-1) + 1)
        if k:
            values, ids = lsm.topk(k, dim=-1)
            top_ids.append(ids)
            top_lps.append(values)
    cat = torch.cat
    if not k:
        empty = [[] for _ in rows.targets]
        return cat(lps).tolist(), cat(ranks).tolist(), empty, list(empty)
    return cat(lps).tolist(), cat(ranks).tolist(), cat(top_ids).tolist(), cat(top_lps).tolist()


class PromptSink:
    """One request's prompt scores as they arrive (shared by the choices of an n > 1
    request: they share its prompt). ``members``: the live requests it completes."""

    __slots__ = ("prompt_ids", "k", "planned", "filled", "logprobs", "ranks", "top", "members", "result")

    def __init__(self, prompt_ids: list[int], k: int, members: list[Any]) -> None:
        self.prompt_ids = prompt_ids
        self.k = k
        self.planned = 0  # positions [0, planned) are scored by a planned step (position p scores token p + 1)
        self.filled = 0
        n = len(prompt_ids)
        self.logprobs: list[float | None] = [None] * n
        self.ranks: list[int | None] = [None] * n
        self.top: list[dict[int, float] | None] = [None] * n
        self.members = members
        self.result: PromptLogprobs | None = None
        if n <= 1:
            self._complete()

    @property
    def wanted(self) -> int:
        """Positions scored in all: every prompt position but the last (whose next token
        is the first generated one)."""
        return len(self.prompt_ids) - 1

    def take(self, at: int, count: int, scores: Scores, offset: int) -> bool:
        """Store positions [at, at + count) from ``scores`` at ``offset``; True when that
        completes the prompt."""
        lps, ranks, top_ids, top_lps = scores
        k = self.k
        for p in range(count):
            j = offset + p
            self.logprobs[at + p + 1] = lps[j]
            self.ranks[at + p + 1] = ranks[j]
            self.top[at + p + 1] = dict(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
        self.filled += count
        if self.filled >= self.wanted and self.result is None:
            self._complete()
            return True
        return False

    def _complete(self) -> None:
        self.result = PromptLogprobs(list(self.prompt_ids), self.logprobs, self.ranks, self.top)


def plan_rows(plan: StepPlan, live: dict[str, Any]) -> tuple[PromptLogprobRows | None, list[tuple[PromptSink, int]]]:
    """The prompt positions ``plan`` scores (None: none), and per scoring row its sink and
    first position, in row order (what ``StepPlan.prompt_sinks`` keeps for delivery)."""
    rows = PromptLogprobRows()
    sinks: list[tuple[PromptSink, int]] = []
    inp = plan.input
    offsets = inp.token_offsets
    for i, seq in enumerate(plan.seqs):
        req = live.get(seq.seq_id)
        if req is None or req.seq is not seq or req.prompt_sink is None:
            continue
        sink = req.prompt_sink
        start = inp.starts[i]
        lo = max(start, sink.planned)
        hi = min(start + offsets[i + 1] - offsets[i], sink.wanted)
        if hi <= lo:
            continue
        rows.add(i, lo - start, seq.prompt_ids[lo + 1 : hi + 1], sink.k)
        sink.planned = hi
        sinks.append((sink, lo))
    return (rows if sinks else None), sinks


__all__ = ["PromptLogprobRows", "PromptLogprobs", "PromptSink", "plan_rows", "score"]
