"""A GGUF checkpoint straight into int8 (``quantization="int8"``), one tensor at a time.

``acb.model.loading`` otherwise dequantizes a GGUF file into a float32 model (and caches it
as a float32 folder). Here the model's skeleton is built with its parameters on the
``meta`` device (no memory), and each GGUF tensor is read, dequantized to float32 on
its own, and either quantized at once to int8 per output channel and group of 64 input
channels (the decoder's projections, smoothed and rotated: :func:`acb.model.int8_weights.rounded`),
rounded to bf16 (the embedding / lm_head, in slices of rows) or kept in the model's dtype
(norms, biases); the largest float32 array alive at any time is one tensor or slice (SmolLM2:
an MLP projection, 3.5 MB), never the model.

The file is read twice on the first load: the first pass builds an unsmoothed int8 model
(float32 between its GEMMs, whatever dtype was asked) that reads
:data:`acb.model.int8_calibration.CALIBRATION` to measure each projection's input maxima, the second
quantizes each weight times its smoothing factors
(:func:`acb.model.int8_calibration.smoothing_factors`). The result is cached under
``acb.model.files.cache_dir()`` (later loads skip the GGUF decoding and the calibration).

Every GGUF quantization type the ``gguf`` package dequantizes is read (F32, F16, BF16,
Q8_0, Q4_0, Q4_1, Q5_x, the K-quants, ...): SmolLM2-135M's file holds Q4_1 (210
tensors), Q8_0 (the embedding) and F32 (the norms); Gemma 3 270M's holds Q4_K/Q6_K/Q8_0
(run ``python -m acb.model.gguf_int8 FILE`` to list a file's types). A block-quantized tensor is
dequantized, smoothed, rotated and requantized in acb's groups of 64.
"""

from __future__ import annotations

import hashlib
import logging
import os

import torch

from . import gguf_reading, int8_cache

log = logging.getLogger("acb")


def tensor_types(path: str | os.PathLike) -> dict[str, int]:
    """{GGUF quantization type: number of tensors} of a file."""
    from collections import Counter

    return dict(Counter(t.tensor_type.name for t in gguf_reading.reader(path).tensors))





def load(folder: str, gguf_file: str, dtype: torch.dtype):
    """(model, tokenizer): the GGUF model with int8 linear layers and embedding (see
    :mod:`acb.model.quantization`), the rest in ``dtype``. The int8 tensors are cached under
    ``acb.model.files.cache_dir()`` (later loads skip the GGUF decoding). ValueError naming
    ``EngineConfig.quantization`` where int8 cannot run this model."""
    with gguf_reading.parsed_once():  # the file's header parsed once, not four times
        return _load(folder, gguf_file, dtype)


def _load(folder: str, gguf_file: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoTokenizer

    from . import int8_calibration, int8_weights, quantization
    from .files import cache_dir, name_added_tokens

    path = os.path.join(folder, gguf_file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.realpath(path)}|{st.st_size}|{int(st.st_mtime)}|{int8_cache.method()}".encode()
                       ).hexdigest()[:16]
    cached = cache_dir() / "int8" / f"{os.path.splitext(gguf_file)[0]}-{key}"
    parts = int8_cache.read(cached)
    if parts is not None:
        name_added_tokens(cached)  # a cache written before its tokenizer config named them (acb.model.files)
    # the config and the tokenizer are cached too: building them from GGUF metadata takes seconds
    config = AutoConfig.from_pretrained(cached) if parts else AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(cached) if parts else \
        AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    quantization.check_dense(int8_cache.skeleton(config, dtype))  # refuse before reading anything
    if parts is None:
        log.info("acb: reading %s into int8 (first load only; cached in %s)", gguf_file, cached)
        # unsmoothed, and float32 whatever dtype was asked: the cached conversion (its key has no
        # dtype) is the same whichever dtype loads the file first
        plain = int8_cache.build(config, *_read(path, int8_cache.skeleton(config, torch.float32), config),
                                 torch.float32, gguf_file)
        ids = int8_calibration.calibration_ids(tokenizer, config.vocab_size)
        factors = int8_calibration.smoothing_factors(plain, int8_calibration.input_maxima(plain, ids))
        del plain
        parts = _read(path, int8_cache.skeleton(config, dtype), config, factors)
        int8_cache.save(cached, config, tokenizer, parts)
    model = int8_cache.build(config, *parts, dtype, gguf_file)
    log.info("acb: %s loaded into int8 (%s)", gguf_file, int8_weights.weight_summary(model))
    return model, tokenizer


