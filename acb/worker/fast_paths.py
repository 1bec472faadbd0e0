"""The fast paths: what stands in for the model's own forward, and keeping it right.

- prepacked linears (CPU: oneDNN-prepacked weights, ``acb.kernels.cpu_linear``);
- the fused CPU forward (``acb.model.fused``), when every layer is one it knows;
- ``torch.compile``d forwards (``compile_level`` and its per-path overrides);
- decode padding to graph buckets and the CUDA graphs replayed for them
  (``acb.worker.cuda_graphs``);
- the model watch (``acb.model.watch``): a fast path is right only while the model is the one
  it was built from, so changed weights rebuild them (:meth:`FastPaths.refresh`).

Which forward serves the steps, and why not the fused one, is ``forward_path`` /
``forward_reason`` (``EngineStats``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..core.defaults import resolve
from ..model import int8_forward, int8_weights
from ..model.watch import ModelWatch
from . import compiling, cuda_graphs

if TYPE_CHECKING:
    from ..attention.metadata import Packed, StepAttention
    from ..core.step import StepInput
    from .kv_store import KVStore

log = logging.getLogger("acb")


class FastPaths:
    """Owns the model's prepacked weights, the fused forward, the compiled forwards
    (``varlen_forward`` for steps with prefill rows, ``decode_forward`` for the others),
    decode padding and the CUDA graphs over the KV store ``kv``, and the model watch."""

    def __init__(self, model: torch.nn.Module, kv: KVStore, attn_backend: str, stream, generator,
                 row_reduce=None) -> None:
        self.model = model
        self.kv = kv
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.attn_backend = attn_backend
        self.stream = stream  # the runner's CUDA stream (None on CPU)
        self.generator = generator  # the runner's, registered with sampling graphs
        # tensor parallel: sums a row-parallel projection's partial output over the ranks
        # in place (acb.distributed.sharding.RowReduce); None on a single rank
        self.row_reduce = row_reduce
        self.packed = None  # the model's prepacked linears (acb.kernels.cpu_linear.Prepacked), see configure
        self.kernels = True  # EngineConfig.cpu_kernels / cpu_fused_forward / cpu_bf16_gemm, as configured
        self.fused_allowed = True
        self.bf16_gemm = True
        # The decode fast path (a kernel reading pages in place) serves steps whose block
        # table is at most this wide; 0 turns it off, None means no bound.
        self.max_decode_blocks: int | None = None
        self.varlen_forward = model
        self.decode_forward = model
        self.fused = None  # acb.model.fused.FusedForward, when it stands in for the model's forward
        self.sampling_kernels = None  # csrc/fused_cpu.cpp: greedy rows' argmax (acb.worker.sampling.greedy)
        self.decode_padding: cuda_graphs.DecodePadding | None = None
        self.decode_graphs: cuda_graphs.DecodeGraphs | None = None
        self._want_fused = False
        self.forward_path = "transformers"
        self.forward_reason = "not configured yet"
        self._graph_rows = 0
        self._graph_kv_interval = 0
        self.watch = ModelWatch(model, self._own_forward)

    @property
    def prepacked(self) -> bool:
        """Whether the model's linear layers use oneDNN-prepacked weights (CPU)."""
        return self.packed is not None

    # ------------------------------------------------------------------ set-up
    def configure(self, config, max_rows: int, *, pad_on_cpu: bool = False) -> None:
        """Apply an EngineConfig's ``compile_level`` (and per-path overrides) and CUDA-graph
        settings. ``pad_on_cpu`` pads decode-only steps to graph buckets without graphs
        (the CPU tests' way to prove that padding never changes a token)."""
        config = resolve(config)  # the environment's overrides too, for runners built without an engine
        self.max_decode_blocks = config.max_blocks_per_request
        self.kernels, self.fused_allowed = config.cpu_kernels, config.cpu_fused_forward
        self.bf16_gemm = config.cpu_bf16_gemm
        self._prepack(config.cpu_prepack)
        if self.attn_backend != "torch" and self.max_decode_blocks == 0:
            log.info("acb attention: decode fast path off (max_blocks_per_request=0); PyTorch decode path")
        self._configure_forwards(config)
        self._configure_graphs(config, max_rows, pad_on_cpu)
        # the weight check in one C++ loop where acb's CPU kernels are built (acb.model.watch), else Python's
        self.watch.native = getattr(self.sampling_kernels, "WeightWatch", None) if self.device.type == "cpu" \
            else None
        self.watch.snapshot()  # the model as the fast paths now see it (prepacked or not)
        if self.device.type == "cpu":  # the packing's freed copies back to the OS, not kept by glibc
            from ..kernels.cpu_linear import trim_heap

            trim_heap()
        if self.decode_padding is None:
            log.info("acb decode steps: eager, unpadded")
        else:
            log.info("acb decode steps: padded to row buckets %s, %s", self.decode_padding.buckets,
                     "replayed from CUDA graphs" if self._graph_rows else "eager")

    def _prepack(self, wanted: bool) -> None:
        """CPU: prepack the model's linears for oneDNN (``EngineConfig.cpu_prepack``), or
        give their own forwards back."""
        if self.device.type != "cpu":
            return
        from ..kernels import cpu_linear

        if wanted and self.packed is None and cpu_linear.available(self.dtype):
            self.packed = cpu_linear.acquire(self.model)
        elif not wanted and self.packed is not None:
            cpu_linear.release(self.model)
            self.packed = None

    def _native_bf16(self) -> bool:
        """Whether acb's own bf16 GEMMs (``fused.native_bf16``) would compute this bf16 model's fused
        forward (built, and not turned off: ``EngineConfig.cpu_bf16_gemm``)."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not self.kernels:
            return False
        from ..model.fused import native_bf16

        return native_bf16(self.bf16_gemm) is not None

    def _configure_forwards(self, config) -> None:
        """The compiled forwards, or the fused one (they exclude each other)."""
        varlen, decode = compiling.path_levels(config.compile_level, config.varlen_compile_level,
                                               config.decode_compile_level)
        self.varlen_forward = self.decode_forward = self.model
        self.fused = self.sampling_kernels = None  # (set again by _build_fused where it builds)
        quantized = int8_weights.is_quantized(self.model)  # int8: acb.model.quantization's forward, no prepacking
        native = self._native_bf16()  # bf16: acb's own GEMMs pack the weights (oneDNN's prepacking not needed)
        self._want_fused = not (varlen or decode) and (self.prepacked or quantized or native) and \
            self.dtype in (torch.float32, torch.bfloat16)
        if varlen or decode:
            self.forward_path, self.forward_reason = "compiled", f"compile_level: varlen {varlen}, decode {decode}"
        elif not self._want_fused:
            self.forward_reason = ("the fused forward runs on CPU only" if self.device.type != "cpu" else
                                   f"its weights are {self.dtype} (fused: float32, bfloat16)"
                                   if self.dtype not in (torch.float32, torch.bfloat16) else
                                   "bfloat16 has no fast kernels on this CPU (neither AVX-512 BF16 nor AVX2, or "
                                   "EngineConfig.cpu_bf16_gemm=False / ACB_CPU_BF16_GEMM=0: oneDNN would emulate "
                                   "it, so nothing is prepacked); dtype='float32' runs the fused forward here"
                                   if self.dtype == torch.bfloat16 and config.cpu_prepack
                                   and not _native_bf16_cpu(self.bf16_gemm) else
                                   "the linear layers are not prepacked (oneDNN unavailable, or "
                                   "EngineConfig.cpu_prepack=False / ACB_CPU_PREPACK=0)")
        self._build_fused()
        if varlen or decode:
            if self.prepacked:  # inductor cannot lower oneDNN-prepacked linears;
                from ..kernels import cpu_linear  # it packs weights itself when it compiles for the CPU

                cpu_linear.release(self.model)
                self.packed = None
            self.varlen_forward = compiling.compiled_forward(self.model, varlen)
            self.decode_forward = compiling.compiled_forward(self.model, decode)
            log.info("acb: torch.compile on: varlen path level %d %s, decode path level %d %s", varlen,
                     compiling.compile_kwargs(varlen), decode, compiling.compile_kwargs(decode))
        if self.packed is not None and self.fused is None:  # transformers' forward over the packed linears:
            self.packed.pack_all()  # packed now, not in the first step (the fused forward packs what it reads)

    def _configure_graphs(self, config, max_rows: int, pad_on_cpu: bool) -> None:
        """Decode padding, and the CUDA graphs replayed for its buckets (on CUDA)."""
        cuda = self.stream is not None
        wanted = cuda_graphs.graphs_requested(config.use_cuda_graph, config.q_padding_interval_size,
                                              config.kv_padding_interval_size, cuda)
        graphs = wanted and cuda
        if (graphs or pad_on_cpu) and self.kv.swa_layers:
            # a warning when asked for explicitly; by default (on CUDA) it is just the path taken
            log.log(logging.INFO if config.use_cuda_graph is None and not pad_on_cpu else logging.WARNING,
                    "acb: CUDA graphs are not used for hybrid sliding-window models yet (two page pools); "
                    "decode steps run eagerly")
            graphs = pad_on_cpu = False
        if wanted and not cuda and not pad_on_cpu:  # (a hybrid model on CUDA: said above)
            log.warning("acb: CUDA graphs need a CUDA device; on %s decode steps run eagerly and unpadded "
                        "(use_cuda_graph=%s, q_padding_interval_size=%d, kv_padding_interval_size=%d)",
                        self.device, config.use_cuda_graph, config.q_padding_interval_size,
                        config.kv_padding_interval_size)
        self.decode_padding = self.decode_graphs = None
        if graphs or pad_on_cpu:
            ps = self.kv.page_size
            self.decode_padding = cuda_graphs.DecodePadding(
                cuda_graphs.decode_buckets(max_rows, config.q_padding_interval_size),
                config.kv_padding_interval_size, ps, scratch_slot=self.kv.null_slot + ps - 1)
        self._graph_rows = max_rows if graphs else 0
        self._graph_kv_interval = config.kv_padding_interval_size
        self._build_graphs()

    def check_graphs(self, kv_interval: int = 0) -> bool:
        """The start-up self-check of ``decode_graphs``: a captured padding-only step must
        replay what the eager forward computes. On failure: a warning, and decode steps
        run eagerly and unpadded."""
        kv = self.kv
        why = self.decode_graphs.self_check(kv.num_pages, kv.null_slot + kv.page_size - 1, kv_interval)
        if why is None:
            return True
        log.warning("acb: CUDA graph self-check failed (%s); decode steps run eagerly", why)
        self.decode_graphs = self.decode_padding = None
        return False

    def _own_forward(self, module: torch.nn.Module):
        """The instance ``forward`` acb set on ``module`` (a prepacked linear's), or None."""
        entry = self.packed.layers.get(module) if self.packed is not None else None
        return entry.bound if entry is not None else None

    def _build_fused(self) -> None:
        """(Re)build the fused CPU forward over the model's current modules and weights."""
        if not self._want_fused:
            return
        from ..kernels.cpu import fused_kernels
        from ..model.fused import FusedForward
        from ..model.fused import why_not as fused_why_not

        def why_not(model, packed, kernels):
            return fused_why_not(model, packed, kernels, native=self._native_bf16())

        if int8_weights.is_quantized(self.model):
            FusedForward, why_not = int8_forward.Int8Forward, int8_forward.why_not_forward  # noqa: N806

        kernels = fused_kernels() if self.kernels else None
        self.sampling_kernels = kernels
        self.fused = FusedForward.build(self.model, self.packed, kernels, self.row_reduce,
                                        bf16_gemm=self.bf16_gemm) if self.fused_allowed else None
        self.varlen_forward = self.decode_forward = self.fused or self.model
        self.forward_path = "fused" if self.fused is not None else "transformers"
        self.forward_reason = "" if self.fused is not None else \
            "EngineConfig.cpu_fused_forward=False" if not self.fused_allowed else \
            "EngineConfig.cpu_kernels=False" if not self.kernels else why_not(self.model, self.packed, kernels)

    def _build_graphs(self) -> None:
        """(Re)create the CUDA-graph set (graphs are captured lazily, per bucket): a
        captured graph holds the weights' addresses of its capture."""
        self.decode_graphs = None
        if self._graph_rows and self.decode_padding is not None:  # (None: the self-check failed once)
            kv = self.kv
            self.decode_graphs = cuda_graphs.DecodeGraphs(self.decode_forward, kv.k_cache, kv.v_cache, kv.page_size,
                                                          self._graph_rows, self.model.config, self.stream,
                                                          self.attn_backend, generator=self.generator)
            with torch.inference_mode(), torch.cuda.stream(self.stream):
                self.check_graphs(self._graph_kv_interval)

    # ------------------------------------------------------------------ the model changing
    def check_model(self) -> tuple[str | None, bool]:
        """Before each step, on the engine's thread: (why the model's own forward must run
        this step, or None; whether the weights changed since the fast paths were built,
        in which case the step must carry ``refresh``). See :mod:`acb.model.watch`."""
        changed = self.watch.weights_changed()
        if changed:
            self.watch.snapshot_weights()
        return self.watch.hooked(), changed

    def refresh(self, everything: bool = False) -> None:
        """Rebuild the fast paths from the model's weights as they are now: repack the
        changed linears (all with ``everything``), rebuild the fused forward, drop the
        captured CUDA graphs. ``everything`` also takes the model's current module tree
        and hooks as the new reference (``Engine.reload_weights``)."""
        if self.packed is not None:
            self.packed.refresh(force=everything)
        self._build_fused()
        self._build_graphs()
        if everything:
            self.watch.snapshot()

    def release(self) -> None:
        """Give the model its own linears back and drop what holds the weights or the
        KV tensors' addresses."""
        self.decode_graphs = None  # they hold the cache's addresses
        if self.prepacked:
            from ..kernels import cpu_linear

            cpu_linear.release(self.model)
            self.packed = None
        self.fused = None  # it holds the packed weights
        self.varlen_forward = self.decode_forward = self.model

    # ------------------------------------------------------------------ per step
    def pad_decode(self, p: Packed) -> tuple[int, bool]:
        """The context width (tokens) of the step's decode rows, and whether the step was
        padded: a decode-only step is padded to a graph bucket when decode padding is on
        (not with forked choices: their rows share the leader's logits row)."""
        if self.decode_padding is not None and p.decode_q and not p.prefill_rows and len(p.keep) == len(p.decode_q):
            width = self.decode_padding.pad(p.tokens, p.positions, p.decode_q, p.lengths, p.table_rows)
            if width is not None:
                return width, True
        return max(p.lengths, default=0), False

    def forward_for(self, meta: StepAttention):
        """The forward that computes a step (not a graph's): the varlen one for a step
        with prefill rows, the decode one for the others."""
        return self.varlen_forward if meta.prefills else self.decode_forward

    def replay(self, step: StepInput, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor,
               meta: StepAttention) -> tuple[torch.Tensor | None, tuple | None] | None:
        """Run a padded decode-only step from its CUDA graph: (the kept rows' logits,
        None), or (None, (ids, logprobs)) when the graph sampled them too; padding rows'
        results dropped. None when no graph serves the step (it runs eagerly)."""
        decode = meta.decode
        # not when max_blocks_per_request sent the rows from the Triton kernel (what the
        # graphs replay) to PyTorch's path
        graphed = decode is not None and decode.padded and (meta.kernel != "triton" or decode.kernel == "triton")
        if not graphed or self.decode_graphs is None or not step.sampling.temperature:
            return None
        mode = cuda_graphs.sampling_mode(step.sampling)
        out = self.decode_graphs.run(input_ids, position_ids, meta, mode, self._graph_params(step, mode))
        if out is None:
            return None
        logits, ids, logprobs = out
        if logits is not None:
            return logits.index_select(0, keep), None
        return None, (ids.index_select(0, keep), logprobs.index_select(0, keep) if logprobs is not None else None)

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


def _native_bf16_cpu(bf16_gemm: bool) -> bool:
    """Whether bf16 has fast GEMMs on this CPU: oneDNN's native ones (what bf16 prepacking needs) or
    acb's (unless ``EngineConfig.cpu_bf16_gemm`` turns them off)."""
    from ..kernels import cpu_linear
    from ..model.fused import native_bf16

    return cpu_linear.available(torch.bfloat16) or native_bf16(bf16_gemm) is not None
