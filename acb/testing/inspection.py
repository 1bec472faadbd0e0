"""The one seam through which tests look inside a running engine.

acb's own tests (and benchmarks) need to see what the public API does not show: which
attention path served a step, whether a step's input was carried over on the device,
the KV tensors. They reach it here, never through an engine's private attributes, so
the engine's internals can change behind one documented surface.

Example::

    from acb.testing import step_counts, tiny_engine

    async with tiny_engine() as engine:
        await engine.generate("hello", max_new_tokens=8)
        assert step_counts(engine).carried > 0  # step overlap fed tokens on the device
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ..engine.engine import Engine
    from ..worker.runner import ModelRunner


def runner_of(engine: Engine) -> ModelRunner:
    """The model runner serving ``engine`` (rank 0's, when tensor-parallel): its KV
    store (``kv``), fast paths (``fast_paths``) and counters. ``RuntimeError`` before ``start()`` or after
    ``aclose()``, when there is none."""
    runner = engine.runner
    if runner is None:
        raise RuntimeError("the engine has no model runner: it is not started, or closed")
    return runner


class StepCounts(NamedTuple):
    """How the engine's steps ran so far (see :func:`step_counts`)."""

    carried: int  # steps fed a token sampled by the step before, on the device (step overlap)
    fast_decode: int  # steps whose decode rows ran on a kernel reading the pages in place
    plain: int  # steps that ran the model's own forward (a hook or a replaced forward was seen)


def step_counts(engine: Engine) -> StepCounts:
    """A snapshot of ``engine``'s step counters (read between steps; they only grow)."""
    runner = runner_of(engine)
    return StepCounts(runner.carried_steps, runner.fast_decode_steps, runner.plain_steps)


def speculate_always(engine: Engine) -> None:
    """Make ``engine`` (built with ``EngineConfig(speculative_method=...)``) propose every
    token it finds, whatever its cost model says: tests of verification then do not depend
    on the machine's timings (the cost model, fed measured step times, may turn proposals
    down on a loaded machine), nor on the batch size (``acb.core.speculative.MAX_SPECULATIVE_ROWS``
    is lifted too)."""
    speculation = engine.scheduler.speculation
    if speculation is None:
        raise ValueError("the engine has no speculative decoding (EngineConfig.speculative_method is None)")
    speculation.adaptive = False
