"""The live requests' own state beside their sequences: settings, mailbox, future,
detokenizer and stop matcher (``LiveRequest``; ``Choices`` groups the choices of an
n > 1 request), and the sampling batch a plan's sampled rows get from their settings.
Runs on the event loop's thread only.
"""

from __future__ import annotations

import time
from typing import Any

from .config import SamplingParams
from .detokenizer import Detokenizer, StopMatcher
from .prompt_logprobs import PromptSink
from .reasoning import ReasoningSplitter, prompt_opens_reasoning
from .request import Mailbox, Outcome, RequestMetrics
from .sampling import Controls, SamplingBatch
from .scheduler import Sequence
from .step import StepPlan
from .structured import TokenMasks


class LiveRequest:
    """A request the engine is serving: its sequence (its tokens) and everything the
    output side needs to turn tokens into text and chunks."""

    __slots__ = ("request_id", "seq", "params", "mailbox", "future", "detok", "stopper",
                 "text_parts", "logprobs", "top_logprobs", "metrics", "finish_reason",
                 "controlled", "penalized", "min_length_banned", "matcher", "group", "index",
                 "deadline", "prompt_sink", "reasoning", "reasoning_parts")

    def __init__(self, request_id: str, seq: Sequence, params: SamplingParams,
                 mailbox: Mailbox | None, future: Outcome, tokenizer, matcher: Any = None):
        self.request_id = request_id
        self.seq = seq
        self.params = params
        self.mailbox = mailbox
        self.future = future
        self.detok = Detokenizer(tokenizer, seq.output_ids) if tokenizer is not None else None
        self.stopper = StopMatcher(params.stop)
        self.text_parts: list[str] = []
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.top_logprobs else None
        # logit processors: whether any applies, and which tokens min_new_tokens holds back
        p = params
        self.penalized = p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)
        self.min_length_banned = tuple(sorted(seq.stop_ids | seq.eos_ids))
        self.group: Choices | None = None  # n > 1: the request this choice belongs to
        self.index = 0
        self.matcher = matcher  # structured output: the grammar matcher (acb.structured)
        self.controlled = bool(self.penalized or p.logit_bias or p.min_p or p.min_new_tokens or matcher)
        self.metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(seq.prompt_ids))
        self.finish_reason: str | None = None
        # time.monotonic() at which timeout_s ends the request (None: no deadline)
        self.deadline = None if params.timeout_s is None else self.metrics.arrival_time + params.timeout_s
        # prompt_logprobs: where this request's prompt scores gather (shared by its choices)
        self.prompt_sink: PromptSink | None = None
        # reasoning_parser: splits the text into reasoning and answer (the prompt may open the thought)
        self.reasoning: ReasoningSplitter | None = None
        self.reasoning_parts: list[str] | None = None
        if p.reasoning_parser is not None and tokenizer is not None:
            tail = tokenizer.decode(seq.prompt_ids[-8:], skip_special_tokens=False)
            self.reasoning = ReasoningSplitter(p.reasoning_parser, prompt_opens_reasoning(tail))
            self.reasoning_parts = []

    @classmethod
    def create(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, mailbox: Mailbox | None,
               future: Outcome, tokenizer, eos_ids: frozenset[int], matcher: Any = None,
               arrival: int = 0) -> LiveRequest:
        """A request and its sequence (its stop token ids, and its EOS ids unless
        ``params.ignore_eos``, end it in ``Scheduler.update``)."""
        stop_ids = frozenset(params.stop_token_ids)
        seq = Sequence(request_id, prompt_ids, params.max_new_tokens, arrival=arrival, stop_ids=stop_ids,
                       eos_ids=frozenset() if params.ignore_eos else eos_ids,
                       prefix_lookup=params.prompt_logprobs is None, priority=params.priority)
        return cls(request_id, seq, params, mailbox, future, tokenizer, matcher)


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


def sampling_batch(plan: StepPlan, live: dict[str, LiveRequest], vocab_size: int) -> SamplingBatch:
    """The sampling batch of ``plan``'s sampled rows: each live request's settings
    (``live``: request id -> live request; a plan just made holds live requests only)."""
    sampling_rows = []
    want_logprobs = False
    top_logprobs = 0
    controlled: list[tuple[int, LiveRequest, int]] = []  # (sampled row, request, carry_from)
    inp = plan.input
    for seq, sample, carry_from in zip(plan.seqs, inp.sample, inp.carry_from, strict=True):
        if not sample:
            continue
        req = live[seq.seq_id]
        p = req.params
        if req.controlled:
            controlled.append((len(sampling_rows), req, carry_from))
        sampling_rows.append((p.temperature, p.top_k, p.top_p, p.seed, seq.num_generated - 1))
        want_logprobs = want_logprobs or p.logprobs
        top_logprobs = max(top_logprobs, p.top_logprobs)
    controls = _controls(controlled, len(sampling_rows), vocab_size) if controlled else None
    return SamplingBatch.from_rows(sampling_rows, want_logprobs, top_logprobs, controls)


def _controls(controlled: list[tuple[int, LiveRequest, int]], num_rows: int, vocab_size: int) -> Controls:
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
        c.token_mask = TokenMasks(masked, matchers, vocab_size)
    return c
