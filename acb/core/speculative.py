"""Speculative decoding, the host side: n-gram proposals (prompt lookup) and the
controller that decides how many tokens each row proposes. Plain Python (no torch:
the scheduler imports it).

How a step verifies (docs/speculative.md): a decode row whose last token is known on
the host carries its proposals ``d1..dk`` as extra query tokens (a short varlen row of
``k + 1`` tokens); the runner keeps the logits of all ``k + 1`` positions and samples
each of them exactly as a step without speculation would (processors, warpers, the
seeded noise of that token index); ``Scheduler.update`` accepts proposals while they
equal the token sampled at their position and takes the first sampled token that
differs (or the one after the last proposal) as well. For a greedy row that is "the
longest prefix equal to the argmax, plus the bonus token". For a sampled row it is
standard speculative (rejection) sampling with a point-mass draft: proposal ``t`` is
accepted with probability ``p(t)``, and on rejection the token is drawn from ``p``
without ``t``, renormalised; so the output distribution is the non-speculative one,
and a seeded request's tokens are the very tokens it gets without speculation.
"""

from __future__ import annotations

import math
from typing import Any

# Above this many running rows nobody proposes. Measured (docs/performance.md, SmolLM2 on two
# cores): with 4 streams proposals made each stream 1.76x faster, with 16 they made it 0.90x as
# fast (the verification rows and the steps planned without overlap cost more than the cost
# model below, fitted on step times alone, sees), so the cap sits between.
MAX_SPECULATIVE_ROWS = 8
# A row that stops finding matches or having them accepted proposes 0, and tries again
# after this many of its steps (a probe), so a row whose text turns repetitive comes back.
PROBE_EVERY = 16
_EMA = 0.3  # weight of the newest observation in a row's acceptance average
# ... and in its match average: a try that finds nothing costs no compute (the row runs
# plainly), only the step's overlap, so a row keeps trying for ~14 misses in a row
_MATCH_EMA = 0.15
_MIN_MATCH = 0.1
_DECAY = 0.97  # per step, the forgetting of the step-cost fit
_DRAFT_EMA = 0.3  # weight of the newest chain-step time in a draft model's step cost
_PLACEHOLDER = 0  # a draft model's proposal until it computes it on the device (acb.worker.draft)


