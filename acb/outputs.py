"""The output side: a step's tokens become text and chunks. For each token
``Scheduler.update`` took into a sequence it detokenizes, matches stop strings and
grammars, fills the request's mailbox and, when the request ends, its ``Completion``.
A request that a stop string or its grammar ends is handed back to the scheduler,
which releases its pages. Runs on the event loop's thread only.

``Outputs`` holds the table of live requests the engine registers into (request id ->
``acb.live.LiveRequest``); finishing, cancelling or failing a request here takes it
out of the scheduler too (its pages come back at once).
"""

from __future__ import annotations

import logging
import time

from .errors import RequestFailedError, caused
from .live import Choices, LiveRequest
from .prompt_logprobs import PromptSink
from .request import Completion
from .scheduler import Scheduler
from .step import StepOutput, StepPlan, StepUpdate

log = logging.getLogger("acb")


class Outputs:
    """The live requests and what reaches them: tokens, text, finishes and failures."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.live: dict[str, LiveRequest] = {}
        self.deadlines = 0  # live requests with a timeout_s: the engine scans for expired ones while > 0
        self.groups: dict[str, Choices] = {}  # requests with n > 1, by request id
        self.scoring: set[PromptSink] = set()  # prompt_logprobs still to compute: the engine plans them while any

    def __contains__(self, request_id: str) -> bool:
        """Whether ``request_id`` names a live request."""
        return request_id in self.live or request_id in self.groups

    def add(self, req: LiveRequest) -> None:
        """Make ``req`` live (counting its deadline)."""
        self.live[req.request_id] = req
        if req.deadline is not None:
            self.deadlines += 1

    def _forget(self, req: LiveRequest) -> None:
        """``req`` is no longer live: its pages go back and its deadline stops counting."""
        if self.live.pop(req.request_id, None) is not None and req.deadline is not None:
            self.deadlines -= 1
        self.scheduler.finish(req.seq)
        sink = req.prompt_sink
        if sink is not None and sink in self.scoring and not any(m.request_id in self.live for m in sink.members):
            self.scoring.discard(sink)

    def expired(self, now: float) -> list[LiveRequest]:
        """The live requests whose deadline is at or before ``now``."""
        return [r for r in self.live.values() if r.deadline is not None and r.deadline <= now]

    def next_deadline(self) -> float | None:
        """The nearest deadline of a live request, or None."""
        return min((r.deadline for r in self.live.values() if r.deadline is not None), default=None)

    def _member_done(self, req: LiveRequest) -> None:
        if req.group is not None and req.group.member_done():
            self.groups.pop(req.group.request_id, None)

    def step_failed(self, plan: StepPlan, error: BaseException) -> None:
        """Fail the requests of a step that raised (the engine goes on serving)."""
        rows, restored = self.scheduler.step_failed(plan)
        for seqs, why in ((restored, " (its offloaded KV came from it)"), (rows, "")):
            for seq in seqs:
                req = self.live.get(seq.seq_id)
                if req is not None and req.seq is seq:
                    self.fail(req, caused(RequestFailedError(
                        f"the model step failed for request {req.request_id}{why}: {error!r}", req.request_id), error))

    def score_prompt(self, members: list[LiveRequest], k: int) -> None:
        """``members`` (a request, or the choices of one) score their shared prompt with
        ``k`` alternatives per token (``SamplingParams.prompt_logprobs``)."""
        sink = PromptSink(members[0].seq.prompt_ids, k, members)
        for req in members:
            req.prompt_sink = sink
        if sink.result is None:
            self.scoring.add(sink)
        else:  # a one-token prompt: nothing to compute
            self._prompt_scored(sink)

    def deliver_prompt_logprobs(self, plan: StepPlan, out: StepOutput) -> None:
        """Store a step's prompt scores (before its tokens are delivered, so a prompt
        completed by the step that samples its first token rides on that token's chunk)."""
        scores = out.prompt_logprobs
        if scores is None:
            return
        rows = plan.input.prompt_logprobs
        offset = 0
        for (sink, first), count in zip(plan.prompt_sinks, rows.counts, strict=True):
            if sink.take(first, count, scores, offset):
                self.scoring.discard(sink)
                self._prompt_scored(sink)
            offset += count

    def _prompt_scored(self, sink: PromptSink) -> None:
        for req in sink.members:
            if req.mailbox is not None and self.live.get(req.request_id) is req:
                req.mailbox.put_prompt_logprobs(sink.result)

    def deliver(self, update: StepUpdate, out: StepOutput) -> None:
        """Turn the tokens ``Scheduler.update`` took into their requests' text and chunks."""
        now = time.monotonic()
        for seq, j, reason in zip(update.seqs, update.samples, update.reasons, strict=True):
            req = self.live.get(seq.seq_id)
            if req is None or req.seq is not seq:
                continue
            top = (out.top_ids[j], out.top_logprobs[j]) if out.top_ids is not None else None
            self.on_token(req, out.token_ids[j], out.logprobs[j] if out.logprobs is not None else None, top,
                          reason, now)

    def scheduled(self, plan: StepPlan) -> None:
        """Stamp the requests ``plan`` took out of the queue for the first time (their
        ``RequestMetrics.scheduled_time``)."""
        now = time.monotonic()
        for seq in plan.admitted:
            req = self.live.get(seq.seq_id)
            if req is not None and req.seq is seq and req.metrics.scheduled_time is None:
                req.metrics.scheduled_time = now

    def on_token(self, req: LiveRequest, token: int, logprob: float | None,
                 top: tuple[list[int], list[float]] | None = None, finish: str | None = None,
                 now: float | None = None) -> None:
        """``token`` was taken into ``req``'s sequence (at ``now``, default the present), ending
        it with ``finish`` (None: it goes on); a stop string or a completed grammar ends it too."""
        params = req.params
        m = req.metrics
        m.last_token_time = now = time.monotonic() if now is None else now
        if m.first_token_time is None:
            m.first_token_time = now
        if req.matcher is not None and not req.matcher.is_terminated():
            if not req.matcher.accept_token(token):
                log.warning("acb: request %s: token %d breaks its grammar", req.request_id, token)
            if req.matcher.is_terminated() and finish in (None, "length"):
                finish = "stop"  # the grammar is complete (its stop token, or ignore_eos)
        text = req.detok.step() if req.detok is not None else ""
        matched = False
        if self._checks_stop_strings(req):
            text, matched = req.stopper.push(text)
        if matched:
            finish = "stop"  # the text ends before the stop string; nothing more to flush
        elif finish is not None:
            text += self.flush_text(req)
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(logprob)
        lp = [logprob] if (params.logprobs and logprob is not None) else None
        alternatives = None
        if req.top_logprobs is not None and top is not None:
            k = params.top_logprobs
            alternatives = [dict(zip(top[0][:k], top[1][:k], strict=True))]
            req.top_logprobs.extend(alternatives)
        if finish is None:
            reasoning, text, mask = self._split(req, text, 1, final=False)
            req.text_parts.append(text)
            if req.mailbox is not None:
                req.mailbox.put([token], text, lp, top_logprobs=alternatives, reasoning=reasoning, reasoning_mask=mask)
        else:
            self.finish(req, finish, text, [token], lp, alternatives)  # hands a stop string's finish back

    @staticmethod
    def _checks_stop_strings(req: LiveRequest) -> bool:
        """Whether stop strings are looked for in the text of the token just taken: not
        within the first ``min_new_tokens`` tokens (vLLM's ``min_tokens``), whose text goes
        out unchecked, so a stop string must lie wholly in the text that follows them."""
        return bool(req.params.stop) and len(req.seq.output_ids) > req.params.min_new_tokens

    def flush_text(self, req: LiveRequest) -> str:
        """Text held back by the detokenizer and the stop matcher, for a request that
        ends without a stop-string match."""
        text = req.detok.flush() if req.detok is not None else ""
        if self._checks_stop_strings(req):
            text, matched = req.stopper.push(text)
            if not matched:
                text += req.stopper.flush()
        return text

    def finish(self, req: LiveRequest, reason: str, text: str, token_ids: list[int] | None = None,
               logprobs: list[float] | None = None, top_logprobs: list[dict[int, float]] | None = None) -> None:
        """End ``req`` with ``reason`` (its sequence leaves the scheduler, if it has not
        already): the last chunk to its mailbox, its ``Completion`` to its future."""
        self._forget(req)
        req.finish_reason = reason
        reasoning, text, mask = self._split(req, text, len(token_ids or ()), final=True)
        req.text_parts.append(text)
        req.metrics.finish_time = time.monotonic()
        self._count(req)
        if req.mailbox is not None:
            req.mailbox.metrics = req.metrics
            req.mailbox.put(token_ids or [], text, logprobs, reason, top_logprobs, reasoning=reasoning,
                            reasoning_mask=mask)
        if not req.future.done():
            req.future.set_result(self.completion(req))
        self._member_done(req)

    @staticmethod
    def _split(req: LiveRequest, text: str, tokens: int, final: bool) -> tuple[str, str, list[bool] | None]:
        """(reasoning, answer, per-token reasoning flags) of the text of ``tokens`` new tokens,
        with a reasoning parser; else ("", text, None). A token is the reasoning's when the
        output was in (or could still open) its thought and the token added no answer text."""
        splitter = req.reasoning
        if splitter is None:
            return "", text, None
        before = splitter.in_reasoning
        reasoning, answer = splitter.push(text, final)
        req.reasoning_parts.append(reasoning)
        return reasoning, answer, [before and not answer] * tokens

    def fail(self, req: LiveRequest, error: BaseException) -> None:
        """End ``req`` with ``error`` (and the other choices of its request with it)."""
        self._forget(req)
        req.metrics.finish_time = time.monotonic()
        if req.mailbox is not None:
            req.mailbox.fail(error)
        if not req.future.done():
            req.future.set_exception(error)
        if req.group is not None:  # a failed choice fails its request: the others with it
            for other in req.group.members:
                if other.request_id in self.live:
                    self.fail(other, error)
        self._member_done(req)

    def fail_all(self, error_for) -> None:
        """Fail every live request with ``error_for(request)``."""
        for req in list(self.live.values()):
            self.fail(req, error_for(req))

    @staticmethod
    def _count(req: LiveRequest) -> None:
        """Copy the sequence's counts into the request's metrics."""
        seq = req.seq
        m = req.metrics
        m.num_generated_tokens = len(seq.output_ids)
        m.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
        m.num_preemptions = seq.num_preemptions

    @classmethod
    def completion(cls, req: LiveRequest) -> Completion:
        seq = req.seq
        m = req.metrics
        cls._count(req)
        return Completion(
            request_id=req.group.request_id if req.group is not None else req.request_id,
            prompt_token_ids=list(seq.prompt_ids), token_ids=list(seq.output_ids),
            text="".join(req.text_parts), logprobs=req.logprobs, finish_reason=req.finish_reason, metrics=m,
            top_logprobs=req.top_logprobs, index=req.index,
            prompt_logprobs=req.prompt_sink.result if req.prompt_sink is not None else None,
            reasoning_text="".join(req.reasoning_parts) if req.reasoning_parts is not None else None,
        )
