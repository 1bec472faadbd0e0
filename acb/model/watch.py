"""Whether acb's fast paths still compute exactly what the user's model would.

acb's fast paths stand in for parts of the model: the fused CPU forward calls no
module's ``__call__`` (so no hook runs), prepacked linears and CUDA graphs hold
copies or addresses of the weights. They are right only while the model is the
one they were built from. :class:`ModelWatch` checks that before every step, in
about 40 plain comparisons' worth of C loops over lists made once (measured in
docs/reliability.md; the weights' part in one C++ loop where acb's CPU kernels are
built, ``WeightWatch`` in acb/kernels/csrc/torch_bindings.cpp): no forward or pre-forward hook
on any module (but acb's own LoRA hooks, ``acb.model.lora``) and none global, no ``forward``
replaced on an instance or a class, the module tree unchanged, and every parameter and
buffer the same tensor, at the same address, with the same in-place version counter.

A hook, a replaced ``forward`` or a changed module tree sends the step through the
model's own (transformers') forward; changed weights make the runner rebuild its
fast paths from them before the step (the engine also drops its prefix cache: KV
computed with the old weights must not be reused). Writes through ``.data``
bypass PyTorch's version counter and cannot be seen; after those, call
:meth:`acb.Engine.reload_weights`.
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch
from torch.nn.modules import module as _torch_module

_VERSION = operator.attrgetter("_version")
_PTR = torch.Tensor.data_ptr
# PyTorch's global hooks (torch.nn.modules.module.register_module_forward_hook and
# register_module_forward_pre_hook): module-level dicts, never rebound
_GLOBAL_HOOKS = (_torch_module._global_forward_hooks, _torch_module._global_forward_pre_hooks)


class ModelWatch:
    """A snapshot of a model's structure, hooks and weights, and the check against it."""

    def __init__(self, model: torch.nn.Module, own_forward=lambda module: None, native=None) -> None:
        self.model = model
        self.own_forward = own_forward  # module -> the instance forward acb set on it, or None
        # acb/kernels/csrc/torch_bindings.cpp's WeightWatch class, when built: the weight check in one C++ loop
        # (set by the runner's fast paths; None: the Python check below)
        self.native = native
        self._native = None
        self.snapshot()

    def snapshot(self) -> None:
        """Take the model as it is now as the reference for :meth:`check`."""
        modules = list(self.model.named_modules())
        self._children = [(m._modules, name, child) for _, m in modules for name, child in m._modules.items()]
        mods = [m for _, m in modules]
        self._hooks = [d for m in mods for d in (m._forward_hooks, m._forward_pre_hooks)]
        # acb's own hooks (the LoRA ones, acb.model.lora: ``_acb_own``) are expected; any other is the user's
        self._own_hooks = [sum(getattr(h, "_acb_own", False) for h in d.values()) for d in self._hooks]
        self._any_own_hooks = any(self._own_hooks)
        self._dicts = [m.__dict__ for m in mods]
        self._forwards = [self.own_forward(m) for m in mods]  # anything else there is the user's
        self._class_forwards = [(c, _own_class_forward(c)) for c in {type(m) for m in mods}]
        self._owners = [d for m in mods for d in (m._parameters, m._buffers) for _ in d]
        self._names = [n for m in mods for d in (m._parameters, m._buffers) for n in d]
        self.snapshot_weights()

    def snapshot_weights(self) -> None:
        """Take the weights as they are now (same modules) as the reference."""
        pairs = [(d, n, t) for d, n, t in zip(self._owners, self._names, map(dict.get, self._owners, self._names))
                 if t is not None]
        self._owners = [d for d, _, _ in pairs]
        self._names = [n for _, n, _ in pairs]
        self._tensors = [t for _, _, t in pairs]
        if self.native is not None:  # the C++ check keeps its own versions and addresses
            self._native = self.native(self._owners, self._names, self._tensors)
            return
        self._native = None
        self._versioned = [t for t in self._tensors if not t.is_inference()]  # others keep no counter
        self._versions = list(map(_VERSION, self._versioned))
        self._ptrs = list(map(_PTR, self._tensors))

    def hooked(self) -> str | None:
        """Why the model's own forward must run this step (a hook, a replaced
        ``forward``, a changed module tree), or None."""
        if any(_GLOBAL_HOOKS):
            return "a global forward hook is registered"
        if (list(map(len, self._hooks)) != self._own_hooks) if self._any_own_hooks else any(self._hooks):
            return "a module has a forward hook"
        if list(map(dict.get, self._dicts, repeat("forward"))) != self._forwards:
            return "a module's forward was replaced"
        if not all(c.forward is f for c, f in self._class_forwards):
            return "a module class's forward was replaced"
        if not all(d.get(n) is c for d, n, c in self._children):
            return "a submodule was replaced"
        return None

    def weights_changed(self) -> bool:
        """Whether any parameter or buffer was replaced, moved or edited in place."""
        if self._native is not None:
            return self._native.changed()
        return (not all(map(operator.is_, map(dict.get, self._owners, self._names), self._tensors))
                or list(map(_VERSION, self._versioned)) != self._versions
                or list(map(_PTR, self._tensors)) != self._ptrs)


def _own_class_forward(cls: type) -> object:
    """``cls.forward`` if the class that defines it wrote it itself (not patched in from
    another module), else a marker that never matches: such a model runs its own forward."""
    for klass in cls.__mro__:
        fn = klass.__dict__.get("forward")
        if fn is not None:
            return fn if getattr(fn, "__module__", None) == klass.__module__ else object()
    return object()
