"""Between the scheduler and the runner: a plan's sampled rows get their requests'
sampling settings, and a finished step's sampled tokens go into their requests (detokenizer, stop
checks, mailbox, final ``Completion``). Runs on the event loop's thread only.

``Outputs`` owns the table of live requests; the engine submits into it, the loop
hands it each finished (or failed) step, and finishing or failing a request here
also takes it out of the scheduler (its pages come back at once).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .config import SamplingParams
from .detokenizer import Detokenizer, StopMatcher
from .errors import RequestFailedError, caused
from .request import Completion, Mailbox, Outcome, RequestMetrics
from .sampling import Controls, SamplingBatch
from .scheduler import Scheduler, Sequence
from .step import StepOutput, StepPlan
from .structured import TokenMasks

log = logging.getLogger("acb")

# the sampling row of a row whose request has left: greedy, its token is dropped
_STALE_ROW = (0.0, 0, 1.0, None, 0)


class LiveRequest:
    __slots__ = ("request_id", "seq", "params", "mailbox", "future", "detok", "stopper",
                 "text_parts", "logprobs", "top_logprobs", "metrics", "stop_ids", "finish_reason",
                 "controlled", "penalized", "min_length_banned", "matcher", "group", "index",
                 "deadline")

    def __init__(self, request_id: str, seq: Sequence, params: SamplingParams,
                 mailbox: Mailbox | None, future: Outcome, tokenizer, stop_ids: frozenset[int],
                 eos_ids: frozenset[int] = frozenset(), matcher: Any = None):
        self.request_id = request_id
        self.seq = seq
        self.params = params
        self.mailbox = mailbox
        self.future = future
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.stopper = StopMatcher(params.stop)
        self.text_parts: list[str] = []
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.top_logprobs else None
        # logit processors: whether any applies, and which tokens min_new_tokens holds back
        p = params
        self.penalized = p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)
        self.min_length_banned = tuple(sorted(stop_ids | (frozenset() if p.ignore_eos else eos_ids)))
        self.group: Choices | None = None  # n > 1: the request this choice belongs to
        self.index = 0
        self.matcher = matcher  # structured output: the grammar matcher (acb.structured)
        self.controlled = bool(self.penalized or p.logit_bias or p.min_p or p.min_new_tokens or matcher)
        self.metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(seq.prompt_ids))
        self.stop_ids = stop_ids
        self.finish_reason: str | None = None
        # time.monotonic() at which timeout_s ends the request (None: no deadline)
        self.deadline = None if params.timeout_s is None else self.metrics.arrival_time + params.timeout_s


class Choices:
    """A request with ``n`` > 1: one LiveRequest per choice, one mailbox and one future
    for the caller (the Completion of choice 0, ``choices`` listing all)."""

    __slots__ = ("request_id", "members", "mailbox", "future")

    def __init__(self, request_id: str, members: list[LiveRequest], mailbox, future: Outcome) -> None:
        self.request_id = request_id
        self.members = members
        self.mailbox = mailbox
        self.future = future

    def member_done(self) -> bool:
        """Complete the request's future once every choice has ended; True then."""
        if not all(m.future.done() for m in self.members):
            return False
        if not self.future.done():
            errors = [m.future.exception() for m in self.members if m.future.exception() is not None]
            if errors:
                self.future.set_exception(errors[0])
            else:
                choices = [m.future.result() for m in self.members]
                choices[0].choices = choices
                self.future.set_result(choices[0])
        return True


