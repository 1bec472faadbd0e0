"""What comes out of the engine: chunks, completions, per-request metrics and the engine's
stats (the public value types; :mod:`acb.core.mailbox` carries them to the consumers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .prompt_logprobs import PromptLogprobs


@dataclass(slots=True)
class Chunk:
    """The new part of one request's output since the consumer's last chunk.

    Attributes:
        request_id: the request this chunk belongs to.
        token_ids: the tokens new in this chunk (several when the consumer fell behind).
        text: the text new in this chunk; never splits a UTF-8 character ("" without a tokenizer).
        logprobs: one log-probability per token in ``token_ids``, when ``logprobs=True`` was asked for.
        finish_reason: None until the request's last chunk, then ``"length"``, ``"eos"``, ``"stop"``,
            ``"cancelled"`` or ``"timeout"``.
        prompt_logprobs: with ``prompt_logprobs=k``, the prompt's scores (``acb.PromptLogprobs``) on
            the first chunk of each choice (the one with its first token), None on the others.
        reasoning_text: with ``reasoning_parser``, the reasoning text new in this chunk (``text`` is
            then the answer's only).
        reasoning_mask: with ``reasoning_parser``, per token of ``token_ids``: True when it belongs to
            the reasoning (its ``<think>`` / ``</think>`` markers included).
        metrics: on the last chunk only (None before), the request's ``RequestMetrics``, as
            ``Completion.metrics``.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    index: int = 0  # which of the request's ``n`` choices this chunk belongs to
    top_logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob} alternatives
    prompt_logprobs: PromptLogprobs | None = None  # once, on the first chunk (prompt_logprobs=k)
    reasoning_text: str = ""  # reasoning_parser: the thought's text new in this chunk
    reasoning_mask: list[bool] | None = None  # reasoning_parser: per token, whether it is the thought's
    metrics: RequestMetrics | None = None  # the last chunk only: the request's metrics


