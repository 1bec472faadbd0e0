"""CUDA graphs for decode-only steps, and the padding that makes their shapes repeat.

A decode-only step has one query token per row, so its shapes are fixed by two numbers:
the rows and the width of the page table (pages of the longest context). Padding rounds
both up to buckets, and the runner replays one captured graph per bucket:

- rows: 1, 2, 4, ... (powers of two below ``q_padding_interval_size``), then multiples of
  the interval, up to ``max_requests_per_batch``;
- context: up to a multiple of ``kv_padding_interval_size`` tokens, in whole pages.
  Both intervals are in tokens, as in transformers' ``ContinuousBatchingConfig``; 0 picks
  :data:`DEFAULT_Q_INTERVAL` / :data:`DEFAULT_KV_INTERVAL`.

A padding row is token 0 at position 0, with a context of length 1 made of the runner's
zero page: it writes its key/value only to the *scratch slot* (the last slot of the zero
page, never read as a valid key) and reads the zero page's first slot, which stays zero.
Everything it computes is finite, it shares no key with a real row, and its logits are
dropped before sampling. So padding never changes a real row's token (the CPU test
forces padding without graphs and checks greedy parity).

Steps holding a prefill chunk, steps wider than :data:`MAX_GRAPH_KV_TOKENS`, and buckets
beyond :data:`MAX_GRAPHS` run eagerly. Sampling is captured with the forward (greedy and
sampled rows, temperature, top-k, top-p and logprobs; the bounds are static device inputs
loaded from pinned memory, the noise comes from the runner's generator registered with
the graph), one graph per (rows, context, sampling mode); a step holding a seeded row
samples eagerly after a forward-only graph, since each seeded row draws from its own
generator.

On CUDA graphs are on by default (``use_cuda_graph=None``); the runner first captures a
padding-only step and compares its replay with the eager forward (:meth:`DecodeGraphs.
self_check`), and falls back to eager steps with a warning if that fails.

Memory. Every graph replays into one shared memory pool plus one shared logits buffer
``[max rows, vocab]``; the pool holds the transient memory of the largest step captured
(dominated by one layer's gathered keys and values). The engine takes
:func:`graph_memory_reserve` (that footprint at the largest bucket and
``MAX_GRAPH_KV_TOKENS``) off the free memory before ``max_memory_percent`` sizes the
cache, and before each capture :meth:`DecodeGraphs.run` checks that the free memory
still covers twice the step's estimate (the pool plus the eager path's transients);
a bucket that does not fit runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import context
from ..attention import metadata as packing
from ..core.model_shape import ModelShape
from .sampling import MIN_TEMPERATURE, filter_top_k_top_p

log = logging.getLogger("acb")

DEFAULT_Q_INTERVAL = 16  # rows
DEFAULT_KV_INTERVAL = 512  # tokens
MAX_GRAPH_KV_TOKENS = 4096  # decode steps with a longer (padded) context run eagerly
MAX_GRAPHS = 256
PAD_TOKEN = 0


def graphs_requested(use_cuda_graph: bool | None, q_interval: int, kv_interval: int, cuda: bool = False) -> bool:
    """``use_cuda_graph`` True, or None (auto) on a CUDA device or with a padding interval
    set (as in transformers)."""
    if use_cuda_graph is None:
        return cuda or bool(q_interval or kv_interval)
    return use_cuda_graph


def decode_buckets(max_rows: int, q_interval: int = 0) -> list[int]:
    """Row counts a decode step is padded to: powers of two below the interval, then
    multiples of it, and always ``max_rows`` itself (the cap)."""
    interval = q_interval or DEFAULT_Q_INTERVAL
    buckets = []
    b = 1
    while b < min(interval, max_rows):
        buckets.append(b)
        b *= 2
    m = interval
    while m < max_rows:
        buckets.append(m)
        m += interval
    buckets.append(max_rows)
    return sorted(set(buckets))


def bucket_for(rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``rows``; None when there are more rows than the cap."""
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


