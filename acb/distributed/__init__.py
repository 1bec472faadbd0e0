"""Tensor parallelism on ``torch.distributed``: one engine over N processes or GPUs.

``acb.EngineConfig(tensor_parallel_size=N)`` is all a user sets: the engine's process
is rank 0 (event loop, scheduler, KV allocator, sampling and streaming, as with one
rank) and acb starts the other N - 1 ranks. Under ``torchrun`` the ranks other than 0
call :func:`run_worker` instead. See docs/distributed.md.
"""

from .group import TensorParallel


def run_worker(*args, **kwargs) -> None:
    """Serve as a rank other than 0 until rank 0's engine closes (see
    :func:`acb.distributed.worker.run_worker`)."""
    from .worker import run_worker as run

    run(*args, **kwargs)


__all__ = ["TensorParallel", "run_worker"]
