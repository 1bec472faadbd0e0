"""LoRA adapters on the device: the stacked weights, and the per-row delta of one step.

Rows of one step may each run a different adapter (or none). Per projection the step
adds, for each adapter ``i`` present in it, over the token rows ``g`` that run it::

    y[g] += scaling_i * (x[g] @ A_i^T) @ B_i^T

(the segmented / gathered LoRA of punica and vLLM, one small GEMM pair per adapter,
here with PyTorch ops, so the same code serves the CPU and CUDA). The weights live in
stacked tensors per (layer, projection), ``A`` [max_adapters, max_rank, in] and ``B``
[max_adapters, out, max_rank]: an adapter owns a slot, and an unloaded adapter's slot
is reused by the next one.

Where the delta is added: the fused CPU forward (``acb.fused``) runs its layers
without their GEMM epilogues in a step with adapter rows (the base-only steps
keep their fused epilogues); transformers' forward (other dtypes and architectures'
layers, CUDA, a step with a user hook) gets it from a forward hook on each target
projection, which does nothing outside acb's steps. The step's :class:`StepLora` is
thread-local (``set_step``): a copy of the model run elsewhere meanwhile sees none.

Loading and unloading (``Engine.load_adapter``): weights are read and checked on a
worker thread and written into a free slot there (no step reads a free slot); the
slot's views are switched on and off on the step thread, between steps.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F  # noqa: N812

from .lora_source import _ATTN, TARGETS, AdapterWeights

if TYPE_CHECKING:
    from .step import StepInput

_local = threading.local()


def current() -> StepLora | None:
    """The step being computed on this thread, if it has adapter rows."""
    return getattr(_local, "step", None)


def set_step(step: StepLora | None) -> None:
    _local.step = step


def why_not(model: torch.nn.Module, config) -> str | None:
    """Why this engine cannot run adapters (naming the setting), or None."""
    if config.max_adapters == 0:
        return "EngineConfig.max_adapters=0: build the engine with max_adapters >= 1 to load adapters"
    if config.tensor_parallel_size > 1:
        return "adapters are not sharded yet: they need tensor_parallel_size=1"
    if config.compile_level or config.varlen_compile_level or config.decode_compile_level:
        return "adapters need compile_level=0 (the compiled forward does not run the LoRA hooks)"
    if config.quantization is not None:
        return f"adapters are not supported with quantization={config.quantization!r} (int8 forward)"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(_projection(block, p) is not None for block in layers for p in TARGETS):
        return "the model is not a decoder with q/k/v/o_proj and gate/up/down_proj linears in model.layers"
    return None


def _projection(block: torch.nn.Module, proj: str) -> torch.nn.Module | None:
    parent = getattr(block, "self_attn" if proj in _ATTN else "mlp", None)
    module = getattr(parent, proj, None)
    return module if isinstance(getattr(module, "weight", None), torch.Tensor) else None


class LoraBank:
    """The adapters' stacked weights over one model, and what each slot holds."""

    def __init__(self, model: torch.nn.Module, max_adapters: int, max_rank: int) -> None:
        self.model = model
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.layers = len(model.model.layers)
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}  # made on first load
        # views[layer][proj][slot]: (A [r, in], B [out, r], scaling) of the adapter in that slot, or None
        self.views = [{p: [None] * max_adapters for p in TARGETS} for _ in range(self.layers)]
        self.active = [False] * max_adapters
        self.scaling = [0.0] * max_adapters  # each slot's adapter's scaling
        self._alloc = threading.Lock()
        self._hooks: list = []
        # names this bank to its hooks: an engine's step adds its own deltas only, and a deep copy
        # of the model (a reference run) gets a new token its hooks never see
        self.token = object()

    # ------------------------------------------------------------------ loading (worker threads)
    def write(self, slot: int, adapter: AdapterWeights) -> dict:
        """Copy ``adapter`` into free ``slot`` (off the step thread: no step reads a free
        slot); return the slot's new views, for :meth:`activate`."""
        self._allocate()
        r = adapter.rank
        views = {}
        for sa, sb in self.stacks.values():  # what an earlier adapter left there: the batched path reads
            sa[slot].zero_()  # every rank row and every projection of the slots it runs
            sb[slot].zero_()
        for (layer, proj), (a, b) in adapter.weights.items():
            sa, sb = self.stacks[(layer, proj)]
            sa[slot, :r].copy_(a)
            sb[slot, :, :r].copy_(b)
            views[(layer, proj)] = (sa[slot, :r], sb[slot, :, :r], adapter.scaling)
        return views

    def _allocate(self) -> None:
        with self._alloc:
            if self.stacks:
                return
            param = next(self.model.parameters())
            for layer, block in enumerate(self.model.model.layers):
                for proj in TARGETS:
                    out_features, in_features = _projection(block, proj).weight.shape
                    kw = dict(dtype=param.dtype, device=param.device)
                    self.stacks[(layer, proj)] = (torch.zeros(self.max_adapters, self.max_rank, in_features, **kw),
                                                  torch.zeros(self.max_adapters, out_features, self.max_rank, **kw))

    # ------------------------------------------------------------------ the step thread, between steps
    def activate(self, slot: int, views: dict) -> None:
        for layer in range(self.layers):
            for proj in TARGETS:
                self.views[layer][proj][slot] = views.get((layer, proj))
        self.scaling[slot] = next(iter(views.values()))[2]
        self.active[slot] = True

    def deactivate(self, slot: int) -> None:
        for per_layer in self.views:
            for proj in TARGETS:
                per_layer[proj][slot] = None
        self.active[slot] = False

    # ------------------------------------------------------------------ per step
    def step(self, step: StepInput, to_device) -> StepLora | None:
        """The LoRA of ``step`` (its token rows grouped by adapter slot), or None when no
        row runs an adapter."""
        slots = step.adapters
        if not slots or max(slots) < 0:
            return None
        offsets = step.token_offsets
        runs: list[tuple[int, int, int]] = []  # (slot, lo, hi): a row of many tokens (a prompt chunk)
        rows: dict[int, list[int]] = {}  # slot -> its rows of few tokens (decode rows)
        for i, slot in enumerate(slots):
            lo, hi = offsets[i], offsets[i + 1]
            if slot < 0 or hi == lo:
                continue
            if not self.active[slot]:
                raise RuntimeError(f"a row runs LoRA slot {slot}, which holds no adapter")
            if hi - lo >= StepLora.RUN_ROWS:
                runs.append((slot, lo, hi))
            else:
                rows.setdefault(slot, []).extend(range(lo, hi))
        for slot, idx in list(rows.items()):
            if idx[-1] - idx[0] + 1 == len(idx):  # one run after all (ascending, no repeats)
                runs.append((slot, idx[0], idx[-1] + 1))
                del rows[slot]
        if not runs and not rows:
            return None  # only forked rows of no tokens
        if not rows:
            return StepLora(self.views, runs, token=self.token)
        widest = max(len(idx) for idx in rows.values())
        if len(rows) > 1 and self.max_adapters * widest <= 2 * sum(map(len, rows.values())) + 64:
            return self._batched(runs, rows, widest, to_device)
        groups, perm = [], []
        for slot, idx in rows.items():  # the rows gathered group after group: each a contiguous run there
            groups.append((slot, len(perm), len(perm) + len(idx)))
            perm += idx
        return StepLora(self.views, runs, groups, to_device(perm), token=self.token)

    def _batched(self, runs: list, rows: dict[int, list[int]], widest: int, to_device) -> StepLora:
        """Interleaved rows of several adapters (decode rows): every slot's rows padded to
        ``widest`` and run as one batched GEMM pair over the whole stack, the padding and the
        slots this step does not run masked to zero (punica's BGMV, with PyTorch's bmm)."""
        param = next(iter(self.stacks.values()))[0]
        index = [0] * (self.max_adapters * widest)  # padding: row 0, its contribution masked to 0
        mask = torch.zeros(self.max_adapters, widest, 1, dtype=param.dtype)
        for slot, idx in rows.items():
            index[slot * widest: slot * widest + len(idx)] = idx
            mask[slot, : len(idx)] = self.scaling[slot]
        return StepLora(self.views, runs, [(slot, 0, 0) for slot in rows], to_device(index),
                        batched=(self.stacks, mask.to(param.device), widest), token=self.token)

    # ------------------------------------------------------------------ transformers' forward
    def install_hooks(self) -> None:
        """A forward hook on each target projection: it adds the step's LoRA delta when
        acb's step on this thread has adapter rows. acb's own hooks (``_acb_own``) do not
        make the model watch (``acb.watch``) send steps to transformers' forward."""
        if self._hooks:
            return
        for layer, block in enumerate(self.model.model.layers):
            for proj in TARGETS:
                hook = functools.partial(_hook, self.token, layer, proj)
                hook._acb_own = True
                self._hooks.append(_projection(block, proj).register_forward_hook(hook))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _hook(token: object, layer: int, proj: str, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
    step = current()
    if step is not None and step.token is token:  # this bank's step (two engines may share a model)
        x = args[0]
        step.add(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), layer, proj)


