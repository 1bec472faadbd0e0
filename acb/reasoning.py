"""The ``<think>`` split (public path). The code lives in :mod:`acb.core.reasoning`; this module is
its public name (``SamplingParams.reasoning_parser``'s parsers)."""

from .core.reasoning import *  # noqa: F403
from .core.reasoning import __all__  # noqa: F401
