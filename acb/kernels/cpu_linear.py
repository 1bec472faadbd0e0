"""Prepacked oneDNN linear layers for the CPU.

``F.linear`` hands PyTorch's plain ``[out, in]`` weights to the BLAS on every call;
oneDNN can instead keep each weight reordered once into its own blocked layout.
Measured on this project's 2-core AVX-512 machine on SmolLM2's shapes (fp32):
~190-205 GFLOP/s against 95-160 for ``F.linear``, the most at the 64-row decode
steps (576x960: 0.38 ms vs 0.76 ms).

While an engine holds the model, each ``nn.Linear`` forward uses its packed weight.
The dense weights stay where they are, the model's own: ``state_dict``,
``load_state_dict`` and in-place edits keep working, at the cost of the linear
weights' memory twice. (The fused forward packs q/k/v and gate/up side by side and
frees these modules' own packed copies, :meth:`Prepacked.drop`: a module packs again
at its next own forward, if one ever runs.) A packed weight is a copy, so each remembers which dense
weight it was made from (the tensor, its ``_version`` and address): a forward
whose weight was replaced or edited in place since computes with the dense weight
(never the stale copy), and :meth:`Prepacked.refresh` repacks what changed (the
engine calls it before the next step; :meth:`acb.Engine.reload_weights` for edits
made through ``.data``, which PyTorch's version counter does not see).
``restore`` puts the original forwards back. ``EngineConfig.cpu_prepack=False`` (or
``ACB_CPU_PREPACK=0``) turns this off.

oneDNN builds (JIT-compiles) a primitive for every row count it is handed and keeps
it in its caches, ~0.57 MB each, up to 1024 of them per cache: with the row count of
every step different (the batch grows and shrinks, prefill chunks vary), a serving
process grew by hundreds of MB over minutes and paid a compile for every new count.
So rows are padded up to :func:`padded_rows` (4 counts per octave: 40 counts up to
2048, fewer than 25 % more rows, none at those counts) and the padding's output is
dropped; the fused forward pads a step once, at its start. The caches then fill during
warm-up and stay put.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("acb")

ATTR = "_acb_prepacked"


def available(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


def padded_rows(rows: int) -> int:
    """The row count a oneDNN linear over ``rows`` rows runs at: ``rows`` up to 8,
    then rounded up to a quarter of its octave (10, 12, 14, 16, 20, ..., 32, 40, ...,
    64, 80, ...), so a serving process meets a few dozen counts, never thousands."""
    step = 1 << max(0, (rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` ([n, k]) with zero rows appended up to ``rows`` (``x`` itself when ``n == rows``)."""
    if x.shape[0] == rows:
        return x
    out = x.new_zeros((rows, x.shape[1]))
    out[: x.shape[0]] = x
    return out


def stamp(weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """What identifies a weight's values short of reading them: the tensor, its
    in-place version counter and its address (``.data = ...`` changes the latter).
    Inference tensors (made under ``torch.inference_mode``) keep no version counter."""
    return weight, -1 if weight.is_inference() else weight._version, weight.data_ptr()


class _Packed:
    __slots__ = ("module", "packed", "stamp", "bound")

    def __init__(self, module: torch.nn.Linear) -> None:
        self.module = module
        self.packed = self.stamp = None  # packed at first use (weight(), or the module's forward)
        self.bound = self.forward  # the instance attribute set on the module (compared by identity)

    def weight(self) -> torch.Tensor:
        """The packed weight, packed now if it is not yet (or was dropped)."""
        packed = self.packed
        return packed if packed is not None else self.pack()

    def pack(self) -> torch.Tensor:
        weight = self.module.weight
        with torch.no_grad():
            packed = self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.data.contiguous(), None)
        self.stamp = stamp(weight)  # written after the packed weight: a reader that sees it sees both
        return packed

    def fresh(self) -> bool:
        weight, version, ptr = self.stamp
        current = self.module.weight
        return current is weight and current.data_ptr() == ptr and (version < 0 or current._version == version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        packed = self.packed  # read once: another engine's fused forward may drop it meanwhile
        if packed is None:  # dropped while a fused forward stood in for this one (drop)
            packed = self.pack()
        if not self.fresh():  # edited since it was packed: the model's own weight, never the copy
            return torch.nn.functional.linear(x, module.weight, module.bias)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(pad_rows(rows, padded_rows(rows.shape[0])), packed,
                                                 module.bias, "none", [], "")
        return out[: rows.shape[0]].view(*x.shape[:-1], out.shape[-1])


class Prepacked:
    """The packed state of one model; shared by every engine open over it. Each linear is
    packed when first used: the fused forward packs q/k/v and gate/up side by side and never
    reads their own packs, so packing those up front (then freeing them) was ~0.1 s of an
    engine's start on SmolLM2; :meth:`pack_all` packs the rest at once where transformers'
    forward will run."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.users = 0
        self.layers: dict[torch.nn.Linear, _Packed] = {}
        for module in model.modules():
            if type(module) is not torch.nn.Linear or module.weight.device.type != "cpu":
                continue
            if "forward" in module.__dict__:  # already wrapped (an accelerate hook, ...): leave it
                continue
            entry = _Packed(module)
            module.forward = entry.bound  # instance attribute: shadows the class method
            self.layers[module] = entry
        log.info("acb: %d linear layers use prepacked oneDNN weights", len(self.layers))

    def pack_all(self) -> None:
        """Pack every layer not packed yet (before transformers' forward first runs)."""
        for entry in self.layers.values():
            entry.weight()

    def refresh(self, force: bool = False) -> int:
        """Repack the layers whose dense weight changed since they were packed (all of
        them with ``force``); returns how many were repacked."""
        # a dropped copy (``drop``) is packed again, from the weight as it is then, when used
        stale = [e for e in self.layers.values() if e.packed is not None and (force or not e.fresh())]
        for entry in stale:
            entry.pack()
        if stale:
            log.info("acb: repacked %d linear layers whose weights changed", len(stale))
        return len(stale)

    def drop(self, modules) -> None:
        """Free the packed copies of ``modules`` (acb.model.fused computes with its own side-by-side
        packs of them); each is packed again at its next own forward, if there is one."""
        for module in modules:
            entry = self.layers.get(module)
            if entry is not None:
                entry.packed = None  # its forward packs again when it finds None

    def restore(self) -> None:
        for entry in self.layers.values():
            if entry.module.__dict__.get("forward") is entry.bound:  # not replaced by the user since
                del entry.module.forward
        self.layers = {}


def trim_heap() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def acquire(model: torch.nn.Module) -> Prepacked:
    """Pack the model's linear layers (once, however many engines hold it)."""
    state = getattr(model, ATTR, None)
    if state is None:
        state = Prepacked(model)
        object.__setattr__(model, ATTR, state)
    state.users += 1
    return state


def release(model: torch.nn.Module) -> None:
    """Drop one holder; the last one restores the dense weights."""
    state = getattr(model, ATTR, None)
    if state is None:
        return
    state.users -= 1
    if state.users <= 0:
        state.restore()
        object.__delattr__(model, ATTR)


def deepcopy_memo(model: torch.nn.Module) -> dict[int, object]:
    """A ``copy.deepcopy`` memo that skips the packed state (opaque oneDNN tensors
    cannot be copied); the copy must then drop its ``forward`` instance attributes."""
    state = getattr(model, ATTR, None)
    if state is None:
        return {}
    memo: dict[int, object] = {id(state): None}
    for entry in state.layers.values():
        memo[id(entry.bound)] = None
    return memo
