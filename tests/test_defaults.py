"""``acb.core.defaults.resolve``: every "None: choose" of an EngineConfig decided in one place,
the environment's overrides applied there and nowhere else."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import acb
from acb.core.defaults import ENV_OVERRIDES, resolve
from acb.testing import runner_of, tiny_engine, tiny_model

# decided by resolve (the rest of the None defaults mean "none" / "no bound" on purpose)
RESOLVED = ("page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "safety_margin",
            "varlen_compile_level", "decode_compile_level", "device", "dtype", "max_waiting_requests")


def test_plain_defaults_are_decided_without_a_model():
    config = resolve(acb.EngineConfig(), environ={})
    assert (config.page_size, config.max_requests_per_batch, config.safety_margin) == (16, 256, 0.15)
    assert (config.varlen_compile_level, config.decode_compile_level) == (0, 0)
    assert resolve(acb.EngineConfig(scheduler="prefill_first"), environ={}).safety_margin == 0.0
    assert resolve(acb.EngineConfig(compile_level=2, decode_compile_level=0), environ={}).varlen_compile_level == 2
    # what the user set is kept; resolving twice changes nothing
    mine = acb.EngineConfig(page_size=8, safety_margin=0.3, max_requests_per_batch=3)
    assert resolve(mine, environ={}) == dataclasses.replace(mine, varlen_compile_level=0, decode_compile_level=0)
    assert resolve(config, environ={}) is config


@pytest.mark.parametrize(("var", "name"), sorted(ENV_OVERRIDES.items()))
def test_the_environment_only_turns_a_cpu_switch_off(var, name):
    assert getattr(resolve(acb.EngineConfig(), environ={var: "0"}), name) is False
    assert getattr(resolve(acb.EngineConfig(), environ={var: "1"}), name) is True
    assert getattr(resolve(acb.EngineConfig(**{name: False}), environ={var: "1"}), name) is False


async def test_an_engine_holds_its_config_with_every_default_decided():
    async with tiny_engine(num_blocks=None, max_memory_percent=0.001) as engine:
        config = engine.config
        assert all(getattr(config, name) is not None for name in RESOLVED), config
        assert (config.num_blocks, config.max_batch_tokens, config.page_size) == \
            (engine.num_pages, engine.max_batch_tokens, engine.page_size)
        assert (config.device, config.dtype) == ("cpu", "float32")
        assert config.max_waiting_requests == 4 * engine.max_requests == engine.max_waiting
        assert engine.scheduler.safety_margin == config.safety_margin == 0.15


def test_a_model_in_a_dtype_the_config_cannot_name_keeps_none():
    """A float64 model runs as it is (PyTorch attention): its config's dtype stays None
    rather than a value EngineConfig would refuse."""
    engine = acb.Engine(tiny_model("llama").to(torch.float64), config=acb.EngineConfig(num_blocks=16))
    assert engine.config.dtype is None and engine.attn_backend == "torch"


async def test_an_environment_override_reaches_the_engine(monkeypatch):
    monkeypatch.setenv("ACB_CPU_PREPACK", "0")
    async with tiny_engine() as engine:
        assert engine.config.cpu_prepack is False and not runner_of(engine).fast_paths.prepacked
        await engine.generate([5, 6, 7], max_new_tokens=2)
    monkeypatch.setenv("ACB_CPU_KERNEL", "0")
    with pytest.raises(ValueError, match="cpu_kernels=False"):
        tiny_engine(attn_backend="native")
