"""The live requests' own state beside their sequences: settings, mailbox, future,
detokenizer and stop matcher (``LiveRequest``; ``Choices`` groups the choices of an
n > 1 request), and the sampling batch a plan's sampled rows get from their settings.
Runs on the event loop's thread only.
"""

from __future__ import annotations

import time
from operator import itemgetter
from typing import Any

import torch

from ..core.detokenizer import Detokenizer, StopMatcher
from ..core.mailbox import Mailbox, Outcome
from ..core.outputs import RequestMetrics
from ..core.prompt_logprobs import PromptSink
from ..core.reasoning import ReasoningSplitter, prompt_opens_reasoning
from ..core.sampling_params import SamplingParams
from ..core.scheduler import Sequence
from ..core.step import Controls, RowProcessors, SamplingBatch, StepPlan, mix_seed
from .structured import TokenMasks


class LiveRequest:
    """A request the engine is serving: its sequence (its tokens) and everything the
    output side needs to turn tokens into text and chunks."""

    __slots__ = ("request_id", "seq", "params", "mailbox", "future", "detok", "stopper",
                 "text_parts", "logprobs", "top_logprobs", "metrics", "finish_reason",
                 "controlled", "penalized", "min_length_banned", "matcher", "group", "index",
                 "deadline", "prompt_sink", "reasoning", "reasoning_parts", "plain", "own_ids",
                 "pool_sink")

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
        self.matcher = matcher  # structured output: the grammar matcher (acb.engine.structured)
        self.controlled = bool(self.penalized or p.logit_bias or p.min_p or p.min_new_tokens or matcher
                               or p.logits_processors)
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
        # a token of its that does not end it is text to its mailbox and nothing else: no grammar,
        # stop strings, logprobs or reasoning parser (Outputs.deliver's shortcut)
        self.plain = not (matcher or p.stop or p.logprobs or p.top_logprobs or self.reasoning is not None)
        self.own_ids: torch.Tensor | None = None  # logits_processors: the ids they read, as of the last step
        self.pool_sink: Any = None  # an embedding request's pooled positions (acb.core.pooling.PoolSink)

    def processor_ids(self, ahead: Any = ()) -> torch.Tensor:
        """What this request's logits processors read (``input_ids``): its host-known ids
        (prompt, output so far, then ``ahead``) as an int64 tensor, extended from the last
        step's by the tokens new since (a step costs its new tokens, not the whole history)."""
        seq = self.seq
        known = len(seq.prompt_ids) + len(seq.output_ids)
        ids = self.own_ids
        if ids is None or ids.numel() > known:  # (first step, or output taken back)
            ids = torch.tensor(seq.token_at(0, known), dtype=torch.long)
        elif ids.numel() < known:
            ids = torch.cat([ids, torch.tensor(seq.token_at(ids.numel(), known), dtype=torch.long)])
        self.own_ids = ids
        return torch.cat([ids, torch.tensor(list(ahead), dtype=torch.long)]) if ahead else ids

    @classmethod
    def create(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, mailbox: Mailbox | None,
               future: Outcome, tokenizer, eos_ids: frozenset[int], matcher: Any = None,
               arrival: int = 0, slot: int = -1) -> LiveRequest:
        """A request and its sequence (its stop token ids, and its EOS ids unless
        ``params.ignore_eos``, end it in ``Scheduler.update``); ``slot``: its row in the
        request table's sampling columns."""
        stop_ids = frozenset(params.stop_token_ids)
        seq = Sequence(request_id, prompt_ids, params.max_new_tokens, arrival=arrival, stop_ids=stop_ids,
                       eos_ids=frozenset() if params.ignore_eos else eos_ids,
                       prefix_lookup=params.prompt_logprobs is None, priority=params.priority, slot=slot)
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


class SamplingColumns:
    """The live requests' sampling settings as columns, one entry per slot of the request
    table, written once when a request is admitted (encode once): a step's sampling batch
    is then a gather by its rows' slots, not a walk over every request's settings."""

    __slots__ = ("temperature", "top_k", "top_p", "seed", "logprobs", "top_logprobs", "controlled", "requests",
                 "_free")

    def __init__(self) -> None:
        self.temperature: list[float] = []
        self.top_k: list[int] = []
        self.top_p: list[float] = []
        self.seed: list[int | None] = []
        self.logprobs: list[bool] = []
        self.top_logprobs: list[int] = []
        self.controlled: list[bool] = []  # any logit processor or grammar: the row's Controls are built per step
        self.requests: list[LiveRequest | None] = []
        self._free: list[int] = []

    def reserve(self) -> int:
        """A free slot (a new one when none is)."""
        if self._free:
            return self._free.pop()
        for column in (self.temperature, self.top_k, self.top_p, self.seed, self.logprobs, self.top_logprobs,
                       self.controlled, self.requests):
            column.append(None)
        return len(self.requests) - 1

    def write(self, slot: int, req: LiveRequest) -> None:
        p = req.params
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = p.temperature, p.top_k, p.top_p
        self.seed[slot], self.logprobs[slot], self.top_logprobs[slot] = p.seed, p.logprobs, p.top_logprobs
        self.controlled[slot], self.requests[slot] = req.controlled, req

    def release(self, slot: int) -> None:
        self.requests[slot] = None
        self._free.append(slot)


