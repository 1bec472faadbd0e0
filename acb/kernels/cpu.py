"""acb's native CPU kernels: decode attention over the paged cache
(``paged_decode_cpu.cpp``) and the fused elementwise ops of the fused forward
(``fused_cpu.cpp``), built with the system C++ compiler on first use and cached by
torch (``~/.cache/torch_extensions``).

``EngineConfig.cpu_kernels=False`` (or ``ACB_CPU_KERNEL=0``) keeps an engine off them; if one
cannot be built, acb logs why once and uses its PyTorch path."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("acb")
_lock = threading.Lock()  # guards _locks
_locks: dict[str, threading.Lock] = {}  # one per kernel: two kernels build side by side, one builds once
_modules: dict[str, object] = {}
_failed: set[str] = set()


def _lock_of(name: str) -> threading.Lock:
    with _lock:
        return _locks.setdefault(name, threading.Lock())


@contextlib.contextmanager
def _builder_lock(ext: str):
    """Hold an OS file lock on the extension's build folder while torch builds or loads it.

    torch marks a build in progress with a ``lock`` file that only the builder removes: a build
    killed midway (Ctrl-C, OOM, a killed test) leaves it, and every later load waits on it forever.
    The OS drops our ``flock`` when its holder dies, so whoever holds it knows any ``lock`` file
    there was left by a dead build, and removes it."""
    try:
        import fcntl

        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(ext, verbose=False))
    except (ImportError, OSError):  # no fcntl (Windows) or torch moved its private helper
        yield
        return
    with open(folder / "acb.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = folder / "lock"
        if stale.exists():
            log.warning("acb: removing %s, left by a kernel build that did not finish", stale)
            stale.unlink(missing_ok=True)
        yield


def extension_name(name: str) -> str:
    """torch's name for kernel ``name``'s build (its folder under ``TORCH_EXTENSIONS_DIR``).

    One build folder per source location: torch's ninja file names the source path, so two
    checkouts of acb sharing one name would rebuild each other's every load. An emulated build
    (``ACB_CPU_KERNEL_EMULATE``) has folders of its own, beside the native ones."""
    where = hashlib.sha1(str(Path(__file__).parent.resolve()).encode()).hexdigest()[:8]
    emulation = _emulation()
    return f"{name}_{where}" + (emulation[0] if emulation else "")


def _build(name: str, source: str, cflags: list[str]):
    """Build (or load from torch's cache) one extension; None, logged once, if it cannot be."""
    if name in _modules or name in _failed:
        return _modules.get(name)
    with _lock_of(name):
        if name not in _modules and name not in _failed:
            try:
                from torch.utils.cpp_extension import load

                src = Path(__file__).parent / "csrc" / source
                ext = extension_name(name)
                emulation = _emulation()
                if emulation:
                    # AVX2 + FMA whatever this CPU has: on an AVX-512 CPU, -march=native would define the
                    # ISA macros the emulation chooses (BF16, VNNI) natively, and build the native kernels
                    cflags = [EMULATION_ARCH if f == "-march=native" else f for f in cflags]
                    cflags = [*cflags, *emulation[1], "-include", str(src.with_name("avx512_emulated.h"))]
                with _builder_lock(ext):
                    _modules[name] = load(name=ext, sources=[str(src)], extra_cflags=cflags,
                                          extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # no compiler, no headers, ...
                _failed.add(name)
                log.warning("acb: CPU kernels %s unavailable (%s); using the PyTorch path", source, e)
    return _modules.get(name)


# ACB_CPU_KERNEL_EMULATE's values: (build-folder suffix, the features left out); the CPU kinds each
# stands for are in avx512_emulated.h. An emulated build targets EMULATION_ARCH (AVX2 and FMA, no
# AVX-512), not this CPU: the AVX-512 macros then come from avx512_emulated.h alone.
EMULATION_ARCH = "-march=x86-64-v3"
_EMULATIONS = {
    "avx512": ("_emu512", []),
    "avx512-vnni": ("_emu512vnni", ["-DACB_EMULATE_NO_BF16"]),
    "avx512-base": ("_emu512base", ["-DACB_EMULATE_NO_BF16", "-DACB_EMULATE_NO_VNNI"]),
}


def _emulation() -> tuple[str, list[str]] | None:
    """``ACB_CPU_KERNEL_EMULATE=avx512`` (AVX-512 with VNNI and BF16), ``avx512-vnni`` (without BF16)
    or ``avx512-base`` (neither): build the kernels' AVX-512 paths against SIMDe's portable
    intrinsics (``avx512_emulated.h``; needs Debian's ``libsimde-dev`` or SIMDe's headers on the
    include path), so a CPU without AVX-512 runs and tests them - slowly; never for speed. Any
    other value is refused by name rather than ignored."""
    value = os.environ.get("ACB_CPU_KERNEL_EMULATE", "")
    if value and value not in _EMULATIONS:
        raise ValueError(f"ACB_CPU_KERNEL_EMULATE={value!r}: the emulations acb builds are "
                         + ", ".join(map(repr, _EMULATIONS)))
    return _EMULATIONS.get(value)


def start_building(*kernels) -> None:
    """Build (or load) each of ``kernels`` (this module's getters: ``fused_kernels``, ...) on a
    thread of its own and return at once; whoever calls a getter later waits for its build. Each
    build is one compiler process: in a fresh cache an engine's first start compiled the
    decode-attention kernel (then ~70 s on 2 cores; ~45 s since the kernels include ``torch_min.h``)
    and then the fused one (~36 s; now ~15 s), one after the other."""
    for getter in kernels:
        threading.Thread(target=getter, name=f"acb-build-{getter.__name__}", daemon=True).start()


def paged_decode_kernel():
    """The compiled decode-attention module, or None when unavailable."""
    return _build("acb_paged_decode_cpu", "paged_decode_cpu.cpp",
                  ["-O3", "-march=native", "-fopenmp", "-ffast-math"])


def fused_kernels():
    """The compiled fused elementwise module (``fused_cpu.cpp``: RMSNorm, RoPE, the gated
    activation, greedy argmax), or None.
    No fast-math: its results must match transformers' modules."""
    return _build("acb_fused_cpu", "fused_cpu.cpp", ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"])


def int8_kernels():
    """The compiled int8 GEMM module (``int8_cpu.cpp``: W8A8 on AVX-512 VNNI), or None."""
    return _build("acb_int8_cpu", "int8_cpu.cpp", ["-O3", "-march=native", "-fopenmp"])


def bf16_kernels():
    """The compiled bf16 GEMM module (``bf16_cpu.cpp``: bf16 x bf16 -> float32 or bf16 on AVX-512
    BF16), or None; ``available()`` says whether it was built with AVX-512 BF16."""
    return _build("acb_bf16_cpu", "bf16_cpu.cpp", ["-O3", "-march=native", "-fopenmp"])


def lora_kernels():
    """The compiled LoRA module (``lora_cpu.cpp``: the deltas of a projection group per row
    group, and act(g) * u), or None. Float32 on AVX-512; ``available()`` says whether it
    was built with AVX-512."""
    return _build("acb_lora_cpu", "lora_cpu.cpp", ["-O3", "-march=native", "-fopenmp"])


_gomp = None


def _libgomp():
    global _gomp
    if _gomp is None:
        _gomp = False
        try:
            import ctypes

            import torch

            libs = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*")) or ["libgomp.so.1"]
            lib = ctypes.CDLL(str(libs[0]))
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            _gomp = lib
        except (OSError, AttributeError):  # another OpenMP runtime, or none
            pass
    return _gomp or None


def release_calling_thread_omp_pool() -> None:
    """Free the OpenMP thread pool of the *calling* thread (the event loop's).

    The engine computes on its worker thread. If the event loop's thread has also
    run a parallel PyTorch op (loading a model does), libgomp keeps a second, idle
    pool; with more pooled threads than CPUs it then throttles its spin-waiting, so
    every small parallel op of the worker sleeps and is woken through the kernel:
    measured on 2 cores, an elementwise op on [64, 576] takes 45 us instead of 5
    (~25 ms per SmolLM2 decode step). ``omp_pause_resource_all`` frees only the
    calling thread's pool; the next parallel op there would build it again.
    """
    lib = _libgomp()
    if lib is not None:
        lib.omp_pause_resource_all(2)  # omp_pause_hard
