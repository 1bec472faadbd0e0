"""Quantized weights kept between runs: a model's int8 form is made once and read back after.

Quantizing a model to acb's int8 (:mod:`acb.model.quantization`) calibrates the smoothing on
:data:`acb.model.int8_calibration.CALIBRATION` (the whole model run over 4,096 tokens) and
rounds, rotates and packs every projection: seconds for SmolLM2-135M, 30-40 s for a 0.5B model on
two cores. ``load`` (a Hugging Face folder, ``quantization="int8"``) and
:func:`acb.model.gguf_int8.load` (a GGUF file) do it on the first load only and save the result
under ``acb.model.files.cache_dir()/int8`` (``$ACB_CACHE_DIR``, default ``~/.cache/acb``); later
loads build the model's skeleton with its parameters on ``meta`` and fill it from the saved tensors.

A saved entry is named by a key over everything its bytes depend on: the checkpoint's files
(names, sizes, modification times) and ``config.json``, the dtype the model was calibrated in, and
:func:`method` (the group size, smoothing strength, rotation and format version). A change to any of
them makes a new entry; an entry is written whole or not at all (:func:`acb.model.files.save_atomically`).
Delete the folder to reclaim the space.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("acb")

FORMAT = 1  # the saved tuple's layout; bump it when Int8Linear.packed or the packing changes


def method() -> str:
    """What the int8 weights' bytes depend on besides the checkpoint: the format, the groups,
    the smoothing strength, the calibration's dtype and the lm_head's width, the rotation."""
    from . import int8_calibration, int8_weights

    return (f"w{int8_weights.GROUP}a{int8_weights.GROUP}-smooth{int8_calibration.SMOOTHING}-f32cal-bf16head"
            f"{'-hadamard' if int8_weights.ROTATION else ''}" + (f"-v{FORMAT}" if FORMAT > 1 else ""))


def folder_key(folder: str, dtype: torch.dtype) -> str:
    """The key of a Hugging Face folder's int8 form in ``dtype``: its weight files' names, sizes and
    modification times, its ``config.json``, the dtype and :func:`method`."""
    root = Path(folder).resolve()
    parts = [str(root), str(dtype), method()]
    for path in sorted(root.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".pt", ".pth") or path.name.endswith(".index.json"):
            st = path.stat()
            parts.append(f"{path.name}|{st.st_size}|{st.st_mtime_ns}")
    try:
        parts.append((root / "config.json").read_text())
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def parameters_on_meta():
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


def skeleton(config, dtype: torch.dtype) -> torch.nn.Module:
    """``config``'s model with its parameters on ``meta`` (no memory, no initialization)."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def build(config, dense: dict, int8: dict, dtype: torch.dtype, source: str) -> torch.nn.Module:
    """The int8 model from its saved parts: ``dense`` {parameter name: tensor} (norms, biases; cast
    to ``dtype``) and ``int8`` {weight name: ``Int8Linear.packed``, or ("bf16", packed, rows) for the
    lm_head and embedding}. ValueError naming ``source`` where a tensor the model needs is missing."""
    from . import int8_weights, quantization

    model = skeleton(config, dtype)
    with torch.no_grad():
        for name, value in dense.items():
            set_parameter(model, name, value.to(dtype), source)
    weights = {name: int8_weights.Bf16Linear(*value[1:]) if value[0] == "bf16" else value
               for name, value in int8.items()}
    if "lm_head.weight" not in weights and getattr(config, "tie_word_embeddings", False):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied: one matrix serves both
    quantization.quantize_(model, weights)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{source} lacks tensors the model needs: {missing[:5]}")
    return model