def _read(path: str, model: torch.nn.Module, config, factors: dict | None = None) -> tuple[dict, dict]:
    """({name: float32 tensor} of the weights kept dense, {name: ``Int8Linear.packed``, or
    ("bf16", packed, rows) for the embedding / lm_head} of the others), decoding one GGUF
    tensor at a time (the large ones in slices of rows); ``factors``: {name: smoothing s} the
    projections' columns are multiplied by before they are quantized."""
    import numpy as np
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    from ..kernels.cpu_linear import trim_heap
    from . import int8_weights
    from .int8_weights import Bf16Linear, Int8Linear

    factors = factors or {}

    def packed(name: str, value: torch.Tensor) -> tuple:
        return Int8Linear.from_weight(value, smoothing=factors.get(name)).packed

    def as_tensor(array: np.ndarray) -> torch.Tensor:
        # gguf's dequantize returns F32 tensors as views of the file's read-only memory map:
        # copy those, so torch owns writable memory (and warns nothing)
        array = np.ascontiguousarray(array, dtype=np.float32)
        return torch.from_numpy(array if array.flags.writeable else array.copy())

    reader = gguf_reading.reader(path)
    arch = read_field(reader, "general.architecture")[0]
    settings = config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=settings)
    names = get_gguf_hf_weights_map(model, processor)
    targets = int8_cache.int8_targets(model)
    dense, int8 = {}, {}
    for i, tensor in enumerate(reader.tensors):
        if i % 16 == 0:  # hand the freed float32 temporaries back (glibc keeps them: measured 1.5 GB peak
            trim_heap()  # RSS for SmolLM2 without this, against 0.6 GB of live data)
        hf_name = names.get(tensor.name)
        if hf_name in _TABLES and tensor.data.ndim == 2:
            # the embedding or lm_head: rows decoded and rounded to bf16 in slices (no processor
            # rewrites these: only Llama's q/k are permuted, Gemma's norms shifted)
            rows = torch.cat([as_tensor(dequantize(tensor.data[i: i + _SLICE], tensor.tensor_type)).bfloat16()
                              for i in range(0, tensor.data.shape[0], _SLICE)])
            table = Bf16Linear.from_dense(rows)
            int8[hf_name] = ("bf16", table.weight, table.out_features)
            continue
        if hf_name in targets and tensor.data.ndim == 2 and tensor.data.shape[0] > _SLICE and \
                ".attn_q." not in tensor.name and ".attn_k." not in tensor.name:
            # a large projection (no processor rewrites it): rows decoded and quantized in slices
            # (each row's groups are its own; the smoothing and the rotation act on columns, so
            # slices take them too)
            s = factors.get(hf_name)
            parts = []
            for i in range(0, tensor.data.shape[0], _SLICE):
                rows = as_tensor(dequantize(tensor.data[i: i + _SLICE], tensor.tensor_type))
                parts.append(int8_weights.quantize_weight(int8_weights.rounded(rows, s)))
            int8[hf_name] = Int8Linear.from_rounded(torch.cat([q for q, _ in parts]), torch.cat([c for _, c in parts]),
                                                    smoothing=s).packed
            continue
        done = processed(processor, tensor.name, dequantize(tensor.data, tensor.tensor_type), names, settings)
        if done is None:
            continue
        hf_name, value = done[0], as_tensor(done[1])
        if hf_name in targets:
            int8[hf_name] = packed(hf_name, value)
        else:
            dense[hf_name] = value
    return dense, int8


def processed(processor, name: str, values, names: dict, settings: dict):
    """(the model's parameter name, the values) of GGUF tensor ``name`` after transformers' GGUF
    processor for its architecture (Llama's q/k permuted back, Gemma's norms shifted), or None where
    the model has no such parameter."""
    result = processor.process(weights=values, name=name, tensor_key_mapping=names,
                               parsed_parameters={"tensors": {}, "config": settings})
    hf_name = names.get(result.name)
    return None if result.weights is None or hf_name is None else (hf_name, result.weights)


_TABLES = ("lm_head.weight", "model.embed_tokens.weight")  # kept bf16 (acb.model.int8_weights.Bf16Linear)
_SLICE = 4096  # rows decoded at once from a tensor taller than this


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        print(arg, tensor_types(arg))