class Outputs:
    def __init__(self, scheduler: Scheduler, eos_token_ids: frozenset[int], vocab_size: int = 0) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.live: dict[str, LiveRequest] = {}
        self.deadlines = 0  # live requests with a timeout_s: the engine scans for expired ones while > 0
        self.groups: dict[str, Choices] = {}  # requests with n > 1, by request id
        self.generated = 0

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

    def expired(self, now: float) -> list[LiveRequest]:
        """The live requests whose deadline is at or before ``now``."""
        return [r for r in self.live.values() if r.deadline is not None and r.deadline <= now]

    def next_deadline(self) -> float | None:
        """The nearest deadline of a live request, or None."""
        return min((r.deadline for r in self.live.values() if r.deadline is not None), default=None)

    def _member_done(self, req: LiveRequest) -> None:
        if req.group is not None and req.group.member_done():
            self.groups.pop(req.group.request_id, None)

    def current(self, seq: Sequence, epoch: int | None = None) -> LiveRequest | None:
        """The live request that ``seq`` belongs to, if any (and, given an epoch, only if
        the sequence has not been preempted since)."""
        req = self.live.get(seq.seq_id)
        if req is None or req.seq is not seq or (epoch is not None and epoch != seq.epoch):
            return None
        return req

    def sampling(self, plan: StepPlan) -> SamplingBatch:
        """The sampling batch of ``plan``'s sampled rows: each live request's settings."""
        sampling_rows = []
        want_logprobs = False
        top_logprobs = 0
        controlled: list[tuple[int, LiveRequest, int]] = []  # (sampled row, request, carry_from)
        inp = plan.input
        for seq, sample, carry_from in zip(plan.seqs, inp.sample, inp.carry_from, strict=True):
            if not sample:
                continue
            req = self.live.get(seq.seq_id)
            if req is None or req.seq is not seq:  # stale row: its token is dropped
                sampling_rows.append(_STALE_ROW)
                continue
            p = req.params
            if req.controlled:
                controlled.append((len(sampling_rows), req, carry_from))
            sampling_rows.append((p.temperature, p.top_k, p.top_p, p.seed, seq.num_generated - 1))
            want_logprobs = want_logprobs or p.logprobs
            top_logprobs = max(top_logprobs, p.top_logprobs)
        controls = self._controls(controlled, len(sampling_rows)) if controlled else None
        return SamplingBatch.from_rows(sampling_rows, want_logprobs, top_logprobs, controls)

    def _controls(self, controlled: list[tuple[int, LiveRequest, int]], num_rows: int) -> Controls:
        """The logit processors of the step's sampled rows that use any."""
        c = Controls([], [], [], [], [], [], [], [], [])
        min_p = [0.0] * num_rows
        masked: list[int] = []
        matchers = []
        for row, req, carry_from in controlled:
            if req.matcher is not None:
                masked.append(row)
                matchers.append(req.matcher)
            p = req.params
            seq = req.seq
            if req.penalized:
                c.penalized.append(row)
                c.history.append(seq.token_at(0, len(seq.prompt_ids) + len(seq.output_ids)))
                c.num_prompt.append(len(seq.prompt_ids))
                c.carry.append(carry_from)
                c.repetition.append(p.repetition_penalty)
                c.presence.append(p.presence_penalty)
                c.frequency.append(p.frequency_penalty)
            if p.logit_bias:
                c.bias.extend((row, token, bias) for token, bias in p.logit_bias.items())
            if seq.num_generated - 1 < p.min_new_tokens:
                c.banned.extend((row, token) for token in req.min_length_banned)
            min_p[row] = p.min_p
        if any(min_p):
            c.min_p = min_p
        if masked:
            c.token_mask = TokenMasks(masked, matchers, self.vocab_size)
        return c

    def step_failed(self, plan: StepPlan, error: BaseException) -> None:
        """Fail the requests of a step that raised (the engine goes on serving)."""
        if self.scheduler.host_pool is not None:
            self._discard_offloads_from(plan, error)
        for seq, epoch in zip(plan.seqs, plan.epochs, strict=True):
            req = self.current(seq, epoch)
            if req is not None:
                self.fail(req, caused(RequestFailedError(
                    f"the model step failed for request {req.request_id}: {error!r}", req.request_id), error))

    def _discard_offloads_from(self, plan: StepPlan, error: BaseException) -> None:
        """A failed step may have left garbage in KV that preempted sequences offloaded
        (their last rows ran in it) or may not have done its swap-outs: such a
        sequence is recomputed instead, or fails if it was already restored."""
        suspects = {id(s): s for s in plan.offloaded}
        suspects.update((id(seq), seq) for seq, epoch in zip(plan.seqs, plan.epochs, strict=True) if epoch != seq.epoch)
        for seq in suspects.values():
            req = self.current(seq)
            if req is None:
                continue
            if seq.host_table is not None:
                self.scheduler.drop_offload(seq)
            elif seq.status == "running" and seq.restored_plan > plan.index:
                self.fail(req, caused(RequestFailedError(
                    f"the model step failed for request {req.request_id} (its offloaded KV came from it): {error!r}",
                    req.request_id), error))

    def apply(self, plan: StepPlan, out: StepOutput) -> None:
        """Take a finished step's sampled tokens into their requests."""
        kv = self.scheduler.kv
        j = 0
        for seq, start, num_tokens, sample, epoch in plan.rows():
            token = logprob = top = None
            if sample:
                token = out.token_ids[j]
                logprob = out.logprobs[j] if out.logprobs is not None else None
                if out.top_ids is not None:
                    top = (out.top_ids[j], out.top_logprobs[j])
                j += 1
            req = self.current(seq, epoch)
            if req is None:
                continue  # finished, cancelled or preempted since this step was planned
            done = start + num_tokens
            if kv.enable_prefix_caching and done // kv.page_size > seq.num_registered_pages:
                seq.num_registered_pages, seq.last_page_hash = kv.register_full_pages(
                    seq.block_table, seq.token_at(0, done), seq.num_registered_pages, seq.last_page_hash, done,
                )
            if token is not None:
                seq.num_inflight -= 1
                seq.output_ids.append(token)
                self.generated += 1
                self.on_token(req, token, logprob, top)

    def on_token(self, req: LiveRequest, token: int, logprob: float | None,
                 top: tuple[list[int], list[float]] | None = None) -> None:
        seq = req.seq
        params = req.params
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.monotonic()
        finish = None
        if req.matcher is not None and not req.matcher.is_terminated():
            if not req.matcher.accept_token(token):
                log.warning("acb: request %s: token %d breaks its grammar", req.request_id, token)
            if req.matcher.is_terminated():
                finish = "stop"  # the grammar is complete (its stop token, or ignore_eos)
        if token in req.stop_ids:
            finish = "stop"
        elif not params.ignore_eos and token in self.eos_token_ids:
            finish = "eos"
        text = req.detok.push((token,)) if req.detok is not None else ""
        matched = False
        if self._checks_stop_strings(req):
            text, matched = req.stopper.push(text)
        if matched:
            finish = "stop"  # the text ends before the stop string; nothing more to flush
        else:
            if finish is None and len(seq.output_ids) >= params.max_new_tokens:
                finish = "length"
            if finish is not None:
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
            req.text_parts.append(text)
            if req.mailbox is not None:
                req.mailbox.put([token], text, lp, top_logprobs=alternatives)
        else:
            self.finish(req, finish, text, [token], lp, alternatives)

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
        self._forget(req)
        req.finish_reason = reason
        req.text_parts.append(text)
        req.metrics.finish_time = time.monotonic()
        if req.mailbox is not None:
            req.mailbox.put(token_ids or [], text, logprobs, reason, top_logprobs)
        if not req.future.done():
            req.future.set_result(self.completion(req))
        self._member_done(req)

    def fail(self, req: LiveRequest, error: BaseException) -> None:
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
    def completion(req: LiveRequest) -> Completion:
        seq = req.seq
        m = req.metrics
        m.num_generated_tokens = len(seq.output_ids)
        m.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
        m.num_preemptions = seq.num_preemptions
        return Completion(
            request_id=req.group.request_id if req.group is not None else req.request_id,
            prompt_token_ids=list(seq.prompt_ids), token_ids=list(seq.output_ids),
            text="".join(req.text_parts), logprobs=req.logprobs, finish_reason=req.finish_reason, metrics=m,
            top_logprobs=req.top_logprobs, index=req.index,
        )