def sampling_batch(plan: StepPlan, columns: SamplingColumns, vocab_size: int) -> SamplingBatch:
    """The sampling batch of ``plan``'s sampled rows: their requests' settings gathered from
    ``columns`` by slot (a plan just made holds live requests only)."""
    inp = plan.input
    if plan.num_drafts:
        return _speculative_batch(plan, columns, vocab_size)
    sampled = [seq for seq, sample in zip(plan.seqs, inp.sample, strict=True) if sample]
    if not sampled:
        return SamplingBatch([], [], [], [], False)
    slots = [seq.slot for seq in sampled]
    take = itemgetter(*slots) if len(slots) > 1 else lambda column: (column[slots[0]],)
    seeds = take(columns.seed)
    if any(s is not None for s in seeds):
        seeds = [None if s is None else mix_seed(s, seq.num_generated - 1)
                 for s, seq in zip(seeds, sampled, strict=True)]
    else:
        seeds = [None] * len(slots)
    controls = None
    if any(take(columns.controlled)):
        carries = [c for c, sample in zip(inp.carry_from, inp.sample, strict=True) if sample]
        requests = columns.requests
        controlled = [(row, requests[slot], carries[row], ()) for row, slot in enumerate(slots)
                      if columns.controlled[slot]]
        controls = _controls(controlled, len(slots), vocab_size)
    return SamplingBatch(list(take(columns.temperature)), list(take(columns.top_k)), list(take(columns.top_p)),
                         seeds, any(take(columns.logprobs)), max(take(columns.top_logprobs)), controls)


def _speculative_batch(plan: StepPlan, columns: SamplingColumns, vocab_size: int) -> SamplingBatch:
    """``sampling_batch`` of a plan whose rows carry proposals: one entry per sampled
    position, each exactly what a step without speculation would sample there (its token
    index's seed; penalties over the history up to it, the proposals before it included;
    ``min_new_tokens`` by its token index), so verification changes no output."""
    inp = plan.input
    entries: list[tuple[Any, int, list[int]]] = []  # (sequence, carry, proposals before the position)
    for i, (seq, sample) in enumerate(zip(plan.seqs, inp.sample, strict=True)):
        if sample:
            d = inp.drafts[i]
            proposals = inp.token_ids[inp.token_offsets[i + 1] - d : inp.token_offsets[i + 1]]
            entries += ((seq, inp.carry_from[i], proposals[:t]) for t in range(d + 1))
    slots = [seq.slot for seq, _, _ in entries]
    seeds = [None if columns.seed[slot] is None else mix_seed(columns.seed[slot], seq.num_generated - 1 + len(ahead))
             for slot, (seq, _, ahead) in zip(slots, entries, strict=True)]
    controls = None
    if any(columns.controlled[slot] for slot in slots):
        controlled = [(row, columns.requests[slot], carry, ahead)
                      for row, (slot, (_, carry, ahead)) in enumerate(zip(slots, entries, strict=True))
                      if columns.controlled[slot]]
        controls = _controls(controlled, len(slots), vocab_size)
    return SamplingBatch([columns.temperature[s] for s in slots], [columns.top_k[s] for s in slots],
                         [columns.top_p[s] for s in slots], seeds, any(columns.logprobs[s] for s in slots),
                         max(columns.top_logprobs[s] for s in slots), controls)


def _controls(controlled: list[tuple[int, LiveRequest, int, Any]], num_rows: int, vocab_size: int) -> Controls:
    """The logit processors of the step's sampled rows that use any (``ahead``, each
    entry's last item: proposals before its position, taken as already generated)."""
    c = Controls([], [], [], [], [], [], [], [], [])
    min_p = [0.0] * num_rows
    masked: list[int] = []
    matchers = []
    for row, req, carry_from, ahead in controlled:
        if req.matcher is not None:
            masked.append(row)
            matchers.append(req.matcher)
        p = req.params
        seq = req.seq
        if req.penalized:
            c.penalized.append(row)
            c.history.append(seq.token_at(0, len(seq.prompt_ids) + len(seq.output_ids)) + list(ahead))
            c.num_prompt.append(len(seq.prompt_ids))
            c.carry.append(carry_from)
            c.repetition.append(p.repetition_penalty)
            c.presence.append(p.presence_penalty)
            c.frequency.append(p.frequency_penalty)
        if p.logit_bias:
            c.bias.extend((row, token, bias) for token, bias in p.logit_bias.items())
        if p.logits_processors:
            c.processors.append(RowProcessors(row, req.request_id, p.logits_processors, req.processor_ids(ahead),
                                              carry_from))
        if seq.num_generated - 1 + len(ahead) < p.min_new_tokens:
            c.banned.extend((row, token) for token in req.min_length_banned)
        min_p[row] = p.min_p
    if any(min_p):
        c.min_p = min_p
    if masked:
        c.token_mask = TokenMasks(masked, matchers, vocab_size)
    return c