class NgramIndex:
    """Every n-gram (``n_min``..``n_max`` tokens) of a growing token list that has a
    continuation, mapped to where its latest occurrence ends. Fed incrementally: a step
    costs a dict insert per new token and n, and a lookup per n."""

    __slots__ = ("n_min", "n_max", "grams", "indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.grams: dict[tuple[int, ...], int] = {}
        self.indexed = 1  # grams ending before this position are in ``grams``

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix of ``tokens`` (``n_max`` down to ``n_min`` tokens) that occurred before;
        [] if none did. Where the occurrence overlaps the suffix, the text is periodic
        and the proposal continues the period."""
        end = len(tokens)
        grams, lo, hi = self.grams, self.n_min, self.n_max
        for e in range(self.indexed, end):  # grams ending at e now have a continuation (tokens[e])
            for n in range(lo, min(hi, e) + 1):
                grams[tuple(tokens[e - n : e])] = e
        self.indexed = max(self.indexed, end)
        for n in range(min(hi, end), lo - 1, -1):
            e = grams.get(tuple(tokens[end - n :]))
            if e is not None:
                out: list[int] = []
                for i in range(k):
                    out.append(tokens[e + i] if e + i < end else out[e + i - end])
                return out
        return []


class RowState:
    """One sequence's speculation: its n-gram index and how its proposals fared."""

    __slots__ = ("index", "accept", "match", "idle", "want")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.index = NgramIndex(n_min, n_max)
        self.accept = 0.7  # per proposed token, the share accepted (a prior that lets it start)
        self.match = 1.0  # the share of its tries that found a proposal
        self.idle = 0  # plans since it last tried to propose (for the probe)
        self.want = False  # whether, as of its last plan, it would propose given its last token


class Speculation:
    """The engine's speculative decoding: proposes each row's tokens (n-gram lookup),
    decides how many (a cost model of the step and each row's measured acceptance), and
    counts what was proposed and accepted (``EngineStats``).

    How many: a step of ``T`` tokens costs about ``a + b * T`` seconds (fitted online from
    the steps' measured times). With ``R`` rows a step makes ``R`` tokens for ``a + b R``;
    a row's ``j``-th proposal adds one token with probability ``accept ** j`` (each needs
    every one before it) for ``b`` more. It pays while ``accept ** j`` exceeds what the
    step already makes per second spent, ``R b / (a + b R)``: a lone row on a
    memory-bound step proposes up to ``num_speculative_tokens``; a large batch
    (compute-bound: ``b R`` dominates) proposes nothing. Above ``MAX_SPECULATIVE_ROWS``
    running rows nobody proposes (measured: see the constant)."""

    def __init__(self, num_tokens: int, n_min: int, n_max: int) -> None:
        self.num_tokens, self.n_min, self.n_max = num_tokens, n_min, n_max
        self.proposed = 0  # tokens proposed
        self.accepted = 0  # of those, accepted
        self.verified_rows = 0  # rows that carried proposals
        # the step-cost fit: decayed sums of 1, T, s, T^2, T s over the steps (T tokens, s seconds)
        self._fit = [0.0] * 5
        self._threshold = 0.0  # this plan's bar for a proposal: R b / (a + b R)
        self.adaptive = True  # False: every row proposes all it may (acb.testing.speculate_always)

    def state(self) -> RowState:
        """A new sequence's speculation state."""
        return RowState(self.n_min, self.n_max)

    # ----------------------------------------------------------------- planning
    def begin_plan(self, running: int) -> None:
        """Before a plan of about ``running`` rows: the bar a proposal must clear."""
        if not self.adaptive:
            self._threshold = 0.0
            return
        if running > MAX_SPECULATIVE_ROWS:
            self._threshold = 1.0
            return
        a, b = self.cost()
        step = a + b * running
        self._threshold = (running * b + self.proposal_overhead()) / step if step > 0 else 0.0

    def wanted(self, row: RowState) -> int:
        """How many tokens this row should propose now (before looking for a match)."""
        if self._threshold >= 1.0:
            return 0
        k = self.num_tokens
        if row.accept <= 0.0:
            worth = 0
        elif row.accept >= 1.0 or self._threshold <= 0.0:
            worth = k
        else:
            worth = int(math.log(max(self._threshold, 1e-9)) / math.log(row.accept))
        if worth <= 0 or row.match < _MIN_MATCH:
            if row.idle < PROBE_EVERY:
                row.idle += 1
                row.want = False
                return 0
            worth = max(worth, 1)  # a probe (until one is tried): would it be accepted now?
        row.want = True
        return min(k, worth)

    def propose(self, row: RowState, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` proposals for the row whose tokens (prompt and output, all known on
        the host) are ``tokens``."""
        found = row.index.propose(tokens, k)
        row.match += _MATCH_EMA * ((1.0 if found else 0.0) - row.match)
        row.idle = 0
        return found

    def want_known_tokens(self, rows: Any) -> bool:
        """Whether the next plan should wait for the step in flight (so the rows' last
        tokens are known and they can propose): some row of ``rows`` would propose. The
        price is the overlap: that plan is made after the step, not while it computes."""
        if len(rows) > MAX_SPECULATIVE_ROWS and self.adaptive:
            return False
        return any(seq.spec is not None and seq.spec.want for seq in rows)

    # ----------------------------------------------------------------- feedback
    def observe_row(self, row: RowState, proposed: int, accepted: int) -> None:
        """A row verified ``proposed`` tokens and accepted ``accepted`` of them."""
        self.proposed += proposed
        self.accepted += accepted
        self.verified_rows += 1
        # per proposal, the chance it is accepted given those before it were: accepted
        # ones were; the first rejected one was not; those after it tell nothing
        tried = accepted + (1 if accepted < proposed else 0)
        rate = accepted / tried
        w = 1.0 - (1.0 - _EMA) ** tried
        row.accept += w * (rate - row.accept)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` tokens computed in ``seconds`` (the cost model's data)."""
        f = self._fit
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            f[i] = f[i] * _DECAY + v

    def cost(self) -> tuple[float, float]:
        """(a, b): a step of T tokens costs about a + b T seconds. Until the steps have
        varied in size, a fixed cost of about 16 tokens' worth is assumed (a small model's
        decode step on a CPU reads every weight once: it is memory-bound)."""
        n, sx, sy, sxx, sxy = self._fit
        if n < 1.0:
            return 16.0, 1.0
        mx, my = sx / n, sy / n
        var = sxx / n - mx * mx
        if var > 1.0:
            b = max((sxy / n - mx * my) / var, 0.0)
            return max(my - b * mx, 0.0), b
        b = my / (mx + 16.0) if mx + 16.0 > 0 else 0.0
        return 16.0 * b, b

    def proposal_overhead(self) -> float:
        """Seconds a step's proposals cost beyond their tokens' share of the step (0 for
        n-gram lookup, done on the host while the step before computes; a draft model's
        chain step: ``DraftSpeculation``)."""
        return 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class DraftSpeculation(Speculation):
    """The controller (``acb.core.speculative.Speculation``) for draft proposals: a row
    proposes placeholders the draft fills on the device (no lookup: a draft always has
    something to propose), and each proposal also costs a share of one step of the draft's
    chain. The chain's steps are timed apart from the step (``observe_draft``); the bar a
    row's ``j``-th proposal must clear becomes ``(R b + c) / (a + b R)`` with ``c`` the
    time of one chain step, shared by the ``R`` rows (all proposing, the case it is built
    for: a lone row pays the whole chain step)."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(num_tokens, 1, 1)
        self.chain_step_s = 0.0  # a moving average of one chain step's time (0 until measured)

    def propose(self, row: Any, tokens: list[int], k: int) -> list[int]:
        row.idle = 0
        return [_PLACEHOLDER] * k

    def observe_draft(self, steps: int, seconds: float) -> None:
        """The draft's chain ran ``steps`` decode steps in ``seconds``."""
        if steps:
            per = seconds / steps
            self.chain_step_s = per if not self.chain_step_s else self.chain_step_s + _DRAFT_EMA * (
                per - self.chain_step_s)

    def proposal_overhead(self) -> float:
        return self.chain_step_s
