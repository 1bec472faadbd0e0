"""The user's model config names acb's attention only inside acb's steps.

An engine over a model must make transformers call acb's paged attention in the
engine's steps, and nowhere else: the user's own ``model(...)`` or ``model.generate(...)``
beside a running engine, on any thread, must run the model's own implementation, masks
included, as if no engine held it. transformers reads the implementation from the
config's ``_attn_implementation`` property, so :func:`route` swaps the config's class
for a subclass whose one difference is that property: acb's name while an acb step runs
transformers' modules (its forward context is set: ``acb.attention.context.current``; on the
thread running the step only), the compiled variant while ``torch.compile``
traces acb's step forward, the config's own value everywhere else. A routed config
pickles (and deep-copies) as its own class: the routing is process-local.
"""

from __future__ import annotations

import torch

from ..core.model_shape import text_config
from .context import current
from .paged import ATTN_NAME, ATTN_NAME_COMPILED

# id of each routed config -> how many engines route it
_routes: dict[int, int] = {}
_routed_classes: dict[type, type] = {}


def _routed_impl(config) -> str | None:
    if torch.compiler.is_compiling():  # acb compiles only its own step forward
        return ATTN_NAME_COMPILED
    if current() is not None:  # inside an acb step, on its worker thread
        return ATTN_NAME
    return config._attn_implementation_internal


def _set_impl(config, value) -> None:
    type(config).__mro__[1]._attn_implementation.fset(config, value)


def _rebuilt(cls: type, state: dict):
    """A config of class ``cls`` with attributes ``state`` (what :func:`_reduce_as_base` pickles)."""
    config = cls.__new__(cls)
    config.__dict__.update(state)
    return config


def _reduce_as_base(self, protocol):
    """Pickle (and deep-copy) a routed config as its own class: routing is process-local.
    (Not ``copyreg.__newobj__``: pickle refuses it for a class other than the object's.)"""
    return _rebuilt, (type(self).__mro__[1], self.__dict__.copy())


def route(config) -> None:
    """Make ``config`` name acb's attention inside acb's steps (on the thread running
    one) and its own implementation everywhere else. Counted: each engine over the
    model routes it once and :func:`unroute`s it once."""
    if id(config) in _routes:
        _routes[id(config)] += 1
        return
    base = type(config)
    cls = _routed_classes.get(base)
    if cls is None:
        # a subclass whose one difference is this property: a data descriptor of the
        # class decides, so an instance attribute could not do it
        cls = type(base.__name__, (base,), {
            "_attn_implementation": property(_routed_impl, _set_impl), "__module__": base.__module__,
            "__qualname__": base.__qualname__, "__reduce_ex__": _reduce_as_base,
        })
        _routed_classes[base] = cls
    config.__class__ = cls
    _routes[id(config)] = 1


def unroute(config) -> None:
    """Undo one :func:`route`; the last one gives the config its own class back."""
    count = _routes.get(id(config))
    if count is None:
        return
    if count > 1:
        _routes[id(config)] = count - 1
        return
    del _routes[id(config)]
    config.__class__ = type(config).__mro__[1]


def route_model(config) -> list:
    """:func:`route` a model's config and, when it has a separate one, its text config
    (the decoder's layers read that one); the configs routed, for :func:`unroute`."""
    configs = [config]
    text = text_config(config)
    if text is not config:
        configs.append(text)
    for c in configs:
        route(c)
    return configs
