"""LoRA adapters on the device: the stacked weights, and the per-row delta of one step.

Rows of one step may each run a different adapter (or none). Per projection the step
adds, for each adapter ``i`` present in it, over the token rows ``g`` that run it::

    y[g] += scaling_i * (x[g] @ A_i^T) @ B_i^T

(the segmented / gathered LoRA of punica and vLLM). The weights live in stacked tensors
transposed for the GEMMs: per (layer, projection group) ``At`` [max_adapters, in, C], the
``A`` of the projections that share an input side by side (q/k/v: C = 3 max_rank,
gate/up: 2 max_rank, o and down: max_rank), so one shrink GEMM serves the group; per
(layer, projection) ``Bt`` [max_adapters, max_rank, out]. An adapter owns a slot (its
rank rows past its own rank and the projections it does not target stay zero), and an
unloaded adapter's slot is zeroed whole before the next one is written there.

Where the delta is added: the fused CPU forward (``acb.model.fused``) in float32 calls the
native kernels of ``acb/kernels/csrc/lora_cpu.cpp``, one call per projection group and layer
(every adapter's rows in tiles, no gather; the MLP's activation and product in one pass
when a delta lands in gate/up); in bfloat16 it adds the deltas with PyTorch ops
(``StepLora.add``: one small GEMM pair per adapter and projection). The step's :class:`StepLora`
travels in its forward context (``acb.attention.context.ForwardContext.lora``): the fused forward
takes it as an argument; transformers' forward (other dtypes and architectures' layers, CUDA, a
step with a user hook) gets the deltas from a forward hook on each target projection, which reads
the context that is set while acb's step runs transformers' modules on this thread and does nothing
outside one: a copy of the model run elsewhere meanwhile sees none.

Loading and unloading (``Engine.load_adapter``): weights are read and checked on a
worker thread and written into a free slot there (no step reads a free slot); the
slot's views are switched on and off on the step thread, between steps.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING

import torch

from ..attention import context
from .lora_source import _ATTN, TARGETS, AdapterWeights

if TYPE_CHECKING:
    from ..core.step import StepInput

# The projections that share an input: one shrink GEMM over their concatenated A
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
_GROUP_OF = {proj: (group, i) for group, projs in GROUPS.items() for i, proj in enumerate(projs)}


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
        # made on first load: (layer, group) -> At [slots, in, C]; (layer, proj) -> Bt [slots, max_rank, out]
        self.a_stacks: dict[tuple[int, str], torch.Tensor] = {}
        self.b_stacks: dict[tuple[int, str], torch.Tensor] = {}
        # (layer, proj) -> float32 [slots]: each slot's scaling there, 0 where its adapter does not target
        # it or the slot is off (the native kernels' view; written on the step thread only)
        self.scales: dict[tuple[int, str], torch.Tensor] = {}
        self.native: dict[tuple[int, str], tuple] = {}  # (layer, group) -> (At, [Bt], [scales]) for the kernels
        # views[layer][proj][slot]: (A^T [in, r], B^T [r, out], scaling) of the adapter in that slot, or None
        self.views = [{p: [None] * max_adapters for p in TARGETS} for _ in range(self.layers)]
        self.active = [False] * max_adapters
        self.scaling = [0.0] * max_adapters  # each slot's adapter's scaling
        self.kernels = None  # acb/kernels/csrc/lora_cpu.cpp when the model is float32 on an AVX-512 CPU
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
        r, R = adapter.rank, self.max_rank
        views = {}
        for stack in (*self.a_stacks.values(), *self.b_stacks.values()):  # whatever an earlier adapter left:
            stack[slot].zero_()  # the kernels and the batched path read every rank row of every projection
        for (layer, proj), (a, b) in adapter.weights.items():
            group, i = _GROUP_OF[proj]
            at, bt = self.a_stacks[(layer, group)], self.b_stacks[(layer, proj)]
            at[slot, :, i * R: i * R + r].copy_(a.t())
            bt[slot, :r].copy_(b.t())
            views[(layer, proj)] = (at[slot, :, i * R: i * R + r], bt[slot, :r], adapter.scaling)
        return views

    def _allocate(self) -> None:
        with self._alloc:
            if self.a_stacks:
                return
            param = next(self.model.parameters())
            kw = dict(dtype=param.dtype, device=param.device)
            for layer, block in enumerate(self.model.model.layers):
                for group, projs in GROUPS.items():
                    in_features = _projection(block, projs[0]).weight.shape[1]
                    at = torch.zeros(self.max_adapters, in_features, len(projs) * self.max_rank, **kw)
                    bts, scales = [], []
                    for proj in projs:
                        out_features = _projection(block, proj).weight.shape[0]
                        bts.append(torch.zeros(self.max_adapters, self.max_rank, out_features, **kw))
                        scales.append(torch.zeros(self.max_adapters, dtype=torch.float32))
                        self.b_stacks[(layer, proj)], self.scales[(layer, proj)] = bts[-1], scales[-1]
                    self.a_stacks[(layer, group)] = at
                    self.native[(layer, group)] = (at, bts, scales)
            if param.dtype == torch.float32 and param.device.type == "cpu" and self.max_rank <= 64:
                from ..kernels.cpu import lora_kernels  # built here, off the step thread, on first load

                kernels = lora_kernels()
                self.kernels = kernels if kernels is not None and kernels.available() else None

    def stack(self, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``proj``'s stacked A^T [slots, in, max_rank] (a view) and B^T [slots, max_rank, out]."""
        group, i = _GROUP_OF[proj]
        R = self.max_rank
        return self.a_stacks[(layer, group)][:, :, i * R: (i + 1) * R], self.b_stacks[(layer, proj)]

    # ------------------------------------------------------------------ the step thread, between steps
    def activate(self, slot: int, views: dict) -> None:
        for layer in range(self.layers):
            for proj in TARGETS:
                view = views.get((layer, proj))
                self.views[layer][proj][slot] = view
                self.scales[(layer, proj)][slot] = 0.0 if view is None else view[2]
        self.scaling[slot] = next(iter(views.values()))[2]
        self.active[slot] = True

    def deactivate(self, slot: int) -> None:
        for layer, per_layer in enumerate(self.views):
            for proj in TARGETS:
                per_layer[proj][slot] = None
                self.scales[(layer, proj)][slot] = 0.0
        self.active[slot] = False

    # ------------------------------------------------------------------ per step
    def step(self, step: StepInput, to_device) -> StepLora | None:
        """The LoRA of ``step`` (its token rows grouped by adapter slot), or None when no
        row runs an adapter."""
        slots = step.adapters
        if not slots or max(slots) < 0:
            return None
        offsets = step.token_offsets
        segments: dict[int, list[tuple[int, int]]] = {}  # slot -> its rows' token ranges, ascending
        for i, slot in enumerate(slots):
            lo, hi = offsets[i], offsets[i + 1]
            if slot < 0 or hi == lo:
                continue
            if not self.active[slot]:
                raise RuntimeError(f"a row runs LoRA slot {slot}, which holds no adapter")
            ranges = segments.setdefault(slot, [])
            if ranges and ranges[-1][1] == lo:  # the same adapter as the row before: one run
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
        if not segments:
            return None  # only forked rows of no tokens
        if self.kernels is not None:  # the fused forward's kernels take every row as it is
            native = _native_rows(segments)
        else:
            native = None
        runs: list[tuple[int, int, int]] = []  # (slot, lo, hi): many tokens (prompt chunks, one adapter's rows)
        rows: dict[int, list[int]] = {}  # slot -> its rows of few tokens (decode rows)
        for slot, ranges in segments.items():
            for lo, hi in ranges:
                if hi - lo >= StepLora.RUN_ROWS or len(ranges) == 1:
                    runs.append((slot, lo, hi))
                else:
                    rows.setdefault(slot, []).extend(range(lo, hi))
        if not rows:
            return StepLora(self, runs, native=native)
        widest = max(len(idx) for idx in rows.values())
        if len(rows) > 1 and self.max_adapters * widest <= 2 * sum(map(len, rows.values())) + 64:
            return self._batched(runs, rows, widest, to_device, native)
        groups, perm = [], []
        for slot, idx in rows.items():  # the rows gathered group after group: each a contiguous run there
            groups.append((slot, len(perm), len(perm) + len(idx)))
            perm += idx
        return StepLora(self, runs, groups, to_device(perm), native=native)

    def _batched(self, runs: list, rows: dict[int, list[int]], widest: int, to_device, native) -> StepLora:
        """Interleaved rows of several adapters (decode rows): every slot's rows padded to
        ``widest`` and run as one batched GEMM pair over the whole stack, the padding and the
        slots this step does not run masked to zero (punica's BGMV, with PyTorch's bmm)."""
        param = next(iter(self.b_stacks.values()))
        index = [0] * (self.max_adapters * widest)  # padding: row 0, its contribution masked to 0
        mask = torch.zeros(self.max_adapters, widest, 1, dtype=param.dtype)
        for slot, idx in rows.items():
            index[slot * widest: slot * widest + len(idx)] = idx
            mask[slot, : len(idx)] = self.scaling[slot]
        return StepLora(self, runs, [(slot, 0, 0) for slot in rows], to_device(index),
                        batched=(mask.to(param.device), widest), native=native)

    # ------------------------------------------------------------------ transformers' forward
    def install_hooks(self) -> None:
        """A forward hook on each target projection: it adds the step's LoRA delta when
        acb's step on this thread has adapter rows. acb's own hooks (``_acb_own``) do not
        make the model watch (``acb.model.watch``) send steps to transformers' forward."""
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
    forward = context.current()  # the forward context of acb's step running transformers' modules here
    step = forward.lora if forward is not None else None
    if step is not None and step.token is token:  # this bank's step (two engines may share a model)
        x = args[0]
        step.add(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), layer, proj)


