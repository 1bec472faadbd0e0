"""The engine: one event-loop task that admits requests, plans steps, runs them on a
worker thread (never blocking the event loop) and fans tokens out to mailboxes.
It waits with anyio primitives, so it runs under asyncio (uvloop too) and trio.

The loop, with async batching on::

    plan N+1  ->  launch N+1  ->  await N  ->  process N's tokens  ->  repeat

so the CPU plans step N+1 while step N computes; a token sampled at step N
reaches step N+1's input on the device (carry-over), not through the host.
Every mutation of requests, scheduler and cache happens on the event loop's
thread between awaits, so a cancel can never race a step's bookkeeping.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anyio
import torch

from . import attention, quantization, sizing
from .config import EngineConfig, SamplingParams
from .errors import (
    AcbError,
    DeviceError,
    EngineClosedError,
    EngineOverloadedError,
    EngineStoppedError,
    InvalidRequestError,
    RequestFailedError,
    as_device_error,
    caused,
)
from .eventloop import LoopHandle
from .handle import ChunkStream, RequestHandle
from .inputs import generation_defaults, prepare, sampling_params, tokenize, tokenize_off_loop
from .kv_cache import HostPool, KVCacheManager
from .kv_events import KVEventPublisher, KVEventStream
from .live import Choices, LiveRequest, sampling_batch
from .outputs import Outputs
from .progress import BatchProgress, check_progress
from .prompt_logprobs import plan_rows
from .request import ChoicesMailbox, Completion, EngineStats, Mailbox, Outcome
from .runner import ModelRunner, PendingOutput
from .scheduler import FORKING, Scheduler
from .step import StepOutput, StepPlan
from .structured import Grammars

log = logging.getLogger("acb")


def _place(model: torch.nn.Module, config: EngineConfig) -> None:
    """Move / cast the model object to ``config.device`` / ``config.dtype`` where they are
    set and differ ("auto" keeps the model's dtype), as ``from_pretrained`` loads it."""
    param = next(model.parameters())
    if config.device is not None:
        try:
            device = torch.device(config.device)
        except RuntimeError as e:
            raise ValueError(f"EngineConfig.device {config.device!r} is not a device: {e}") from None
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else device
        if param.device != device:
            log.info("acb: moving the model to %s (EngineConfig.device)", device)
            try:
                model.to(device)
            except (AssertionError, RuntimeError) as e:  # no such device in this process
                raise ValueError(f"EngineConfig.device {config.device!r} cannot take the model: {e}") from None
    if config.dtype not in (None, "auto") and param.dtype != getattr(torch, config.dtype):
        log.info("acb: casting the model to %s (EngineConfig.dtype)", config.dtype)
        model.to(getattr(torch, config.dtype))


class EngineState(enum.Enum):
    """The engine's lifecycle. ``start()``: STOPPED -> RUNNING. ``stop()``: RUNNING ->
    DRAINING (the loop finishes what it holds; a hard stop fails it) -> STOPPED; a device
    failure drains too, and a crashed loop stops at once. ``aclose()``: STOPPED -> CLOSED,
    for good. ``Engine._transition`` is the only place the state changes."""

    STOPPED = "stopped"
    RUNNING = "running"
    DRAINING = "draining"
    CLOSED = "closed"


_TRANSITIONS = {
    EngineState.STOPPED: frozenset({EngineState.RUNNING, EngineState.CLOSED}),
    EngineState.RUNNING: frozenset({EngineState.DRAINING, EngineState.STOPPED}),
    EngineState.DRAINING: frozenset({EngineState.STOPPED}),
    EngineState.CLOSED: frozenset(),
}


class Engine:
    """A continuous-batching engine over a paged KV cache, for asyncio (uvloop too)
    and trio programs alike (anyio).

    Example::

        engine = acb.Engine.from_pretrained(folder, gguf_file="model.gguf")
        async with engine:
            async for chunk in engine.stream([{"role": "user", "content": "Name a cat breed."}], max_new_tokens=32):
                print(chunk.text, end="", flush=True)
    """

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, config: EngineConfig | None = None,
                 sampling: SamplingParams | None = None) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an acb.EngineConfig, got {type(config).__name__}")
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be an acb.SamplingParams, got {type(sampling).__name__}")
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        _place(model, self.config)
        quantization.prepare(model, self.config)  # int8: quantized in place, once
        param = next(model.parameters())
        for name in self.config.inactive_settings(param.device, param.dtype):
            log.warning("acb: EngineConfig.%s=%r has no effect on %s with %s weights; it is ignored", name,
                        getattr(self.config, name), param.device, str(param.dtype).removeprefix("torch."))
        self.sampling = sampling or SamplingParams()
        if self.sampling.priority and self.config.scheduler != "priority":
            raise ValueError(f"SamplingParams.priority={self.sampling.priority} needs EngineConfig(scheduler="
                             f"'priority'); the scheduler is {self.config.scheduler!r}")
        # what the model's generation_config sets for fields a request leaves unset
        self.generation_defaults = generation_defaults(model)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = sizing.eos_ids(model, tokenizer)
        # refuses (ValueError naming attn_backend) a backend that cannot run here, now
        self.attn_backend = attention.resolve_backend(self.config.attn_backend, next(model.parameters()).device,
                                                      next(model.parameters()).dtype)
        self._tp = None  # acb.distributed.TensorParallel: the other ranks, when tensor-parallel
        if self.config.tensor_parallel_size > 1:
            from .distributed import TensorParallel

            self._tp = TensorParallel(model, self.config)
        self.device = self._tp.device if self._tp else next(model.parameters()).device
        self.layout = self._tp.layout if self._tp else sizing.layout(model, self.config)
        self.page_size = self.layout.page_size
        self.num_pages = self.layout.num_pages
        self.max_model_len = self.layout.max_model_len
        self.max_batch_tokens = self.layout.max_batch_tokens
        self.max_requests = self.layout.max_requests
        self.max_waiting = self.config.max_waiting_requests or 4 * self.max_requests
        self._kv_events: KVEventPublisher | None = None
        if self.config.kv_events:
            self._kv_events = KVEventPublisher(lambda: self.kv.registered())
            if not self.layout.prefix_caching:
                log.warning("acb: EngineConfig.kv_events=True, but prefix caching is off for this model (sliding-"
                            "window layers, or allow_prefix_sharing=False): no page will ever be stored")
        self.kv = KVCacheManager(self.num_pages, self.page_size, enable_prefix_caching=self.layout.prefix_caching,
                                 events=self._kv_events.pending if self._kv_events else None,
                                 medium="GPU" if self.device.type == "cuda" else self.device.type.upper())
        self.host_pool = HostPool(self.layout.host_pages) if self.layout.host_pages else None
        self.kv_swa = KVCacheManager(self.layout.swa_pages, self.page_size, enable_prefix_caching=False) \
            if self.layout.swa_pages else None
        self.scheduler = Scheduler(
            self.kv, self.max_batch_tokens, self.max_requests,
            policy=self.config.scheduler, safety_margin=self.config.effective_safety_margin,
            sliding_window=self.layout.sliding_window, host_pool=self.host_pool, kv_swa=self.kv_swa,
            aging_steps=self.config.priority_aging_steps,
        )
        self._out = Outputs(self.scheduler)
        self._grammars = Grammars(tokenizer, self.vocab_size, self.eos_token_ids,
                                  cache_size=self.config.grammar_cache_size,
                                  timeout_s=self.config.grammar_compile_timeout_s,
                                  threads=1 if self.device.type == "cpu" else 8)
        self._live = self._out.live  # request id -> LiveRequest
        self._runner: ModelRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loop: LoopHandle | None = None
        self._task: Any = None  # the asyncio task of the loop (trio: None, a system task)
        self._finished: anyio.Event | None = None  # set when the loop task has ended
        self._wakeup: anyio.Event | None = None
        self._state = EngineState.STOPPED  # changed by _transition only
        self._hard = False
        self._arrivals = itertools.count()
        self._steps = 0
        self._device_s = 0.0  # the steps' StepOutput.device_s, summed
        self._poll_interval = 0.0002
        self._omp_reset = None
        if self.device.type == "cpu":
            from .kernels.cpu import release_calling_thread_omp_pool

            self._omp_reset = release_calling_thread_omp_pool
        self._stop_reason: str | None = None
        self._hooked: str | None = None  # why the model's own forward runs, as of the last step

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None, config: EngineConfig | None = None,
                        sampling: SamplingParams | None = None, **model_kwargs: Any) -> Engine:
        """Load a model and tokenizer from a local HF folder (or a folder plus
        ``gguf_file``) and build an engine over them."""
        from .loading import default_dtype, load

        config = config or EngineConfig()
        device = config.device
        if config.dtype is None and config.tensor_parallel_size == 1:
            dtype = default_dtype(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            log.info("acb: loading the model in %s (EngineConfig.dtype=None picks it for this device; "
                     "dtype='float32' or acb serve --dtype float32 keeps full precision)", dtype)
            config = dataclasses.replace(config, dtype=dtype)
        if config.tensor_parallel_size > 1:
            # the full model stays on the host; each rank takes its share to its device
            device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
            config = dataclasses.replace(config, device=device,
                                         dtype=config.dtype or ("bfloat16" if device.startswith("cuda") else None))
            device = "cpu"
        model, tokenizer = load(path, gguf_file, dtype=config.dtype, device=device, quantization=config.quantization,
                                **model_kwargs)
        return cls(model, tokenizer=tokenizer, config=config, sampling=sampling)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine loop on the running event loop, asyncio or trio (allocates
        the KV cache the first time)."""
        self._check_not_closed()
        if self._state in (EngineState.RUNNING, EngineState.DRAINING):
            return
        if self._tp is not None and self._tp.error is not None:
            raise EngineStoppedError(self._stop_reason or f"the engine stopped: {self._tp.error}")
        if self._runner is None:
            if self._tp is not None:
                self._runner = self._tp.runner(self.layout, self.config)
            else:
                self._runner = ModelRunner(self.model, self.num_pages, self.page_size, self.attn_backend,
                                           host_pages=self.host_pool.num_slots if self.host_pool else 0,
                                           swa_pages=self.layout.swa_pages, swa_layers=self.layout.swa_layers)
            self._runner.fault_hook = self.config.fault_hook
            self._runner.configure_fast_paths(self.config, self.max_requests)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acb-step")
        self._loop = LoopHandle()
        self._wakeup = self._loop.Event()
        self._finished = self._loop.Event()
        self._hard = False
        self._stop_reason = None
        self._transition(EngineState.RUNNING)
        self._task = self._loop.spawn(self._run, "acb-engine")

    async def stop(self, hard: bool = False) -> None:
        """Stop admitting. Graceful: finish everything queued and running. Hard: end
        now; every unfinished request raises ``EngineStoppedError``. After ``aclose()``
        it raises ``EngineClosedError``."""
        self._check_not_closed()
        if self._state not in (EngineState.RUNNING, EngineState.DRAINING):
            return
        self._transition(EngineState.DRAINING)
        if hard:
            self._hard = True
            error = EngineStoppedError("the engine was stopped (hard stop)")
            for req in list(self._live.values()):
                self._out.fail(req, error)
        self._wakeup.set()
        await self._finished.wait()  # cancelling this wait leaves the loop draining
        self._task = None
        self._transition(EngineState.STOPPED)

    async def aclose(self) -> None:
        """Graceful stop, then release the model runner's memory and the worker thread.
        The engine cannot be used afterwards."""
        if self._state is EngineState.CLOSED:
            return
        await self.stop()
        if self._runner is not None:
            self._runner.release()
            self._runner = None
            if self.device.type == "cpu":
                import gc

                from .kernels.cpu_linear import trim_heap

                gc.collect()
                trim_heap()  # the cache's memory goes back to the OS now, not at exit
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._grammars.close()
        if self._tp is not None:
            self._tp.close()  # every other rank exits
        self._transition(EngineState.CLOSED)

    def _transition(self, to: EngineState) -> None:
        """Move the lifecycle to ``to`` (staying put is allowed); RuntimeError for a move
        the lifecycle does not have."""
        if to is not self._state and to not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"acb engine: no transition from {self._state.value} to {to.value}")
        self._state = to

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def is_running(self) -> bool:
        """True between ``start()`` and ``stop()``: the engine admits requests."""
        return self._state is EngineState.RUNNING and (self._tp is None or self._tp.error is None)

    @property
    def runner(self) -> ModelRunner | None:
        """The model runner computing this engine's steps: None before ``start()`` and after
        ``aclose()``. Not part of the stable API: tests reach it through
        ``acb.testing.runner_of``."""
        return self._runner

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel ranks this engine started (empty with one
        rank, or under torchrun, where the launcher owns them)."""
        return self._tp.worker_pids if self._tp else []

    # ------------------------------------------------------------------ submission
    def _check_not_closed(self) -> None:
        if self._state is EngineState.CLOSED:
            raise EngineClosedError("the engine is closed")

    def _check_accepting(self) -> None:
        self._check_not_closed()
        if self._tp is not None and self._tp.error is not None:
            raise EngineStoppedError(self._stop_reason or f"the engine stopped: {self._tp.error}")
        if self._state is not EngineState.RUNNING:
            raise EngineStoppedError(
                self._stop_reason or "the engine is not running: call `await engine.start()` first")

    def _prepare(self, prompt: Any, request_id: str | None, sampling: SamplingParams | None,
                 overrides: dict[str, Any]) -> tuple[str, list[int], SamplingParams, Any]:
        """(request id, prompt ids, resolved params, compiled grammar or None), or
        InvalidRequestError. All of it on this thread: the sync path (``submit``, ``stream``)."""
        return self._checked(prompt, request_id, self._params(sampling, overrides))

    async def _prepare_async(self, prompt: Any, request_id: str | None, sampling: SamplingParams | None,
                             overrides: dict[str, Any]) -> tuple[str, list[int], SamplingParams, Any]:
        """``_prepare`` with its heavy parts off the event loop: a long prompt is tokenized,
        and a grammar not in the cache compiled, on worker threads. Everything after the
        last await runs at once, so the caller registers what it checked."""
        params = self._params(sampling, overrides)
        ids = await tokenize_off_loop(prompt, self.tokenizer, self.vocab_size)
        grammar = await self._grammars.compiled_async(params, self._loop.wait_future) if params.structured else None
        return self._checked(prompt, request_id, params, ids, grammar)

    def _params(self, sampling: SamplingParams | None, overrides: dict[str, Any]) -> SamplingParams:
        params = sampling_params(self.sampling, sampling, overrides, self.generation_defaults)
        if params.priority and self.config.scheduler != "priority":
            raise InvalidRequestError(f"priority={params.priority} needs an engine built with EngineConfig("
                                      f"scheduler='priority'); this one schedules {self.config.scheduler!r}",
                                      param="priority")
        return params

    def _checked(self, prompt: Any, request_id: str | None, params: SamplingParams, ids: list[int] | None = None,
                 grammar: Any = None) -> tuple[str, list[int], SamplingParams, Any]:
        rid, ids, params = prepare(prompt, request_id, params, self.tokenizer, self.vocab_size, self.max_model_len,
                                   self._out, ids=ids)
        if params.n > 1:
            self._check_choices(params)
        if params.structured and grammar is None:
            grammar = self._grammars.compiled(params)  # on this thread, for at most grammar_compile_timeout_s
        return rid, ids, params, grammar

    def _check_room(self, n: int = 1) -> None:
        """Raise ``EngineOverloadedError`` if ``n`` more requests would overfill the waiting queue.
        A request with ``n`` > 1 counts once: it waits as one sequence (its prompt) until the
        step that prefills it forks the choices, and ``n`` is bounded by the batch rows."""
        waiting = len(self.scheduler.waiting)
        if waiting + n > self.max_waiting:
            raise EngineOverloadedError(
                f"the engine is overloaded: {waiting} requests are waiting (max_waiting_requests="
                f"{self.max_waiting}); retry later", retry_after=1.0)

    def _register(self, request_id: str, ids: list[int], params: SamplingParams, grammar: Any,
                  stream: bool) -> LiveRequest | Choices:
        if params.n > 1:
            return self._register_choices(request_id, ids, params, grammar, stream)
        mailbox = Mailbox(request_id, params.logprobs, self._loop.Event, params.top_logprobs > 0) if stream else None
        req = self._live_request(request_id, ids, params, grammar, mailbox)
        if params.prompt_logprobs is not None:
            self._out.score_prompt([req], params.prompt_logprobs)
        self.scheduler.add(req.seq)
        self._wakeup.set()
        return req

    def _live_request(self, key: str, ids: list[int], params: SamplingParams, grammar: Any,
                      mailbox: Mailbox | None) -> LiveRequest:
        matcher = self._grammars.matcher(grammar) if grammar is not None else None
        req = LiveRequest.create(key, ids, params, mailbox, Outcome(self._loop.Event), self.tokenizer,
                                 self.eos_token_ids, matcher, next(self._arrivals))
        self._out.add(req)
        return req

    def _register_choices(self, request_id: str, ids: list[int], params: SamplingParams, grammar: Any,
                          stream: bool) -> Choices:
        """n > 1: one sequence per choice (``request_id#i``); choice 0 prefills the prompt
        and the others fork from it (Scheduler._fork). With a seed, choice i samples with
        a seed of its own derived from it."""
        mailbox = ChoicesMailbox(request_id, params.n, params.logprobs, params.top_logprobs > 0,
                                 self._loop.Event) if stream else None
        members = []
        for i in range(params.n):
            p = params
            if params.seed is not None and i:
                p = dataclasses.replace(params, seed=(params.seed + i * 0x9E3779B97F4A7C15) % 2**63)
            req = self._live_request(f"{request_id}#{i}", ids, p, grammar, mailbox.members[i] if stream else None)
            req.index = i
            members.append(req)
        group = Choices(request_id, members, mailbox, Outcome(self._loop.Event))
        for req in members:
            req.group = group
            req.seq.status = FORKING
        if params.prompt_logprobs is not None:
            self._out.score_prompt(members, params.prompt_logprobs)
        leader = members[0].seq
        leader.forks = [m.seq for m in members[1:]]
        self._out.groups[request_id] = group
        self.scheduler.add(leader)
        self._wakeup.set()
        return group

    def _check_choices(self, params: SamplingParams) -> None:
        """n > 1 forks choices from one prefilled prompt, all in the step that prefills it."""
        if params.n > self.max_requests:
            raise InvalidRequestError(f"n={params.n} is more than the rows one step can hold ({self.max_requests}: "
                                      "max_requests_per_batch)", param="n")

    def submit(self, prompt: Any, *, request_id: str | None = None, sampling: SamplingParams | None = None,
               **kwargs: Any) -> RequestHandle:
        """Queue a request now and return its handle (stream it, await it, cancel it).
        Bad input raises ``InvalidRequestError`` here; the engine is unaffected.

        Synchronous: a long prompt is tokenized, and a grammar not in the cache compiled
        (for at most ``EngineConfig.grammar_compile_timeout_s``), before it returns, on
        the caller's thread. ``await engine.asubmit(...)`` does those on worker threads."""
        self._check_accepting()
        self._check_room()
        return self._handle(*self._prepare(prompt, request_id, sampling, kwargs), stream=True)

    async def asubmit(self, prompt: Any, *, request_id: str | None = None, sampling: SamplingParams | None = None,
                      **kwargs: Any) -> RequestHandle:
        """``submit`` without blocking the event loop: a long text or chat prompt is
        tokenized, and a grammar not yet compiled (``json_schema``, ``regex``, ``choice``)
        compiled, on worker threads while other requests and streams go on; then the
        request is queued. Bad input, or a grammar that does not compile within
        ``EngineConfig.grammar_compile_timeout_s``, raises ``InvalidRequestError`` naming
        the field.

        Example::

            handle = await engine.asubmit("Pick one.", json_schema={"enum": names})
            completion = await handle
        """
        return await self._asubmit(prompt, request_id, sampling, kwargs, stream=True)

    async def _asubmit(self, prompt: Any, request_id: str | None, sampling: SamplingParams | None,
                       kwargs: dict[str, Any], stream: bool) -> RequestHandle:
        self._check_accepting()
        self._check_room()
        prepared = await self._prepare_async(prompt, request_id, sampling, kwargs)
        self._check_accepting()  # again: the engine may have stopped, or the queue filled, meanwhile
        self._check_room()
        return self._handle(*prepared, stream=stream)

    def _handle(self, rid: str, ids: list[int], params: SamplingParams, grammar: Any, *,
                stream: bool) -> RequestHandle:
        req = self._register(rid, ids, params, grammar, stream)
        return RequestHandle(rid, req.mailbox, req.future, lambda index=None: self._cancel(rid, index))

    def stream(self, prompt: Any, *, request_id: str | None = None, sampling: SamplingParams | None = None,
               **kwargs: Any) -> ChunkStream:
        """Submit a request and return an async iterator of its ``Chunk``s.

        Example::

            async for chunk in engine.stream([{"role": "user", "content": "Hi!"}], max_new_tokens=16):
                print(chunk.text, end="")
        """
        return aiter(self.submit(prompt, request_id=request_id, sampling=sampling, **kwargs))

    async def generate(self, prompt: Any, *, request_id: str | None = None,
                       sampling: SamplingParams | None = None, **kwargs: Any) -> Completion:
        """Run one request to the end and return its ``Completion`` (long prompts tokenized
        and grammars compiled off the event loop, as ``asubmit``)."""
        return await (await self._asubmit(prompt, request_id, sampling, kwargs, stream=False))

    async def generate_batch(self, prompts: list[Any], *, sampling: SamplingParams | None = None,
                             request_ids: list[str] | None = None, progress: bool = False,
                             **kwargs: Any) -> list[Completion]:
        """Run several prompts; results come back in input order. Submission is
        ordered by prompt tokens so requests sharing a prefix run close together.
        ``progress=True`` shows a tqdm bar on stderr: requests done, generated tokens/s.

        Example::

            results = await engine.generate_batch(prompts, max_new_tokens=64, progress=True)
        """
        self._check_accepting()
        self._check_room()  # the batch itself may exceed the bound: its size is the caller's
        check_progress(progress)
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"prompts must be a list, got {type(prompts).__name__}", param="prompts")
        if request_ids is not None and (not isinstance(request_ids, (list, tuple))
                                        or len(request_ids) != len(prompts)):
            raise InvalidRequestError("request_ids must have one id per prompt", param="request_ids")
        prepared = []
        seen: set[str] = set()
        for i, prompt in enumerate(prompts):
            rid = request_ids[i] if request_ids is not None else None
            try:
                p = await self._prepare_async(prompt, rid, sampling, kwargs)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompts[{i}]: {e}", param=e.param) from e
            if p[0] in seen:
                raise InvalidRequestError(f"prompts[{i}]: duplicate request_id {p[0]!r}", param="request_id")
            seen.add(p[0])
            prepared.append(p)
        self._check_accepting()  # preparing may have awaited (long prompts, grammars): check again
        for i, p in enumerate(prepared):
            if p[0] in self._out:
                raise InvalidRequestError(f"prompts[{i}]: request_id {p[0]!r} is already in use by a live request",
                                          param="request_id")
        order = sorted(range(len(prepared)), key=lambda i: prepared[i][1])
        reqs: list[LiveRequest | None] = [None] * len(prepared)
        for i in order:
            reqs[i] = self._register(*prepared[i], stream=False)
        if not reqs:
            return []
        bar = BatchProgress(len(reqs), disable=not progress)
        settled = self._loop.Event()
        left = [len(reqs)]

        def on_done(outcome: Outcome) -> None:
            left[0] -= 1
            if outcome.exception() is None:
                if progress:
                    bar.done(outcome.result())
            else:
                settled.set()  # one failed: raise it now
            if left[0] == 0:
                settled.set()

        try:
            for r in reqs:
                r.future.add_done_callback(on_done)
            await settled.wait()
            return [r.future.result() for r in reqs]
        except BaseException:
            for r in reqs:
                self._cancel(r.request_id)
            raise
        finally:
            bar.close()

    def tokenize(self, prompt: Any) -> list[int]:
        """The token ids ``prompt`` (text, token ids or chat messages) runs as; bad input
        raises ``InvalidRequestError`` naming it. Servers use it to know a prompt's length
        and text before its first token."""
        return tokenize(prompt, self.tokenizer, self.vocab_size)

    def cancel(self, request_id: str, index: int | None = None) -> bool:
        """Cancel a live request: its stream ends with ``finish_reason="cancelled"``
        and its pages are released at once. With ``n`` > 1 every choice is cancelled,
        or only choice ``index``. Returns False if it is not live; raises
        ``EngineClosedError`` after ``aclose()``."""
        self._check_not_closed()
        return self._cancel(request_id, index)

    def _cancel(self, request_id: str, index: int | None = None) -> bool:
        group = self._out.groups.get(request_id)
        if group is not None:
            members = group.members if index is None else group.members[index:index + 1] if index >= 0 else []
            return any([self._cancel(m.request_id) for m in members])
        req = self._live.get(request_id)
        if req is None:
            return False
        if self._loop is not None and not self._loop.in_loop_thread():
            self._loop.call_soon_threadsafe(self._cancel, request_id)
            return True
        text = self._out.flush_text(req)
        self._out.finish(req, "cancelled", text)
        return True

    def _expire(self) -> None:
        """End every request whose ``timeout_s`` has run out with ``finish_reason="timeout"``
        (its partial output kept); its pages are free at once. Runs in the loop between
        steps, as a cancel does."""
        for req in self._out.expired(time.monotonic()):
            if self._live.get(req.request_id) is req:
                self._out.finish(req, "timeout", self._out.flush_text(req))

    def stats(self) -> EngineStats:
        """A snapshot of the engine's load, cache and counters (see ``acb.EngineStats``).

        Example::

            s = engine.stats()
            print(s.running, s.waiting, s.free_blocks, s.prefix_hit_rate)
        """
        kv = self.kv
        host = self.host_pool
        runner = self._runner
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            total_blocks=kv.num_pages, free_blocks=kv.num_free, cached_blocks=kv.num_cached,
            used_blocks=kv.num_used, prefix_hit_rate=kv.hit_rate, steps=self._steps,
            generated_tokens=self.scheduler.num_generated_tokens, preemptions=self.scheduler.num_preemptions,
            page_size=self.page_size, max_batch_tokens=self.max_batch_tokens,
            host_blocks=host.num_slots if host else 0, offloaded_blocks=host.num_used if host else 0,
            offloads=host.num_offloads if host else 0, restores=host.num_restores if host else 0,
            recomputed_tokens=self.scheduler.num_recomputed_tokens,
            sliding_total_blocks=self.kv_swa.num_pages if self.kv_swa else 0,
            sliding_free_blocks=self.kv_swa.num_free if self.kv_swa else 0,
            attn_backend=self._runner.attn_backend if self._runner is not None else self.attn_backend,
            device_time_s=self._device_s, hashed_blocks=len(kv.page_key),
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            forward_path=runner.forward_path if runner is not None else "",
            forward_reason=runner.forward_reason if runner is not None else "",
            grammars_compiled=self._grammars.compiles, grammar_cache_hits=self._grammars.hits,
            quantization="int8" if quantization.is_quantized(self.model) else "",
        )

    def kv_events(self, max_batches: int = 1024) -> KVEventStream:
        """Subscribe to the prefix cache's events (needs ``EngineConfig(kv_events=True)``):
        an async iterator of ``acb.KVEventBatch``, one per engine step that changed the set
        of prefix pages, starting with a resync (the whole current set). A subscriber that
        falls ``max_batches`` behind loses the queued batches (``stream.dropped`` counts them)
        and gets a resync next; the engine never waits for it. The iterator ends when the
        engine stops or on ``stream.close()``.

        Example::

            cached = set()
            async for batch in engine.kv_events():
                for event in batch.events:
                    if isinstance(event, acb.AllBlocksCleared):
                        cached.clear()
                    elif isinstance(event, acb.BlockStored):
                        cached.update(event.block_hashes)
                    else:
                        cached.difference_update(event.block_hashes)
        """
        self._check_not_closed()
        if self._kv_events is None:
            raise ValueError("engine.kv_events() needs an engine built with EngineConfig(kv_events=True)")
        if not isinstance(max_batches, int) or isinstance(max_batches, bool) or max_batches < 1:
            raise ValueError(f"max_batches must be an int >= 1, got {max_batches!r}")
        return self._kv_events.subscribe(max_batches)

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        inflight: tuple[StepPlan, Future] | None = None
        cancelled = anyio.get_cancelled_exc_class()
        try:
            while True:
                if self._hard:
                    break
                if self._out.deadlines:
                    self._expire()
                launched = masks = None
                if self.scheduler.has_work():
                    if self._omp_reset is not None:
                        self._omp_reset()
                    hooked, refresh = self._check_model()
                    plan = self.scheduler.schedule()
                    if plan.admitted:
                        self._out.scheduled(plan)
                    if plan.seqs:
                        step = plan.input
                        step.sampling = sampling_batch(plan, self._live, self.vocab_size)
                        if self._out.scoring:
                            step.prompt_logprobs, plan.prompt_sinks = plan_rows(plan, self._live)
                        step.plain = hooked is not None
                        step.refresh = refresh
                        controls = step.sampling.controls
                        masks = controls.token_mask if controls is not None else None
                        fut = self._executor.submit(self._runner.execute, step)
                        launched = (plan, fut)
                        if not self.config.async_batching:
                            if masks is not None:
                                masks.fill()
                            await self._complete(launched)
                            launched = masks = None
                if inflight is not None:
                    try:
                        await self._complete(inflight)
                    finally:
                        # the launched step's structured-output masks need every earlier
                        # token accepted: they are filled now, while its forward runs
                        if masks is not None:
                            masks.fill()
                elif masks is not None:
                    masks.fill()
                inflight = launched
                if self._kv_events is not None:
                    self._kv_events.flush()  # this iteration's: what schedule() evicted, update() stored
                if inflight is None:
                    if self._state is EngineState.DRAINING and not self._live:
                        break
                    if not self.scheduler.has_work():
                        if self.config.debug_checks:
                            self.check_integrity()
                        # nothing else runs between the check and the new event, so a
                        # submission either saw work or sets this event
                        self._wakeup = wakeup = self._loop.Event()
                        deadline = self._out.next_deadline() if self._out.deadlines else None
                        if deadline is None:
                            await wakeup.wait()
                        else:  # wake up in time to end the request whose deadline is nearest
                            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                                await wakeup.wait()
                else:
                    await anyio.sleep(0)  # let consumers and submitters run
        except BaseException as e:
            if not isinstance(e, cancelled):
                log.exception("acb engine loop crashed")
            error = caused(RequestFailedError(f"the engine loop failed: {e!r}"), e)
            self._out.fail_all(lambda req: error)
            self._transition(EngineState.STOPPED)
            if isinstance(e, cancelled):
                raise
        finally:
            try:
                if inflight is not None:
                    with anyio.CancelScope(shield=True):
                        try:
                            await self._loop.wait_future(inflight[1])  # never leave the worker mid-step
                        except Exception:
                            pass
                if self._hard:
                    for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                        self.scheduler.finish(seq)
                    if self._stop_reason is not None:  # ended by a device failure, not by stop()
                        self._transition(EngineState.STOPPED)
            finally:
                if self._kv_events is not None:
                    self._kv_events.close()  # every kv_events() stream ends with the loop
                self._finished.set()  # stop() waits for this

    async def _complete(self, launched: tuple[StepPlan, Future]) -> None:
        plan, fut = launched
        try:
            out: StepOutput | PendingOutput = await self._loop.wait_future(fut)
            if isinstance(out, PendingOutput):
                # The step is queued on the device: poll its event without blocking
                # the loop (sub-millisecond sleeps keep latency low for short steps).
                while not out.ready():
                    await anyio.sleep(self._poll_interval)
                out = out.result()
        except Exception as e:
            self._steps += 1
            device_error = as_device_error(e)
            if device_error is not None:
                self._device_failed(device_error)
                return
            log.warning("step failed: %r", e)
            self._out.step_failed(plan, e)
            return
        self._steps += 1
        self._device_s += out.device_s
        if plan.prompt_sinks:
            self._out.deliver_prompt_logprobs(plan, out)
        self._out.deliver(self.scheduler.update(plan, out), out)
        if self._kv_events is not None:
            # before anyone awaiting a request that just finished runs: its pages' events are out
            self._kv_events.flush()

    def _check_model(self) -> tuple[str | None, bool]:
        """Has the model changed since the last step (hooks, forwards, weights)? When it
        has, KV cached for prefix hits was computed by another model: forget it."""
        if self._tp is not None:  # the ranks run shards copied at construction, not the model object
            return None, False
        hooked, changed = self._runner.check_model()
        if changed or hooked != self._hooked:
            if hooked != self._hooked:
                log.info("acb: %s", f"{hooked}: the model's own forward runs" if hooked
                         else "the model's fast paths are back on")
            self._hooked = hooked
            self.kv.forget_prefixes()
        return hooked, changed

    async def reload_weights(self) -> None:
        """Take the model as it is now: after weights written through ``.data`` (which
        PyTorch's version counter does not see), or any change acb should take as the
        new model. Waits for the step in flight, repacks every weight, rebuilds the fast
        paths and forgets the prefix cache; the next step computes with the new weights.

        Replacing parameters, ``load_state_dict`` and in-place edits (``weight.mul_``,
        ``weight.copy_``) need no call: acb sees them before the next step.
        """
        self._check_not_closed()
        if self._tp is not None:
            raise NotImplementedError("reload_weights() with tensor_parallel_size > 1: the ranks hold shards "
                                      "copied when the engine was built; build a new engine over the new weights")
        if self._runner is None:
            return  # nothing packed yet: start() takes the weights as they are
        await self._loop.wait_future(self._executor.submit(self._runner.refresh_weights, True))
        self.kv.forget_prefixes()
        if self._kv_events is not None:
            self._kv_events.flush()

    def _device_failed(self, error: DeviceError) -> None:
        """The device is unusable: fail every unfinished request and stop the loop
        (never hang). ``start()`` may be tried again."""
        log.error("acb: %s; stopping the engine", error)
        self._stop_reason = f"the engine stopped after a device failure: {error}"
        self._out.fail_all(lambda req: caused(
            RequestFailedError(f"request {req.request_id} failed: {error}", req.request_id), error))
        self._transition(EngineState.DRAINING)
        self._hard = True

    def check_integrity(self) -> None:
        """Assert the cache's invariants against the live requests' block tables."""
        self._check_not_closed()
        tables = [r.seq.block_table for r in self._live.values()]
        self.kv.check_integrity(tables)
        if self.kv_swa is not None:
            self.kv_swa.check_integrity(r.seq.swa_table for r in self._live.values())
        if self.host_pool is not None:
            self.host_pool.check_integrity(r.seq.host_table for r in self._live.values() if r.seq.host_table)


__all__ = ["Engine", "EngineStats", "AcbError"]
