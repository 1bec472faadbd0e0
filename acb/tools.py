"""Tool calls (public path): OpenAI's ``tools`` checked, forced and parsed. The code lives in
:mod:`acb.core.tools`; this module is its public name (``acb.tools.get_parser``)."""

from .core.tools import *  # noqa: F403
from .core.tools import __all__  # noqa: F401
