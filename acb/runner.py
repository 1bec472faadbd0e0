"""The model runner: owns the model, the KV tensors and the device.

It turns a step (rows of token ids with their pages) into packed tensors, runs
the HF model with acb's paged attention, samples, and returns the chosen ids.
``execute`` runs on the engine's worker thread; nothing here knows the engine.
"""

from __future__ import annotations

import logging
import time

import torch

from . import attention, compiling, cuda_graphs, offload, packing, prompt_logprobs
from .sampling import sample, top_alternatives
from .step import PageMoves, StepInput, StepOutput
from .watch import ModelWatch

log = logging.getLogger("acb")


class PendingOutput:
    """A step queued on a device stream: the sampled ids land in pinned host memory
    when ``event`` completes. The engine polls ``ready()`` from the event loop (never
    blocking it) and then takes ``result()``, which no longer waits. ``timings`` are
    (start, end) timing events of the device work it reports (``StepOutput.device_s``)."""

    __slots__ = ("event", "ids", "logprobs", "top", "timings", "prompt")

    def __init__(self, event, ids: torch.Tensor, logprobs: torch.Tensor | None,
                 top: tuple[torch.Tensor, torch.Tensor] | None = None, timings: list[tuple] = ()) -> None:
        self.event = event
        self.ids = ids
        self.logprobs = logprobs
        self.top = top  # top-logprob ids and values, in pinned host memory
        self.timings = timings
        self.prompt = None  # the step's prompt scores (prompt_logprobs), already on the host

    def ready(self) -> bool:
        return bool(self.event.query())

    def result(self) -> StepOutput:
        self.event.synchronize()  # a no-op once ready() said so; surfaces device errors (the
        # engine classifies them with errors.as_device_error)
        out = _step_output(self.ids, self.logprobs, self.top)
        out.device_s = sum(start.elapsed_time(end) for start, end in self.timings) / 1e3
        out.prompt_logprobs = self.prompt
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
        self.prev_sampled: torch.Tensor | None = None
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._tensor = packing.DeviceIds(self.device)  # host list -> long tensor on the device
        # the CPU offload pool (EngineConfig.cpu_offload_space), None without one
        self.offload = offload.HostOffload(host_pages, self.k_cache, self.v_cache, page_size, self._tensor,
                                           self.swa_layers, swa_pages) if host_pages else None
        attention.register()
        configs = [model.config]
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
        if text is not None and text is not model.config:
            configs.append(text)
        self._routed = configs  # acb's attention inside acb's steps only (see attention.route)
        for c in configs:
            attention.route(c)
        self.fault_hook = None  # test hook: callable(step_index, stage) that may raise
        # the backend serving this runner, which names its kernel path: "native" | "triton" |
        # "torch" (ValueError if the requested one cannot run here)
        self.attn_backend = attention.resolve_backend(attn_backend, self.device, self.dtype)
        if not attention.load_kernels(self.attn_backend):  # native kernels not built (logged)
            self.attn_backend = "torch"
        self.attention = packing.AttentionBuilder(self.attn_backend, page_size, self._tensor, self.k_cache,
                                                  self.v_cache, num_pages, self.swa_layers, swa_pages)
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
        self.varlen_forward = model
        self.decode_forward = model
        self.fused = None  # acb.fused.FusedForward, when it stands in for the model's forward
        # tensor parallel: sums a row-parallel projection's partial output over the ranks
        # in place (acb.distributed.sharding.RowReduce); None on a single rank
        self.row_reduce = None
        self.decode_padding: cuda_graphs.DecodePadding | None = None
        self.decode_graphs: cuda_graphs.DecodeGraphs | None = None
        self._want_fused = False
        # which forward serves the steps, and why not the fused one (EngineStats.forward_path)
        self.forward_path = "transformers"
        self.forward_reason = "not configured yet"
        self._graph_rows = 0
        self._graph_kv_interval = 0
        self.watch = ModelWatch(model, self._own_forward)
        self.plain_steps = 0  # steps that ran the model's own forward (a hook, a replaced forward)
        self.carried_steps = 0  # steps fed a token sampled by the step before on the device (overlap)
        # CUDA: (start, end) timing events of the steps not yet reported in a StepOutput
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

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
        self.varlen_forward = self.decode_forward = self.model
        self.fused = None
        self._want_fused = not (varlen or decode) and self.prepacked and self.dtype in (torch.float32, torch.bfloat16)
        if varlen or decode:
            self.forward_path, self.forward_reason = "compiled", f"compile_level: varlen {varlen}, decode {decode}"
        elif not self._want_fused:
            self.forward_reason = ("the fused forward runs on CPU only" if self.device.type != "cpu" else
                                   f"its weights are {self.dtype} (fused: float32, bfloat16)"
                                   if self.dtype not in (torch.float32, torch.bfloat16) else
                                   "the linear layers are not prepacked (oneDNN unavailable or ACB_CPU_PREPACK=0)")
        self._build_fused()
        if varlen or decode:
            if self.prepacked:  # inductor cannot lower oneDNN-prepacked linears;
                from .kernels import cpu_linear  # it packs weights itself when it compiles for the CPU

                cpu_linear.release(self.model)
                self._packed = None
            self.varlen_forward = compiling.compiled_forward(self.model, varlen)
            self.decode_forward = compiling.compiled_forward(self.model, decode)
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
        from .fused import FusedForward, why_not
        from .kernels.cpu import fused_kernels

        kernels = fused_kernels()
        self.fused = FusedForward.build(self.model, self._packed, kernels, self.row_reduce)
        self.varlen_forward = self.decode_forward = self.fused or self.model
        self.forward_path = "fused" if self.fused is not None else "transformers"
        self.forward_reason = "" if self.fused is not None else why_not(self.model, self._packed, kernels)

    def _build_graphs(self) -> None:
        """(Re)create the CUDA-graph set (graphs are captured lazily, per bucket): a
        captured graph holds the weights' addresses of its capture."""
        self.decode_graphs = None
        if self._graph_rows and self.decode_padding is not None:  # (None: the self-check failed once)
            self.decode_graphs = cuda_graphs.DecodeGraphs(self.decode_forward, self.k_cache, self.v_cache,
                                                          self.page_size, self._graph_rows, self.model.config,
                                                          self.stream, self.attn_backend, generator=self.generator)
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
        self.offload = None  # these two hold the cache tensors too
        self.attention = None
        self.prev_sampled = None
        if self.prepacked:
            from .kernels import cpu_linear

            cpu_linear.release(self.model)
            self._packed = None
        self.fused = None  # it holds the packed weights
        self.varlen_forward = self.decode_forward = self.model
        for config in self._routed:
            attention.unroute(config)
        self._routed = []

    # ------------------------------------------------------------------------------
    def _build(self, step: StepInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, attention.StepAttention]:
        """The step's input ids, positions, kept logits rows and attention metadata."""
        p = packing.pack(step, self.page_size, self._zeroed, self._zeroed_swa if self.swa_layers else None)
        if step.prompt_logprobs is not None:  # scored prompt positions: their logits after the sampled rows'
            p.keep += step.prompt_logprobs.keep(step.token_offsets)
        # decode rows' contexts; a decode-only step may be padded to a graph bucket
        # (not with forked choices: their rows share the leader's logits row)
        width = max(p.lengths, default=0)
        padded = False
        if self.decode_padding is not None and p.decode_q and not p.prefill_rows and len(p.keep) == len(p.decode_q):
            padded_width = self.decode_padding.pad(p.tokens, p.positions, p.slots, p.decode_q, p.lengths, p.tables)
            if padded_width is not None:
                width, padded = padded_width, True
        self._zero_pages(p.fresh, sliding=False)
        self._zero_pages(p.swa_fresh, sliding=True)
        input_ids = self._tensor(p.tokens)
        # After a failed step there is nothing to carry: those rows belong to failed
        # requests whose results are dropped, so their placeholder ids stay.
        if p.carry_pos and self.prev_sampled is not None:
            input_ids[self._tensor(p.carry_pos)] = self.prev_sampled[self._tensor(p.carry_src)]
            self.carried_steps += 1
        meta = self.attention.build(p, self._tensor(p.slots), width, padded, self.max_decode_blocks)
        if meta.decode is not None and meta.decode.kernel != "torch":
            self.fast_decode_steps += 1
        return input_ids, self._tensor(p.positions), self._tensor(p.keep), meta

    def _zero_pages(self, pages: list[int], sliding: bool) -> None:
        """Zero pages used for the first time in every layer of their pool."""
        if pages:
            idx = self._tensor(pages)
            for view in self._page_views(sliding):
                view.index_fill_(1, idx, 0.0)

    def _page_views(self, sliding: bool) -> list[torch.Tensor]:
        """K and V of every layer of one page pool (hybrid models: ``sliding`` picks the
        sliding layers'), viewed as [kv heads, pages, page_size * head_dim]."""
        ps = self.page_size
        return [cache.view(cache.shape[0], cache.shape[1] // ps, ps * cache.shape[2])
                for layer, caches in enumerate(zip(self.k_cache, self.v_cache, strict=True))
                if (layer in self.swa_layers) == sliding for cache in caches]

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
        if not step.sampling.temperature:
            self.prev_sampled = None
            if self.stream is not None:  # reported with the next step that samples
                self._timings[-1][1].record(self.stream)
            return StepOutput([], None, prompt_logprobs=prompt)
        if self.fault_hook is not None:
            self.fault_hook(self.step_index, "sample")
        if sampled is not None:
            ids, logprobs = sampled
        else:
            ids, logprobs = sample(logits, step.sampling, self.generator, self.prev_sampled)
        top = top_alternatives(logits, step.sampling.top_logprobs) if step.sampling.top_logprobs else None
        self.prev_sampled = ids
        if self.stream is None:
            out = _step_output(ids, logprobs, top)
            out.prompt_logprobs = prompt
            return out
        ids_host = _to_pinned(ids)
        lp_host = _to_pinned(logprobs) if logprobs is not None else None
        top_host = (_to_pinned(top[0]), _to_pinned(top[1])) if top is not None else None
        timings, self._timings = self._timings, []
        event = timings[-1][1]
        event.record(self.stream)
        pending = PendingOutput(event, ids_host, lp_host, top_host, timings)
        pending.prompt = prompt
        return pending

    def forward(self, step: StepInput) -> tuple[torch.Tensor | None, tuple | None]:
        """The step's offload copies and forward: (the logits of its sampled rows [K, vocab],
        None), or (None, (ids, logprobs)) when a CUDA graph sampled them too."""
        if step.refresh:
            self.refresh_weights()
        if step.swap_out:
            self.offload.swap_out(step.swap_out)
        if step.swap_in:
            self.offload.swap_in(step.swap_in)
            for page in step.swap_in.dst:  # written whole: never zero them
                self._zeroed[page] = 1
            for page in step.swap_in.swa:
                if page >= 0:
                    self._zeroed_swa[page] = 1
        if step.copy_pages:
            self._copy_pages(step.copy_pages, sliding=False)
        if step.copy_swa_pages:
            self._copy_pages(step.copy_swa_pages, sliding=True)
        input_ids, position_ids, keep, meta = self._build(step)
        if self.fault_hook is not None:
            self.fault_hook(self.step_index, "forward")
        logits = sampled = None
        # a padded decode-only step replays its graph, unless max_blocks_per_request sent its
        # rows from the Triton kernel (what the graphs replay) to PyTorch's path
        decode = meta.decode
        graphed = decode is not None and decode.padded and (meta.kernel != "triton" or decode.kernel == "triton")
        if step.plain:
            self.plain_steps += 1
        elif graphed and self.decode_graphs is not None and step.sampling.temperature:
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
                forward = self.varlen_forward if meta.prefills else self.decode_forward
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
        src = self._tensor(moves.src)
        dst = self._tensor(moves.dst)
        for pages in self._page_views(sliding):
            pages[:, dst] = pages[:, src]
        zeroed = self._zeroed_swa if sliding else self._zeroed
        for page in moves.dst:
            zeroed[page] = 1  # written whole: never zero it
