"""The model runner: one step in, its sampled ids out.

It turns a step (rows of token ids with their pages) into packed tensors, runs
the HF model with acb's paged attention, samples, and returns the chosen ids.
``execute`` runs on the engine's worker thread; nothing here knows the engine. The
KV tensors and their page copies are the KV store's (``acb.worker.kv_store``); what stands
in for the model's forward is the fast paths' (``acb.worker.fast_paths``).
"""

from __future__ import annotations

import logging
import time

import torch

from ..attention import context, kv_quant, selector
from ..attention import metadata as packing
from ..attention import paged as attention
from ..attention import routing as attention_routing
from ..core import prompt_logprobs
from ..core.step import StepInput, StepOutput
from ..model import lora
from .fast_paths import FastPaths
from .kv_store import KVStore
from .pooling import pooled_forward
from .sampling import sample, top_alternatives

log = logging.getLogger("acb")


class PendingOutput:
    """A step queued on a device stream: the sampled ids land in pinned host memory
    when ``event`` completes. The engine polls ``ready()`` from the event loop (never
    blocking it) and then takes ``result()``, which no longer waits. ``timings`` are
    (start, end) timing events of the device work it reports (``StepOutput.device_s``)."""

    __slots__ = ("event", "ids", "logprobs", "top", "timings", "prompt", "proposals", "pooled")

    def __init__(self, event, ids: torch.Tensor, logprobs: torch.Tensor | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None, timings: list[tuple] = ()) -> None:
        self.event = event
        self.ids = ids
        self.logprobs = logprobs
        self.top = top  # top-logprob ids and values, in pinned host memory
        self.timings = timings
        self.prompt = None  # the step's prompt scores (prompt_logprobs), already on the host
        self.proposals = None  # (a draft model's proposals in pinned host memory, its chain's steps)
        self.pooled = None  # the step's pooled hidden states (embeddings), already on the host

    def ready(self) -> bool:
        return bool(self.event.query())

    def result(self) -> StepOutput:
        self.event.synchronize()  # a no-op once ready() said so; surfaces device errors (the
        # engine classifies them with errors.as_device_error)
        out = _step_output(self.ids, self.logprobs, self.top)
        out.device_s = sum(start.elapsed_time(end) for start, end in self.timings) / 1e3
        out.prompt_logprobs = self.prompt
        out.pooled = self.pooled
        if self.proposals is not None:
            out.proposals, out.draft_steps = self.proposals[0].tolist(), self.proposals[1]
        return out