def set_parameter(model: torch.nn.Module, name: str, value: torch.Tensor, source: str) -> None:
    """Put ``value`` in ``model``'s parameter (or buffer) ``name``, checking its shape."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        expected = module._parameters[leaf].shape
        if tuple(expected) != tuple(value.shape):
            raise ValueError(f"{source}: tensor {name} has shape {list(value.shape)}, the model expects "
                             f"{list(expected)}")
        module._parameters[leaf] = torch.nn.Parameter(value.contiguous(), requires_grad=False)
    else:
        getattr(module, leaf).copy_(value)


def int8_targets(model: torch.nn.Module) -> set[str]:
    """Names of the weights :func:`acb.model.quantization.quantize_` stores as int8 or bf16 (the
    decoder's projections, the lm_head and the embedding), named as the dense model has them."""
    from .int8_calibration import projections

    names = {"lm_head.weight", "model.embed_tokens.weight"}
    for i, layer in enumerate(model.model.layers[: model.config.num_hidden_layers]):
        for owner, name in projections(layer):
            prefix = "self_attn" if owner is layer.self_attn else "mlp"
            names.add(f"model.layers.{i}.{prefix}.{name}.weight")
    return names


def saved_parts(model: torch.nn.Module, dense: dict) -> tuple[dict, dict]:
    """(dense, int8) of a model :func:`acb.model.quantization.quantize_` has quantized, as
    :func:`build` takes them back: ``dense`` (the parameters it kept, taken before it ran: the
    projections' biases live in their int8 modules after) and each int8 and bf16 module's tensors."""
    from . import int8_weights

    int8: dict = {f"{name}.weight": module.packed for name, module in model.named_modules()
                  if isinstance(module, int8_weights.Int8Linear)}
    head = model.lm_head
    int8["lm_head.weight"] = ("bf16", head.weight, head.out_features)
    table = model.model.embed_tokens.table
    if table is not head:  # tied: the lm_head's entry serves both
        int8["model.embed_tokens.weight"] = ("bf16", table.weight, table.out_features)
    return dense, int8


def save(target: Path, config, tokenizer, weights: tuple[dict, dict]) -> None:
    """Save an int8 model's parts at ``target``, atomically (a folder renamed into place); with
    ``config`` and ``tokenizer`` where they are given (a GGUF file's: building them takes seconds)."""
    from .files import name_added_tokens, save_atomically

    def write(folder):
        if config is not None:
            config.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            name_added_tokens(folder)
        torch.save(weights, folder / "weights.pt")

    save_atomically(target, write)


def read(target: Path) -> tuple[dict, dict] | None:
    """The parts saved at ``target``, or None where there are none (or they cannot be read: a
    damaged entry is removed and made again)."""
    path = target / "weights.pt"
    if not path.is_file():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # truncated or damaged: make it again
        log.warning("acb: the saved int8 weights in %s cannot be read (%s); quantizing again", target, e)
        import shutil

        shutil.rmtree(target, ignore_errors=True)
        return None


def entry(folder: str, dtype: torch.dtype) -> Path:
    """Where a Hugging Face folder's int8 form in ``dtype`` is saved."""
    from .files import cache_dir

    name = os.path.basename(os.path.normpath(folder))
    return cache_dir() / "int8" / f"{name}-{folder_key(folder, dtype)}"


def cached(folder: str, dtype: torch.dtype) -> torch.nn.Module | None:
    """A Hugging Face folder's model in int8 (activations in ``dtype``) from its saved entry, or
    None where this folder was not quantized in this dtype before. ValueError (naming
    ``EngineConfig.quantization``) where int8 cannot run the model, before anything is read."""
    from transformers import AutoConfig

    from . import quantization

    config = AutoConfig.from_pretrained(folder)
    quantization.check_dense(skeleton(config, dtype))
    target = entry(folder, dtype)
    parts = read(target)
    if parts is None:
        return None
    model = build(config, *parts, dtype, str(target))
    log.info("acb: int8 weights of %s read from %s", folder, target)
    return model


def quantize_and_save(folder: str, model: torch.nn.Module, tokenizer) -> None:
    """Quantize ``model`` (loaded dense from ``folder``) in place, calibrated on ``tokenizer``,
    and save its int8 form for the next load (a cache that cannot be written: one warning)."""
    from . import quantization

    dtype = next(model.parameters()).dtype
    target = entry(folder, dtype)
    log.info("acb: quantizing %s to int8 (first load only; saved in %s)", folder, target)
    targets = int8_targets(model)
    dense = {n: p.detach() for n, p in model.named_parameters() if n not in targets}
    quantization.quantize_(model, tokenizer=tokenizer)
    try:
        save(target, None, None, saved_parts(model, dense))
    except OSError as e:
        log.warning("acb: the int8 weights could not be saved in %s (%s); the next load quantizes again", target, e)
