"""The ranks of a tensor-parallel engine and what they share: the process groups, the
start-up hand-over (model, weights, agreed capacity) and the runner each rank steps.

Rank 0 is the engine's own process. Its :class:`TensorParallel` starts the other ranks
(``python -m acb.distributed.worker``, one child process each) or, under ``torchrun``,
joins the ranks the launcher started; then it hands each rank its share of the weights
and agrees the KV capacity with them. Every step, rank 0's :class:`TPModelRunner`
broadcasts the step (acb.distributed.protocol) and computes its own share; the
row-parallel projections' all-reduces keep the ranks in lock step.

The groups are ``torch.distributed`` process groups of their own (not the default
group), so several engines, and a user's own ``init_process_group``, can share a
process. Every collective runs under ``EngineConfig.distributed_timeout_s``; while the
engine idles rank 0 broadcasts a heartbeat, so a waiting rank never mistakes an idle
engine for a dead one, and a rank that dies is noticed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.config import EngineConfig
from ..core.errors import DeviceError, caused
from ..core.step import StepInput
from ..worker import sizing
from ..worker.runner import ModelRunner
from . import protocol, sharding

log = logging.getLogger("acb")

READY_KEY = "acb/tp/ready/{}"  # a rank joined the store
SERVING_KEY = "acb/tp/serving/{}"  # a rank built its runner and waits for steps
# Starting a rank (importing torch) and building its runner (compiling acb's native
# kernels) can take minutes on a busy machine: the ranks wait for each other on the
# store for that, not in a collective.
START_TIMEOUT_S = 900.0


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a ``torchrun`` (or compatible) launch."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def control_group(store, rank: int, size: int):
    """The gloo group of start-up (pickled objects, weights) and, on CPU, of the steps,
    whose collectives each pass the step timeout; start-up waits up to START_TIMEOUT_S."""
    return dist.ProcessGroupGloo(dist.PrefixStore("acb/tp/gloo", store), rank, size,
                                 timedelta(seconds=START_TIMEOUT_S))


def step_group(store, rank: int, size: int, device: torch.device, timeout: timedelta, control):
    """The group of the steps' broadcasts and all-reduces: NCCL on CUDA, else ``control``."""
    if device.type != "cuda":
        return control
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("acb/tp/nccl", store), rank, size, options)


def broadcast_object(group, obj=None):
    """Rank 0 sends ``obj`` (pickled, start-up only); the other ranks return it."""
    payload = pickle.dumps(obj) if obj is not None else b""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    group.broadcast(size, 0).wait()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(
        int(size), dtype=torch.uint8)
    group.broadcast(data, 0).wait()
    return obj if payload else pickle.loads(data.numpy().tobytes())


def agree_capacity(group, layout: sizing.Layout) -> tuple[int, int]:
    """(KV pages, offload pages) every rank can hold: the minimum over the ranks."""
    mine = torch.tensor([layout.num_pages, layout.host_pages], dtype=torch.int64)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MIN
    group.allreduce([mine], options).wait()
    return int(mine[0]), int(mine[1])


def runner_config(config: EngineConfig, warn: bool = False) -> EngineConfig:
    """The runner's settings on a tensor-parallel rank: decode steps run eagerly (a
    CUDA graph would capture one rank's collectives)."""
    if warn and (config.q_padding_interval_size or config.kv_padding_interval_size):
        log.warning("acb: q_padding_interval_size / kv_padding_interval_size have no effect with "
                    "tensor_parallel_size > 1 (decode steps run eagerly, unpadded)")
    return dataclasses.replace(config, use_cuda_graph=False, q_padding_interval_size=0,
                               kv_padding_interval_size=0, fault_hook=None)


def runner_args(layout: sizing.Layout, config: EngineConfig) -> tuple[tuple, dict]:
    return ((layout.num_pages, layout.page_size, config.attn_backend),
            dict(host_pages=layout.host_pages, swa_pages=layout.swa_pages, swa_layers=layout.swa_layers))


