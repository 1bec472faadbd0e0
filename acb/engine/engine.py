"""The engine: the public API and the lifecycle (``acb.core.lifecycle``) over the parts ``acb.engine.assembly`` wires:
the request table, the scheduler over the paged cache, the step loop (plans step N+1 while step N computes
on a worker thread, never on the event loop); asyncio, uvloop and trio (anyio). docs/design.md draws it."""

from __future__ import annotations

from typing import Any

import torch

from ..core.config import EngineConfig
from ..core.errors import AcbError, EngineStoppedError
from ..core.eventloop import LoopHandle
from ..core.handle import ChunkStream, RequestHandle
from ..core.kv_events import KVEventPublisher, KVEventStream
from ..core.lifecycle import EngineState, Lifecycle
from ..core.outputs import Completion, EngineStats
from ..core.progress import check_progress, gather_batch
from ..core.sampling_params import SamplingParams
from ..model import int8_weights
from ..worker import sizing
from ..worker.runner import ModelRunner
from . import assembly
from .embeddings import check_pooling, embedding_prompts
from .inputs import tokenize
from .output_processor import Outputs
from .request_table import Prepared
from .step_loop import StepLoop


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
        config, self.sampling = assembly.checked_settings(config, sampling)  # every None decided: acb.core.defaults
        self.model, self.tokenizer = model, tokenizer
        config = assembly.place(model, config, tokenizer)  # and warns naming the settings that cannot act on it
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.eos_token_ids = sizing.eos_ids(model, tokenizer)
        self._draft = assembly.build_draft(model, config)  # speculative_method="draft" (acb.worker.draft), else None
        # refuses, naming the setting, a backend or a parallel layout that cannot run here, now
        placement = assembly.build_placement(model, config, self._draft)
        self.attn_backend, self._tp, self.device, self.layout, self.config = placement
        self.max_waiting = self.config.max_waiting_requests
        self._kv_events = KVEventPublisher(lambda: self.kv.registered()) if self.config.kv_events else None
        self.scheduler = assembly.build_scheduler(self.layout, self.config, self.device, self._kv_events)
        self.kv, self.kv_swa, self.host_pool = self.scheduler.kv, self.scheduler.kv_swa, self.scheduler.host_pool
        self.kv.disk = assembly.build_disk_tier(model, self.layout, self.config)  # kv_disk_path; refused by name
        self._grammars, self._adapters, self._table = assembly.build_requests(
            model, tokenizer, self.config, self.sampling, self.scheduler, self.device, self.layout, self.eos_token_ids)
        self.generation_defaults = self._table.generation_defaults  # the model's, for fields a request leaves unset
        self._out = Outputs(self._table)
        self._life = Lifecycle(lambda: self._tp.error if self._tp is not None else None)
        self._steps = StepLoop(self._table, self._out, self._life, vocab_size=self.vocab_size,
                               kv_events=self._kv_events, async_batching=self.config.async_batching,
                               debug_checks=self.config.debug_checks, watch_model=self._tp is None)
        self._loop: LoopHandle | None = None

    # the cache's shape (acb.worker.sizing.Layout) as the engine's attributes
    page_size = property(lambda self: self.layout.page_size)
    num_pages = property(lambda self: self.layout.num_pages)
    max_model_len = property(lambda self: self.layout.max_model_len)
    max_batch_tokens = property(lambda self: self.layout.max_batch_tokens)
    max_requests = property(lambda self: self.layout.max_requests)

    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None, config: EngineConfig | None = None,
                        sampling: SamplingParams | None = None, **model_kwargs: Any) -> Engine:
        """Load a model and tokenizer from a local HF folder (or plus ``gguf_file``) and build an engine."""
        from ..model.loading import checkpoint_dtype, load

        config, dtype, device = assembly.resolve_load(config or EngineConfig(), checkpoint_dtype(path, gguf_file))
        model, tokenizer = load(path, gguf_file, dtype=dtype, device=device, quantization=config.quantization,
                                **model_kwargs)
        return cls(model, tokenizer=tokenizer, config=config, sampling=sampling)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the engine loop on the running event loop, asyncio or trio (allocates the KV cache at first)."""
        self._life.check_startable()
        if self._life.looping:
            return
        self._adapters.install_hooks()
        runner = self._steps.runner or assembly.build_runner(self.model, self.layout, self.config,
                                                             self.attn_backend, self._tp, self._draft)
        runner.lora = self._adapters.bank
        assembly.open_disk_tier(self.kv.disk, self.model, self.config, runner)
        self._loop = LoopHandle()
        self._table.event = self._loop.Event
        self._life.move(EngineState.RUNNING)
        self._steps.start(runner, self._loop, cpu=self.device.type == "cpu")

    async def stop(self, hard: bool = False) -> None:
        """Stop admitting. Graceful: finish everything queued and running. Hard: end now; every
        unfinished request raises ``EngineStoppedError``. After ``aclose()``: ``EngineClosedError``."""
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
        """Graceful stop, then release the runner's memory and the worker thread; the end of it."""
        if self._life.state is EngineState.CLOSED:
            return
        await self.stop()
        self._steps.close(cpu=self.device.type == "cpu")
        self._adapters.remove_hooks()
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
        """The runner computing the steps (None before ``start()``); not stable API (acb.testing)."""
        return self._steps.runner

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the tensor-parallel ranks this engine started (none with one rank or torchrun)."""
        return self._tp.worker_pids if self._tp else []

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: Any, *, request_id: str | None = None, sampling: SamplingParams | None = None,
               **kwargs: Any) -> RequestHandle:
        """Queue a request now and return its handle (stream it, await it, cancel it). Bad input
        raises ``InvalidRequestError`` here; the engine is unaffected. Tokenizing and grammar
        compiling happen on the caller's thread: ``await engine.asubmit(...)`` moves them off it."""
        self._admissible()
        return self._handle(self._table.prepare(prompt, request_id, sampling, kwargs), stream=True)

    async def asubmit(self, prompt: Any, *, request_id: str | None = None, sampling: SamplingParams | None = None,
                      **kwargs: Any) -> RequestHandle:
        """``submit`` without blocking the event loop: long prompts are tokenized and new grammars
        compiled on worker threads, then the request is queued. Bad input, or a grammar that does
        not compile within ``EngineConfig.grammar_compile_timeout_s``, raises ``InvalidRequestError``.

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
        """Run one request to the end and return its ``Completion`` (off the event loop, as ``asubmit``)."""
        return await (await self._asubmit(prompt, request_id, sampling, kwargs, stream=False))

    async def generate_batch(self, prompts: list[Any], *, sampling: SamplingParams | None = None,
                             request_ids: list[str] | None = None, progress: bool = False,
                             **kwargs: Any) -> list[Completion]:
        """Run several prompts; results in input order (queued in prompt order, so shared prefixes run
        together). ``progress=True``: a tqdm bar on stderr (requests done, tokens/s).

        Example::

            results = await engine.generate_batch(prompts, max_new_tokens=64, progress=True)
        """
        self._admissible()  # the batch itself may exceed the bound: its size is the caller's
        check_progress(progress)
        prepared = await self._table.prepare_batch(prompts, request_ids, sampling, kwargs, self._loop.wait_future)
        self._life.check_accepting()  # preparing awaited (long prompts, grammars): check again
        reqs = self._table.register_batch(prepared)
        if not reqs:
            return []
        self._steps.wake()
        return await gather_batch(reqs, self._loop.Event, progress, lambda rid: self._out.cancel(rid, None, self._loop))

    async def embed(self, inputs: Any, *, pooling: str = "last", normalize: bool = True) -> list[list[float]]:
        """Embed texts or token-id prompts: one vector (a list of floats, the model's hidden size)
        per input, in input order. ``inputs``: a string, a list of strings, a list of token ids
        (one prompt) or a list of token-id lists; a single string or token-id list gives a list
        of one vector. The vectors pool the model's final hidden states (after its final norm,
        transformers' ``last_hidden_state``) over each prompt: ``pooling="last"`` the last
        token's (decoder embedders such as Qwen3-Embedding), ``"mean"`` the mean over every
        token, ``"cls"`` the first token's; ``normalize=True`` scales each to unit length
        (so dot products are cosine similarities). Texts are tokenized as ``generate`` does.

        The prompts run as prefill-only requests in the engine's own steps, beside generation
        (``EngineConfig.max_embedding_tokens`` bounds their share of every step, so streams keep
        their pace). Bad input raises ``InvalidRequestError``
        naming it (``inputs[i]``, ``pooling``); the engine goes on. Cancelling the call cancels
        every one of its prompts. See docs/embeddings.md.

        Example::

            vectors = await engine.embed(["a cat sat", "a dog ran"], pooling="mean")
            similarity = sum(a * b for a, b in zip(*vectors))
        """
        self._life.check_accepting()
        check_pooling(pooling, normalize)
        prompts = await embedding_prompts(inputs, pooling, self.tokenizer, self.vocab_size, self.max_model_len)
        self._life.check_accepting()  # tokenizing awaited: check again
        reqs = self._table.register_pooled(prompts, pooling, normalize)
        self._steps.wake()
        return await gather_batch(reqs, self._loop.Event, False, lambda rid: self._out.cancel(rid, None, self._loop))

    # ------------------------------------------------------------------ adapters
    async def load_adapter(self, source: Any, adapter_name: str) -> None:
        """Load a LoRA adapter (a PEFT folder, a ``peft`` model or ``(LoraConfig, state dict)``)
        for requests to name (``adapter=adapter_name``) while the engine serves: prepared on a
        worker thread, switched on between two steps. ``InvalidRequestError`` names what is
        wrong; ``ValueError`` the setting where adapters cannot run. See docs/adapters.md.

        Example::

            await engine.load_adapter("adapters/sql-lora", "sql")
            completion = await engine.generate("SELECT", adapter="sql", max_new_tokens=16)
        """
        self._life.check_open()
        await self._adapters.load(source, adapter_name, self.model, self._steps.between_steps)

    async def unload_adapter(self, adapter_name: str) -> None:
        """Unload an adapter: new requests naming it are refused (``InvalidRequestError``) at once;
        returns when the requests queued or running with it have finished and its slot is free."""
        self._life.check_open()
        await self._adapters.unload(adapter_name, self._steps.between_steps)

    def adapters(self) -> list[str]:
        """The names of the loaded adapters requests may name, in load order."""
        return self._adapters.names()

    def adapter_ids(self) -> dict[str, int]:
        """Each loaded adapter's ``lora_id`` by name (its pages' key: ``kv_events()``, ``prefix_page_hashes``)."""
        return {name: self._adapters.loaded[name].lora_id for name in self._adapters.names()}

    def tokenize(self, prompt: Any) -> list[int]:
        """The token ids ``prompt`` (text, ids or chat messages) runs as; ``InvalidRequestError`` if bad."""
        return tokenize(prompt, self.tokenizer, self.vocab_size)

    def cancel(self, request_id: str, index: int | None = None) -> bool:
        """Cancel a live request (every choice, or only choice ``index``): its stream ends with
        ``finish_reason="cancelled"``, its pages are released at once. False if it is not live."""
        self._life.check_open()
        return self._out.cancel(request_id, index, self._loop)

    # ------------------------------------------------------------------ inspection
    def stats(self) -> EngineStats:
        """A snapshot of the engine's load, cache and counters (``acb.EngineStats``)."""
        runner = self._steps.runner
        return self._steps.stats(
            page_size=self.page_size, max_batch_tokens=self.max_batch_tokens,
            attn_backend=runner.attn_backend if runner is not None else self.attn_backend,
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            grammars_compiled=self._grammars.compiles, grammar_cache_hits=self._grammars.hits,
            quantization=int8_weights.quantization_of(self.model))

    def kv_events(self, max_batches: int = 1024) -> KVEventStream:
        """Subscribe to the prefix cache's events (``EngineConfig(kv_events=True)``): an async
        iterator of ``acb.KVEventBatch``, one per step that changed the prefix pages, starting with
        a resync. A subscriber ``max_batches`` behind loses the queued batches (``stream.dropped``)
        and gets a resync; the engine never waits for it (docs/design.md, "KV-cache events")."""
        self._life.check_open()
        if self._kv_events is None:
            raise ValueError("engine.kv_events() needs an engine built with EngineConfig(kv_events=True)")
        return self._kv_events.subscribe(max_batches)  # ValueError for a max_batches that is not an int >= 1

    async def reload_weights(self) -> None:
        """Take the model as it is now (after writes through ``.data``, which PyTorch's version
        counter does not see): waits for the step in flight, repacks the weights, rebuilds the fast
        paths and forgets the prefix cache. ``load_state_dict`` and in-place edits need no call."""
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