def padded_kv_pages(length: int, kv_interval: int, page_size: int) -> int:
    """Pages covering ``length`` tokens rounded up to a multiple of the interval (tokens)."""
    interval = kv_interval or DEFAULT_KV_INTERVAL
    padded = -(-length // interval) * interval
    return -(-padded // page_size)


@dataclass(slots=True)
class DecodePadding:
    """How a decode-only step is padded; one per runner."""

    buckets: list[int]
    kv_interval: int  # tokens; 0 = DEFAULT_KV_INTERVAL
    page_size: int
    scratch_slot: int  # where padding rows write (never read as a valid key)

    def pad_rows(self, rows: int) -> int:
        """The rows a decode step of ``rows`` rows is padded to (its bucket)."""
        return bucket_for(rows, self.buckets) or rows

    def pad(self, tokens: list[int], positions: list[int], token_idx: list[int], lengths: list[int],
            table_rows: list[int]) -> int | None:
        """Append padding rows to a decode-only step's lists (one entry per row) up to the
        rows bucket; return the padded context width in tokens (whole pages), or None
        (nothing changed) when the rows exceed the last bucket. A padding row reads the
        empty block-table row (-1: the zero page) and writes ``scratch_slot`` (the runner
        places it: see ``ModelRunner._slots``)."""
        rows = bucket_for(len(lengths), self.buckets)
        if rows is None:
            return None
        for _ in range(rows - len(lengths)):
            token_idx.append(len(tokens))
            tokens.append(PAD_TOKEN)
            positions.append(0)
            lengths.append(1)
            table_rows.append(-1)
        return padded_kv_pages(max(lengths), self.kv_interval, self.page_size) * self.page_size


def decode_step_bytes(config, dtype: torch.dtype, rows: int, kv_tokens: int) -> int:
    """An upper estimate of one eager decode step's transient device memory: one layer's
    gathered keys and values and attention scores (the PyTorch decode path), the
    per-token activations, and the logits (model dtype, then float32 for sampling)."""
    s = ModelShape.of(config)
    e = dtype.itemsize
    gathered = 2 * s.kv_heads * rows * kv_tokens * s.head_dim * e
    scores = 3 * s.heads * rows * kv_tokens * max(e, 4)  # scores, masked, softmax
    activations = rows * (4 * s.hidden + 3 * s.intermediate) * e
    logits = rows * s.vocab * (e + 4)
    return gathered + scores + activations + logits


def graph_memory_reserve(model_config, dtype: torch.dtype, engine_config, cuda: bool = False) -> int:
    """Device memory the engine leaves out of the KV cache for CUDA graphs: the pool at
    the largest bucket and :data:`MAX_GRAPH_KV_TOKENS`, plus the shared logits buffer.
    0 when the engine config does not ask for graphs (on a CUDA device when ``cuda``)."""
    c = engine_config
    if c.tensor_parallel_size > 1:  # tensor-parallel ranks run decode steps eagerly
        return 0
    if not graphs_requested(c.use_cuda_graph, c.q_padding_interval_size, c.kv_padding_interval_size, cuda):
        return 0
    max_rows = c.max_requests_per_batch or 256  # the engine's default cap
    vocab = ModelShape.of(model_config).vocab
    return decode_step_bytes(model_config, dtype, max_rows, MAX_GRAPH_KV_TOKENS) + max_rows * vocab * dtype.itemsize


def sampling_mode(batch) -> str | None:
    """How a decode step's sampling is captured: ``greedy`` or ``sample`` (+ ``+logprobs``);
    None when the graph holds the forward only (a seeded row, logit processors or top
    logprobs: sampled eagerly after)."""
    if (not batch.temperature or any(seed is not None for seed in batch.seeds) or batch.controls is not None
            or batch.top_logprobs):
        return None
    sampled = any(t >= MIN_TEMPERATURE for t in batch.temperature)
    return ("sample" if sampled else "greedy") + ("+logprobs" if batch.want_logprobs else "")


def graph_sample(logits: torch.Tensor, params: torch.Tensor, mode: str, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling without host values (capturable): ``params`` ``[3, rows]`` holds each row's
    temperature, top-k and top-p (float32). Same rules as :func:`acb.worker.sampling.sample`:
    below MIN_TEMPERATURE greedy, else the exponential race over the top-k / top-p
    filtered softmax; logprobs of the chosen ids under the unscaled logits. Returns
    (ids, logprobs) (logprobs empty unless the mode asks for them)."""
    logits = logits.float()
    ids = logits.argmax(dim=-1)
    if mode.startswith("sample"):
        temperature, top_k, top_p = params[0], params[1].long(), params[2]
        greedy = temperature < MIN_TEMPERATURE
        scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
        vocab = logits.shape[1]
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        probs = torch.softmax(filter_top_k_top_p(scaled, k, top_p), dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        ids = torch.where(greedy, ids, (probs / noise).argmax(dim=-1))
    if mode.endswith("+logprobs"):
        return ids, torch.log_softmax(logits, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    return ids, logits.new_empty(0)


@dataclass(slots=True)
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor  # [rows] static inputs, copied in before each replay
    positions: torch.Tensor
    slots: torch.Tensor
    pages: torch.Tensor  # [rows, pages]
    lengths: torch.Tensor
    key_pos: torch.Tensor  # [1, pages * page_size], constant
    token_idx: torch.Tensor  # [rows] arange, constant
    params: torch.Tensor  # [3, rows] temperature, top-k, top-p (sampling modes)
    mode: str | None  # sampling_mode(); None: the forward only, into the shared logits


class DecodeGraphs:
    """Captured decode steps (CUDA only), one graph per (rows, pages, sampling mode)
    bucket, captured the first time the bucket is seen and replayed after. All graphs
    share one memory pool and one output buffer each for logits, ids and logprobs, which
    is safe because steps replay one after another on the runner's stream and each
    step's outputs are consumed (copied or sampled) on that stream before the next
    replay. The graphs hold the addresses of the KV cache: drop them with the cache."""

    def __init__(self, forward, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], page_size: int,
                 max_rows: int, config, stream, kernel: str = "torch", generator=None) -> None:
        self.forward = forward
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.page_size = page_size
        self.max_rows = max_rows
        self.config = config  # the model config, for memory estimates
        self.stream = stream
        self.kernel = kernel  # the runner's kernel path (acb.attention.selector.KERNEL_PATHS), replayed
        self.generator = generator  # sampled rows' noise
        self.pool = None  # one memory pool for every graph, made at the first capture
        self.graphs: dict[tuple[int, int, str | None], _Graph] = {}
        self.skipped: set[tuple[int, int]] = set()
        self.logits: torch.Tensor | None = None
        self.ids_out: torch.Tensor | None = None
        self.logprobs_out: torch.Tensor | None = None
        self.failed = False

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: packing.StepAttention,
            mode: str | None = None, params: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """Replay a padded decode-only step from its graph (captured now if new): with a
        sampling ``mode`` (and its ``params`` on the device, ``[3, rows]``) the sampled
        ids and logprobs ``[rows]`` (logits None), without one the logits ``[rows, vocab]``
        (ids None). None when the step should run eagerly instead."""
        rows, width = meta.pool.decode_pages.shape
        key = (rows, width, mode)
        g = self.graphs.get(key)
        if g is None:
            if self.failed or (rows, width) in self.skipped or not self._may_capture(rows, width):
                self.skipped.add((rows, width))
                return None
            g = self._capture(key, input_ids, position_ids, meta, params)
            if g is None:
                return None
        else:
            self._load(g, input_ids, position_ids, meta, params)
            g.graph.replay()
        if mode is None:
            return self.logits[:rows], None, None
        return None, self.ids_out[:rows], self.logprobs_out[:rows] if mode.endswith("+logprobs") else None

    def self_check(self, null_page: int, scratch_slot: int, kv_interval: int) -> str | None:
        """Capture a one-row, padding-only step (token 0 at position 0 writing only the
        scratch slot, reading the zero page) and compare its replay with the same step
        run eagerly. None when they agree, else what went wrong (the capture is dropped)."""
        dev = self.k_cache[0].device
        width = padded_kv_pages(1, kv_interval, self.page_size)
        one = torch.ones(1, dtype=torch.long, device=dev)
        meta = self._decode_step(one * scratch_slot, torch.full((1, width), null_page, device=dev), one, one * 0)
        ids = torch.full((1,), PAD_TOKEN, dtype=torch.long, device=dev)
        positions = torch.zeros(1, dtype=torch.long, device=dev)
        try:
            out = self.run(ids, positions, meta)
            if out is None:
                return "the capture failed" if self.failed else "the first bucket was not captured"
            replayed = out[0].float().clone()
            eager = self._body(self.graphs[(1, width, None)]).float()
            err = (replayed - eager).abs().max().item()
            if not err <= 1e-3 * (1.0 + eager.abs().max().item()):
                return f"the replayed logits differ from the eager ones by {err:.3g}"
        except Exception as e:  # unverified hardware paths fail soft
            return repr(e)
        finally:
            if self.failed or self.graphs.get((1, width, None)) is None:
                self.graphs.clear()
        return None

    def _may_capture(self, rows: int, width: int) -> bool:
        kv_tokens = width * self.page_size
        if kv_tokens > MAX_GRAPH_KV_TOKENS or len(self.graphs) >= MAX_GRAPHS:
            return False
        dtype = self.k_cache[0].dtype
        free = self._free_memory()
        if free < 2 * decode_step_bytes(self.config, dtype, rows, kv_tokens):
            log.info("acb: no CUDA graph for decode bucket (%d rows, %d tokens): %.2f GiB free is too little",
                     rows, kv_tokens, free / 2**30)
            return False
        return True

    def _decode_step(self, slots: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor, token_idx: torch.Tensor,
                     key_pos: torch.Tensor | None = None) -> packing.StepAttention:
        """A decode-only step's metadata over device tensors (a graph's static inputs: no
        host value depends on the step)."""
        decode = packing.DecodeRows.build(token_idx, lengths, pages.shape[1] * self.page_size, self.kernel,
                                            padded=True, key_pos=key_pos)
        pool = packing.PagePool(self.k_cache, self.v_cache, slots, pages)
        return packing.StepAttention(self.kernel, self.page_size, pool, decode)

    # The three CUDA calls, as methods so a CPU test can stand in for them.
    def _free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.k_cache[0].device)[0]

    def _new_graph(self):
        return torch.cuda.CUDAGraph()

    def _record(self, graph, work) -> None:
        """Capture ``work`` into ``graph`` (recorded, not run). thread_local: the event
        loop's thread may query CUDA events meanwhile. The runner's generator is
        registered so each replay draws fresh noise."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            work()

    @staticmethod
    def _load(g: _Graph, input_ids, position_ids, meta: packing.StepAttention, params) -> None:
        g.ids.copy_(input_ids)
        g.positions.copy_(position_ids)
        g.slots.copy_(meta.pool.slot_mapping)
        g.pages.copy_(meta.pool.decode_pages)
        g.lengths.copy_(meta.decode.lengths)
        if params is not None:
            g.params.copy_(params)

    def _body(self, g: _Graph) -> torch.Tensor:
        """The captured forward: the step's metadata derived from the static inputs on the
        device (no host value depends on the step), then the model."""
        meta = self._decode_step(g.slots, g.pages, g.lengths, g.token_idx, g.key_pos)
        out = context.run(self.forward, context.ForwardContext(meta), input_ids=g.ids.unsqueeze(0),
                          position_ids=g.positions.unsqueeze(0), attention_mask=None, use_cache=False,
                          logits_to_keep=0)
        return out.logits[0]

    def _step(self, g: _Graph) -> None:
        """The whole captured step: forward, then sampling into the shared outputs (or
        the logits, for the forward-only mode)."""
        rows = g.ids.shape[0]
        logits = self._body(g)
        if g.mode is None:
            self.logits[:rows].copy_(logits)
            return
        ids, logprobs = graph_sample(logits, g.params, g.mode, self.generator)
        self.ids_out[:rows].copy_(ids)
        if logprobs.numel():
            self.logprobs_out[:rows].copy_(logprobs)

    def _capture(self, key, input_ids, position_ids, meta, params) -> _Graph | None:
        rows, width, mode = key
        dev = input_ids.device
        try:
            g = _Graph(
                graph=self._new_graph(),
                ids=torch.zeros(rows, dtype=torch.long, device=dev),
                positions=torch.zeros(rows, dtype=torch.long, device=dev),
                slots=torch.zeros(rows, dtype=torch.long, device=dev),
                pages=torch.zeros(rows, width, dtype=torch.long, device=dev),
                lengths=torch.ones(rows, dtype=torch.long, device=dev),
                key_pos=torch.arange(width * self.page_size, device=dev).unsqueeze(0),
                token_idx=torch.arange(rows, device=dev),
                params=torch.zeros(3, rows, dtype=torch.float32, device=dev),
                mode=mode,
            )
            self._load(g, input_ids, position_ids, meta, params)
            # Warm-up, eagerly on the runner's stream: lazy initialisation (cuBLAS
            # workspaces, Triton compilation) must not happen inside the capture. It
            # computes this step; the replay below writes the same keys and values again.
            warm = self._body(g)
            if self.logits is None:
                self.logits = torch.empty(self.max_rows, warm.shape[-1], dtype=warm.dtype, device=dev)
                self.ids_out = torch.zeros(self.max_rows, dtype=torch.long, device=dev)
                self.logprobs_out = torch.zeros(self.max_rows, dtype=torch.float32, device=dev)
            if mode is not None:
                graph_sample(warm, g.params, mode, self.generator)  # its kernels' lazy setup too
            del warm
            self._record(g.graph, lambda: self._step(g))
            g.graph.replay()
        except Exception as e:  # unverified hardware paths fail soft: eager from now on
            self.failed = True
            log.warning("acb: CUDA graph capture failed for decode bucket (%d rows, %d pages, sampling %s); decode "
                        "steps run eagerly from now on: %r", rows, width, mode or "outside", e)
            return None
        self.graphs[key] = g
        log.info("acb: captured a CUDA graph for decode bucket (%d rows, %d tokens, sampling %s); %d graphs",
                 rows, width * self.page_size, mode or "outside", len(self.graphs))
        return g
