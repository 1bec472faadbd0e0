"""How an engine is put together: where and in what dtype the model runs
(``resolve_load`` decides it for a model ``Engine.from_pretrained`` loads; ``place``
moves / casts a model object handed to ``Engine`` to ``EngineConfig.device`` /
``dtype`` and names the settings that cannot act on the result), and the scheduler
over the page pools the cache's layout (``acb.worker.sizing.Layout``) sizes."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..core.config import EngineConfig
from ..core.defaults import resolve
from ..core.kv_cache import HostPool, KVCacheManager
from ..core.kv_events import KVEventPublisher
from ..core.sampling_params import SamplingParams
from ..core.scheduler import Scheduler
from .settings import inactive_settings

log = logging.getLogger("acb")


def checked_settings(config: EngineConfig | None, sampling: SamplingParams | None,
                     ) -> tuple[EngineConfig, SamplingParams]:
    """An engine's config (what it leaves to the engine decided as far as it can be before
    the model is placed: ``acb.core.defaults``) and default sampling (their defaults when None),
    or TypeError / ValueError naming what is wrong."""
    if config is not None and not isinstance(config, EngineConfig):
        raise TypeError(f"config must be an acb.EngineConfig, got {type(config).__name__}")
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be an acb.SamplingParams, got {type(sampling).__name__}")
    config, sampling = config or EngineConfig(), sampling or SamplingParams()
    if sampling.priority and config.scheduler != "priority":
        raise ValueError(f"SamplingParams.priority={sampling.priority} needs EngineConfig(scheduler="
                         f"'priority'); the scheduler is {config.scheduler!r}")
    return resolve(config), sampling


def resolve_load(config: EngineConfig, checkpoint: str | None = None) -> tuple[EngineConfig, str | None, str | None]:
    """(the config with its device and dtype decided, the dtype and device to load the
    checkpoint in). ``dtype=None``: bf16 on a device with native bf16 (acb.model.loading.default_dtype),
    else float32, logged beside ``checkpoint`` (the checkpoint's own dtype, when known) and
    how to change it. Tensor-parallel: the full model loads on the host; each rank takes
    its share to its device."""
    from ..model.loading import default_dtype

    config = resolve(config)  # the environment's overrides (ACB_CPU_PREPACK=0: no bf16 fast path)
    device = config.device
    if config.dtype is None and config.tensor_parallel_size == 1:
        dtype = default_dtype(device or ("cuda" if torch.cuda.is_available() else "cpu"), prepack=config.cpu_prepack)
        log.info("acb: running the model in %s (the checkpoint's own dtype: %s; EngineConfig.dtype=None picks %s "
                 "for this device; dtype='float32' or acb serve --dtype float32 keeps full precision, "
                 "dtype='auto' the checkpoint's dtype)", dtype, checkpoint or "not recorded", dtype)
        config = dataclasses.replace(config, dtype=dtype)
    if config.tensor_parallel_size > 1:
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        config = dataclasses.replace(config, device=device,
                                     dtype=config.dtype or ("bfloat16" if device.startswith("cuda") else None))
        device = "cpu"
    return config, config.dtype, device


def place(model: torch.nn.Module, config: EngineConfig, tokenizer=None) -> EngineConfig:
    """Move / cast the model object to ``config.device`` / ``config.dtype`` where they are
    set and differ ("auto" keeps the model's dtype), quantize it (``EngineConfig.quantization``),
    then warn naming each setting that has no effect on the device and dtype it ends on
    (``tokenizer`` reads int8's calibration text).
    The config with the device and dtype the model ended on."""
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
    from ..model import int8_weights, quantization

    if config.dtype not in (None, "auto") and param.dtype != getattr(torch, config.dtype):
        if int8_weights.is_quantized(model):  # its scales and packed bf16 lm_head would be cast too
            raise ValueError(
                f"EngineConfig.dtype={config.dtype!r} cannot be applied: the model holds acb's int8 layers, "
                f"quantized for {str(param.dtype).removeprefix('torch.')} activations, and is not cast after "
                f"quantizing; pass the dense model with dtype={config.dtype!r} and quantization='int8' (or "
                f"load(..., dtype={config.dtype!r}, quantization='int8')), or leave dtype unset")
        log.info("acb: casting the model to %s (EngineConfig.dtype)", config.dtype)
        model.to(getattr(torch, config.dtype))
    quantization.prepare(model, config, tokenizer)  # int8: quantized in place, once
    param = next(model.parameters())
    for name in inactive_settings(config, param.device, param.dtype):
        log.warning("acb: EngineConfig.%s=%r has no effect on %s with %s weights; it is ignored", name,
                    getattr(config, name), param.device, str(param.dtype).removeprefix("torch."))
    return resolve(config, model)


def build_placement(model: torch.nn.Module, config: EngineConfig, draft: torch.nn.Module | None = None):
    """(attention backend, tensor-parallel group or None, device, cache layout, the config
    with the cache's sizes decided) of an engine over ``model`` (and a ``draft`` model whose
    cache mirrors its pages: ``build_draft``): the backend refused (ValueError naming
    attn_backend) if it cannot run here; with tensor_parallel_size > 1 the ranks start and
    the group sizes the cache."""
    from ..attention import kv_quant, selector
    from ..worker import sizing

    param = next(model.parameters())
    backend = selector.resolve_backend(config.attn_backend, param.device, param.dtype, native=config.cpu_kernels)
    kv_quant.check(config.kv_cache_dtype, backend)  # int8 pages: native CPU attention only
    if config.tensor_parallel_size > 1:
        from ..distributed import TensorParallel

        tp = TensorParallel(model, config)
        return backend, tp, tp.device, tp.layout, resolve(config, layout=tp.layout)
    layout = sizing.layout(model, config, draft)
    return backend, None, param.device, layout, resolve(config, layout=layout)


def build_scheduler(layout, config: EngineConfig, device: torch.device,
                    kv_events: KVEventPublisher | None) -> Scheduler:
    """The scheduler over the page pools of ``layout``: the cache's pages (with prefix
    caching, publishing ``kv_events``), the sliding layers' on hybrid models, the host's
    for CPU offload."""
    if kv_events is not None and not layout.prefix_caching:
        log.warning("acb: EngineConfig.kv_events=True, but prefix caching is off for this model (sliding-"
                    "window layers, or allow_prefix_sharing=False): no page will ever be stored")
    kv = KVCacheManager(layout.num_pages, layout.page_size, enable_prefix_caching=layout.prefix_caching,
                        events=kv_events.pending if kv_events else None,
                        medium="GPU" if device.type == "cuda" else device.type.upper())
    swa = KVCacheManager(layout.swa_pages, layout.page_size, enable_prefix_caching=False) if layout.swa_pages else None
    scheduler = Scheduler(kv, layout.max_batch_tokens, layout.max_requests, policy=config.scheduler,
                          safety_margin=config.safety_margin, sliding_window=layout.sliding_window,
                          host_pool=HostPool(layout.host_pages) if layout.host_pages else None, kv_swa=swa,
                          aging_steps=config.priority_aging_steps,
                          max_prefill_only_tokens=config.max_embedding_tokens)
    if config.speculative_method == "ngram":
        from ..core.speculative import Speculation

        scheduler.speculation = Speculation(config.num_speculative_tokens, config.prompt_lookup_min,
                                            config.prompt_lookup_max)
    elif config.speculative_method == "draft":
        from ..core.speculative import DraftSpeculation

        scheduler.speculation = DraftSpeculation(config.num_speculative_tokens)
    return scheduler


def build_disk_tier(model: torch.nn.Module, layout, config: EngineConfig):
    """The prefix cache's disk tier (``EngineConfig.kv_disk_path``; ``acb.core.kv_disk``), or None: a
    directory it cannot write to, or a ``kv_disk_space`` smaller than one page, is refused by
    name (ValueError) now. It serves once the engine starts (``open_disk_tier``)."""
    if config.kv_disk_path is None:
        return None
    from ..core.kv_disk import DiskTier
    from ..core.kv_disk_files import HEADER_SIZE, check_directory
    from ..worker.disk_pages import page_bytes

    why = check_directory(config.kv_disk_path)
    if why is not None:
        raise ValueError(f"EngineConfig.kv_disk_path {config.kv_disk_path!r} {why}")
    size = page_bytes(model, config.kv_cache_dtype, layout.page_size)
    space = int(config.kv_disk_space * 2**30)
    if space < size + HEADER_SIZE:
        raise ValueError(f"EngineConfig.kv_disk_space must hold at least one page ({size + HEADER_SIZE} bytes "
                         f"for this model and page size), got {config.kv_disk_space!r} GiB")
    if not layout.prefix_caching:
        log.warning("acb: EngineConfig.kv_disk_path=%r has no effect: prefix caching is off for this model "
                    "(sliding-window layers, or allow_prefix_sharing=False)", config.kv_disk_path)
        return None
    return DiskTier(config.kv_disk_path, space, size, layout.page_size)


def open_disk_tier(disk, model: torch.nn.Module, config: EngineConfig, runner) -> None:
    """Start the disk tier ``disk`` (if any, and not serving) under the fingerprint of the KV values
    ``runner`` computes (``acb.worker.disk_pages.fingerprint``)."""
    if disk is None or disk.active:
        return
    from ..worker.disk_pages import fingerprint

    disk.open(fingerprint(model, config, runner.kv.k_cache, runner.attn_backend, runner.forward_path))


def build_requests(model: torch.nn.Module, tokenizer, config: EngineConfig, sampling: SamplingParams, scheduler,
                   device: torch.device, layout, eos_ids) -> tuple[Any, Any, Any]:
    """The request side of an engine: (grammar compiler, adapter registry, request table)."""
    from ..model import lora
    from .adapters import AdapterRegistry
    from .inputs import generation_defaults
    from .request_table import RequestTable
    from .structured import Grammars

    vocab_size = model.get_input_embeddings().num_embeddings
    grammars = Grammars(tokenizer, vocab_size, eos_ids, cache_size=config.grammar_cache_size,
                        timeout_s=config.grammar_compile_timeout_s, threads=1 if device.type == "cpu" else 8)
    refusal = lora.why_not(model, config)  # None: LoRA adapters can run here (acb.model.lora)
    adapters = AdapterRegistry(config.max_adapters, None if refusal else lora.LoraBank(
        model, config.max_adapters, config.max_adapter_rank), refusal)
    table = RequestTable(scheduler, grammars, tokenizer=tokenizer, defaults=sampling,
                         generation_defaults=generation_defaults(model), vocab_size=vocab_size,
                         max_model_len=layout.max_model_len, eos_ids=eos_ids, adapters=adapters)
    return grammars, adapters, table


def build_draft(model: torch.nn.Module, config: EngineConfig):
    """The draft model of ``speculative_method="draft"`` (``acb.worker.draft.prepare``: refused by
    name if it cannot propose for ``model``), else None."""
    if config.speculative_method != "draft":
        return None
    from ..worker.draft import prepare

    return prepare(model, config)


def build_runner(model: torch.nn.Module, layout, config: EngineConfig, attn_backend: str, tp=None, draft=None):
    """The device side of an engine: a ``ModelRunner`` over the model's KV cache, or the
    tensor-parallel group's runner (``tp``), its fast paths configured; with the draft
    model ``draft`` (``acb.worker.draft``) beside it, over a cache mirroring its own."""
    if tp is not None:
        runner = tp.runner(layout, config)
    else:
        from ..worker.runner import ModelRunner

        if attn_backend == "native" and config.cpu_fused_forward:
            from ..kernels import cpu

            # the fused forward's kernels compile while the runner builds the attention kernel
            bf16 = next(model.parameters()).dtype == torch.bfloat16
            cpu.start_building(cpu.fused_kernels, *([cpu.bf16_kernels] if bf16 else []))
        runner = ModelRunner(model, layout.num_pages, layout.page_size, attn_backend, host_pages=layout.host_pages,
                             swa_pages=layout.swa_pages, swa_layers=layout.swa_layers,
                             kv_cache_dtype=config.kv_cache_dtype)
    runner.fault_hook = config.fault_hook
    runner.configure_fast_paths(config, layout.max_requests)
    if draft is not None:
        from ..worker.draft import DraftRunner

        runner.draft = DraftRunner(draft, runner, config)
    return runner


def release_runner(runner, cpu: bool) -> None:
    """Free the runner's cache and packed weights; on the CPU hand the memory back to the
    OS now, not at exit."""
    runner.release()
    if cpu:
        import gc

        from ..kernels.cpu_linear import trim_heap

        gc.collect()
        trim_heap()
