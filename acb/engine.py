"""The engine: the public API and the lifecycle over the parts it wires together
(``acb.assembly``): the request table (``acb.request_table``) and its output side
(``acb.outputs``), the scheduler over the paged cache, the step loop (``acb.step_loop``:
plans step N+1 while step N computes on a worker thread, never on the event loop) and
the lifecycle (``acb.lifecycle``). It waits with anyio primitives, so it runs under
asyncio (uvloop too) and trio. docs/design.md draws the whole."""

from __future__ import annotations

import logging
from typing import Any

import torch

from . import lora, quantization, sizing
from .adapters import AdapterRegistry
from .assembly import build_placement, build_runner, build_scheduler, checked_settings, place, resolve_load
from .config import EngineConfig, SamplingParams
from .errors import AcbError, EngineStoppedError
from .eventloop import LoopHandle
from .handle import ChunkStream, RequestHandle
from .inputs import generation_defaults, tokenize
from .kv_events import KVEventPublisher, KVEventStream
from .lifecycle import EngineState, Lifecycle
from .outputs import Outputs
from .progress import check_progress, gather_batch
from .request import Completion, EngineStats
from .request_table import Prepared, RequestTable
from .runner import ModelRunner
from .step_loop import StepLoop
from .structured import Grammars

log = logging.getLogger("acb")


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
        config, self.sampling = checked_settings(config, sampling)  # every None decided: acb.defaults
        self.model, self.tokenizer = model, tokenizer
        config = place(model, config)  # and warns naming the settings that cannot act on it
        self.generation_defaults = generation_defaults(model)  # the model's, for fields a request leaves unset
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = sizing.eos_ids(model, tokenizer)
        # refuses, naming the setting, a backend or a parallel layout that cannot run here, now
        self.attn_backend, self._tp, self.device, self.layout, self.config = build_placement(model, config)
        self.max_waiting = self.config.max_waiting_requests
        self._kv_events = KVEventPublisher(lambda: self.kv.registered()) if self.config.kv_events else None
        self.scheduler = build_scheduler(self.layout, self.config, self.device, self._kv_events)
        self.kv, self.kv_swa, self.host_pool = self.scheduler.kv, self.scheduler.kv_swa, self.scheduler.host_pool
        c = self.config
        self._grammars = Grammars(tokenizer, self.vocab_size, self.eos_token_ids, cache_size=c.grammar_cache_size,
                                  timeout_s=c.grammar_compile_timeout_s, threads=1 if self.device.type == "cpu" else 8)
        refusal = lora.why_not(model, c)  # None: LoRA adapters can run here (acb.lora)
        self._adapters = AdapterRegistry(c.max_adapters, None if refusal else lora.LoraBank(
            model, c.max_adapters, c.max_adapter_rank), refusal)
        self._table = RequestTable(self.scheduler, self._grammars, tokenizer=tokenizer, defaults=self.sampling,
                                   generation_defaults=self.generation_defaults, vocab_size=self.vocab_size,
                                   max_model_len=self.max_model_len, eos_ids=self.eos_token_ids,
                                   adapters=self._adapters)
        self._out = Outputs(self._table)
        self._life = Lifecycle(lambda: self._tp.error if self._tp is not None else None)
        self._steps = StepLoop(self._table, self._out, self._life, vocab_size=self.vocab_size,
                               kv_events=self._kv_events, async_batching=self.config.async_batching,
                               debug_checks=self.config.debug_checks, watch_model=self._tp is None)
        self._loop: LoopHandle | None = None

    # the cache's shape (acb.sizing.Layout), as the engine's own attributes
    page_size = property(lambda self: self.layout.page_size)
    num_pages = property(lambda self: self.layout.num_pages)
    max_model_len = property(lambda self: self.layout.max_model_len)
    max_batch_tokens = property(lambda self: self.layout.max_batch_tokens)
    max_requests = property(lambda self: self.layout.max_requests)

    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None, config: EngineConfig | None = None,
                        sampling: SamplingParams | None = None, **model_kwargs: Any) -> Engine:
        """Load a model and tokenizer from a local HF folder (or a folder plus
        ``gguf_file``) and build an engine over them."""
        from .loading import checkpoint_dtype, load

        config, dtype, device = resolve_load(config or EngineConfig(), checkpoint_dtype(path, gguf_file))
        model, tokenizer = load(path, gguf_file, dtype=dtype, device=device, quantization=config.quantization,
                                **model_kwargs)
        return cls(model, tokenizer=tokenizer, config=config, sampling=sampling)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine loop on the running event loop, asyncio or trio (allocates
        the KV cache the first time)."""
        self._life.check_startable()
        if self._life.looping:
            return
        bank = self._adapters.bank
        if bank is not None:
            bank.install_hooks()  # before the runner's model watch takes the model as its reference
        runner = self._steps.runner or build_runner(self.model, self.layout, self.config, self.attn_backend, self._tp)
        runner.lora = bank
        self._loop = LoopHandle()
        self._table.event = self._loop.Event
        self._life.move(EngineState.RUNNING)
        self._steps.start(runner, self._loop, cpu=self.device.type == "cpu")

    async def stop(self, hard: bool = False) -> None:
        """Stop admitting. Graceful: finish everything queued and running. Hard: end
        now; every unfinished request raises ``EngineStoppedError``. After ``aclose()``
        it raises ``EngineClosedError``."""
        self._life.check_open()
        if not self._life.looping:
            return
        if hard and not self._life.halting:
            self._life.move(EngineState.HALTING)
            error = EngineStoppedError("the engine was stopped (hard stop)")
            self._out.fail_all(lambda req: error)
        elif self._life.state is EngineState.RUNNING:
            self._life.move(EngineState.DRAINING)
        self._steps.wake()
        await self._steps.finished.wait()  # cancelling this wait leaves the loop draining
        self._steps.task = None
        self._life.move(EngineState.STOPPED)

    async def aclose(self) -> None:
        """Graceful stop, then release the model runner's memory and the worker thread.
        The engine cannot be used afterwards."""
        if self._life.state is EngineState.CLOSED:
            return
        await self.stop()
        self._steps.close(cpu=self.device.type == "cpu")
        if self._adapters.bank is not None:
            self._adapters.bank.remove_hooks()
        self._grammars.close()
        if self._tp is not None:
            self._tp.close()  # every other rank exits
        self._life.move(EngineState.CLOSED)

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def is_running(self) -> bool:
        """True between ``start()`` and ``stop()``: the engine admits requests."""
        return self._life.accepting

    @property
    def runner(self) -> ModelRunner | None:
        """The model runner computing this engine's steps (None before ``start()`` and after
        ``aclose()``); not stable API: tests reach it through ``acb.testing.runner_of``."""
        return self._steps.runner

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel ranks this engine started (empty with one
        rank, or under torchrun, where the launcher owns them)."""
        return self._tp.worker_pids if self._tp else []

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: Any, *, request_id: str | None = None, sampling: SamplingParams | None = None,
               **kwargs: Any) -> RequestHandle:
        """Queue a request now and return its handle (stream it, await it, cancel it).
        Bad input raises ``InvalidRequestError`` here; the engine is unaffected.

        Synchronous: a long prompt is tokenized, and a grammar not in the cache compiled
        (for at most ``EngineConfig.grammar_compile_timeout_s``), before it returns, on
        the caller's thread. ``await engine.asubmit(...)`` does those on worker threads."""
        self._admissible()
        return self._handle(self._table.prepare(prompt, request_id, sampling, kwargs), stream=True)

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
        self._admissible()
        prepared = await self._table.prepare_async(prompt, request_id, sampling, kwargs, self._loop.wait_future)
        self._admissible()  # again: the engine may have stopped, or the queue filled, while it awaited
        return self._handle(prepared, stream=stream)

    def _admissible(self) -> None:
        """Raise unless the engine admits one more request now (running, the queue not full)."""
        self._life.check_accepting()
        self._table.check_room(self.max_waiting)

    def _handle(self, prepared: Prepared, stream: bool) -> RequestHandle:
        req = self._table.register(prepared, stream)
        self._steps.wake()
        rid = req.request_id
        return RequestHandle(rid, req.mailbox, req.future, lambda index=None: self._out.cancel(rid, index, self._loop))

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
        self._admissible()  # the batch itself may exceed the bound: its size is the caller's
        check_progress(progress)
        prepared = await self._table.prepare_batch(prompts, request_ids, sampling, kwargs, self._loop.wait_future)
        self._life.check_accepting()  # preparing awaited (long prompts, grammars): check again
        for p in prepared:  # an adapter may have begun unloading while the batch was prepared
            self._table.check_adapter(p.params)
        reqs: list[Any] = [None] * len(prepared)
        for i in sorted(range(len(prepared)), key=lambda i: prepared[i].prompt_ids):
            reqs[i] = self._table.register(prepared[i], stream=False)
        if not reqs:
            return []
        self._steps.wake()
        return await gather_batch(reqs, self._loop.Event, progress, lambda rid: self._out.cancel(rid, None, self._loop))

    # ------------------------------------------------------------------ adapters
    async def load_adapter(self, source: Any, adapter_name: str) -> None:
        """Load a LoRA adapter for requests to name (``adapter=adapter_name``) while the
        engine serves: ``source`` is a PEFT adapter folder, a ``peft`` model (its active
        adapter) or ``(LoraConfig, state dict)``. Read, checked and written into a free slot
        on a worker thread; switched on between two steps. ``InvalidRequestError`` naming
        what is wrong (a refused PEFT feature, shapes that do not fit the model, a rank above
        ``max_adapter_rank``, no free slot of ``max_adapters``); ``ValueError`` naming the
        setting where this engine cannot run adapters. See docs/adapters.md.

        Example::

            await engine.load_adapter("adapters/sql-lora", "sql")
            completion = await engine.generate("SELECT", adapter="sql", max_new_tokens=16)
        """
        self._life.check_open()
        await self._adapters.load(source, adapter_name, self.model, self._steps.between_steps)

    async def unload_adapter(self, adapter_name: str) -> None:
        """Unload an adapter: new requests naming it are refused (``InvalidRequestError``
        naming ``adapter``) at once; the call returns when the requests already queued or
        running with it have ended (they finish normally) and its slot is free."""
        self._life.check_open()
        await self._adapters.unload(adapter_name, self._steps.between_steps)

    def adapters(self) -> list[str]:
        """The names of the loaded adapters requests may name, in load order."""
        return self._adapters.names()

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
        self._life.check_open()
        return self._out.cancel(request_id, index, self._loop)

    # ------------------------------------------------------------------ inspection
    def stats(self) -> EngineStats:
        """A snapshot of the engine's load, cache and counters (see ``acb.EngineStats``).

        Example::

            s = engine.stats()
            print(s.running, s.waiting, s.free_blocks, s.prefix_hit_rate)
        """
        runner = self._steps.runner
        return self._steps.stats(
            page_size=self.page_size, max_batch_tokens=self.max_batch_tokens,
            attn_backend=runner.attn_backend if runner is not None else self.attn_backend,
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            grammars_compiled=self._grammars.compiles, grammar_cache_hits=self._grammars.hits,
            quantization="int8" if quantization.is_quantized(self.model) else "")

    def kv_events(self, max_batches: int = 1024) -> KVEventStream:
        """Subscribe to the prefix cache's events (needs ``EngineConfig(kv_events=True)``):
        an async iterator of ``acb.KVEventBatch``, one per engine step that changed the set
        of prefix pages, starting with a resync (the whole current set). A subscriber that
        falls ``max_batches`` behind loses the queued batches (``stream.dropped`` counts them)
        and gets a resync next; the engine never waits for it. The iterator ends when the
        engine stops or on ``stream.close()``; replaying the events in order (add on
        ``BlockStored``, discard on ``BlockRemoved``, clear on ``AllBlocksCleared``) gives the
        engine's set of prefix pages (docs/design.md, "KV-cache events")."""
        self._life.check_open()
        if self._kv_events is None:
            raise ValueError("engine.kv_events() needs an engine built with EngineConfig(kv_events=True)")
        return self._kv_events.subscribe(max_batches)  # ValueError for a max_batches that is not an int >= 1

    async def reload_weights(self) -> None:
        """Take the model as it is now: after weights written through ``.data`` (which
        PyTorch's version counter does not see), or any change acb should take as the
        new model. Waits for the step in flight, repacks every weight, rebuilds the fast
        paths and forgets the prefix cache; the next step computes with the new weights.

        Replacing parameters, ``load_state_dict`` and in-place edits (``weight.mul_``,
        ``weight.copy_``) need no call: acb sees them before the next step.
        """
        self._life.check_open()
        if self._tp is not None:
            raise NotImplementedError("reload_weights() with tensor_parallel_size > 1: the ranks hold shards "
                                      "copied when the engine was built; build a new engine over the new weights")
        await self._steps.reload_weights()

    def check_integrity(self) -> None:
        """Assert the caches' invariants and the runner's block tables (after the steps in flight)."""
        self._life.check_open()
        self._steps.check_integrity()


__all__ = ["Engine", "EngineStats", "AcbError"]
