"""The model runner: owns the model, the KV tensors and the device.

It turns a step (rows of token ids with their pages) into packed tensors, runs
the HF model with acb's paged attention, samples, and returns the chosen ids.
``execute`` runs on the engine's worker thread; nothing here knows the engine.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from . import attention, compiling, cuda_graphs, offload
from .sampling import sample, top_alternatives
from .step import PageMoves, StepInput, StepOutput
from .watch import ModelWatch

log = logging.getLogger("acb")


class PendingOutput:
    """A step queued on a device stream: the sampled ids land in pinned host memory
    when ``event`` completes. The engine polls ``ready()`` from the event loop (never
    blocking it) and then takes ``result()``, which no longer waits."""

    __slots__ = ("event", "ids", "logprobs", "top")

    def __init__(self, event, ids: torch.Tensor, logprobs: torch.Tensor | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.event = event
        self.ids = ids
        self.logprobs = logprobs
        self.top = top  # top-logprob ids and values, in pinned host memory

    def ready(self) -> bool:
        return bool(self.event.query())

    def result(self) -> StepOutput:
        self.event.synchronize()  # a no-op once ready() said so; surfaces device errors (the
        # engine classifies them with errors.as_device_error)
        return _step_output(self.ids, self.logprobs, self.top)


def _step_output(ids: torch.Tensor, logprobs: torch.Tensor | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None) -> StepOutput:
    return StepOutput(ids.tolist(), logprobs.tolist() if logprobs is not None else None,
                      top[0].tolist() if top is not None else None, top[1].tolist() if top is not None else None)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into pinned host memory (done when the step's event is)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def model_layers_info(config) -> tuple[int, int, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_layers = text.num_hidden_layers
    num_heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return num_layers, kv_heads, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    num_layers, kv_heads, head_dim = model_layers_info(config)
    return 2 * num_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, attn_backend: str = "auto",
                 host_pages: int = 0, swa_pages: int = 0, swa_layers: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.page_size = page_size
        self.num_pages = num_pages
        num_layers, kv_heads, head_dim = model_layers_info(model.config)
        # One extra page at the end holds zeros: padding reads point at it, so a
        # padded key is always finite (masked scores times NaN values would be NaN).
        self.null_slot = num_pages * page_size
        # Hybrid models: the sliding layers (``swa_layers``) have their own, smaller page
        # pool of ``swa_pages`` pages (and their own zero page at its end).
        self.swa_pages = swa_pages
        self.swa_layers = swa_layers if swa_pages else frozenset()
        # torch.empty: on CPU the pages are only backed by memory once written.
        self.k_cache, self.v_cache = [], []
        for layer in range(num_layers):
            slots = ((swa_pages if layer in self.swa_layers else num_pages) + 1) * page_size
            for caches in (self.k_cache, self.v_cache):
                caches.append(torch.empty(kv_heads, slots, head_dim, dtype=self.dtype, device=self.device))
                caches[-1][:, slots - page_size :].zero_()
        # Attention reads whole pages, so the unwritten tail of a row's last page is read
        # too (and masked). Masked scores are -inf, but a NaN bit pattern in never-written
        # memory would still poison ``weights @ V``: each page is zeroed on first use.
        self._zeroed = bytearray(num_pages)
        self._zeroed_swa = bytearray(swa_pages)
        # The CPU offload pool: one contiguous [layers, k/v, kv heads, page] block per
        # slot, so a page moves in one copy (pinned on CUDA, for asynchronous copies).
        # On CPU it is backed by memory only where written, like the cache.
        self.host_pool = None
        if host_pages:
            self.host_pool = torch.empty(
                host_pages, num_layers, 2, kv_heads, page_size * head_dim, dtype=self.dtype,
                pin_memory=self.device.type == "cuda",
            )
        self.prev_sampled: torch.Tensor | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        attention.register()
        configs = [model.config]
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
        if text is not None and text is not model.config:
            configs.append(text)
        self._routed = configs  # acb's attention inside acb's steps only (see attention.route)
        for c in configs:
            attention.route(c)
        self.fault_hook = None  # test hook: callable(step_index, stage) that may raise
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.decode_kernel = None  # the native CPU kernels' module (backend "native")
        self.triton = None  # acb.kernels.triton_attention (backend "triton")
        # the backend serving this runner: "native" | "triton" | "torch" (ValueError if the
        # requested one cannot run here)
        self.attn_backend = attention.resolve_backend(attn_backend, self.device, self.dtype)
        if self.attn_backend == "native":
            from .kernels.cpu import paged_decode_kernel

            self.decode_kernel = paged_decode_kernel()
            if self.decode_kernel is None:  # could not be built (logged): PyTorch's path
                self.attn_backend = "torch"
        elif self.attn_backend == "triton":
            from .kernels import triton_attention

            self.triton = triton_attention
        log.info("acb attention backend: %s (attn_backend=%r on %s, %s)", self.attn_backend, attn_backend,
                 self.device, self.dtype)
        self._packed = None  # the model's prepacked linears (acb.kernels.cpu_linear.Prepacked)
        if self.device.type == "cpu":
            from .kernels import cpu_linear

            if cpu_linear.available(self.dtype):
                self._packed = cpu_linear.acquire(model)
        self.step_index = 0
        self.max_decode_blocks: int | None = None
        self.fast_decode_steps = 0  # steps whose decode rows ran on the native kernel
        # fast paths, set by configure_fast_paths: compiled forwards, decode padding, CUDA graphs
        self._varlen_forward = model
        self._decode_forward = model
        self.fused = None  # acb.fused.FusedForward, when it stands in for the model's forward
        # tensor parallel: sums a row-parallel projection's partial output over the ranks
        # in place (acb.distributed.sharding.RowReduce); None on a single rank
        self.row_reduce = None
        self.decode_padding: cuda_graphs.DecodePadding | None = None
        self.decode_graphs: cuda_graphs.DecodeGraphs | None = None
        self._want_fused = False
        self._graph_rows = 0
        self._graph_kv_interval = 0
        self.watch = ModelWatch(model, self._own_forward)
        self.plain_steps = 0  # steps that ran the model's own forward (a hook, a replaced forward)
        self.carried_steps = 0  # steps fed a token sampled by the step before on the device (overlap)

    @property
    def prepacked(self) -> bool:
        """Whether the model's linear layers use oneDNN-prepacked weights (CPU)."""
        return self._packed is not None

    def configure_fast_paths(self, config, max_rows: int, *, pad_on_cpu: bool = False) -> None:
        """Apply an EngineConfig's ``compile_level`` (and per-path overrides) and CUDA-graph
        settings. ``pad_on_cpu`` pads decode-only steps to graph buckets without graphs
        (the CPU tests' way to prove that padding never changes a token)."""
        # The decode fast path (the native kernel reading pages in place) serves steps whose
        # block table is at most this wide; 0 turns it off, None means no bound.
        self.max_decode_blocks = config.max_blocks_per_request
        if self.attn_backend != "torch" and self.max_decode_blocks == 0:
            log.info("acb attention: decode fast path off (max_blocks_per_request=0); PyTorch decode path")
        varlen, decode = compiling.path_levels(config.compile_level, config.varlen_compile_level,
                                               config.decode_compile_level)
        self._varlen_forward = self._decode_forward = self.model
        self.fused = None
        self._want_fused = not (varlen or decode) and self.prepacked and self.dtype == torch.float32
        self._build_fused()
        if varlen or decode:
            if self.prepacked:  # inductor cannot lower oneDNN-prepacked linears;
                from .kernels import cpu_linear  # it packs weights itself when it compiles for the CPU

                cpu_linear.release(self.model)
                self._packed = None
            self._varlen_forward = compiling.compiled_forward(self.model, varlen)
            self._decode_forward = compiling.compiled_forward(self.model, decode)
            log.info("acb: torch.compile on: varlen path level %d %s, decode path level %d %s", varlen,
                     compiling.compile_kwargs(varlen), decode, compiling.compile_kwargs(decode))
        cuda = self.stream is not None
        wanted = cuda_graphs.graphs_requested(config.use_cuda_graph, config.q_padding_interval_size,
                                              config.kv_padding_interval_size, cuda)
        graphs = wanted and cuda
        if (graphs or pad_on_cpu) and self.swa_layers:
            # a warning when asked for explicitly; by default (on CUDA) it is just the path taken
            log.log(logging.INFO if config.use_cuda_graph is None and not pad_on_cpu else logging.WARNING,
                    "acb: CUDA graphs are not used for hybrid sliding-window models yet (two page pools); "
                    "decode steps run eagerly")
            graphs = pad_on_cpu = False
        if wanted and not graphs and not pad_on_cpu:
            log.warning("acb: CUDA graphs need a CUDA device; on %s decode steps run eagerly and unpadded "
                        "(use_cuda_graph=%s, q_padding_interval_size=%d, kv_padding_interval_size=%d)",
                        self.device, config.use_cuda_graph, config.q_padding_interval_size,
                        config.kv_padding_interval_size)
        self.decode_padding = self.decode_graphs = None
        if graphs or pad_on_cpu:
            ps = self.page_size
            self.decode_padding = cuda_graphs.DecodePadding(
                cuda_graphs.decode_buckets(max_rows, config.q_padding_interval_size),
                config.kv_padding_interval_size, ps, scratch_slot=self.null_slot + ps - 1)
        self._graph_rows = max_rows if graphs else 0
        self._graph_kv_interval = config.kv_padding_interval_size
        self._build_graphs()
        self.watch.snapshot()  # the model as the fast paths now see it (prepacked or not)
        if self.decode_padding is None:
            log.info("acb decode steps: eager, unpadded")
        else:
            log.info("acb decode steps: padded to row buckets %s, %s", self.decode_padding.buckets,
                     "replayed from CUDA graphs" if graphs else "eager")

    def check_graphs(self, kv_interval: int = 0) -> bool:
        """The start-up self-check of ``decode_graphs``: a captured padding-only step must
        replay what the eager forward computes. On failure: a warning, and decode steps
        run eagerly and unpadded."""
        why = self.decode_graphs.self_check(self.num_pages, self.null_slot + self.page_size - 1, kv_interval)
        if why is None:
            return True
        log.warning("acb: CUDA graph self-check failed (%s); decode steps run eagerly", why)
        self.decode_graphs = self.decode_padding = None
        return False

    def _own_forward(self, module: torch.nn.Module):
        """The instance ``forward`` acb set on ``module`` (a prepacked linear's), or None."""
        entry = self._packed.layers.get(module) if self._packed is not None else None
        return entry.bound if entry is not None else None

    def _build_fused(self) -> None:
        """(Re)build the fused CPU forward over the model's current modules and weights."""
        if not self._want_fused:
            return
        from .fused import FusedForward
        from .kernels.cpu import fused_kernels

        self.fused = FusedForward.build(self.model, self._packed, fused_kernels(), self.row_reduce)
        self._varlen_forward = self._decode_forward = self.fused or self.model

    def _build_graphs(self) -> None:
        """(Re)create the CUDA-graph set (graphs are captured lazily, per bucket): a
        captured graph holds the weights' addresses of its capture."""
        self.decode_graphs = None
        if self._graph_rows and self.decode_padding is not None:  # (None: the self-check failed once)
            self.decode_graphs = cuda_graphs.DecodeGraphs(self._decode_forward, self.k_cache, self.v_cache,
                                                          self.page_size, self._graph_rows, self.model.config,
                                                          self.stream, triton=self.triton, generator=self.generator)
            with torch.inference_mode(), torch.cuda.stream(self.stream):
                self.check_graphs(self._graph_kv_interval)

    def check_model(self) -> tuple[str | None, bool]:
        """Before each step, on the engine's thread: (why the model's own forward must run
        this step, or None; whether the weights changed since the fast paths were built,
        in which case the step must carry ``refresh``). See :mod:`acb.watch`."""
        changed = self.watch.weights_changed()
        if changed:
            self.watch.snapshot_weights()
        return self.watch.hooked(), changed

    def refresh_weights(self, everything: bool = False) -> None:
        """Rebuild the fast paths from the model's weights as they are now: repack the
        changed linears (all with ``everything``), rebuild the fused forward, drop the
        captured CUDA graphs. ``everything`` also takes the model's current module tree
        and hooks as the new reference (``Engine.reload_weights``)."""
        if self._packed is not None:
            self._packed.refresh(force=everything)
        self._build_fused()
        self._build_graphs()
        if everything:
            self.watch.snapshot()

    def release(self) -> None:
        """Give back the KV memory and the model's attention setting."""
        self.decode_graphs = None  # they hold the cache's addresses
        self.k_cache = []
        self.v_cache = []
        self.host_pool = None
        self.prev_sampled = None
        if self.prepacked:
            from .kernels import cpu_linear

            cpu_linear.release(self.model)
            self._packed = None
        self.fused = None  # it holds the packed weights
        self._varlen_forward = self._decode_forward = self.model
        for config in self._routed:
            attention.unroute(config)
        self._routed = []

    # ------------------------------------------------------------------------------
    def _build(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, attention.StepAttention]:
        ps = self.page_size
        dev = self.device
        tokens = list(step.token_ids)  # a copy: decode padding appends to it
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        carry_pos: list[int] = []
        carry_src: list[int] = []
        decode_q: list[int] = []
        fresh: list[int] = []
        prefills: list[attention.PrefillSpan] = []
        swa = bool(self.swa_layers)
        swa_slots: list[int] = []
        swa_fresh: list[int] = []
        swa_ctx: list[torch.Tensor | None] = []
        lengths: list[int] = []  # decode rows' context lengths and page tables
        tables: list[Sequence[int]] = []
        swa_tables: list[Sequence[int] | None] = []
        triton = self.triton is not None
        prefill_rows: list[tuple[int, int, int]] = []  # Triton: (first token, tokens, past) per prefill row
        prefill_tables: list[Sequence[int]] = []
        swa_prefill_tables: list[Sequence[int] | None] = []
        t_off, p_off, s_off = step.token_offsets, step.page_offsets, step.swa_offsets
        for i, start in enumerate(step.starts):
            q0 = t_off[i]
            n = t_off[i + 1] - q0
            if n == 0:  # a forked choice: it samples from the logits of the row before it
                if step.sample[i]:  # (not on the ranks other than 0 of tensor parallelism: they sample nothing)
                    keep.append(q0 - 1)
                continue
            pages = step.pages[p_off[i] : p_off[i + 1]]
            swa_pages = step.swa_pages[s_off[i] : s_off[i + 1]] if swa else None
            carry_from = step.carry_from[i]
            positions.extend(range(start, start + n))
            self._place(pages, start, n, self._zeroed, slots, fresh)
            if swa:
                self._place(swa_pages, start, n, self._zeroed_swa, swa_slots, swa_fresh)
            if carry_from >= 0:
                carry_pos.append(q0 + n - 1)
                carry_src.append(carry_from)
            if step.sample[i]:
                keep.append(q0 + n - 1)
            if n == 1:
                decode_q.append(q0)
                lengths.append(start + 1)
                tables.append(pages)
                swa_tables.append(swa_pages)
            elif triton:  # every prefill row reads its keys through its block table
                prefill_rows.append((q0, n, start))
                prefill_tables.append(pages)
                swa_prefill_tables.append(swa_pages)
                prefills.append(attention.PrefillSpan(q0, q0 + n, start, None))
            else:
                ctx = None
                if start > 0:
                    ctx = self._page_table([pages], start + n)
                    if swa:
                        swa_ctx.append(self._page_table([swa_pages], start + n, self.swa_pages))
                elif swa:
                    swa_ctx.append(None)
                kernel_row = None
                if start > 0 and self.decode_kernel is not None:
                    kernel_row = torch.tensor([[q0, q0 + n, 0, start]], dtype=torch.int64)
                prefills.append(attention.PrefillSpan(q0, q0 + n, start, ctx, kernel_row))
        # decode rows' contexts; a decode-only step may be padded to a graph bucket
        width = max(lengths, default=0)
        padded = False
        # (not with forked choices: their rows share the leader's logits row)
        if self.decode_padding is not None and decode_q and not prefills and len(keep) == len(decode_q):
            padded_width = self.decode_padding.pad(tokens, positions, slots, decode_q, lengths, tables)
            if padded_width is not None:
                width, padded = padded_width, True
        for pages_to_zero, sliding in ((fresh, False), (swa_fresh, True)):
            if pages_to_zero:
                idx = self._tensor(pages_to_zero)
                for layer, (k, v) in enumerate(zip(self.k_cache, self.v_cache, strict=True)):
                    if (layer in self.swa_layers) == sliding:
                        for cache in (k, v):
                            kvh, num_slots, d = cache.shape
                            cache.view(kvh, num_slots // ps, ps * d).index_fill_(1, idx, 0.0)
        input_ids = self._tensor(tokens)
        # After a failed step there is nothing to carry: those rows belong to failed
        # requests whose results are dropped, so their placeholder ids stay.
        if carry_pos and self.prev_sampled is not None:
            input_ids[self._tensor(carry_pos)] = self.prev_sampled[self._tensor(carry_src)]
            self.carried_steps += 1
        position_ids = self._tensor(positions)
        meta = attention.StepAttention(
            k_cache=self.k_cache, v_cache=self.v_cache,
            slot_mapping=self._tensor(slots),
            decode_token_idx=None, decode_pages=None, decode_key_pos=None, decode_q_pos=None,
            decode_valid=None, prefills=prefills, page_size=ps,
        )
        if decode_q:
            meta.padded = padded
            meta.decode_pages = self._page_table(tables, width)
            lmax = meta.decode_pages.shape[1] * ps
            meta.decode_token_idx = self._tensor(decode_q)
            length_t = self._tensor(lengths)
            meta.decode_lengths = length_t
            fits = self.max_decode_blocks is None or meta.decode_pages.shape[1] <= self.max_decode_blocks
            meta.decode_kernel = (self.triton if triton else self.decode_kernel) if fits else None
            if meta.decode_kernel is not None:
                self.fast_decode_steps += 1
            else:  # PyTorch's decode path: masks over the gathered pages
                key_pos = torch.arange(lmax, device=dev).unsqueeze(0)
                meta.decode_key_pos = key_pos
                meta.decode_q_pos = (length_t - 1).unsqueeze(1)
                meta.decode_valid = (key_pos < length_t.unsqueeze(1)).view(len(lengths), 1, lmax)
        if triton:
            meta.triton = self.triton
            if prefill_rows:
                meta.triton_prefill = self._prefill_rows(prefill_rows, prefill_tables)
        if prefills and self.decode_kernel is not None:
            meta.prefill_kernel = self.decode_kernel
            fresh_spans = [(sp.q_start, sp.q_end, sp.q_start, 0) for sp in prefills if sp.past == 0]
            if fresh_spans:
                meta.fresh_spans = torch.tensor(fresh_spans, dtype=torch.int64)
        if swa:
            # the sliding layers' view of the same step: their own slots and page tables
            meta.swa = dataclasses.replace(
                meta, slot_mapping=self._tensor(swa_slots),
                prefills=prefills if triton else [dataclasses.replace(sp, context_pages=c)
                                                  for sp, c in zip(prefills, swa_ctx, strict=True)],
                decode_pages=self._page_table(swa_tables, width, self.swa_pages) if decode_q else None,
                triton_prefill=self._prefill_rows(prefill_rows, swa_prefill_tables, self.swa_pages)
                if prefill_rows else None,
            )
            meta.swa_layers = self.swa_layers
        keep_t = self._tensor(keep)
        return input_ids, position_ids, keep_t, meta

    def _place(self, table: list[int], start: int, n: int, zeroed: bytearray, slots: list[int],
               fresh: list[int]) -> None:
        """Append the slots of positions [start, start + n) under ``table``, and the pages
        they touch that were never used before (to be zeroed)."""
        ps = self.page_size
        slots.extend(table[p // ps] * ps + p % ps for p in range(start, start + n))
        for page in table[start // ps : (start + n - 1) // ps + 1]:
            if not zeroed[page]:
                zeroed[page] = 1
                fresh.append(page)

    def _prefill_rows(self, rows: list[tuple[int, int, int]], tables: list[Sequence[int]], zero: int | None = None):
        """The Triton prefill kernel's view of a step's prefill rows (one per page pool)."""
        from .kernels.triton_attention import PrefillRows

        width = max(start + n for _, n, start in rows)
        programs = PrefillRows.programs_for([n for _, n, _ in rows])
        return PrefillRows(self._tensor(rows), self._page_table(tables, width, zero), self._tensor(programs))

    def _tensor(self, values: list) -> torch.Tensor:
        """Host list -> long tensor on the device; on CUDA through pinned memory, without
        making the host wait for the copy."""
        if self.stream is None:
            return torch.tensor(values, dtype=torch.long)
        return torch.tensor(values, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)

    def _page_table(self, tables: list[list[int]], length: int, zero: int | None = None) -> torch.Tensor:
        """[B, P] pages covering ``length`` positions per row; the zero page pads."""
        npages = -(-length // self.page_size)
        z = self.num_pages if zero is None else zero  # the zero page: padding and recycled pages
        table = [[p if p >= 0 else z for p in t[:npages]] + [z] * (npages - len(t[:npages])) for t in tables]
        return self._tensor(table)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput | PendingOutput:
        """Run one step. On CPU it returns when the step is done; on CUDA it returns
        once the step is queued on the runner's stream (a ``PendingOutput``)."""
        self.step_index += 1
        try:
            if self.stream is None:
                return self._execute(step)
            with torch.cuda.stream(self.stream):
                return self._execute(step)
        except BaseException:
            self.prev_sampled = None
            raise

    def _execute(self, step: StepInput) -> StepOutput | PendingOutput:
        logits, sampled = self._forward(step)
        if not step.sampling.temperature:
            self.prev_sampled = None
            return StepOutput([], None)
        if self.fault_hook is not None:
            self.fault_hook(self.step_index, "sample")
        if sampled is not None:
            ids, logprobs = sampled
        else:
            ids, logprobs = sample(logits, step.sampling, self.generator, self.prev_sampled)
        top = top_alternatives(logits, step.sampling.top_logprobs) if step.sampling.top_logprobs else None
        self.prev_sampled = ids
        if self.stream is None:
            return _step_output(ids, logprobs, top)
        ids_host = _to_pinned(ids)
        lp_host = _to_pinned(logprobs) if logprobs is not None else None
        top_host = (_to_pinned(top[0]), _to_pinned(top[1])) if top is not None else None
        event = torch.cuda.Event()
        event.record(self.stream)
        return PendingOutput(event, ids_host, lp_host, top_host)

    def _forward(self, step: StepInput) -> tuple[torch.Tensor | None, tuple | None]:
        """The step's offload copies and forward: (the logits of its sampled rows [K, vocab],
        None), or (None, (ids, logprobs)) when a CUDA graph sampled them too."""
        if step.refresh:
            self.refresh_weights()
        if step.swap_out:
            self._swap_out(step.swap_out)
        if step.swap_in:
            self._swap_in(step.swap_in)
        if step.copy_pages:
            self._copy_pages(step.copy_pages, sliding=False)
        if step.copy_swa_pages:
            self._copy_pages(step.copy_swa_pages, sliding=True)
        input_ids, position_ids, keep, meta = self._build(step)
        if self.fault_hook is not None:
            self.fault_hook(self.step_index, "forward")
        logits = sampled = None
        # graphs replay the Triton decode kernel: not for a step max_blocks_per_request sends
        # to PyTorch's path
        graphed = self.triton is None or meta.decode_kernel is not None
        if step.plain:
            self.plain_steps += 1
        elif meta.padded and graphed and self.decode_graphs is not None and step.sampling.temperature:
            mode = cuda_graphs.sampling_mode(step.sampling)
            out = self.decode_graphs.run(input_ids, position_ids, meta, mode, self._graph_params(step, mode))
            if out is not None:  # padding rows' results are dropped
                logits, ids, logprobs = out
                if logits is not None:
                    logits = logits.index_select(0, keep)
                else:
                    sampled = ids.index_select(0, keep), logprobs.index_select(0, keep) if logprobs is not None \
                        else None
        if logits is None and sampled is None:
            if step.plain:
                forward = self.model
            else:
                forward = self._varlen_forward if meta.prefills else self._decode_forward
            attention.set_step(meta)
            try:
                out = forward(
                    input_ids=input_ids.unsqueeze(0),
                    position_ids=position_ids.unsqueeze(0),
                    attention_mask=None,
                    use_cache=False,
                    logits_to_keep=keep,
                )
            finally:
                attention.set_step(None)
            logits = out.logits[0]
        return logits, sampled

    def _graph_params(self, step: StepInput, mode: str | None) -> torch.Tensor | None:
        """A sampling graph's static inputs for ``step``: [3, rows] (temperature, top-k,
        top-p) per padded row, greedy for rows that do not sample; through pinned memory,
        without a host wait. None for modes that do not read them."""
        if mode is None or not mode.startswith("sample"):
            return None
        rows = self.decode_padding.pad_rows(step.num_rows)
        params = [[0.0] * rows, [0.0] * rows, [1.0] * rows]
        b = step.sampling
        sampled_rows = (i for i, s in enumerate(step.sample) if s)
        for j, i in enumerate(sampled_rows):
            params[0][i], params[1][i], params[2][i] = b.temperature[j], float(b.top_k[j]), b.top_p[j]
        host = torch.tensor(params, dtype=torch.float32)
        if self.stream is None:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _copy_pages(self, moves: PageMoves, sliding: bool) -> None:
        """Copy-on-write of shared partial pages (forked choices): K and V of each source
        page into its fresh page, before this step writes to it, in every layer of one
        page pool (hybrid models: ``sliding`` picks the sliding layers' own pool)."""
        ps = self.page_size
        src = self._tensor(moves.src)
        dst = self._tensor(moves.dst)
        for layer, caches in enumerate(zip(self.k_cache, self.v_cache, strict=True)):
            if (layer in self.swa_layers) != sliding:
                continue
            for cache in caches:
                kvh, num_slots, d = cache.shape
                pages = cache.view(kvh, num_slots // ps, ps * d)
                pages[:, dst] = pages[:, src]
        zeroed = self._zeroed_swa if sliding else self._zeroed
        for page in moves.dst:
            zeroed[page] = 1  # written whole: never zero it

    # ------------------------------------------------------------------ CPU offload
    def _swap_out(self, moves: PageMoves) -> None:
        """Copy device pages into host slots (the pages may be reused right after)."""
        offload.swap_out(self, moves)

    def _swap_in(self, moves: PageMoves) -> None:
        """Copy host slots back into (fresh) device pages."""
        offload.swap_in(self, moves)