def _kill(procs: list[subprocess.Popen]) -> None:
    """End every rank process still running and reap it (no zombie, no orphan)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end
            log.error("acb: tensor-parallel rank process %d did not exit", proc.pid)


class TensorParallel:
    """Rank 0 of a tensor-parallel group: starts (or joins) the other ranks, shards the
    model, agrees capacity, and owns the group until :meth:`close`.

    Raises ``ValueError`` naming ``tensor_parallel_size`` when the model cannot be split
    that many ways."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        sharding.check(model.config, size)
        self.size = size
        self.timeout = timedelta(seconds=config.distributed_timeout_s)
        self.device = torch.device(config.device) if config.device else next(model.parameters()).device
        if self.device.type == "cuda" and not launched_by_torchrun():
            first = self.device.index or 0
            if torch.cuda.device_count() < first + size:
                raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices from {self.device}; "
                                 f"found {torch.cuda.device_count()}")
            self.device = torch.device("cuda", first)
        self.procs: list[subprocess.Popen] = []
        self.error: DeviceError | None = None
        self.lock = threading.Lock()  # one message, and the collectives of its step, at a time
        self.last_send = time.monotonic()
        self._closed = threading.Event()
        self._finalizer = weakref.finalize(self, _kill, self.procs)
        self._threads = torch.get_num_threads()
        try:
            self._start(model, config)
        except BaseException:
            self._closed.set()
            _kill(self.procs)
            raise
        self._heartbeat = threading.Thread(target=self._beat, name="acb-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------ start-up
    def _start(self, model: torch.nn.Module, config: EngineConfig) -> None:
        store = self._rendezvous()
        self.ctrl = control_group(store, 0, self.size)
        threads = self._threads
        if self.device.type == "cpu":
            threads = max(1, self._threads // self.size)  # the ranks share this machine's cores
            torch.set_num_threads(threads)
        dtype = next(model.parameters()).dtype
        broadcast_object(self.ctrl, dict(
            model_class=type(model), config=model.config, dtype=dtype, engine_config=runner_config(config),
            device=str(self.device), threads=threads, timeout=self.timeout))
        self.data = step_group(store, 0, self.size, self.device, self.timeout, self.ctrl)
        self.model = sharding.build_local(model, self.size, 0, self.device)
        self._send_weights(model)
        self.reduce = sharding.RowReduce(self.data, 0, self.timeout)
        sharding.install(self.model, self.reduce)
        layout = sizing.layout(self.model, config)
        pages, host_pages = agree_capacity(self.ctrl, layout)
        if pages != layout.num_pages:
            layout = sizing.layout(self.model, dataclasses.replace(config, num_blocks=pages))
        self.layout = dataclasses.replace(layout, host_pages=host_pages)
        broadcast_object(self.ctrl, self.layout)
        self.channel = protocol.Channel(self.data, self.device, self.timeout)
        self._wait_for(SERVING_KEY, max(START_TIMEOUT_S, self.timeout.total_seconds()))
        log.info("acb: tensor parallel over %d ranks (%s, %s); %d KV pages per rank", self.size,
                 "spawned" if self.procs else "torchrun", self.device, self.layout.num_pages)

    def _rendezvous(self):
        if launched_by_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if int(os.environ["RANK"]) != 0 or world != self.size:
                raise ValueError(f"tensor_parallel_size={self.size}: under torchrun the engine runs on rank 0 of "
                                 f"a world of that size (RANK={os.environ['RANK']}, WORLD_SIZE={world}); the "
                                 f"other ranks run acb.distributed.run_worker()")
            self.store, _, _ = next(dist.rendezvous("env://", 0, world, timeout=timedelta(seconds=START_TIMEOUT_S)))
            return self.store
        store = self.store = dist.TCPStore("127.0.0.1", 0, self.size, True,
                                           timeout=timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False)
        for rank in range(1, self.size):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "acb.distributed.worker", "--rank", str(rank), "--size", str(self.size),
                 "--store", f"127.0.0.1:{store.port}", "--parent", str(os.getpid())],
                stdin=subprocess.DEVNULL))
        self._wait_for(READY_KEY, max(START_TIMEOUT_S, self.timeout.total_seconds()))
        return store

    def _wait_for(self, key: str, timeout_s: float) -> None:
        """Wait until every other rank has set ``key`` in the store; fail fast if one of
        the processes acb started exits instead."""
        deadline = time.monotonic() + timeout_s
        keys = [key.format(r) for r in range(1, self.size)]
        while not self.store.check(keys):
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank process {proc.pid} exited with {proc.returncode} "
                                       f"while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not start within {timeout_s:g} s")
            time.sleep(0.05)

    def _send_weights(self, model: torch.nn.Module) -> None:
        splitter = sharding.Splitter(model.config, model.base_model_prefix, self.size)
        full = sharding.full_tensors(model)
        with torch.no_grad():
            for name, target in sharding.tensors(self.model):
                for rank in range(1, self.size):
                    # the receiving rank's skeleton has rank 0's dtypes (sharding.build_local): sent as
                    # another dtype, the bytes would not fill it (a bf16 model's inv_freq: 2 bytes of 4)
                    piece = splitter.piece(name, full[name], rank).to("cpu", target.dtype).contiguous()
                    self.ctrl.send([piece], rank, 0).wait()

    # ------------------------------------------------------------------ steps
    def runner(self, layout: sizing.Layout, config: EngineConfig) -> TPModelRunner:
        """Rank 0's model runner (the engine creates it when it starts)."""
        args, kwargs = runner_args(layout, config)
        return TPModelRunner(self, *args, **kwargs)

    def check(self) -> None:
        """Raise the group's failure, if it has failed."""
        if self.error is not None:
            raise self.error

    def fail(self, cause: BaseException) -> DeviceError:
        """The group is broken (a rank died, hung past the timeout, or the ranks fell out
        of step): end every rank and return the error the engine stops with."""
        if self.error is None:
            self.error = caused(DeviceError(
                f"a tensor-parallel rank failed or timed out ({self.timeout.total_seconds():g} s): {cause}"), cause)
            log.error("acb: %s", self.error)
            self._closed.set()
            _kill(self.procs)
        return self.error

    def _beat(self) -> None:
        interval = max(0.2, min(5.0, self.timeout.total_seconds() / 4))
        while not self._closed.wait(interval / 2):
            with self.lock:
                if self._closed.is_set() or time.monotonic() - self.last_send < interval:
                    continue
                try:
                    self.channel.send_op(protocol.OP_IDLE)
                    self.last_send = time.monotonic()
                except Exception as e:
                    self.fail(e)
                    return

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop every rank (they exit) and release the groups. Idempotent."""
        if getattr(self, "_done", False):
            return
        self._done = True
        self._closed.set()
        if self.error is None:
            try:
                with self.lock:
                    self.channel.send_op(protocol.OP_STOP)
            except Exception as e:  # already broken: the kill below ends the ranks
                log.warning("acb: could not tell the tensor-parallel ranks to stop: %s", e)
        for proc in self.procs:
            try:
                proc.wait(timeout=min(30.0, self.timeout.total_seconds()))
            except subprocess.TimeoutExpired:
                log.warning("acb: tensor-parallel rank process %d did not stop; killing it", proc.pid)
        _kill(self.procs)
        self._heartbeat.join()
        torch.set_num_threads(self._threads)
        self.ctrl = self.data = self.reduce = self.channel = None


class TPModelRunner(ModelRunner):
    """Rank 0's runner: broadcasts each step to the other ranks, then computes its own
    share. A failure once the step is on its way leaves the ranks out of step, so it
    ends the group (a ``DeviceError``: the engine fails the step's requests and stops);
    sampling, which rank 0 does alone, fails like any step."""

    def __init__(self, tp: TensorParallel, *args, **kwargs) -> None:
        super().__init__(tp.model, *args, row_reduce=tp.reduce, **kwargs)
        self.tp = tp

    def configure_fast_paths(self, config, max_rows: int, *, pad_on_cpu: bool = False) -> None:
        super().configure_fast_paths(runner_config(config, warn=True), max_rows)

    def check_tables(self, tables) -> None:
        """Rank 0's store, then every other rank's: each checks its own against the tables
        sent to it; AssertionError naming a rank whose store differs."""
        super().check_tables(tables)
        tp = self.tp
        with tp.lock:
            tp.check()
            tp.channel.send_check(tables)
            tp.last_send = time.monotonic()
            bad = tp.channel.agree(0)
        assert not bad, (f"tensor-parallel rank {bad}: its block-table store differs from the scheduler's "
                         "tables (its log says where)")

    def forward(self, step: StepInput) -> tuple:
        tp = self.tp
        with tp.lock:
            tp.check()
            try:
                tp.channel.send(step, self.prev_sampled)
                tp.last_send = time.monotonic()
                return super().forward(step)
            except Exception as e:
                raise tp.fail(e) from e
