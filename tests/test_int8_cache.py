"""A folder's int8 form is made once and read back after (acb.model.int8_cache): the same bytes, the
same tokens, no second calibration; a changed checkpoint or dtype makes a new entry, a damaged entry
is made again, a cache that cannot be written costs one warning and nothing else."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from acb import Engine, EngineConfig
from acb.kernels.cpu import int8_kernels
from acb.model import int8_cache, int8_calibration, int8_weights
from acb.model.loading import load
from acb.testing import tiny_model, tiny_tokenizer


@pytest.fixture
def folder(tmp_path, monkeypatch):
    k = int8_kernels()
    if k is None or not k.available():
        pytest.skip("acb's int8 kernels need AVX-512 VNNI or AVX2 and a compiler")
    monkeypatch.setenv("ACB_CACHE_DIR", str(tmp_path / "cache"))

    def make(arch: str = "qwen2", seed: int = 3):
        path = tmp_path / f"{arch}-{seed}"
        tiny_model(arch, seed=seed).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
        return str(path)

    return make


def _state(model: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _no_calibration(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("calibrated again: the saved int8 weights were not read")

    monkeypatch.setattr(int8_calibration, "input_maxima", refuse)


async def _greedy(model, tokenizer) -> list[list[int]]:
    engine = Engine(model, tokenizer=tokenizer, config=EngineConfig(quantization="int8", num_blocks=64))
    async with engine:
        outs = [await engine.generate(p, max_new_tokens=12, do_sample=False)
                for p in ("hello there", "the int8 cache")]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])  # q/k/v biases; a tied, scaled embedding
async def test_a_folder_is_quantized_once_and_read_back_to_the_same_bytes_and_tokens(folder, arch, monkeypatch):
    path = folder(arch)
    first, tok = load(path, dtype="float32", device="cpu", quantization="int8")
    assert int8_weights.is_quantized(first)
    entries = os.listdir(os.path.join(os.environ["ACB_CACHE_DIR"], "int8"))
    assert len(entries) == 1 and entries[0].startswith(f"{arch}-3-")
    _no_calibration(monkeypatch)
    second, tok2 = load(path, dtype="float32", device="cpu", quantization="int8")
    a, b = _state(first), _state(second)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert type(second.lm_head) is int8_weights.Bf16Linear
    tied = first.model.embed_tokens.table is first.lm_head
    assert (second.model.embed_tokens.table is second.lm_head) == tied
    assert await _greedy(first, tok) == await _greedy(second, tok2)


async def test_an_engine_from_a_folder_reads_the_saved_form_on_its_second_start(folder, monkeypatch, caplog):
    path = folder("llama")
    config = EngineConfig(quantization="int8", dtype="float32", num_blocks=64)
    engine = Engine.from_pretrained(path, config=config)
    async with engine:
        want = (await engine.generate("abc", max_new_tokens=8, do_sample=False)).token_ids
    _no_calibration(monkeypatch)
    with caplog.at_level(logging.INFO, logger="acb"):
        engine = Engine.from_pretrained(path, config=config)
    assert "read from" in caplog.text
    async with engine:
        assert (await engine.generate("abc", max_new_tokens=8, do_sample=False)).token_ids == want


def test_a_changed_checkpoint_or_another_dtype_is_quantized_again(folder):
    path = folder("llama")
    root = os.path.join(os.environ["ACB_CACHE_DIR"], "int8")
    load(path, dtype="float32", device="cpu", quantization="int8")
    load(path, dtype="bfloat16", device="cpu", quantization="int8")
    assert len(os.listdir(root)) == 2
    tiny_model("llama", seed=4).save_pretrained(path)  # new weights in the same folder
    model, _ = load(path, dtype="float32", device="cpu", quantization="int8")
    assert len(os.listdir(root)) == 3
    fresh = tiny_model("llama", seed=4)
    int8_weights_of = {k: v for k, v in model.state_dict().items() if k.endswith("norm.weight")}
    for name, value in int8_weights_of.items():  # the new checkpoint's tensors, not the old entry's
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_a_damaged_entry_is_made_again_with_a_warning(folder, caplog):
    path = folder("llama")
    load(path, dtype="float32", device="cpu", quantization="int8")
    entry = int8_cache.entry(path, torch.float32)
    weights = entry / "weights.pt"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated
    with caplog.at_level(logging.WARNING, logger="acb"):
        model, _ = load(path, dtype="float32", device="cpu", quantization="int8")
    assert "cannot be read" in caplog.text
    assert int8_weights.is_quantized(model)
    assert int8_cache.read(entry) is not None  # saved whole again


def test_a_cache_that_cannot_be_written_costs_one_warning(folder, monkeypatch, tmp_path, caplog):
    path = folder("llama")
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("ACB_CACHE_DIR", str(blocked))
    with caplog.at_level(logging.WARNING, logger="acb"):
        model, _ = load(path, dtype="float32", device="cpu", quantization="int8")
    assert int8_weights.is_quantized(model)
    assert caplog.text.count("could not be saved") == 1
