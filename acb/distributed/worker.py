"""A rank other than 0 of a tensor-parallel engine: receive the model's share, then loop
receive step -> forward until rank 0 says stop.

acb starts these itself (``python -m acb.distributed.worker --rank R ...``, one child
process per rank). Under ``torchrun`` every rank other than 0 calls :func:`run_worker`
(``acb serve`` does so on its own), or runs this module with no arguments::

    torchrun --nproc-per-node 2 -m acb.distributed.worker      # ranks 1.., rank 0 serves
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.step import SamplingBatch
from ..worker import sizing
from ..worker.runner import ModelRunner
from . import group, protocol, sharding

log = logging.getLogger("acb")


def run_worker(rank: int | None = None, size: int | None = None, store_address: str | None = None) -> None:
    """Serve as rank ``rank`` (not 0) of a tensor-parallel engine until rank 0 closes it.

    With no arguments the rank, world size and rendezvous come from ``torchrun``'s
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)::

        import acb
        if int(os.environ["RANK"]) != 0:
            acb.distributed.run_worker()      # returns when rank 0's engine closes
        else:
            engine = acb.Engine.from_pretrained(path, config=acb.EngineConfig(tensor_parallel_size=2))
    """
    timeout = timedelta(seconds=group.START_TIMEOUT_S)  # until rank 0 sends the engine's own
    if store_address is None:
        if not group.launched_by_torchrun():
            raise RuntimeError("run_worker() without arguments needs torchrun's RANK, WORLD_SIZE, MASTER_ADDR "
                               "and MASTER_PORT")
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _, _ = next(dist.rendezvous("env://", rank, size, timeout=timeout))
    else:
        host, port = store_address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), size, False, timeout=timeout)
    if not rank:
        raise ValueError("run_worker serves the ranks other than 0; rank 0 is the engine's process")
    store.set(group.READY_KEY.format(rank), "1")
    ctrl = group.control_group(store, rank, size)
    start = group.broadcast_object(ctrl)
    timeout = start["timeout"]
    torch.set_num_threads(start["threads"])
    device = _device(torch.device(start["device"]), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    data = group.step_group(store, rank, size, device, timeout, ctrl)
    config = start["engine_config"]
    model = sharding.skeleton(start["model_class"], sharding.shard_config(start["config"], size), start["dtype"])
    with torch.no_grad():
        for _, tensor in sharding.tensors(model):
            ctrl.recv([tensor], 0, 0).wait()
    model.to(device)
    reduce = sharding.RowReduce(data, rank, timeout)
    sharding.install(model, reduce)
    group.agree_capacity(ctrl, sizing.layout(model, config))
    layout = group.broadcast_object(ctrl)
    args, kwargs = group.runner_args(layout, config)
    runner = ModelRunner(model, *args, row_reduce=reduce, **kwargs)
    runner.configure_fast_paths(config, layout.max_requests)
    channel = protocol.Channel(data, device, timeout)
    store.set(group.SERVING_KEY.format(rank), "1")
    _serve(runner, channel, rank)


def _device(rank0: torch.device, rank: int) -> torch.device:
    if rank0.type != "cuda":
        return rank0
    if "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", (rank0.index or 0) + rank)


def _check_tables(runner: ModelRunner, tables, rank: int) -> int:
    """0 if this rank's block-table store holds ``tables``; else ``rank`` (logged)."""
    try:
        runner.check_tables(tables)
    except AssertionError as e:
        log.error("acb: tensor-parallel rank %d: %s", rank, e)
        return rank
    return 0


def _serve(runner: ModelRunner, channel: protocol.Channel, rank: int) -> None:
    nothing = SamplingBatch([], [], [], [], False)
    stream = torch.cuda.stream(runner.stream) if runner.stream is not None else contextlib.nullcontext()
    try:
        with torch.inference_mode(), stream:
            while True:
                op, step = channel.receive()
                if op == protocol.OP_STOP:
                    break
                if op == protocol.OP_STEP:
                    step.sampling = nothing  # rank 0 samples: the others keep no logits
                    step.sample = [False] * step.num_rows
                    runner.forward(step)
                elif op == protocol.OP_CHECK:  # step is the scheduler's tables: is the store the same?
                    channel.agree(_check_tables(runner, step, rank))
    finally:
        runner.release()


def _exit_with_parent(parent: int) -> None:
    """End this process once the engine's process is gone, however it ended (a watch
    thread: ``PR_SET_PDEATHSIG`` would fire when the *thread* that started us exits)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="acb-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m acb.distributed.worker",
                                     description="A rank other than 0 of an acb tensor-parallel engine.")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--size", type=int)
    parser.add_argument("--store", help="host:port of rank 0's store (default: torchrun's environment)")
    parser.add_argument("--parent", type=int, help="the engine's process id: exit with it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s acb rank {args.rank}: %(message)s")
    if args.parent is not None:
        _exit_with_parent(args.parent)
    try:
        run_worker(args.rank, args.size, args.store)
    except RuntimeError as e:  # rank 0 went away or timed out: the group is over
        log.error("tensor-parallel rank stopped: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
