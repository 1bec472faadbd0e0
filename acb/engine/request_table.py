"""The request table: which requests are live, and how one becomes live.

A request is checked (``prepare``, or ``prepare_async`` with long prompts tokenized and
grammars compiled on worker threads: its settings resolved, its prompt tokenized and
bounded, its grammar compiled), then registered atomically (``register``): its
``LiveRequest`` (or, with ``n`` > 1, one per choice, grouped in ``Choices``, each with
a seed of its own derived from the request's) enters the table and its sequence the
scheduler's queue. Choices of one request are handed to the scheduler as one queued
sequence with forks (``Scheduler.add``): the scheduler alone writes sequences.

The output side (``acb.engine.output_processor.Outputs``) ends requests; ending one takes it out of
the table and, if it has not finished there already, out of the scheduler
(``forget``: ``Scheduler.finish`` runs once per request). Runs on the event loop's
thread only.
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from typing import Any

from ..core.errors import EngineOverloadedError, InvalidRequestError
from ..core.mailbox import ChoicesMailbox, Mailbox, Outcome
from ..core.pooling import PoolSink
from ..core.prompt_logprobs import PromptSink
from ..core.sampling_params import SamplingParams
from ..core.scheduler import FINISHED, Scheduler
from ..core.step import StepPlan
from .adapters import AdapterRegistry
from .inputs import prepare, sampling_params, tokenize_off_loop
from .live import Choices, LiveRequest, SamplingColumns
from .structured import Grammars

# what an embedding request's sequence runs with: it samples nothing and never speculates
_PREFILL_ONLY = SamplingParams(max_new_tokens=1, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                               repetition_penalty=1.0, speculative=False)
# choice i of a seeded n > 1 request samples with seed + i * this (mod 2**63)
_CHOICE_SEED_STRIDE = 0x9E3779B97F4A7C15


@dataclasses.dataclass(slots=True, frozen=True)
class Prepared:
    """A request checked and ready to register."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    grammar: Any  # the compiled grammar of a structured-output request, else None


