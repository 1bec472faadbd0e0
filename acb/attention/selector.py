"""The attention backends and their kernels: which backend serves an engine
(:func:`resolve_backend`), and the kernel modules of the backends that have one
(:data:`KERNELS`, loaded by :func:`load_kernels`).

The backends: ``native`` (acb's CPU kernels, ``acb.attention.native``), ``torch`` (PyTorch's
ops, ``acb.attention.torch_backend``) and ``triton`` (CUDA, ``acb.attention.triton_backend``);
:func:`acb.attention.paged.attend` dispatches a step's attention to them by the kernel path its
metadata names.
"""

from __future__ import annotations

import os

import torch

KERNEL_PATHS = ("native", "triton", "torch")
# The kernel modules of the paths that have one, loaded by :func:`load_kernels` (the
# runner, at construction): step metadata names a path, the attention function looks
# its module up here.
KERNELS: dict[str, object] = {}
_BF16_PREFILL = [False]  # the native kernel's bf16 prefill path, once loaded (bf16_prefill)


def load_kernels(path: str) -> bool:
    """Load (build, for ``native``) the kernels of kernel path ``path``; False when they
    cannot be (``native`` without a compiler). ``torch`` needs none."""
    if path == "native":
        from ..kernels.cpu import paged_decode_kernel

        module = paged_decode_kernel()
    elif path == "triton":
        from ..kernels import triton_attention as module
    else:
        return True
    if module is None:
        return False
    KERNELS[path] = module
    if path == "native":
        _BF16_PREFILL[0] = bool(module.prefill_bf16())
    return True


def bf16_prefill() -> bool:
    """Whether the native prefill kernel takes bfloat16 queries, keys and values (built with
    avx512_bf16: ``paged_decode_cpu.cpp``); else a bf16 step widens them to float32 for it.
    Read from the kernel once, when it loads (``load_kernels``)."""
    return _BF16_PREFILL[0]


BACKENDS = ("auto", "native", "torch", "triton", "flash_attn")
# the model (and so KV page) dtypes the native CPU kernels read; they compute in float32
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``, or None when they can: on CUDA,
    or on CPU under ``TRITON_INTERPRET=1`` (Triton's interpreter: for tests, slow)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        from ..kernels import triton_attention

        if triton_attention.INTERPRETED:
            return None
        return "TRITON_INTERPRET=1 was set after acb's Triton kernels were imported"
    return f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests); the model is on {device}"


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype, native: bool = True) -> str:
    """The attention backend that serves ``EngineConfig.attn_backend=requested`` for a
    model of ``dtype`` on ``device``: ``native`` (CPU: float32, bfloat16 or float16),
    ``triton`` or ``torch``. ``auto`` picks Triton on CUDA (PyTorch when triton is
    missing), the native kernels on CPU models, PyTorch otherwise. A backend that cannot run here raises
    ``ValueError`` naming ``attn_backend`` and why. ``native=False``
    (``EngineConfig.cpu_kernels=False``): acb's native CPU kernels are not used."""
    device = torch.device(device)

    def refuse(why: str) -> ValueError:
        return ValueError(f"EngineConfig.attn_backend={requested!r} cannot run here: {why}")

    if requested == "auto":
        if device.type == "cuda":
            return "triton" if triton_unavailable(device) is None else "torch"
        return "native" if native and device.type == "cpu" and dtype in NATIVE_DTYPES else "torch"
    if requested == "native" and not native:
        raise refuse("EngineConfig.cpu_kernels=False (or ACB_CPU_KERNEL=0) turns acb's native CPU kernels off")
    if requested == "native" and not (device.type == "cpu" and dtype in NATIVE_DTYPES):
        raise refuse(f"the native kernels serve float32, bfloat16 and float16 models on CPU; this model is "
                     f"{dtype} on {device}")
    if requested == "triton":
        why = triton_unavailable(device)
        if why is not None:
            raise refuse(why)
    if requested == "flash_attn":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise refuse("the flash-attn package is not installed") from None
        # flash-attn's paged kernels want [pages, page_size, kv_heads, head_dim] caches with
        # page_size a multiple of 256; acb's pages are [kv_heads, slots, head_dim]
        raise refuse("acb's paged KV layout is not flash-attn's (use 'triton' or 'auto' on CUDA)")
    if requested not in BACKENDS:
        raise refuse(f"unknown backend; choose from {BACKENDS}")
    return requested