def _step_output(ids: torch.Tensor, logprobs: torch.Tensor | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None) -> StepOutput:
    return StepOutput(ids.tolist(), logprobs.tolist() if logprobs is not None else None,
                      top[0].tolist() if top is not None else None, top[1].tolist() if top is not None else None)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into pinned host memory (done when the step's event is)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class ModelRunner:
    """Owns the model on its device, the step's inputs and sampling: ``execute`` builds a
    step's tensors and attention metadata, runs the forward and samples. Beside it, its
    ``kv`` (:class:`~acb.worker.kv_store.KVStore`: the KV tensors, page zeroing, copy-on-write,
    offload) and its ``fast_paths`` (:class:`~acb.worker.fast_paths.FastPaths`: prepacked
    weights, the fused and compiled forwards, CUDA graphs). It also holds the sampled ids
    of the last step (``prev_sampled``, the carry-over) and the step counters that
    ``acb.testing.step_counts`` reads."""

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, attn_backend: str = "auto",
                 host_pages: int = 0, swa_pages: int = 0, swa_layers: frozenset[int] = frozenset(),
                 row_reduce=None, kv_cache_dtype: str | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.prev_sampled: torch.Tensor | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._tensor = packing.DeviceIds(self.device)  # host list -> long tensor on the device
        self.kv = KVStore(model.config, kv_quant.cache_dtype(kv_cache_dtype, self.dtype), self.device, num_pages,
                          page_size, self._tensor, host_pages, swa_pages, swa_layers)
        attention.register()
        # acb's attention inside acb's steps only (see acb.attention.routing)
        self._routed = attention_routing.route_model(model.config)
        self.fault_hook = None  # test hook: callable(step_index, stage) that may raise
        # the backend serving this runner, which names its kernel path: "native" | "triton" |
        # "torch" (ValueError if the requested one cannot run here)
        self.attn_backend = selector.resolve_backend(attn_backend, self.device, self.dtype)
        if not selector.load_kernels(self.attn_backend):  # native kernels not built (logged)
            self.attn_backend = "torch"
        kv_quant.check(kv_cache_dtype, self.attn_backend)
        self.attention = packing.AttentionBuilder(self.attn_backend, page_size, self._tensor, self.kv.k_cache,
                                                  self.kv.v_cache, self.kv.tables, self.kv.swa_layers)
        log.info("acb attention backend: %s (attn_backend=%r on %s, %s)", self.attn_backend, attn_backend,
                 self.device, self.dtype)
        self.fast_paths = FastPaths(model, self.kv, self.attn_backend, self.stream, self.generator, row_reduce)
        self.lora: lora.LoraBank | None = None  # the engine's adapters (acb.model.lora), when it can run them
        self.draft = None  # acb.worker.draft.DraftRunner: a draft model proposing (speculative_method="draft")
        self._proposals: torch.Tensor | None = None  # the packed index of this step's draft proposals
        self._proposed_ids: torch.Tensor | None = None  # ... into these input ids
        self._pooled: torch.Tensor | None = None  # this step's pooled hidden states (StepOutput.pooled)
        self.step_index = 0
        self.fast_decode_steps = 0  # steps whose decode rows ran on a kernel reading pages in place
        self.plain_steps = 0  # steps that ran the model's own forward (a hook, a replaced forward)
        self.carried_steps = 0  # steps fed a token sampled by the step before on the device (overlap)
        # CUDA: (start, end) timing events of the steps not yet reported in a StepOutput
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    # The engine's view of the fast paths: set up at start, checked before each step,
    # reported in EngineStats (forward_path, forward_reason).
    def configure_fast_paths(self, config, max_rows: int, *, pad_on_cpu: bool = False) -> None:
        """See :meth:`acb.worker.fast_paths.FastPaths.configure`."""
        self.fast_paths.configure(config, max_rows, pad_on_cpu=pad_on_cpu)

    def check_model(self) -> tuple[str | None, bool]:
        """See :meth:`acb.worker.fast_paths.FastPaths.check_model`."""
        return self.fast_paths.check_model()

    def refresh_weights(self, everything: bool = False) -> None:
        """See :meth:`acb.worker.fast_paths.FastPaths.refresh`."""
        self.fast_paths.refresh(everything)

    @property
    def forward_path(self) -> str:
        """Which forward serves the steps: "fused", "compiled" or "transformers"."""
        return self.fast_paths.forward_path

    @property
    def forward_reason(self) -> str:
        """Why the fused forward does not serve the steps ("" when it does)."""
        return self.fast_paths.forward_reason

    def check_tables(self, tables) -> None:
        """Assert the block-table store holds ``tables`` ((row, pages, sliding pages) per
        running sequence, as sent: ``Scheduler.sent_tables``). Run it on the worker thread,
        after the steps launched so far (their deltas applied)."""
        if self.stream is not None:
            self.stream.synchronize()
        self.kv.tables.check(tables)

    def save_disk_pages(self, copies: list[tuple], disk) -> None:
        """Copy the pages ``copies`` names out to the disk tier ``disk`` (``acb.core.kv_disk``), on the
        step thread after the steps launched so far (on CUDA on the runner's stream, so after the
        steps queued there). A failure is logged and the pages are not written."""
        try:
            if self.stream is None:
                self.kv.save_disk_pages(copies, disk)
            else:
                with torch.cuda.stream(self.stream):
                    self.kv.save_disk_pages(copies, disk)
        except Exception as e:
            log.warning("acb: copying %d KV pages out for the disk tier failed: %r", len(copies), e)
            disk.abandon(copies)

    def release(self) -> None:
        """Give back the KV memory, the model's own linears and its attention setting."""
        self.fast_paths.release()  # first: CUDA graphs hold the cache's addresses
        if self.draft is not None:
            self.draft.release()
            self.draft = None
        self.kv.release()
        self.attention = None  # it holds the cache tensors too
        self.prev_sampled = None
        for config in self._routed:
            attention_routing.unroute(config)
        self._routed = []

    # ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput | PendingOutput:
        """Run one step. On CPU it returns when the step is done; on CUDA it returns
        once the step is queued on the runner's stream (a ``PendingOutput``)."""
        self.step_index += 1
        try:
            if self.stream is None:
                start = time.perf_counter()
                out = self._execute(step)
                out.device_s = time.perf_counter() - start
                return out
            with torch.cuda.stream(self.stream):
                self._timings.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                self._timings[-1][0].record(self.stream)
                return self._execute(step)
        except BaseException:
            self.prev_sampled = None
            self._proposals = self._proposed_ids = self._pooled = None
            if self._timings:
                self._timings.pop()  # never recorded its end
            raise

    def _execute(self, step: StepInput) -> StepOutput | PendingOutput:
        logits, sampled = self.forward(step)
        prompt = None
        if step.prompt_logprobs is not None:  # (a step scoring its prompt rows is never a graph's)
            n = len(step.sampling.temperature)
            # on CUDA this waits for the step's device work, on this worker thread
            prompt = prompt_logprobs.score(logits[n:], step.prompt_logprobs)
            logits = logits[:n]
        pooled, self._pooled = self._pooled, None
        if not step.sampling.temperature:
            self.prev_sampled = None
            if self.stream is not None:  # reported with the next step that samples
                self._timings[-1][1].record(self.stream)
            return StepOutput([], None, prompt_logprobs=prompt, pooled=pooled)
        if self.fault_hook is not None:
            self.fault_hook(self.step_index, "sample")
        if sampled is not None:
            ids, logprobs = sampled
        else:
            controls = step.sampling.controls
            if self._proposals is not None and controls is not None and controls.penalized:
                # penalties at a proposal's position count the proposals before it: the draft's, known now
                from .draft import fill_penalty_history

                fill_penalty_history(step, self._proposed_ids.index_select(0, self._proposals).tolist())
            ids, logprobs = sample(logits, step.sampling, self.generator, self.prev_sampled,
                                   self.fast_paths.sampling_kernels)
        top = top_alternatives(logits, step.sampling.top_logprobs) if step.sampling.top_logprobs else None
        self.prev_sampled = ids
        proposals = self._take_proposals()
        if self.stream is None:
            out = _step_output(ids, logprobs, top)
            out.prompt_logprobs = prompt
            out.pooled = pooled
            if proposals is not None:
                out.proposals, out.draft_steps, out.draft_s = proposals.tolist(), self.draft.chain_steps, \
                    self.draft.chain_s
            return out
        proposed = (_to_pinned(proposals), self.draft.chain_steps) if proposals is not None else None
        pending = self._pending(ids, logprobs, top)  # (its event is recorded after that copy)
        pending.prompt = prompt
        pending.pooled = pooled
        pending.proposals = proposed
        return pending

    def _take_proposals(self) -> torch.Tensor | None:
        """The draft's proposals of this step (in row order), or None."""
        if self._proposals is None:
            return None
        index, self._proposals = self._proposals, None
        ids, self._proposed_ids = self._proposed_ids, None
        return ids.index_select(0, index)

    def _pending(self, ids: torch.Tensor, logprobs: torch.Tensor | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None) -> PendingOutput:
        """CUDA: the sampled results on their way to pinned host memory, and the event
        that says they are there."""
        ids_host = _to_pinned(ids)
        lp_host = _to_pinned(logprobs) if logprobs is not None else None
        top_host = (_to_pinned(top[0]), _to_pinned(top[1])) if top is not None else None
        timings, self._timings = self._timings, []
        event = timings[-1][1]
        event.record(self.stream)
        return PendingOutput(event, ids_host, lp_host, top_host, timings)

    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, tuple | None]:
        """The step's page copies and forward: (the logits of its sampled rows [K, vocab],
        None), or (None, (ids, logprobs)) when a CUDA graph sampled them too."""
        self.kv.update_tables(step)  # first: the next step's deltas build on these, whatever happens here
        if step.refresh:
            self.fast_paths.refresh()
        self.kv.move_pages(step)
        self.kv.zero_new_pages(step)
        if self.draft is not None:
            self.draft.prepare(step)  # its store mirrors this one's
        input_ids, position_ids, keep, meta = self._build(step)
        if self.draft is not None:  # the draft's proposals over their placeholders, then its mirror forward
            self._proposals = self.draft.run(step, input_ids)
            self._proposed_ids = input_ids
        adapters = self.lora.step(step, self._tensor) if self.lora is not None else None
        if self.fault_hook is not None:
            self.fault_hook(self.step_index, "forward")
        if step.plain:
            self.plain_steps += 1
            forward = self.model
        else:
            # (CUDA graphs were captured without LoRA: a step with adapter rows runs eagerly; a step
            # pooling positions holds prompt rows, never a graph's)
            graphed = adapters is None and step.pooling is None
            replayed = self.fast_paths.replay(step, input_ids, position_ids, keep, meta) if graphed else None
            if replayed is not None:
                return replayed
            forward = self.fast_paths.forward_for(meta)
        # the step's one forward context: acb's fused forwards take it as an argument, transformers'
        # modules read it while the forward runs (acb.attention.context)
        ctx = context.ForwardContext(meta, adapters)
        if step.pooling is not None:  # embeddings: the pooled positions' final hidden states too
            logits, self._pooled = pooled_forward(forward, self.model, ctx, input_ids, position_ids, keep,
                                                  step.pooling)
            return logits, None
        out = context.run(forward, ctx, input_ids=input_ids.unsqueeze(0),
                          position_ids=position_ids.unsqueeze(0), attention_mask=None, use_cache=False,
                          logits_to_keep=keep)
        return out.logits[0], None

    def _build(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, packing.StepAttention]:
        """The step's input ids, positions, kept logits rows and attention metadata."""
        p = packing.pack(step)
        if step.prompt_logprobs is not None:  # scored prompt positions: their logits after the sampled rows'
            p.keep += step.prompt_logprobs.keep(step.token_offsets)
        if step.pooling is not None:  # pooled positions (embeddings): their hidden states, last
            p.keep += step.pooling.keep(step.token_offsets)
        width, padded = self.fast_paths.pad_decode(p)  # a decode-only step may be padded to a graph bucket
        input_ids = self._tensor(p.tokens)
        # After a failed step there is nothing to carry: those rows belong to failed
        # requests whose results are dropped, so their placeholder ids stay.
        if p.carry_pos and self.prev_sampled is not None:
            input_ids[self._tensor(p.carry_pos)] = self.prev_sampled[self._tensor(p.carry_src)]
            self.carried_steps += 1
        positions = self._tensor(p.positions)
        slots, swa_slots = self._slots(p, positions)
        meta = self.attention.build(p, slots, swa_slots, width, padded, self.fast_paths.max_decode_blocks)
        if meta.decode is not None and meta.decode.kernel != "torch":
            self.fast_decode_steps += 1
        return input_ids, positions, self._tensor(p.keep), meta

    def _slots(self, p: packing.Packed, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where each packed token's key and value go, in the full pool and (hybrid models)
        the sliding one: gathered from the block tables; decode padding rows write the
        scratch slot (the sliding pool's slots cover the step's own tokens only)."""
        tables = self.kv.tables
        real = len(p.token_rows)
        rows = self._tensor(p.token_rows)
        own = positions[:real] if len(p.positions) > real else positions
        slots = tables.slots(rows, own)
        if len(p.positions) > real:
            scratch = self.fast_paths.decode_padding.scratch_slot
            slots = torch.cat([slots, torch.full((len(p.positions) - real,), scratch, dtype=slots.dtype,
                                                 device=slots.device)])
        return slots, tables.slots(rows, own, sliding=True) if self.kv.swa_layers else None