class StepLora:
    """One step's adapters: ``runs``, rows of many tokens (prompt chunks) or an adapter's
    rows that are one run of the packed rows, computed in place on their slices; and the
    rest, rows of few tokens (decode rows) of interleaved adapters, gathered by ``perm``:
    ``groups`` gives each slot's run of the gathered rows, or with ``batched`` every slot
    is padded to the same width and all run as one batched GEMM pair."""

    __slots__ = ("views", "runs", "groups", "perm", "batched", "run_threads", "threads", "token", "_gathered")

    # Below this many rows the LoRA GEMMs run on one thread: for [rows, in] x [in, r] the
    # OpenMP fork/join costs more than the work (measured: benchmarks/adapters.py)
    SINGLE_THREAD_ROWS = 256
    RUN_ROWS = 16  # a row of at least this many tokens is computed on its own slice

    def __init__(self, views: list, runs: list[tuple[int, int, int]], groups: list[tuple[int, int, int]] = (),
                 perm: torch.Tensor | None = None, batched: tuple | None = None, token: object = None) -> None:
        self.views = views
        self.token = token  # the LoraBank's (its hooks add this step's deltas, no other bank's)
        self.runs = runs
        self.groups = groups
        self.perm = perm
        # (stacks, mask [max_adapters, widest, 1]: each slot's scaling on its rows, else 0, widest):
        # ``perm`` then gathers every slot's rows padded to ``widest``
        self.batched = batched
        single = self.SINGLE_THREAD_ROWS
        self.run_threads = 1 if sum(hi - lo for _, lo, hi in runs) < single else 0  # 0: the process's
        self.threads = 1 if perm is not None and len(perm) < single else 0
        self._gathered: tuple = (None, None, None)  # (input, its data_ptr and shape, its gathered rows)

    def touches(self, layer: int, proj: str) -> bool:
        """Whether an adapter of this step has weights on ``proj`` of ``layer``."""
        views = self.views[layer][proj]
        return any(views[slot] is not None for slot, _, _ in self.runs) or \
            any(views[slot] is not None for slot, _, _ in self.groups)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> None:
        """``y[g] += scaling * B(A(x[g]))`` in place, for each adapter's rows ``g`` (``y``
        and ``x`` 2-D, rows past the step's tokens being padding)."""
        views = self.views[layer][proj]
        threads = torch.get_num_threads()
        try:
            if self.runs:
                torch.set_num_threads(self.run_threads or threads)
                for slot, lo, hi in self.runs:  # in place on the run's rows: no gather, no scatter
                    if views[slot] is not None:
                        a, b, scaling = views[slot]
                        y[lo:hi].addmm_(F.linear(x[lo:hi], a), b.t(), alpha=scaling)
            if self.perm is None:
                return
            torch.set_num_threads(self.threads or threads)
            xs = self._gather(x)
            if self.batched is not None:
                self._add_batched(y, xs, layer, proj)
                return
            delta = y.new_empty(xs.shape[0], y.shape[1])
            for slot, lo, hi in self.groups:
                if views[slot] is None:
                    delta[lo:hi].zero_()
                else:
                    a, b, scaling = views[slot]
                    delta[lo:hi].addmm_(F.linear(xs[lo:hi], a), b.t(), beta=0, alpha=scaling)
            y.index_add_(0, self.perm, delta)
        finally:
            torch.set_num_threads(threads)

    def _add_batched(self, y: torch.Tensor, xs: torch.Tensor, layer: int, proj: str) -> None:
        views = self.views[layer][proj]
        if all(views[slot] is None for slot, _, _ in self.groups):
            return
        stacks, mask, widest = self.batched
        a, b = stacks[(layer, proj)]  # [slots, rank, in], [slots, out, rank]
        h = torch.bmm(xs.view(a.shape[0], widest, -1), a.transpose(1, 2))
        h.mul_(mask)
        y.index_add_(0, self.perm, torch.bmm(h, b.transpose(1, 2)).view(-1, y.shape[1]))

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s adapter rows, gathered once for the projections that share it (q/k/v,
        gate/up); the held reference keeps ``x``'s memory from being reused meanwhile."""
        held, key, xs = self._gathered
        if held is None or key != (x.data_ptr(), x.shape):
            xs = x.index_select(0, self.perm)
            self._gathered = (x, (x.data_ptr(), x.shape), xs)
        return xs
