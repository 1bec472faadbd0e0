"""Which dtype ``Engine.from_pretrained`` runs (issue 28, point 4): ``dtype=None`` picks the
device's fast dtype and says so in the log, naming the checkpoint's own dtype and how to
change it; ``dtype="auto"`` follows the checkpoint's own dtype, as transformers does; an
explicit dtype is what runs."""

from __future__ import annotations

import logging

import pytest
import torch

from acb import Engine, EngineConfig
from acb.model.loading import checkpoint_dtype, default_dtype
from acb.testing import tiny_model, tiny_tokenizer


@pytest.fixture
def bf16_checkpoint(tmp_path):
    model = tiny_model("llama", seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def test_the_checkpoint_dtype_is_read_from_its_config(bf16_checkpoint, tmp_path_factory):
    assert checkpoint_dtype(bf16_checkpoint) == "bfloat16"
    assert checkpoint_dtype(tmp_path_factory.mktemp("empty")) is None
    assert checkpoint_dtype("folder", "model.gguf") == "float32"  # acb dequantizes GGUF to float32


@pytest.mark.parametrize("dtype,want", [("auto", "bfloat16"), ("float32", "float32"), (None, default_dtype("cpu"))])
def test_from_pretrained_runs_the_dtype_asked_for(bf16_checkpoint, dtype, want, caplog):
    with caplog.at_level(logging.INFO, logger="acb"):
        engine = Engine.from_pretrained(str(bf16_checkpoint), config=EngineConfig(num_blocks=32, dtype=dtype))
    assert engine.stats().dtype == want
    assert next(engine.model.parameters()).dtype == getattr(torch, want)
    said = [r.getMessage() for r in caplog.records if "running the model in" in r.getMessage()]
    if dtype is None:  # the default is announced with the checkpoint's dtype and both ways out
        assert len(said) == 1
        assert f"running the model in {want}" in said[0] and "checkpoint's own dtype: bfloat16" in said[0]
        assert "dtype='float32'" in said[0] and "dtype='auto'" in said[0]
    else:
        assert said == []


def test_the_default_on_this_cpu_follows_its_bf16_support():
    from acb.kernels import cpu_linear

    want = "bfloat16" if cpu_linear.available(torch.bfloat16) else "float32"
    assert default_dtype("cpu") == want
    assert default_dtype("cuda") == "bfloat16"
