"""The CPU decode-attention kernel (``paged_decode_cpu.cpp``), built with the system
C++ compiler on first use and cached by torch (``~/.cache/torch_extensions``).

``ACB_CPU_KERNEL=0`` turns it off; if it cannot be built, acb logs why once and
uses its PyTorch path."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("acb")
_lock = threading.Lock()
_module = None
_failed = False


def paged_decode_kernel():
    """The compiled module, or None when unavailable."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    if os.environ.get("ACB_CPU_KERNEL", "1") == "0":
        _failed = True
        return None
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load

                src = Path(__file__).with_name("paged_decode_cpu.cpp")
                _module = load(name="acb_paged_decode_cpu", sources=[str(src)],
                               extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                               extra_ldflags=["-fopenmp"],
                               verbose=False)
            except Exception as e:  # no compiler, no headers, ...
                _failed = True
                log.warning("acb: CPU decode kernel unavailable (%s); using the PyTorch path", e)
    return _module
