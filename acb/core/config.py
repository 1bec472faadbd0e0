"""``EngineConfig``: how the engine uses the hardware (memory, scheduling, kernels,
placement). It validates at construction and raises ``ValueError`` naming the field. The
model side, ``SamplingParams``, is :mod:`acb.core.sampling_params`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .checks import is_int, is_number

# The values a str field may take (its checks below; acb serve's flags offer them as choices)
CHOICES: dict[str, tuple[str, ...]] = {
    "scheduler": ("fifo", "prefill_first", "priority"),
    "attn_backend": ("auto", "native", "torch", "triton", "flash_attn"),  # acb.attention.selector.BACKENDS
    "dtype": ("auto", "float32", "float16", "bfloat16"),
    "quantization": ("int8", "gguf"),
    "kv_cache_dtype": ("auto", "int8"),
    "speculative_method": ("ngram", "draft"),
}
_SCHEDULERS = CHOICES["scheduler"]
_ATTN_BACKENDS = CHOICES["attn_backend"]


@dataclass(frozen=True)
class EngineConfig:  # ~330 lines: its fields (each with its docstring), and one check per field (__post_init__)
    """How the engine uses the hardware: memory, scheduling and kernels.

    ``None`` means "choose for the device". Example::

        config = acb.EngineConfig(max_batch_tokens=1024, num_blocks=512)

    Active: ``page_size`` (default 16), ``num_blocks`` / ``max_memory_percent`` (cache size;
    default half the free device memory, or available RAM on CPU, allocated lazily on CPU),
    ``max_batch_tokens`` (default 2048 on CPU, 8192 on GPU), ``max_requests_per_batch``
    (default 256), ``scheduler``, ``safety_margin``, ``allow_prefix_sharing``,
    ``async_batching``, ``attn_backend`` (``auto`` | ``native`` | ``torch`` | ``triton`` |
    ``flash_attn``: ``auto`` is Triton on CUDA, native on CPU (float32, bfloat16, float16), PyTorch otherwise; the
    engine refuses a backend that cannot run where it is, see ``acb.attention.selector.resolve_backend``), ``device``,
    ``dtype`` (``float32`` | ``bfloat16`` | ``float16`` | ``auto``; a model object is cast to it,
    ``auto`` keeps its dtype, and ``from_pretrained`` loads the checkpoint's own dtype, as
    transformers' ``dtype="auto"``; ``None``: a model object keeps its dtype, while ``from_pretrained``
    loads bfloat16 on CUDA and on CPUs with native bf16 (AVX-512 BF16 or AMX, as vLLM does),
    float32 on other CPUs, and logs which, the checkpoint's own dtype and how to change it; see docs/performance.md for
    what bf16 costs in accuracy), ``debug_checks`` (integrity check whenever the engine goes idle),
    ``cpu_offload_space`` (GiB of host memory that preempted requests' KV pages go to, so
    they resume without recompute; 0 = recompute, None = the cap, 80 % of available RAM).
    ``kv_disk_path`` / ``kv_disk_space`` (None / 10 GiB): the prefix cache's disk tier, pages kept
    in files that later requests and later processes load instead of computing (docs/kv_disk.md).

    ``compile_level`` 0-3 wraps the forward in ``torch.compile`` (0 off; 1 default mode,
    dynamic; 2 max-autotune-no-cudagraphs, dynamic; 3 the same, static);
    ``varlen_compile_level`` / ``decode_compile_level`` (None: ``compile_level``) override it
    for steps holding a prefill chunk and for decode-only steps. ``use_cuda_graph`` (None:
    on for CUDA devices once a start-up self-check passes, and when a padding interval is
    set) replays whole decode-only steps, sampling included, from CUDA graphs, padded to
    buckets of ``q_padding_interval_size`` rows and ``kv_padding_interval_size`` context
    tokens (0: a default); CUDA only: on CPU, True or a padding interval logs a warning and
    decode steps run eagerly.
    ``max_blocks_per_request`` bounds the block table of the decode fast path (the native CPU
    kernel or the Triton kernel, both reading pages in place): a step whose decode rows span
    more pages runs the PyTorch decode path; 0 turns the fast path off; None (default) sets
    no bound.

    ``max_waiting_requests`` bounds the requests queued and not yet running (None: four
    times ``max_requests_per_batch``): beyond it ``submit``, ``stream`` and ``generate``
    raise ``acb.EngineOverloadedError`` at once and queue nothing (``generate_batch`` when
    the queue is already full).

    ``scheduler="priority"`` admits waiting requests by ``SamplingParams.priority`` (lower
    first), then arrival, and preempts the least urgent running request first, never one
    more urgent than the request that needs the room. ``priority_aging_steps`` bounds
    starvation: a request is ranked as if it had arrived ``priority * priority_aging_steps``
    engine steps after it did, so a later, more urgent request overtakes it only if it
    arrives within that many steps per priority level of difference (0: no aging, strict
    priority, a flood of urgent work can starve less urgent work for ever). See
    docs/design.md, "Scheduling".

    ``kv_events`` (False): publish the prefix cache's events (``BlockStored``,
    ``BlockRemoved``, ``AllBlocksCleared``) to ``engine.kv_events()`` subscribers.

    Speculative decoding (docs/speculative.md): ``speculative_method`` (None = off;
    ``"ngram"``: each decode row proposes up to ``num_speculative_tokens`` (4) tokens by
    matching its last ``prompt_lookup_max``..``prompt_lookup_min`` (4..2) tokens against its
    prompt and output, and the same step verifies them; ``"draft"``: ``draft_model``, a
    smaller model sharing the tokenizer (a folder or a model object, with its own paged
    cache), proposes them greedily). Lossless: greedy output is unchanged and sampled
    output keeps its distribution. A request opts out with ``SamplingParams(speculative=False)``.

    Structured outputs: ``grammar_compile_timeout_s`` (30.0; None = no bound) is how long a
    request waits for its ``json_schema`` / ``regex`` / ``choice`` grammar to compile (on a
    worker thread, off the event loop) before it is refused with ``InvalidRequestError``
    naming the field (400 from ``acb serve``); the compile itself runs to its end and is
    cached. ``grammar_cache_size`` (256; 0 = none) bounds the compiled grammars kept, by
    canonical schema / regex / choice text, least recently used first out.

    LoRA adapters (``Engine.load_adapter``): ``max_adapters`` (4; 0 = none) adapters loaded at
    once, each of rank at most ``max_adapter_rank`` (16). The stacked A/B buffers they need,
    ``max_adapters * max_adapter_rank * (in + out)`` values per target projection, are
    allocated when the first adapter loads. Adapters need a single rank, ``compile_level=0``
    and no ``quantization``: ``load_adapter`` refuses the others naming the setting.

    CPU kernels (each True by default; False turns the piece off, for A/B measurements and
    bisecting; the environment variables ``ACB_CPU_KERNEL=0``, ``ACB_CPU_PREPACK=0``,
    ``ACB_CPU_FUSED=0`` and ``ACB_CPU_BF16_GEMM=0`` override them to False, see
    ``acb.core.defaults``): ``cpu_kernels``
    builds and uses acb's native CPU kernels (paged attention reading pages in place, the fused
    forward's norm/RoPE/activation kernels; off: the ``torch`` attention backend, no fused
    forward); ``cpu_prepack`` prepacks the linear layers' weights for oneDNN (off: PyTorch's
    own linears, so no fused forward either); ``cpu_fused_forward`` runs acb's fused CPU
    forward in place of transformers' (off: transformers' forward over acb's paged attention);
    ``cpu_bf16_gemm`` computes a bfloat16 model's fused forward with acb's own bf16 GEMMs
    (``acb/kernels/csrc/bf16_cpu.cpp``: AVX-512 BF16, or AVX2 widening the weights; a float32 residual
    stream between them) where they are built (off: oneDNN's prepacked bf16 linears, with bf16
    outputs and residual stream, where oneDNN has native bf16; else transformers' forward). It
    acts on bfloat16 models on the CPU without ``quantization`` (the int8 forward's bf16
    ``lm_head`` takes acb's bf16 GEMM wherever it is built); elsewhere False is named inactive.
    ``quantization="int8"`` needs the first three.

    ``kv_cache_dtype`` (named as vLLM's): None or ``"auto"`` store the KV pages in the model's
    dtype; ``"int8"`` stores each key/value row (one token, one kv head) as int8 with its own
    float32 scale, ``head_dim + 4`` bytes, so about twice the pages of a bf16 cache fit the
    same memory (the sizing counts the scales), and decode steps read fewer bytes (faster where
    attention is much of a step: +15-24 % beside ``quantization="int8"`` on 2026-12-04). Written
    quantized (keys rotated by a Walsh-Hadamard matrix first, queries alike: ``acb.attention.kv_quant``),
    read by acb's native CPU attention kernels in float32; it costs accuracy (SmolLM2 top-1
    agreement with float32 99.05 -> 98.40 % beside bf16 weights, 97.53 -> 97.22 % beside int8),
    so it is never on unless asked for. The engine refuses it, naming it, where
    those kernels do not run (CUDA, ``attn_backend="torch"``, ``cpu_kernels=False``,
    ``tensor_parallel_size > 1``). Accuracy: docs/performance.md.

    A setting that has no effect where the engine runs (the CUDA-graph settings on the
    CPU, say) is named by :func:`acb.engine.settings.inactive_settings`, and the engine logs a
    warning naming it at construction.
    """

    # Each field's docstring (the string under it) is its one-line reference: `acb serve --help`
    # prints it (acb.serving.engine_flags), as the API reference does.
    page_size: int | None = None
    """Tokens per KV page (None: 16)."""
    num_blocks: int | None = None
    """KV cache pages (None: sized by max_memory_percent)."""
    max_memory_percent: float = 0.5
    """Share of the free device memory (available RAM on the CPU) the KV cache may take, in (0, 1]."""
    max_batch_tokens: int | None = None
    """Tokens one forward pass computes (None: 2048 on the CPU, 8192 on a GPU)."""
    max_requests_per_batch: int | None = None
    """Requests (rows) one step holds (None: 256)."""
    scheduler: str = "fifo"
    """Admission order: fifo, prefill_first, or priority (by the requests' priority, lower first)."""
    safety_margin: float | None = None
    """Share of the KV pages held back from new prefills, in [0, 1) (None: 0.15)."""
    allow_prefix_sharing: bool = True
    """Prefix caching: requests share the KV pages of a common prompt prefix."""
    cpu_offload_space: float | None = 0.0
    """GiB of host memory preempted requests' KV pages go to, so they resume without recompute
    (0: recompute; None: the cap, 80 % of available RAM)."""
    kv_disk_path: str | None = None
    """A directory for the prefix cache's disk tier: full prompt pages are written there in the background and
    reused by later requests and later processes (None: off; docs/kv_disk.md)."""
    kv_disk_space: float = 10.0
    """GiB the disk tier's page files may take in kv_disk_path (least recently used deleted first)."""
    use_cuda_graph: bool | None = None
    """Replay decode-only steps from CUDA graphs (CUDA only; None: on once a start-up self-check passes)."""
    q_padding_interval_size: int = 0
    """CUDA graphs: rows are padded to buckets of this many (0: a default)."""
    kv_padding_interval_size: int = 0
    """CUDA graphs: context tokens are padded to buckets of this many (0: a default)."""
    async_batching: bool = True
    """Plan step N+1 while step N computes."""
    compile_level: int = 0
    """torch.compile the forward: 0 off; 1 default mode, dynamic; 2 max-autotune-no-cudagraphs, dynamic;
    3 the same, static."""
    max_blocks_per_request: int | None = None
    """Widest block table (pages) the decode fast path serves; wider steps take the PyTorch path
    (0: fast path off; None: no bound)."""
    attn_backend: str = "auto"
    """Attention: native, torch, triton or flash_attn (auto: Triton on CUDA, native on the CPU)."""
    device: str | None = None
    """Torch device, e.g. cpu or cuda:0 (None: cuda if available, else cpu)."""
    dtype: str | None = None
    """Weights dtype: float32, bfloat16, float16, or auto (the checkpoint's own) (None: bfloat16 on CUDA
    and CPUs with native bf16, else float32)."""
    debug_checks: bool = False
    """Check the KV cache's integrity whenever the engine goes idle (slow; for debugging)."""
    fault_hook: Any = field(default=None, repr=False, compare=False)
    """A callable run at each step stage (fault injection in tests)."""
    varlen_compile_level: int | None = None
    """compile_level for steps holding a prefill chunk (None: compile_level)."""
    decode_compile_level: int | None = None
    """compile_level for decode-only steps (None: compile_level)."""
    tensor_parallel_size: int = 1
    """Shard the model over this many ranks (acb starts the others: gloo on the CPU, NCCL on CUDA)."""
    distributed_timeout_s: float = 120.0
    """Seconds the tensor-parallel ranks wait for each other."""
    max_waiting_requests: int | None = None
    """Requests queued beyond the running batch before new ones are refused (EngineOverloadedError;
    429 with Retry-After from acb serve) (None: 4 x max_requests_per_batch)."""
    priority_aging_steps: int = 5000
    """scheduler=priority: engine steps per priority level a waiting request ages by (0: no aging)."""
    kv_events: bool = False
    """Publish the prefix cache's events (BlockStored, BlockRemoved, AllBlocksCleared) to engine.kv_events()
    (acb serve: GET /v1/kv_events, as server-sent events)."""
    grammar_compile_timeout_s: float | None = 30.0
    """Seconds a request waits for its structured-output grammar to compile before it is refused (400);
    it compiles off the event loop either way (None: no bound)."""
    grammar_cache_size: int = 256
    """Compiled grammars kept, least recently used first out (0: none)."""
    quantization: str | None = None
    """int8: int8 weights and activations per 64 channels, smoothed, Hadamard-rotated, bf16 lm_head (CPU);
    gguf: a GGUF file's 4-8 bit blocks run at their own widths on acb's kernels (CPU; docs/gguf.md)."""
    kv_cache_dtype: str | None = None
    """int8: KV pages in int8 with a float32 scale per token and kv head, ~2x the pages of bf16 (acb's
    native CPU attention only); auto: the model's dtype (None: auto)."""
    max_adapters: int = 4
    """LoRA adapters loaded at once (0: none)."""
    max_adapter_rank: int = 16
    """The highest LoRA rank an adapter may have."""
    cpu_kernels: bool = True
    """acb's native CPU kernels (paged attention, the fused forward's ops); off: torch attention, no
    fused forward."""
    cpu_prepack: bool = True
    """oneDNN-prepacked linear weights on the CPU; off: PyTorch's own linears, no fused forward."""
    cpu_fused_forward: bool = True
    """acb's fused CPU forward in place of transformers' (float32, bfloat16, int8)."""
    cpu_bf16_gemm: bool = True
    """A bfloat16 model's fused CPU forward on acb's own bf16 GEMMs (float32 residual stream); off:
    oneDNN's prepacked bf16 linears."""
    speculative_method: str | None = None
    """Speculative decoding (docs/speculative.md): ngram (proposals found in the prompt and output) or
    draft (draft_model proposes them) (None: off)."""
    num_speculative_tokens: int = 4
    """The most proposals a row carries per step (the cost model may choose fewer), 1..64."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix (tokens) matched in the prompt and output."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix, tried first."""
    draft_model: Any = field(default=None, repr=False, compare=False)
    """speculative_method=draft: a model folder (or model object) sharing the model's tokenizer."""
    max_embedding_tokens: int | None = None
    """Embedding prompt tokens one step computes, beside generation or not (None: max_batch_tokens / 32)."""

    def __post_init__(self) -> None:  # long: one check per field, in field order; not on a hot path
        def bad(name: str, why: str) -> None:
            raise ValueError(f"EngineConfig.{name} {why}, got {getattr(self, name)!r}")

        if self.page_size is not None and (not is_int(self.page_size) or self.page_size < 4):
            bad("page_size", "must be an int >= 4")
        if self.num_blocks is not None and (not is_int(self.num_blocks) or self.num_blocks < 1):
            bad("num_blocks", "must be an int >= 1")
        if not is_number(self.max_memory_percent) or not 0 < self.max_memory_percent <= 1:
            bad("max_memory_percent", "must be in (0, 1]")
        if self.max_batch_tokens is not None and (
            not is_int(self.max_batch_tokens) or self.max_batch_tokens < 1
        ):
            bad("max_batch_tokens", "must be an int >= 1")
        if self.max_requests_per_batch is not None and (
            not is_int(self.max_requests_per_batch) or self.max_requests_per_batch < 1
        ):
            bad("max_requests_per_batch", "must be an int >= 1")
        if self.scheduler not in _SCHEDULERS:
            bad("scheduler", f"must be one of {_SCHEDULERS}")
        if self.safety_margin is not None and (
            not is_number(self.safety_margin) or not 0 <= self.safety_margin < 1
        ):
            bad("safety_margin", "must be in [0, 1)")
        if not isinstance(self.allow_prefix_sharing, bool):
            bad("allow_prefix_sharing", "must be a bool")
        if self.cpu_offload_space is not None and (
            not is_number(self.cpu_offload_space) or self.cpu_offload_space < 0
        ):
            bad("cpu_offload_space", "must be None or a number of GiB >= 0")
        if self.kv_disk_path is not None and (not isinstance(self.kv_disk_path, str) or not self.kv_disk_path):
            bad("kv_disk_path", "must be None or a directory path (str)")
        if not is_number(self.kv_disk_space) or not 0 < self.kv_disk_space < math.inf:
            bad("kv_disk_space", "must be a finite number of GiB > 0")
        if self.kv_disk_path is not None and self.tensor_parallel_size > 1:
            bad("kv_disk_path", "must be None with tensor_parallel_size > 1 (each rank holds part of a page)")
        if self.kv_disk_path is not None and self.speculative_method == "draft":
            bad("kv_disk_path", "must be None with speculative_method='draft' (the draft model's pages are not saved)")
        if self.use_cuda_graph is not None and not isinstance(self.use_cuda_graph, bool):
            bad("use_cuda_graph", "must be None or a bool")
        for name in ("q_padding_interval_size", "kv_padding_interval_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                bad(name, "must be an int >= 0")
        if not isinstance(self.async_batching, bool):
            bad("async_batching", "must be a bool")
        if not is_int(self.compile_level) or not 0 <= self.compile_level <= 3:
            bad("compile_level", "must be an int in 0..3")
        for name in ("varlen_compile_level", "decode_compile_level"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= 3):
                bad(name, "must be None or an int in 0..3")
        if self.max_blocks_per_request is not None and (
            not is_int(self.max_blocks_per_request) or self.max_blocks_per_request < 0
        ):
            bad("max_blocks_per_request", "must be None or an int >= 0")
        if self.attn_backend not in _ATTN_BACKENDS:
            bad("attn_backend", f"must be one of {_ATTN_BACKENDS}")
        if self.device is not None and not isinstance(self.device, str):
            bad("device", "must be None or a device string such as 'cpu' or 'cuda:0'")
        if not is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            bad("tensor_parallel_size", "must be an int >= 1")
        if not is_number(self.distributed_timeout_s) or not 0 < self.distributed_timeout_s < math.inf:
            bad("distributed_timeout_s", "must be a finite number of seconds > 0")
        if self.tensor_parallel_size > 1:
            if self.compile_level or self.varlen_compile_level or self.decode_compile_level:
                bad("compile_level", "must be 0 with tensor_parallel_size > 1 (torch.compile is not used across "
                    "ranks yet)")
            if self.use_cuda_graph:
                bad("use_cuda_graph", "must not be True with tensor_parallel_size > 1 (decode steps run eagerly)")
        if self.dtype is not None and self.dtype not in CHOICES["dtype"]:
            bad("dtype", "must be None, 'auto', 'float32', 'float16' or 'bfloat16'")
        for name in ("max_waiting_requests", "max_embedding_tokens"):
            if getattr(self, name) is not None and (not is_int(getattr(self, name)) or getattr(self, name) < 1):
                bad(name, "must be None or an int >= 1")
        if not isinstance(self.kv_events, bool):
            bad("kv_events", "must be a bool")
        timeout = self.grammar_compile_timeout_s
        if timeout is not None and (not is_number(timeout) or not 0 < timeout < math.inf):
            bad("grammar_compile_timeout_s", "must be None or a finite number of seconds > 0")
        if not is_int(self.grammar_cache_size) or self.grammar_cache_size < 0:
            bad("grammar_cache_size", "must be an int >= 0 (0 = no cache)")
        for name in ("cpu_kernels", "cpu_prepack", "cpu_fused_forward", "cpu_bf16_gemm"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a bool")
        if not is_int(self.priority_aging_steps) or self.priority_aging_steps < 0:
            bad("priority_aging_steps", "must be an int >= 0 (0 = no aging)")
        if not is_int(self.max_adapters) or self.max_adapters < 0:
            bad("max_adapters", "must be an int >= 0 (0 = no LoRA adapters)")
        if not is_int(self.max_adapter_rank) or self.max_adapter_rank < 1:
            bad("max_adapter_rank", "must be an int >= 1")
        if self.quantization is not None:
            if self.quantization not in CHOICES["quantization"]:
                bad("quantization", "must be None, 'int8' or 'gguf'")
            if self.tensor_parallel_size > 1:
                bad("quantization", "must be None with tensor_parallel_size > 1 (the ranks shard dense weights)")
            if not (self.cpu_kernels and self.cpu_fused_forward):
                bad("quantization", "needs cpu_kernels and cpu_fused_forward: int8 runs on acb's fused CPU forward "
                    "only (ACB_CPU_KERNEL=0 / ACB_CPU_FUSED=0 in the environment turn them off)")
            if self.compile_level or self.varlen_compile_level or self.decode_compile_level:
                bad("quantization", "must be None with compile_level > 0 (int8 runs acb's fused forward, which "
                    "torch.compile does not trace)")
        if self.kv_cache_dtype not in (None, *CHOICES["kv_cache_dtype"]):
            bad("kv_cache_dtype", "must be None, 'auto' (the model's dtype) or 'int8'")
        if self.kv_cache_dtype == "int8" and self.tensor_parallel_size > 1:
            bad("kv_cache_dtype", "must not be 'int8' with tensor_parallel_size > 1 (int8 pages are read by the "
                "native CPU kernels of a single process)")
        self._check_speculative(bad)

    def _check_speculative(self, bad: Any) -> None:
        """speculative_method and its settings (docs/speculative.md)."""
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1)):
            if not is_int(getattr(self, name)) or getattr(self, name) < low:
                bad(name, f"must be an int >= {low}")
        if self.num_speculative_tokens > 64:
            bad("num_speculative_tokens", "must be <= 64 (proposals per row and step)")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            bad("prompt_lookup_max", f"must be >= prompt_lookup_min ({self.prompt_lookup_min})")
        method = self.speculative_method
        if method is None:
            if self.draft_model is not None:
                bad("draft_model", "needs speculative_method='draft'")
            return
        if method not in CHOICES["speculative_method"]:
            bad("speculative_method", "must be None, 'ngram' or 'draft'")
        if method == "draft" and self.draft_model is None:
            bad("draft_model", "must be set (a model folder or a model object sharing the model's tokenizer) with "
                "speculative_method='draft'")
        if method != "draft" and self.draft_model is not None:
            bad("draft_model", "is only for speculative_method='draft'")
        if self.tensor_parallel_size > 1:
            bad("speculative_method", "must be None with tensor_parallel_size > 1 (the ranks' step message does "
                "not carry proposals yet)")
