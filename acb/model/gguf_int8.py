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

import contextlib
import hashlib
import logging
import os

import torch

log = logging.getLogger("acb")


@contextlib.contextmanager
def _parameters_on_meta():
    """Build modules with their parameters on ``meta`` (buffers stay real: RoPE's
    frequencies are computed as usual), skipping the weights' initialization."""
    from transformers.initialization import no_init_weights

    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        with no_init_weights():
            yield
    finally:
        torch.nn.Module.register_parameter = register


def tensor_types(path: str | os.PathLike) -> dict[str, int]:
    """{GGUF quantization type: number of tensors} of a file."""
    from collections import Counter

    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))





def load(folder: str, gguf_file: str, dtype: torch.dtype):
    """(model, tokenizer): the GGUF model with int8 linear layers and embedding (see
    :mod:`acb.model.quantization`), the rest in ``dtype``. The int8 tensors are cached under
    ``acb.model.files.cache_dir()`` (later loads skip the GGUF decoding). ValueError naming
    ``EngineConfig.quantization`` where int8 cannot run this model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from . import int8_calibration, int8_weights, quantization
    from .files import cache_dir, name_added_tokens

    path = os.path.join(folder, gguf_file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    st = os.stat(path)
    method = (f"w{int8_weights.GROUP}a{int8_weights.GROUP}-smooth{int8_calibration.SMOOTHING}-f32cal-bf16head"
              f"{'-hadamard' if int8_weights.ROTATION else ''}")  # the format
    key = hashlib.sha1(f"{os.path.realpath(path)}|{st.st_size}|{int(st.st_mtime)}|{method}".encode()).hexdigest()[:16]
    cached = cache_dir() / "int8" / f"{os.path.splitext(gguf_file)[0]}-{key}"
    hit = (cached / "weights.pt").is_file()
    if hit:
        name_added_tokens(cached)  # a cache written before its tokenizer config named them (acb.model.files)
    # the config and the tokenizer are cached too: building them from GGUF metadata takes seconds
    config = AutoConfig.from_pretrained(cached) if hit else AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(cached) if hit else \
        AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    def skeleton(dt: torch.dtype = dtype):
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=dt)
        return model.eval()

    def build(dense: dict, int8: dict, dt: torch.dtype = dtype):
        model = skeleton(dt)
        with torch.no_grad():
            for name, value in dense.items():
                _set(model, name, value.to(dt))
        weights = {name: int8_weights.Bf16Linear(*value[1:]) if value[0] == "bf16" else value
                   for name, value in int8.items()}
        if "lm_head.weight" not in weights and getattr(config, "tie_word_embeddings", False):
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied: one matrix serves both
        quantization.quantize_(model, weights)
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise ValueError(f"{gguf_file} lacks tensors the model needs: {missing[:5]}")
        return model

    quantization.check_dense(skeleton())  # refuse before reading anything
    if hit:
        dense, int8 = torch.load(cached / "weights.pt", weights_only=True)
    else:
        log.info("acb: reading %s into int8 (first load only; cached in %s)", gguf_file, cached)
        # unsmoothed, and float32 whatever dtype was asked: the cached conversion (its key has no
        # dtype) is the same whichever dtype loads the file first
        plain = build(*_read(path, skeleton(torch.float32), config), torch.float32)
        ids = int8_calibration.calibration_ids(tokenizer, config.vocab_size)
        factors = int8_calibration.smoothing_factors(plain, int8_calibration.input_maxima(plain, ids))
        del plain
        dense, int8 = _read(path, skeleton(), config, factors)
        _save(cached, config, tokenizer, (dense, int8))
    model = build(dense, int8)
    log.info("acb: %s loaded into int8 (%s)", gguf_file, int8_weights.weight_summary(model))
    return model, tokenizer


def _save(target, config, tokenizer, weights) -> None:
    """Cache the converted checkpoint at ``target``, atomically (a folder renamed into place)."""
    from .files import name_added_tokens, save_atomically

    def write(folder):
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        name_added_tokens(folder)
        torch.save(weights, folder / "weights.pt")

    save_atomically(target, write)


def _read(path: str, model: torch.nn.Module, config, factors: dict | None = None) -> tuple[dict, dict]:
    """({name: float32 tensor} of the weights kept dense, {name: ``Int8Linear.packed``, or
    ("bf16", packed, rows) for the embedding / lm_head} of the others), decoding one GGUF
    tensor at a time (the large ones in slices of rows); ``factors``: {name: smoothing s} the
    projections' columns are multiplied by before they are quantized."""
    import numpy as np
    from gguf import GGUFReader, dequantize
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

    reader = GGUFReader(path)
    arch = read_field(reader, "general.architecture")[0]
    settings = config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=settings)
    names = get_gguf_hf_weights_map(model, processor)
    targets = _int8_targets(model)
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
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters={"tensors": {}, "config": settings})
        hf_name = names.get(result.name)
        if result.weights is None or hf_name is None:
            continue
        value = as_tensor(result.weights)
        if hf_name in targets:
            int8[hf_name] = packed(hf_name, value)
        else:
            dense[hf_name] = value
    return dense, int8


_TABLES = ("lm_head.weight", "model.embed_tokens.weight")  # kept bf16 (acb.model.int8_weights.Bf16Linear)
_SLICE = 4096  # rows decoded at once from a tensor taller than this


def _int8_targets(model: torch.nn.Module) -> set[str]:
    """Names of the weights :func:`acb.model.quantization.quantize_` stores as int8."""
    from .int8_calibration import projections

    base = model.model
    names = {"lm_head.weight", "model.embed_tokens.weight"}
    for i, layer in enumerate(base.layers[: model.config.num_hidden_layers]):
        for owner, name in projections(layer):
            prefix = "self_attn" if owner is layer.self_attn else "mlp"
            names.add(f"model.layers.{i}.{prefix}.{name}.weight")
    return names


def _set(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        expected = module._parameters[leaf].shape
        if tuple(expected) != tuple(value.shape):
            raise ValueError(f"GGUF tensor {name} has shape {list(value.shape)}, the model expects {list(expected)}")
        module._parameters[leaf] = torch.nn.Parameter(value.contiguous(), requires_grad=False)
    else:
        getattr(module, leaf).copy_(value)


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        print(arg, tensor_types(arg))