def _native_rows(segments: dict[int, list[tuple[int, int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' view of a step's adapter rows: ``order``, the token rows slot after slot,
    and ``groups``, each slot's (slot, start, count) in ``order``."""
    order: list[int] = []
    groups = []
    for slot, ranges in segments.items():
        start = len(order)
        for lo, hi in ranges:
            order.extend(range(lo, hi))
        groups.append((slot, start, len(order) - start))
    return torch.tensor(order, dtype=torch.long), torch.tensor(groups, dtype=torch.long)


class StepLora:
    """One step's adapters: ``runs``, rows of many tokens (prompt chunks) or an adapter's
    rows that are one run of the packed rows, computed in place on their slices; and the
    rest, rows of few tokens (decode rows) of interleaved adapters, gathered by ``perm``:
    ``groups`` gives each slot's run of the gathered rows, or with ``batched`` every slot
    is padded to the same width and all run as one batched GEMM pair. ``native``: the
    rows as the native kernels take them (:meth:`add_group`), when the bank has them."""

    __slots__ = ("bank", "views", "runs", "groups", "perm", "batched", "native", "slots", "run_threads", "threads",
                 "token", "_gathered")

    # Below this many rows the LoRA GEMMs run on one thread: for [rows, in] x [in, r] the
    # OpenMP fork/join costs more than the work (measured: benchmarks/adapters.py)
    SINGLE_THREAD_ROWS = 256
    RUN_ROWS = 16  # a row of at least this many tokens is computed on its own slice

    def __init__(self, bank: LoraBank, runs: list[tuple[int, int, int]], groups: list[tuple[int, int, int]] = (),
                 perm: torch.Tensor | None = None, batched: tuple | None = None,
                 native: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.bank = bank
        self.views = bank.views
        self.token = bank.token  # the LoraBank's (its hooks add this step's deltas, no other bank's)
        self.runs = runs
        self.groups = groups
        self.perm = perm
        # (mask [max_adapters, widest, 1]: each slot's scaling on its rows, else 0, widest):
        # ``perm`` then gathers every slot's rows padded to ``widest``
        self.batched = batched
        self.native = native
        self.slots = sorted({slot for slot, _, _ in runs} | {slot for slot, _, _ in groups})
        single = self.SINGLE_THREAD_ROWS
        self.run_threads = 1 if sum(hi - lo for _, lo, hi in runs) < single else 0  # 0: the process's
        self.threads = 1 if perm is not None and len(perm) < single else 0
        self._gathered: tuple = (None, None, None)  # (input, its data_ptr and shape, its gathered rows)

    def touches(self, layer: int, proj: str) -> bool:
        """Whether an adapter of this step has weights on ``proj`` of ``layer``."""
        views = self.views[layer][proj]
        return any(views[slot] is not None for slot in self.slots)

    def add_group(self, ys: list[torch.Tensor], x: torch.Tensor, layer: int, group: str) -> None:
        """The deltas of ``group``'s projections (``GROUPS``) on ``ys`` in place, over their
        shared input ``x``: one native call (``acb/kernels/csrc/lora_cpu.cpp``), every slot's rows
        in tiles, no gather; needs ``native``."""
        if any(self.touches(layer, proj) for proj in GROUPS[group]):
            at, bts, scales = self.bank.native[(layer, group)]
            self.bank.kernels.add_(ys, x, at, bts, scales, *self.native)

    def glu_add(self, g: torch.Tensor, u: torch.Tensor, x: torch.Tensor, layer: int, act: int) -> torch.Tensor:
        """``act(g + gate delta) * (u + up delta)``, the deltas over input ``x``, in one native
        pass (``glu_add`` of ``acb/kernels/csrc/lora_cpu.cpp``); needs ``native``."""
        at, bts, scales = self.bank.native[(layer, "gate_up")]
        return self.bank.kernels.glu_add(g, u, x, at, bts, scales, *self.native, act)

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
                        y[lo:hi].addmm_(torch.mm(x[lo:hi], a), b, alpha=scaling)
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
                    delta[lo:hi].addmm_(torch.mm(xs[lo:hi], a), b, beta=0, alpha=scaling)
            y.index_add_(0, self.perm, delta)
        finally:
            torch.set_num_threads(threads)

    def _add_batched(self, y: torch.Tensor, xs: torch.Tensor, layer: int, proj: str) -> None:
        views = self.views[layer][proj]
        if all(views[slot] is None for slot, _, _ in self.groups):
            return
        mask, widest = self.batched
        a, b = self.bank.stack(layer, proj)  # [slots, in, rank], [slots, rank, out]
        h = torch.bmm(xs.view(a.shape[0], widest, -1), a)
        h.mul_(mask)
        y.index_add_(0, self.perm, torch.bmm(h, b).view(-1, y.shape[1]))

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s adapter rows, gathered once for the projections that share it (q/k/v,
        gate/up); the held reference keeps ``x``'s memory from being reused meanwhile."""
        held, key, xs = self._gathered
        if held is None or key != (x.data_ptr(), x.shape):
            xs = x.index_select(0, self.perm)
            self._gathered = (x, (x.data_ptr(), x.shape), xs)
        return xs