class RequestTable:
    """The live requests (request id -> ``LiveRequest``; ``groups``: the ``Choices`` of
    n > 1 requests), their deadlines and pending prompt scores, and their admission."""

    def __init__(self, scheduler: Scheduler, grammars: Grammars, *, tokenizer: Any, defaults: SamplingParams,
                 generation_defaults: dict[str, Any], vocab_size: int, max_model_len: int,
                 eos_ids: frozenset[int], adapters: AdapterRegistry | None = None) -> None:
        self.scheduler = scheduler
        self.adapters = adapters  # the loaded LoRA adapters (None: this engine runs none)
        self.grammars = grammars
        self.tokenizer = tokenizer
        self.defaults = defaults  # the engine's SamplingParams
        self.generation_defaults = generation_defaults  # the model's, for fields a request leaves unset
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.live: dict[str, LiveRequest] = {}
        self.groups: dict[str, Choices] = {}
        self.deadlines = 0  # live requests with a timeout_s: the loop scans for expired ones while > 0
        self.scoring: set[PromptSink] = set()  # prompt_logprobs still to compute: the loop plans them while any
        self.pooling = 0  # live embedding requests: the loop plans their pooled positions while any
        self.event: Any = None  # the running loop's Event class (bound by Engine.start)
        self.columns = SamplingColumns()  # the live requests' sampling settings, by slot
        self._arrivals = itertools.count()

    def __contains__(self, request_id: str) -> bool:
        """Whether ``request_id`` names a live request."""
        return request_id in self.live or request_id in self.groups

    # ------------------------------------------------------------------ admission
    def check_room(self, max_waiting: int) -> None:
        """Raise ``EngineOverloadedError`` if one more request would overfill the waiting
        queue (a request with ``n`` > 1 waits as one sequence, its prompt): overload is
        refused, never absorbed."""
        waiting = len(self.scheduler.waiting)
        if waiting + 1 > max_waiting:
            raise EngineOverloadedError(
                f"the engine is overloaded: {waiting} requests are waiting (max_waiting_requests="
                f"{max_waiting}); retry later", retry_after=1.0)

    def prepare(self, prompt: Any, request_id: str | None, sampling: SamplingParams | None,
                overrides: dict[str, Any]) -> Prepared:
        """Check one request against the engine, or raise ``InvalidRequestError`` naming
        what is wrong; nothing is registered. All on this thread (the sync ``submit``): a
        grammar not in the cache compiles here, for at most its compile bound."""
        return self._checked(prompt, request_id, self._params(sampling, overrides))

    async def prepare_async(self, prompt: Any, request_id: str | None, sampling: SamplingParams | None,
                            overrides: dict[str, Any], wait_future: Any) -> Prepared:
        """``prepare`` with its heavy parts off the event loop: a long prompt tokenized, and
        a grammar not in the cache compiled, on worker threads (``wait_future`` awaits one).
        What follows the last await runs at once, so the caller registers what it checked
        (after checking again what may have changed meanwhile: the engine's state, the queue)."""
        params = self._params(sampling, overrides)
        ids = await tokenize_off_loop(prompt, self.tokenizer, self.vocab_size)
        grammar = await self.grammars.compiled_async(params, wait_future) if params.structured else None
        return self._checked(prompt, request_id, params, ids, grammar)

    def _params(self, sampling: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
        params = sampling_params(self.defaults, sampling, overrides, self.generation_defaults)
        policy = self.scheduler.policy
        if params.priority and policy != "priority":
            raise InvalidRequestError(f"priority={params.priority} needs an engine built with EngineConfig("
                                      f"scheduler='priority'); this one schedules {policy!r}", param="priority")
        if params.structured and params.speculative is not False and self.scheduler.speculation is not None:
            raise InvalidRequestError("structured outputs (json_schema, regex, choice) do not compose with speculative "
                                      "decoding yet: pass speculative=False with them on an engine built with "
                                      "EngineConfig(speculative_method=...)", param="speculative")
        return params

    def _checked(self, prompt: Any, request_id: str | None, params: SamplingParams, ids: list[int] | None = None,
                 grammar: Any = None) -> Prepared:
        rid, ids, params = prepare(prompt, request_id, params, self.tokenizer, self.vocab_size, self.max_model_len,
                                   self, ids=ids)
        if params.n > self.scheduler.max_requests:  # choices fork from one prefill, all in one step
            raise InvalidRequestError(f"n={params.n} is more than the rows one step can hold "
                                      f"({self.scheduler.max_requests}: max_requests_per_batch)", param="n")
        self.check_adapter(params)
        if params.structured and grammar is None:
            grammar = self.grammars.compiled(params)  # on this thread, for at most grammar_compile_timeout_s
        return Prepared(rid, ids, params, grammar)

    def check_adapter(self, params: SamplingParams) -> None:
        """InvalidRequestError naming ``adapter`` unless the adapter a request names is loaded."""
        if params.adapter is not None:
            if self.adapters is None:
                raise InvalidRequestError(f"adapter {params.adapter!r}: this engine runs no adapters",
                                          param="adapter")
            self.adapters.resolve(params.adapter)

    async def prepare_batch(self, prompts: Any, request_ids: Any, sampling: SamplingParams | None,
                            overrides: dict[str, Any], wait_future: Any) -> list[Prepared]:
        """Check every request of a batch (an error names the prompt's index), in input
        order, the heavy parts off the loop (``prepare_async``)."""
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a list, got {type(prompts).__name__}", param="prompts")
        if request_ids is not None and (not isinstance(request_ids, (list, tuple))
                                        or len(request_ids) != len(prompts)):
            raise InvalidRequestError("request_ids must have one id per prompt", param="request_ids")
        prepared: list[Prepared] = []
        seen: set[str] = set()
        for i, prompt in enumerate(prompts):
            try:
                p = await self.prepare_async(prompt, request_ids[i] if request_ids is not None else None, sampling,
                                             overrides, wait_future)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompts[{i}]: {e}", param=e.param) from e
            if p.request_id in seen:
                raise InvalidRequestError(f"prompts[{i}]: duplicate request_id {p.request_id!r}", param="request_id")
            seen.add(p.request_id)
            prepared.append(p)
        for i, p in enumerate(prepared):  # preparing awaited: an id may have gone live meanwhile
            if p.request_id in self:
                raise InvalidRequestError(f"prompts[{i}]: request_id {p.request_id!r} is already in use by a live "
                                          "request", param="request_id")
        return prepared

    def register(self, p: Prepared, stream: bool) -> LiveRequest | Choices:
        """Make a prepared request live and queue it (``stream``: it gets a mailbox)."""
        params = p.params
        if params.n > 1:
            return self._register_choices(p, stream)
        mailbox = Mailbox(p.request_id, params.logprobs, self.event, params.top_logprobs > 0) if stream else None
        req = self._add(p.request_id, p.prompt_ids, params, p.grammar, mailbox)
        if params.prompt_logprobs is not None:
            self.score_prompt([req], params.prompt_logprobs)
        self.scheduler.add(req.seq)
        return req

    def register_batch(self, prepared: list[Prepared]) -> list[LiveRequest | Choices]:
        """Register a prepared batch (no stream), in the input's order, queued in prompt order so
        requests sharing a prefix run close together; every adapter is checked again first (one
        may have begun unloading while the batch was prepared)."""
        for p in prepared:
            self.check_adapter(p.params)
        reqs: list[Any] = [None] * len(prepared)
        for i in sorted(range(len(prepared)), key=lambda i: prepared[i].prompt_ids):
            reqs[i] = self.register(prepared[i], stream=False)
        return reqs

    def _register_choices(self, p: Prepared, stream: bool) -> Choices:
        """n > 1: one sequence per choice (``request_id#i``); choice 0 prefills the prompt
        and the others fork from it. With a seed, choice i samples with one of its own."""
        params = p.params
        mailbox = ChoicesMailbox(p.request_id, params.n, params.logprobs, params.top_logprobs > 0,
                                 self.event) if stream else None
        members = []
        for i in range(params.n):
            q = params
            if params.seed is not None and i:
                q = dataclasses.replace(params, seed=(params.seed + i * _CHOICE_SEED_STRIDE) % 2**63)
            req = self._add(f"{p.request_id}#{i}", p.prompt_ids, q, p.grammar, mailbox.members[i] if stream else None)
            req.index = i
            members.append(req)
        group = Choices(p.request_id, members, mailbox, Outcome(self.event))
        for req in members:
            req.group = group
        if params.prompt_logprobs is not None:
            self.score_prompt(members, params.prompt_logprobs)
        self.groups[p.request_id] = group
        self.scheduler.add(members[0].seq, forks=[m.seq for m in members[1:]])
        return group

    def _add(self, key: str, ids: list[int], params: SamplingParams, grammar: Any,
             mailbox: Mailbox | None) -> LiveRequest:
        """One live request (each choice its own grammar matcher over the shared compiled grammar)."""
        matcher = self.grammars.matcher(grammar) if grammar is not None else None
        adapter = self.adapters.acquire(params.adapter) if params.adapter is not None else None
        slot = self.columns.reserve()
        req = LiveRequest.create(key, ids, params, mailbox, Outcome(self.event), self.tokenizer, self.eos_ids,
                                 matcher, next(self._arrivals), slot)
        if adapter is not None:  # its rows run the adapter's slot; its prefix pages chain from its root
            req.seq.adapter, req.seq.prefix_root, req.seq.last_page_hash = adapter.slot, adapter.root, adapter.root
            req.seq.lora_id = adapter.lora_id
        self.columns.write(slot, req)
        # (logits processors read each position's history: a request with its own does not speculate)
        if self.scheduler.speculation is not None and params.speculative is not False \
                and not params.logits_processors:
            req.seq.spec = self.scheduler.speculation.state()
        self.live[key] = req
        if req.deadline is not None:
            self.deadlines += 1
        return req

    def register_pooled(self, prompts: list[list[int]], pooling: str, normalize: bool) -> list[LiveRequest]:
        """Make embedding requests live and queue them, in order: prefill-only sequences
        (``acb.core.pooling``) pooling their prompts' final hidden states by ``pooling``
        (``mean`` computes every position, so it does not start from the prefix cache)."""
        reqs = []
        for ids in prompts:
            req = self._add(uuid.uuid4().hex, ids, _PREFILL_ONLY, None, None)
            req.seq.prefill_only = True
            req.seq.prefix_lookup = pooling != "mean"
            req.pool_sink = PoolSink(pooling, len(ids), normalize)
            self.pooling += 1
            self.scheduler.add(req.seq)
            reqs.append(req)
        return reqs

    def score_prompt(self, members: list[LiveRequest], k: int) -> None:
        """``members`` (a request, or the choices of one) score their shared prompt with
        ``k`` alternatives per token (``SamplingParams.prompt_logprobs``)."""
        sink = PromptSink(members[0].seq.prompt_ids, k, members)
        for req in members:
            req.prompt_sink = sink
        if sink.result is None:
            self.scoring.add(sink)
        else:  # a one-token prompt: nothing to compute
            self.prompt_scored(sink)

    def prompt_scored(self, sink: PromptSink) -> None:
        """Hand a completed prompt score to the mailboxes of the requests still live."""
        for req in sink.members:
            if req.mailbox is not None and self.live.get(req.request_id) is req:
                req.mailbox.put_prompt_logprobs(sink.result)

    # ------------------------------------------------------------------ leaving
    def forget(self, req: LiveRequest) -> None:
        """``req`` is no longer live: its deadline stops counting and its sequence leaves
        the scheduler, its pages back, unless the scheduler finished it already."""
        if self.live.pop(req.request_id, None) is not None:
            self.columns.release(req.seq.slot)
            if req.seq.adapter >= 0:
                self.adapters.release(req.seq.adapter)
            if req.deadline is not None:
                self.deadlines -= 1
            if req.pool_sink is not None:
                self.pooling -= 1
        if req.seq.status is not FINISHED:
            self.scheduler.finish(req.seq)
        sink = req.prompt_sink
        if sink is not None and sink in self.scoring and not any(m.request_id in self.live for m in sink.members):
            self.scoring.discard(sink)

    def member_done(self, req: LiveRequest) -> None:
        """A choice ended: its request leaves the table once every choice has."""
        if req.group is not None and req.group.member_done():
            self.groups.pop(req.group.request_id, None)

    # ------------------------------------------------------------------ queries
    def expired(self, now: float) -> list[LiveRequest]:
        """The live requests whose deadline is at or before ``now``."""
        return [r for r in self.live.values() if r.deadline is not None and r.deadline <= now]

    def next_deadline(self) -> float | None:
        """The nearest deadline of a live request, or None."""
        return min((r.deadline for r in self.live.values() if r.deadline is not None), default=None)

    def scheduled(self, plan: StepPlan, now: float) -> None:
        """Stamp the requests ``plan`` took out of the queue for the first time (their
        ``RequestMetrics.scheduled_time``)."""
        for seq in plan.admitted:
            m = self.live[seq.seq_id].metrics
            if m.scheduled_time is None:
                m.scheduled_time = now

    def check_integrity(self) -> None:
        """Assert the caches' invariants against the live requests' page tables."""
        s = self.scheduler
        seqs = [r.seq for r in self.live.values()]
        s.kv.check_integrity([q.block_table for q in seqs])
        if s.kv_swa is not None:
            s.kv_swa.check_integrity(q.swa_table for q in seqs)
        if s.host_pool is not None:
            s.host_pool.check_integrity(q.host_table for q in seqs if q.host_table)