@dataclass(slots=True)
class RequestMetrics:
    """Timing and token counts of one request (``Completion.metrics``, and the last
    ``Chunk.metrics`` of a stream). Times are ``time.monotonic()`` seconds; the derived
    durations are None until the events they span have happened.

    Attributes:
        arrival_time: at submission.
        scheduled_time: when the first step computing the request was planned (it left the queue).
        first_token_time: when the first generated token was ready (None before it).
        last_token_time: when the last generated token was ready.
        finish_time: when the request ended (None while it runs).
        num_prompt_tokens: tokens in the prompt.
        num_generated_tokens: tokens generated.
        num_cached_prompt_tokens: prompt tokens served from the prefix cache instead of computed.
        num_preemptions: how often the scheduler preempted the request to make room.

    Derived (seconds): ``queue_time_s`` (arrival to scheduled), ``ttft_s`` (arrival to first
    token), ``prefill_time_s`` (scheduled to first token), ``decode_time_s`` (first to last
    token), ``generation_time_s`` (scheduled to last token: prefill plus decode),
    ``mean_itl_s`` (decode time per token after the first), ``latency_s`` (arrival to end),
    and ``tokens_per_s`` (generated tokens over the generation time).

    Example::

        done = await engine.generate("Hi", max_new_tokens=16)
        print(done.metrics.queue_time_s, done.metrics.ttft_s, done.metrics.tokens_per_s)
    """

    arrival_time: float = 0.0  # time.monotonic() at submission
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    scheduled_time: float | None = None
    last_token_time: float | None = None

    @staticmethod
    def _span(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else end - start

    @property
    def queue_time_s(self) -> float | None:
        """Seconds from submission until the first step computing it was planned."""
        return self._span(self.arrival_time, self.scheduled_time)

    @property
    def prefill_time_s(self) -> float | None:
        """Seconds from leaving the queue to the first generated token."""
        return self._span(self.scheduled_time, self.first_token_time)

    @property
    def decode_time_s(self) -> float | None:
        """Seconds from the first generated token to the last."""
        return self._span(self.first_token_time, self.last_token_time)

    @property
    def generation_time_s(self) -> float | None:
        """Seconds from leaving the queue to the last generated token (prefill plus decode)."""
        return self._span(self.scheduled_time, self.last_token_time)

    @property
    def mean_itl_s(self) -> float | None:
        """Mean seconds between consecutive generated tokens (None with fewer than two)."""
        decode = self.decode_time_s
        if decode is None or self.num_generated_tokens < 2:
            return None
        return decode / (self.num_generated_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second of generation time (queueing excluded)."""
        generation = self.generation_time_s
        if not generation or not self.num_generated_tokens:
            return None
        return self.num_generated_tokens / generation

    @property
    def ttft_s(self) -> float | None:
        """Seconds from submission to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency_s(self) -> float | None:
        """Seconds from submission to the end of the request."""
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass(slots=True)
class Completion:
    """A finished request (also a cancelled one: then partial, ``finish_reason="cancelled"``).

    Attributes:
        request_id: the request's id.
        prompt_token_ids: the prompt as the engine saw it (after tokenizing or the chat template).
        token_ids: every generated token.
        text: the generated text (stop strings excluded).
        logprobs: one log-probability per generated token, when asked for.
        finish_reason: why it ended (see ``Chunk.finish_reason``).
        metrics: timings and counts (``ttft_s``, ``latency_s``, token counts).
        prompt_logprobs: with ``prompt_logprobs=k``, the prompt's scores (``acb.PromptLogprobs``;
            None if the request ended before its prompt was computed).
        reasoning_text: with ``reasoning_parser``, the reasoning (``text`` is the answer); else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    finish_reason: str | None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    top_logprobs: list[dict[int, float]] | None = None  # per token, when ``top_logprobs`` was asked for
    index: int = 0  # which choice this is (``n`` > 1)
    # every choice of the request, this one first among them when n == 1; with n > 1 the
    # Completion ``generate`` returns describes choice 0 and lists all n here
    choices: list[Completion] = field(default_factory=list, repr=False, compare=False)
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs=k (every choice the same)
    reasoning_text: str | None = None  # with reasoning_parser: the thought (text is the answer)

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices.append(self)


@dataclass(slots=True)
class EngineStats:
    """What ``engine.stats()`` returns: load, KV-cache occupancy and counters since start.

    Attributes:
        running: requests in the running batch (embedding prompts included).
        waiting: requests queued for admission (``embeddings_waiting`` apart).
        total_blocks: KV-cache pages in all.
        free_blocks: pages a request can take now (never used, or cached and evictable).
        cached_blocks: unreferenced pages kept for prefix hits (counted in ``free_blocks``).
        used_blocks: pages held by live requests.
        prefix_hit_rate: share of prompt tokens served from the prefix cache.
        steps: engine steps run.
        generated_tokens: tokens generated.
        preemptions: times a running request was preempted to make room.
        page_size: tokens per page.
        max_batch_tokens: the step's token budget.
        host_blocks: capacity of the CPU offload pool, in pages (0: offload off).
        offloaded_blocks: pages held in that pool now.
        offloads: preemptions whose KV went to the pool.
        restores: resumptions that copied it back instead of recomputing.
        recomputed_tokens: computed tokens that preemption threw away.
        sliding_total_blocks: hybrid models: the sliding-window layers' own page pool (0: none).
        sliding_free_blocks: free pages in that pool.
        attn_backend: the attention backend serving the engine (``native``, ``triton`` or
            ``torch``; see ``EngineConfig.attn_backend``).
        device_time_s: seconds the steps computed (on CPU the step thread's time in them,
            on CUDA the device's, timed by events on the runner's stream).
        hashed_blocks: pages whose prefix hash is registered, in use or cached: the set
            ``engine.kv_events()`` describes (equal to ``cached_blocks`` when nothing runs).
        dtype: the dtype the model (and so the KV pages) runs in, e.g. ``"bfloat16"``.
        forward_path: the forward serving the steps: ``"fused"`` (acb's fused CPU forward),
            ``"compiled"`` (``compile_level``) or ``"transformers"`` (the model's own).
        forward_reason: why the fused forward does not serve ("" when it does).
        grammars_compiled: structured-output grammars compiled (those refused included).
        grammar_cache_hits: requests whose grammar came from the cache, or from a compile
            of the same grammar already running, without compiling again.
        quantization: ``"int8"`` when the model's linear layers hold int8 weights
            (``EngineConfig.quantization``), else "".
        spec_proposed_tokens: speculative decoding: tokens proposed (and verified).
        spec_accepted_tokens: of those, the ones accepted (each a token the step made
            beyond its one).
        spec_acceptance_rate: accepted / proposed (0 before any proposal).
        disk_*: the prefix cache's disk tier (``EngineConfig.kv_disk_path``; all 0 without it):
            ``disk_hits`` pages admitted from disk instead of computed, ``disk_pages_read`` /
            ``disk_pages_written`` / ``disk_bytes_read`` / ``disk_bytes_written`` page files read
            (and checked) and written, ``disk_errors`` files found corrupt, truncated or foreign
            (deleted and recomputed, never served) and failed writes, ``disk_dropped_writes`` writes
            skipped (a directory that takes no more writes, or a writer far behind), ``disk_load_s``
            seconds spent reading and checking, ``disk_copy_s`` seconds the step thread spent copying
            pages out for the writer (the tier's only cost to the steps), ``disk_blocks`` /
            ``disk_bytes`` the page files this engine knows of in the directory.
        embeddings_waiting: embedding prompts (``Engine.embed``) queued for admission, in a queue
            of their own (docs/embeddings.md).
    """

    running: int
    waiting: int
    total_blocks: int
    free_blocks: int  # pages a request can take now: never used, or cached and evictable
    cached_blocks: int  # unreferenced pages kept for prefix hits (counted in free_blocks)
    used_blocks: int
    prefix_hit_rate: float
    steps: int
    generated_tokens: int
    preemptions: int
    page_size: int
    max_batch_tokens: int
    host_blocks: int = 0  # capacity of the CPU offload pool, in pages (0: offload off)
    offloaded_blocks: int = 0  # pages held in the pool now (preempted requests)
    offloads: int = 0  # preemptions whose KV went to the pool
    restores: int = 0  # resumptions that copied it back instead of recomputing
    recomputed_tokens: int = 0  # computed tokens preemption threw away (to be recomputed)
    sliding_total_blocks: int = 0  # hybrid models: the sliding layers' own page pool (0: none)
    sliding_free_blocks: int = 0
    attn_backend: str = ""  # the attention backend serving the engine: native | triton | torch
    device_time_s: float = 0.0  # seconds the steps computed (summed StepOutput.device_s)
    hashed_blocks: int = 0  # pages holding a registered prefix, in use or cached (what kv_events() describe)
    dtype: str = ""  # the model's (and the KV pages') dtype
    forward_path: str = ""  # fused | compiled | transformers ("" before the engine first starts)
    forward_reason: str = ""  # why the fused forward does not serve ("" when it does)
    grammars_compiled: int = 0  # structured-output grammars compiled (refused ones included)
    grammar_cache_hits: int = 0  # requests served a grammar without compiling it again
    quantization: str = ""  # "int8" when the linear layers hold int8 weights, else ""
    spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed and verified
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_acceptance_rate: float = 0.0  # accepted / proposed
    disk_hits: int = 0  # pages admitted from the disk tier instead of computed
    disk_pages_read: int = 0
    disk_pages_written: int = 0
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_errors: int = 0  # corrupt / truncated / foreign files (never served) and failed writes
    disk_dropped_writes: int = 0
    disk_load_s: float = 0.0
    disk_copy_s: float = 0.0  # the step thread's share: copying pages out of the KV tensors
    disk_blocks: int = 0  # page files indexed
    disk_bytes: int = 0
    embeddings_waiting: int = 0  # embedding prompts queued (their own queue; not in waiting)
