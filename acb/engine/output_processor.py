"""The output side: a step's tokens become text and chunks. For each token
``Scheduler.update`` took into a sequence it detokenizes, matches stop strings and
grammars, fills the request's mailbox and, when the request ends, its ``Completion``.
A request that a stop string or its grammar ends is handed back to the scheduler,
which releases its pages. Runs on the event loop's thread only.

``Outputs`` ends requests (finished, cancelled, expired or failed) and takes them out
of the request table (``acb.engine.request_table``) and, if they have not finished there
already, out of the scheduler (their pages come back at once). Which rows of a step
are still current is the scheduler's to say (``Scheduler.update``); a row it handed
on is skipped here only if an earlier row of the same step ended it (a failed choice
fails every choice of its request).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..core.errors import RequestFailedError, caused
from ..core.eventloop import LoopHandle
from ..core.outputs import Completion
from ..core.step import StepOutput, StepPlan, StepUpdate
from .embeddings import vector
from .live import LiveRequest
from .request_table import RequestTable

log = logging.getLogger("acb")


class Outputs:
    """What reaches the live requests of ``table``: tokens, text, finishes and failures."""

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        self.live = table.live

    def step_failed(self, plan: StepPlan, error: BaseException) -> None:
        """Fail the requests of a step that raised (the engine goes on serving)."""
        rows, restored = self.table.scheduler.step_failed(plan)
        for seqs, why in ((restored, " (its offloaded KV came from it)"), (rows, "")):
            for seq in seqs:
                req = self.live.get(seq.seq_id)
                if req is not None:  # not failed with another choice of its request already
                    self.fail(req, caused(RequestFailedError(
                        f"the model step failed for request {req.request_id}{why}: {error!r}", req.request_id), error))

    def processors_failed(self, failures: list[tuple[str, Any, BaseException]]) -> None:
        """Fail each request whose own logits processor raised or returned another shape
        (``Controls.failures``: request id, processor, error); the engine goes on."""
        for request_id, processor, error in failures:
            req = self.live.get(request_id)
            if req is None:  # failed by an earlier entry (another position, another choice)
                continue
            name = getattr(processor, "__qualname__", None) or type(processor).__qualname__
            log.warning("acb: request %s: its logits processor %s failed: %r", request_id, name, error)
            self.fail(req, caused(RequestFailedError(
                f"request {request_id}: its logits processor {name} failed: {error!r}", request_id), error))

    def cancel(self, request_id: str, index: int | None = None, loop: LoopHandle | None = None) -> bool:
        """End a live request (with ``n`` > 1 every choice, or choice ``index``) with
        ``finish_reason="cancelled"``; False if there is none. Called from a thread other
        than ``loop``'s, it hands the cancel to the loop (True if the request was live)."""
        if loop is not None and not loop.in_loop_thread():
            if request_id not in self.table:
                return False
            loop.call_soon_threadsafe(self.cancel, request_id, index)
            return True
        group = self.table.groups.get(request_id)
        if group is not None:
            members = group.members if index is None else group.members[index:index + 1] if index >= 0 else []
            return any([self.cancel(m.request_id) for m in members])
        req = self.live.get(request_id)
        if req is None:
            return False
        self.finish(req, "cancelled", self.flush_text(req))
        return True

    def expire(self, now: float) -> None:
        """End every request whose ``timeout_s`` has run out by ``now`` with
        ``finish_reason="timeout"``, its partial output kept."""
        for req in self.table.expired(now):
            if self.live.get(req.request_id) is req:
                self.finish(req, "timeout", self.flush_text(req))

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
                self.table.scoring.discard(sink)
                self.table.prompt_scored(sink)
            offset += count

    def deliver_pooled(self, plan: StepPlan, out: StepOutput) -> None:
        """Add a step's pooled hidden states to their requests' sinks; a request whose sink
        is complete ends with its vector (``acb.engine.embeddings.vector``)."""
        counts = plan.input.pooling.counts
        for j, req in enumerate(plan.pooled_requests):
            if self.live.get(req.request_id) is not req:  # cancelled or failed meanwhile
                continue
            if req.pool_sink.take(counts[j], out.pooled[j]):
                self.table.forget(req)  # (its sequence ends here: its pages come back)
                req.finish_reason = "embedded"
                req.metrics.finish_time = req.metrics.last_token_time = time.monotonic()
                req.future.set_result(vector(req.pool_sink))

    def deliver(self, update: StepUpdate, out: StepOutput) -> None:
        """Turn the tokens ``Scheduler.update`` took into their requests' text and chunks."""
        now = time.monotonic()
        live = self.live
        ids = out.token_ids
        for seq, j, reason, end in zip(update.seqs, update.samples, update.reasons, update.ends, strict=True):
            req = live.get(seq.seq_id)
            if req is None:  # ended by an earlier row (or token: a stop string) of this step
                continue
            if reason is None and req.plain:  # what on_token does with such a token, in short
                m = req.metrics
                m.last_token_time = now
                if m.first_token_time is None:
                    m.first_token_time = now
                text = req.detok.step(end) if req.detok is not None else ""
                req.text_parts.append(text)
                if req.mailbox is not None:
                    req.mailbox.put([ids[j]], text, None)
                continue
            top = (out.top_ids[j], out.top_logprobs[j]) if out.top_ids is not None else None
            self.on_token(req, ids[j], out.logprobs[j] if out.logprobs is not None else None, top, reason, now, end)

    def on_token(self, req: LiveRequest, token: int, logprob: float | None,
                 top: tuple[list[int], list[float]] | None = None, finish: str | None = None,
                 now: float | None = None, end: int | None = None) -> None:
        """``token`` was taken into ``req``'s sequence (at ``now``, default the present), ending
        it with ``finish`` (None: it goes on); a stop string or a completed grammar ends it too.
        ``end``: the sequence's generated tokens up to this one (default: all of them; fewer
        when a row that verified proposals took several in at once, and if this one ends
        the request, those after it are dropped)."""
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
        text = req.detok.step(end) if req.detok is not None else ""
        matched = False
        if self._checks_stop_strings(req, end):
            text, matched = req.stopper.push(text)
        if matched:
            finish = "stop"  # the text ends before the stop string; nothing more to flush
        if finish is not None and end is not None and end < len(req.seq.output_ids):
            self.table.scheduler.truncate(req.seq, end)
        if finish is not None and not matched:
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
    def _checks_stop_strings(req: LiveRequest, end: int | None = None) -> bool:
        """Whether stop strings are looked for in the text of the token just taken (the
        ``end``-th generated one, default the last): not within the first
        ``min_new_tokens`` tokens (vLLM's ``min_tokens``), whose text goes out unchecked, so
        a stop string must lie wholly in the text that follows them."""
        count = len(req.seq.output_ids) if end is None else end
        return bool(req.params.stop) and count > req.params.min_new_tokens

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
        self.table.forget(req)
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
        self.table.member_done(req)

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
        self.table.forget(req)
        req.metrics.finish_time = time.monotonic()
        if req.mailbox is not None:
            req.mailbox.fail(error)
        if not req.future.done():
            req.future.set_exception(error)
        if req.group is not None:  # a failed choice fails its request: the others with it
            for other in req.group.members:
                if other.request_id in self.live:
                    self.fail(other, error)
        self.table.member_done(req)

    def fail_all(self, error_for) -> None:
        """Fail every live request with ``error_for(request)``."""
        for req in list(self.live.values()):
            if self.live.get(req.request_id) is req:  # not failed with another choice of its request
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
