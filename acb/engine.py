"""The engine: one asyncio task that admits requests, plans steps, runs them on a
worker thread (never blocking the event loop) and fans tokens out to mailboxes.

The loop, with async batching on::

    plan N+1  ->  launch N+1  ->  await N  ->  process N's tokens  ->  repeat

so the CPU plans step N+1 while step N computes; a token sampled at step N
reaches step N+1's input on the device (carry-over), not through the host.
Every mutation of requests, scheduler and cache happens on the event loop's
thread between awaits, so a cancel can never race a step's bookkeeping.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .config import EngineConfig, SamplingParams
from .cuda_graphs import graph_memory_reserve
from .detokenizer import Detokenizer, StopMatcher
from .errors import (
    AcbError,
    DeviceError,
    EngineClosedError,
    EngineStoppedError,
    InvalidRequestError,
    RequestFailedError,
    as_device_error,
)
from .handle import ChunkStream, RequestHandle
from .inputs import sampling_params, tokenize
from .kv_cache import HostPool, KVCacheManager
from .request import Completion, Mailbox, RequestMetrics
from .runner import ModelRunner, PendingOutput, RowInput, StepInput, StepOutput, kv_bytes_per_token
from .sampling import SamplingBatch
from .scheduler import Scheduler, Sequence, StepPlan

log = logging.getLogger("acb")


@dataclass(slots=True)
class EngineStats:
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


class _Request:
    __slots__ = ("request_id", "seq", "params", "mailbox", "future", "detok", "stopper",
                 "text_parts", "logprobs", "metrics", "stop_ids", "finish_reason")

    def __init__(self, request_id: str, seq: Sequence, params: SamplingParams,
                 mailbox: Mailbox | None, future: asyncio.Future, tokenizer, stop_ids: frozenset[int]):
        self.request_id = request_id
        self.seq = seq
        self.params = params
        self.mailbox = mailbox
        self.future = future
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.stopper = StopMatcher(params.stop)
        self.text_parts: list[str] = []
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(seq.prompt_ids))
        self.stop_ids = stop_ids
        self.finish_reason: str | None = None


def _silence(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class Engine:
    """An asyncio continuous-batching engine over a paged KV cache.

    Example::

        engine = acb.Engine.from_pretrained(folder, gguf_file="model.gguf")
        async with engine:
            async for chunk in engine.stream("Name a cat breed.", max_new_tokens=32):
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
        for name in self.config.inactive_settings():
            log.warning("acb: EngineConfig.%s is accepted but not active yet; it has no effect", name)
        self.sampling = sampling or SamplingParams()
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = self._eos_ids(model, tokenizer)
        self.device = next(model.parameters()).device
        self.page_size = self.config.page_size or 16
        self.num_pages = self._size_cache(model)
        self.max_model_len = min(
            getattr(text_config, "max_position_embeddings", None) or 1 << 30,
            self.num_pages * self.page_size,
        )
        # CPU: 2048 measured best on the standard workload (1024: -8 %, 4096: -12 %);
        # a bigger chunk makes fewer steps, each carrying every running decode.
        default_tokens = 2048 if self.device.type == "cpu" else 8192
        self.max_batch_tokens = self.config.max_batch_tokens or max(
            256, min(default_tokens, self.num_pages * self.page_size)
        )
        self.max_requests = self.config.max_requests_per_batch or 256
        sliding = getattr(text_config, "sliding_window", None) is not None and any(
            t == "sliding_attention" for t in (getattr(text_config, "layer_types", None) or ["sliding_attention"])
        )
        window = getattr(text_config, "sliding_window", None)
        layer_types = getattr(text_config, "layer_types", None)
        all_sliding = bool(sliding and (not layer_types or all(t == "sliding_attention" for t in layer_types)))
        if all_sliding and self.num_pages * self.page_size >= window + self.max_batch_tokens + 2 * self.page_size:
            # every layer slides: pages behind the window are recycled, so a request's
            # memory is bounded by the window, not by its length
            self.max_model_len = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        prefix = self.config.allow_prefix_sharing and not sliding
        if self.config.allow_prefix_sharing and sliding:
            log.info("prefix caching is off: the model has sliding-window layers")
        self.kv = KVCacheManager(self.num_pages, self.page_size, enable_prefix_caching=prefix)
        host_pages = self._size_host_pool(model)
        self.host_pool = HostPool(host_pages) if host_pages else None
        self.scheduler = Scheduler(
            self.kv, self.max_batch_tokens, self.max_requests,
            policy=self.config.scheduler, safety_margin=self.config.effective_safety_margin,
            sliding_window=window if all_sliding else None, host_pool=self.host_pool,
        )
        self._runner: ModelRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._live: dict[str, _Request] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._state = "stopped"  # stopped | running | draining | closed
        self._hard = False
        self._arrivals = itertools.count()
        self._steps = 0
        self._generated = 0
        self._poll_interval = 0.0002
        self._stop_reason: str | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None, config: EngineConfig | None = None,
                        sampling: SamplingParams | None = None, **model_kwargs: Any) -> Engine:
        """Load a model and tokenizer from a local HF folder (or a folder plus
        ``gguf_file``) and build an engine over them."""
        from .loading import load

        config = config or EngineConfig()
        model, tokenizer = load(path, gguf_file, dtype=config.dtype, device=config.device, **model_kwargs)
        return cls(model, tokenizer=tokenizer, config=config, sampling=sampling)

    @staticmethod
    def _eos_ids(model, tokenizer) -> frozenset[int]:
        ids: set[int] = set()
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos is not None:
            ids.update(int(e) for e in eos)
        return frozenset(ids)

    def _size_cache(self, model) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        per_page = kv_bytes_per_token(model.config, next(model.parameters()).dtype) * self.page_size
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            free -= graph_memory_reserve(model.config, next(model.parameters()).dtype, self.config)
        else:
            import psutil

            free = psutil.virtual_memory().available
        return max(16, int(free * self.config.max_memory_percent) // per_page)

    def _size_host_pool(self, model) -> int:
        """Pages of the CPU offload pool: ``cpu_offload_space`` GiB (None: as much as
        allowed), never more than 80 % of the RAM available now."""
        space = self.config.cpu_offload_space
        if space == 0:
            return 0
        import psutil

        per_page = kv_bytes_per_token(model.config, next(model.parameters()).dtype) * self.page_size
        cap = 0.8 * psutil.virtual_memory().available
        wanted = cap if space is None else min(space * 2**30, cap)
        if space is not None and space * 2**30 > cap:
            log.warning("acb: cpu_offload_space=%s GiB is more than 80%% of available RAM; using %.2f GiB",
                        space, cap / 2**30)
        pages = int(wanted // per_page)
        log.info("acb: CPU offload pool of %d pages (%.2f GiB)", pages, pages * per_page / 2**30)
        return pages

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine loop on the running event loop (allocates the KV cache
        the first time)."""
        if self._state == "closed":
            raise EngineClosedError("the engine is closed")
        if self._state in ("running", "draining"):
            return
        if self._runner is None:
            self._runner = ModelRunner(self.model, self.num_pages, self.page_size, self.config.attn_backend,
                                       host_pages=self.host_pool.num_slots if self.host_pool else 0)
            self._runner.fault_hook = self.config.fault_hook
            self._runner.configure_fast_paths(self.config, self.max_requests)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acb-step")
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._hard = False
        self._stop_reason = None
        self._state = "running"
        self._task = self._loop.create_task(self._run(), name="acb-engine")

    async def stop(self, hard: bool = False) -> None:
        """Stop admitting. Graceful: finish everything queued and running. Hard: end
        now; every unfinished request raises ``EngineStoppedError``."""
        if self._state not in ("running", "draining"):
            return
        self._state = "draining"
        if hard:
            self._hard = True
            error = EngineStoppedError("the engine was stopped (hard stop)")
            for req in list(self._live.values()):
                self._fail(req, error)
        self._wakeup.set()
        task = self._task
        if task is not None:
            await asyncio.shield(task)
        self._task = None
        self._state = "stopped"

    async def aclose(self) -> None:
        """Graceful stop, then release the model runner's memory and the worker thread.
        The engine cannot be used afterwards."""
        if self._state == "closed":
            return
        await self.stop()
        if self._runner is not None:
            self._runner.release()
            self._runner = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._state = "closed"

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def is_running(self) -> bool:
        return self._state == "running"

    # ------------------------------------------------------------------ submission
    def _check_accepting(self) -> None:
        if self._state == "closed":
            raise EngineClosedError("the engine is closed")
        if self._state != "running":
            raise EngineStoppedError(
                self._stop_reason or "the engine is not running: call `await engine.start()` first")

    def _prepare(self, prompt: Any, request_id: str | None, sampling: SamplingParams | None,
                 overrides: dict[str, Any]) -> tuple[str, list[int], SamplingParams]:
        params = sampling_params(self.sampling, sampling, overrides)
        ids = tokenize(prompt, self.tokenizer, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids instead", param="stop")
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise InvalidRequestError(f"stop_token_ids: {t} is out of the vocabulary")
        total = len(ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) is {total} tokens, "
                f"more than this engine can ever hold ({self.max_model_len}: see EngineConfig.num_blocks, "
                f"page_size and the model's max_position_embeddings)",
                param="max_new_tokens",
            )
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._live:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use by a live request")
        return request_id, ids, params

    def _register(self, request_id: str, ids: list[int], params: SamplingParams, stream: bool) -> _Request:
        seq = Sequence(request_id, ids, params.max_new_tokens, arrival=next(self._arrivals))
        future = self._loop.create_future()
        future.add_done_callback(_silence)
        mailbox = Mailbox(request_id, params.logprobs) if stream else None
        stop_ids = frozenset(params.stop_token_ids)
        req = _Request(request_id, seq, params, mailbox, future, self.tokenizer, stop_ids)
        self._live[request_id] = req
        self.scheduler.add(seq)
        self._wakeup.set()
        return req

    def submit(self, prompt: Any, *, request_id: str | None = None, sampling: SamplingParams | None = None,
               **kwargs: Any) -> RequestHandle:
        """Queue a request now and return its handle (stream it, await it, cancel it).
        Bad input raises ``InvalidRequestError`` here; the engine is unaffected."""
        return self._submit(prompt, request_id, sampling, kwargs, stream=True)

    def _submit(self, prompt: Any, request_id: str | None, sampling: SamplingParams | None,
                kwargs: dict[str, Any], stream: bool) -> RequestHandle:
        self._check_accepting()
        rid, ids, params = self._prepare(prompt, request_id, sampling, kwargs)
        req = self._register(rid, ids, params, stream)
        return RequestHandle(rid, req.mailbox, req.future, lambda: self.cancel(rid))

    def stream(self, prompt: Any, *, request_id: str | None = None, sampling: SamplingParams | None = None,
               **kwargs: Any) -> ChunkStream:
        """Submit a request and return an async iterator of its ``Chunk``s.

        Example::

            async for chunk in engine.stream("Hi", max_new_tokens=16):
                print(chunk.text, end="")
        """
        return aiter(self.submit(prompt, request_id=request_id, sampling=sampling, **kwargs))

    async def generate(self, prompt: Any, *, request_id: str | None = None,
                       sampling: SamplingParams | None = None, **kwargs: Any) -> Completion:
        """Run one request to the end and return its ``Completion``."""
        return await self._submit(prompt, request_id, sampling, kwargs, stream=False)

    async def generate_batch(self, prompts: list[Any], *, sampling: SamplingParams | None = None,
                             request_ids: list[str] | None = None, **kwargs: Any) -> list[Completion]:
        """Run several prompts; results come back in input order. Submission is
        ordered by prompt tokens so requests sharing a prefix run close together."""
        self._check_accepting()
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
                p = self._prepare(prompt, rid, sampling, kwargs)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompts[{i}]: {e}", param=e.param) from e
            if p[0] in seen:
                raise InvalidRequestError(f"prompts[{i}]: duplicate request_id {p[0]!r}", param="request_id")
            seen.add(p[0])
            prepared.append(p)
        order = sorted(range(len(prepared)), key=lambda i: prepared[i][1])
        reqs: list[_Request | None] = [None] * len(prepared)
        for i in order:
            reqs[i] = self._register(*prepared[i], stream=False)
        try:
            return list(await asyncio.gather(*(asyncio.shield(r.future) for r in reqs)))
        except BaseException:
            for r in reqs:
                self.cancel(r.request_id)
            raise

    def cancel(self, request_id: str) -> bool:
        """Cancel a live request: its stream ends with ``finish_reason="cancelled"``
        and its pages are released at once. Returns False if it is not live."""
        req = self._live.get(request_id)
        if req is None:
            return False
        if self._loop is not None and not self._in_loop_thread():
            self._loop.call_soon_threadsafe(self.cancel, request_id)
            return True
        text = self._flush_text(req)
        self._finish(req, "cancelled", text)
        return True

    def _in_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def stats(self) -> EngineStats:
        kv = self.kv
        host = self.host_pool
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            total_blocks=kv.num_pages, free_blocks=kv.num_free, cached_blocks=kv.num_cached,
            used_blocks=kv.num_used, prefix_hit_rate=kv.hit_rate, steps=self._steps,
            generated_tokens=self._generated, preemptions=self.scheduler.num_preemptions,
            page_size=self.page_size, max_batch_tokens=self.max_batch_tokens,
            host_blocks=host.num_slots if host else 0, offloaded_blocks=host.num_used if host else 0,
            offloads=host.num_offloads if host else 0, restores=host.num_restores if host else 0,
            recomputed_tokens=self.scheduler.num_recomputed_tokens,
        )

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        inflight: tuple[StepPlan, asyncio.Future] | None = None
        try:
            while True:
                if self._hard:
                    break
                launched = None
                if self.scheduler.has_work():
                    plan = self.scheduler.schedule()
                    if plan.rows:
                        step = self._step_input(plan, inflight[0] if inflight else None)
                        fut = self._loop.run_in_executor(self._executor, self._runner.execute, step)
                        launched = (plan, fut)
                        if not self.config.async_batching:
                            await self._complete(launched)
                            launched = None
                if inflight is not None:
                    await self._complete(inflight)
                inflight = launched
                if inflight is None:
                    if self._state == "draining" and not self._live:
                        break
                    if not self.scheduler.has_work():
                        if self.config.debug_checks:
                            self.check_integrity()
                        self._wakeup.clear()
                        await self._wakeup.wait()
                else:
                    await asyncio.sleep(0)  # let consumers and submitters run
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                log.exception("acb engine loop crashed")
            error = RequestFailedError(f"the engine loop failed: {e!r}")
            error.__cause__ = e
            for req in list(self._live.values()):
                self._fail(req, error)
            self._state = "stopped"
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            if inflight is not None:
                try:
                    await asyncio.shield(inflight[1])  # never leave the worker mid-step
                except BaseException:
                    pass
            if self._hard:
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self.scheduler.finish(seq)
                if self._stop_reason is not None:  # ended by a device failure, not by stop()
                    self._state = "stopped"

    def _step_input(self, plan: StepPlan, prev: StepPlan | None) -> StepInput:
        carry_index: dict[int, int] = {}
        if prev is not None:
            j = 0
            for row in prev.rows:
                if row.sample:
                    carry_index[id(row.seq)] = j
                    j += 1
        rows: list[RowInput] = []
        sampling_rows = []
        want_logprobs = False
        pages_for = self.kv.pages_for
        for row in plan.rows:
            seq = row.seq
            end = row.start + row.num_tokens
            if row.carry:
                tokens = seq.token_at(row.start, end - 1) + [0]
                carry_from = carry_index.get(id(seq), -1)
            else:
                tokens = seq.token_at(row.start, end)
                carry_from = -1
            rows.append(RowInput(tokens, row.start, seq.block_table[: pages_for(end)], carry_from, row.sample))
            if row.sample:
                req = self._live.get(seq.seq_id)
                p = req.params if req is not None else self.sampling
                sampling_rows.append((p.temperature, p.top_k, p.top_p, p.seed, seq.num_generated - 1))
                want_logprobs = want_logprobs or p.logprobs
        return StepInput(rows, SamplingBatch.from_rows(sampling_rows, want_logprobs), plan.swap_out, plan.swap_in)

    async def _complete(self, launched: tuple[StepPlan, asyncio.Future]) -> None:
        plan, fut = launched
        try:
            out: StepOutput | PendingOutput = await asyncio.shield(fut)
            if isinstance(out, PendingOutput):
                # The step is queued on the device: poll its event without blocking
                # the loop (sub-millisecond sleeps keep latency low for short steps).
                while not out.ready():
                    await asyncio.sleep(self._poll_interval)
                out = out.result()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._steps += 1
            device_error = as_device_error(e)
            if device_error is not None:
                self._device_failed(device_error)
                return
            log.warning("step failed: %r", e)
            self._discard_offloads_from(plan, e)
            for row in plan.rows:
                req = self._live.get(row.seq.seq_id)
                if req is not None and req.seq is row.seq and row.epoch == row.seq.epoch:
                    error = RequestFailedError(f"the model step failed for request {req.request_id}: {e!r}",
                                               req.request_id)
                    error.__cause__ = e
                    self._fail(req, error)
            return
        self._steps += 1
        j = 0
        for row in plan.rows:
            token = logprob = None
            if row.sample:
                token = out.token_ids[j]
                logprob = out.logprobs[j] if out.logprobs is not None else None
                j += 1
            seq = row.seq
            req = self._live.get(seq.seq_id)
            if req is None or req.seq is not seq or row.epoch != seq.epoch:
                continue  # finished, cancelled or preempted since this step was planned
            kv = self.kv
            done = row.start + row.num_tokens
            if kv.enable_prefix_caching and done // kv.page_size > seq.num_registered_pages:
                seq.num_registered_pages, seq.last_page_hash = kv.register_full_pages(
                    seq.block_table, seq.token_at(0, done), seq.num_registered_pages, seq.last_page_hash, done,
                )
            if token is not None:
                seq.num_inflight -= 1
                seq.output_ids.append(token)
                self._generated += 1
                self._on_token(req, token, logprob)

    def _discard_offloads_from(self, plan: StepPlan, error: BaseException) -> None:
        """A failed step may have left garbage in KV that preempted sequences offloaded
        (their last rows ran in it) or may not have done its swap-outs: such a
        sequence is recomputed instead, or fails if it was already restored."""
        if self.host_pool is None:
            return
        suspects = {id(s): s for s in plan.offloaded}
        suspects.update((id(r.seq), r.seq) for r in plan.rows if r.epoch != r.seq.epoch)
        for seq in suspects.values():
            req = self._live.get(seq.seq_id)
            if req is None or req.seq is not seq:
                continue
            if seq.host_table is not None:
                self.scheduler.drop_offload(seq)
            elif seq.status == "running" and seq.restored_plan > plan.index:
                failure = RequestFailedError(
                    f"the model step failed for request {req.request_id} (its offloaded KV came from it): {error!r}",
                    req.request_id)
                failure.__cause__ = error
                self._fail(req, failure)

    def _device_failed(self, error: DeviceError) -> None:
        """The device is unusable: fail every unfinished request and stop the loop
        (never hang). ``start()`` may be tried again."""
        log.error("acb: %s; stopping the engine", error)
        self._stop_reason = f"the engine stopped after a device failure: {error}"
        for req in list(self._live.values()):
            failure = RequestFailedError(f"request {req.request_id} failed: {error}", req.request_id)
            failure.__cause__ = error
            self._fail(req, failure)
        self._state = "draining"
        self._hard = True

    def _on_token(self, req: _Request, token: int, logprob: float | None) -> None:
        seq = req.seq
        params = req.params
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = time.monotonic()
        finish = None
        if token in req.stop_ids:
            finish = "stop"
        elif not params.ignore_eos and token in self.eos_token_ids:
            finish = "eos"
        text = req.detok.push((token,)) if req.detok is not None else ""
        matched = False
        if params.stop:
            text, matched = req.stopper.push(text)
        if matched:
            finish = "stop"  # the text ends before the stop string; nothing more to flush
        else:
            if finish is None and len(seq.output_ids) >= params.max_new_tokens:
                finish = "length"
            if finish is not None:
                text += self._flush_text(req)
        if req.logprobs is not None and logprob is not None:
            req.logprobs.append(logprob)
        lp = [logprob] if (params.logprobs and logprob is not None) else None
        if finish is None:
            req.text_parts.append(text)
            if req.mailbox is not None:
                req.mailbox.put([token], text, lp)
        else:
            self._finish(req, finish, text, [token], lp)

    def _flush_text(self, req: _Request) -> str:
        """Text held back by the detokenizer and the stop matcher, for a request that
        ends without a stop-string match."""
        text = req.detok.flush() if req.detok is not None else ""
        if req.params.stop:
            text, matched = req.stopper.push(text)
            if not matched:
                text += req.stopper.flush()
        return text

    def _finish(self, req: _Request, reason: str, text: str, token_ids: list[int] | None = None,
                logprobs: list[float] | None = None) -> None:
        self._live.pop(req.request_id, None)
        self.scheduler.finish(req.seq)
        req.finish_reason = reason
        req.text_parts.append(text)
        req.metrics.finish_time = time.monotonic()
        if req.mailbox is not None:
            req.mailbox.put(token_ids or [], text, logprobs, reason)
        if not req.future.done():
            req.future.set_result(self._completion(req))

    def _fail(self, req: _Request, error: BaseException) -> None:
        self._live.pop(req.request_id, None)
        self.scheduler.finish(req.seq)
        req.metrics.finish_time = time.monotonic()
        if req.mailbox is not None:
            req.mailbox.fail(error)
        if not req.future.done():
            req.future.set_exception(error)

    def _completion(self, req: _Request) -> Completion:
        seq = req.seq
        m = req.metrics
        m.num_generated_tokens = len(seq.output_ids)
        m.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
        m.num_preemptions = seq.num_preemptions
        return Completion(
            request_id=req.request_id, prompt_token_ids=list(seq.prompt_ids), token_ids=list(seq.output_ids),
            text="".join(req.text_parts), logprobs=req.logprobs, finish_reason=req.finish_reason, metrics=m,
        )

    def check_integrity(self) -> None:
        """Assert the cache's invariants against the live requests' block tables."""
        tables = [r.seq.block_table for r in self._live.values()]
        self.kv.check_integrity(tables)
        if self.host_pool is not None:
            self.host_pool.check_integrity(r.seq.host_table for r in self._live.values() if r.seq.host_table)


__all__ = ["Engine", "EngineStats", "AcbError"]
