"""acb's native CPU kernels: one library, built from ``acb/kernels/csrc/`` as one extension with the
system C++ compiler and ninja on first use, and cached in torch's extensions folder
(``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``). Its parts, one source file each:
attention over the paged cache (``paged_decode_cpu.cpp``: :func:`paged_decode_kernel`), the fused
forward's elementwise ops (``fused_cpu.cpp``: :func:`fused_kernels`), the int8 and bf16 GEMMs with
their decode loops (``int8_cpu.cpp``, ``bf16_cpu.cpp``) and the LoRA deltas (``lora_cpu.cpp``), bound
for Python in ``torch_bindings.cpp``; they call each other as C++ functions (``csrc/ops.h``).

``EngineConfig.cpu_kernels=False`` (or ``ACB_CPU_KERNEL=0``) keeps an engine off them; if the library
cannot be built (no compiler, no ninja, no headers), acb logs why once and uses its PyTorch path."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

log = logging.getLogger("acb")
CSRC = Path(__file__).parent / "csrc"
# The library's source files, each compiled with COMMON_FLAGS and its own (a source's flags are the ones
# it had as an extension of its own, so its code compiles as it did). What one file's object shares with
# another's at link time is torch's inline code without float arithmetic (reference counts, sizes,
# strides; `nm` on the objects): acb's vector helpers are static inline (csrc/vec*.h) and its ops in each
# file's namespace, so no file's float arithmetic runs compiled with another's flags. Longest to compile
# first, so ninja starts them first (CPU-seconds on this project's 2-core host: the bindings ~33,
# pybind11's headers and glue; decode attention ~20; the GEMMs and the fused ops ~10-13 each, LoRA ~7).
COMMON_FLAGS = ["-O3", "-march=native", "-fopenmp"]
SOURCES = {
    "torch_bindings.cpp": [],
    "paged_decode_cpu.cpp": ["-ffast-math"],
    "bf16_cpu.cpp": [],
    "int8_cpu.cpp": [],
    # no fast-math, no FMA contraction: its results must match transformers' modules bit for bit
    "fused_cpu.cpp": ["-ffp-contract=off"],
    "lora_cpu.cpp": [],
}
# Linked without -ffast-math (as torch links an extension): GCC would add crtfastmath.o, which sets
# flush-to-zero for the whole process when the library loads.
LINK_FLAGS = ["-shared", "-fopenmp"]

_lock = threading.Lock()  # one build at a time in this process; the others wait for it
_library: list = []  # the loaded library, once built
_failed: list[str] = []  # why it could not be built, once it could not


def extension_name() -> str:
    """The library's module name, and its build folder's under ``TORCH_EXTENSIONS_DIR``.

    One per source location and torch version: ninja's file names the sources' paths, so two
    checkouts of acb sharing one name would rebuild each other's every load, and ninja does not
    see torch's headers change (they are system headers to it). An emulated build
    (``ACB_CPU_KERNEL_EMULATE``) has a name and folder of its own, beside the native one."""
    import torch

    where = hashlib.sha1(f"{Path(__file__).parent.resolve()} {torch.__version__}".encode()).hexdigest()[:8]
    emulation = _emulation()
    return f"acb_kernels_{where}" + (emulation[0] if emulation else "")


def build_folder() -> Path:
    """Where the library is built: ``TORCH_EXTENSIONS_DIR``, else torch's default root with one
    folder per Python version (as torch's own extensions), then :func:`extension_name`."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{version}_cpu")
    return Path(root) / extension_name()


def compile_flags() -> dict[str, list[str]]:
    """Each source file's own compiler flags (COMMON_FLAGS, then its SOURCES entry), for this CPU
    (``-march=native``) or the AVX-512 kind ``ACB_CPU_KERNEL_EMULATE`` names."""
    emulation = _emulation()
    flags = {}
    for source, own in SOURCES.items():
        f = [*COMMON_FLAGS, *own]
        if emulation:
            # AVX2 + FMA whatever this CPU has: on an AVX-512 CPU, -march=native would define the
            # ISA macros the emulation chooses (BF16, VNNI) natively, and build the native kernels
            f = [EMULATION_ARCH if x == "-march=native" else x for x in f]
            if emulation[0] != _AVX2[0]:
                # SIMDe's intrinsics at -O3 took ~9 CPU-minutes to compile, at -O1 under 2, and the
                # emulated kernels' tests run as fast (measured on a 2-core Zen 3): correctness only
                f = ["-O1" if x == "-O3" else x for x in f]
            f = [*f, *emulation[1]]
            if emulation[0] != _AVX2[0]:
                f += ["-include", str(CSRC / "avx512_emulated.h")]
        flags[source] = f
    return flags


@contextlib.contextmanager
def _builder_lock(folder: Path):
    """An OS file lock on the build folder while this process builds or loads the library there:
    two processes starting at once build it once (ninja is not safe to run twice in one folder).
    The OS drops the lock when its holder dies, so a build killed midway (Ctrl-C, OOM, a killed
    test) holds no later one up, and ninja redoes whatever it left unfinished."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(folder / "acb.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:  # the ninja package (pyproject's dependency): its binary is off PATH where the venv is not activated
        import ninja

        return os.path.join(ninja.BIN_DIR, "ninja")
    except (ImportError, AttributeError):
        raise RuntimeError("ninja is not installed (pip install ninja)") from None


def _write_ninja_file(folder: Path, name: str) -> None:
    """build.ninja: each source file compiled with its own flags (:func:`compile_flags`), then the
    objects linked into ``name``.so, with the include paths, defines and libraries torch gives one
    of its extensions (``torch.utils.cpp_extension.load``, which takes one set of flags for all)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [*include_paths(), sysconfig.get_path("include", scheme="posix_prefix")]
    common = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
              *(f"-isystem {shlex.quote(i)}" for i in includes), "-fPIC", "-std=c++20"]
    ldflags = [*LINK_FLAGS, *(f"-L{shlex.quote(p)}" for p in library_paths()),
               "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]

    def escaped(path) -> str:  # a path as ninja reads it in a build line
        return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")

    lines = ["ninja_required_version = 1.3", f"cxx = {os.environ.get('CXX', 'c++')}",
             f"common = {' '.join(common)}", f"ldflags = {' '.join(ldflags)}", "",
             "rule compile", "  command = $cxx -MMD -MF $out.d $common $flags -c $in -o $out",
             "  depfile = $out.d", "  deps = gcc", "", "rule link", "  command = $cxx $in $ldflags -o $out", ""]
    objects = []
    for source, flags in compile_flags().items():
        obj = Path(source).with_suffix(".o").name
        objects.append(obj)
        lines += [f"build {obj}: compile {escaped(CSRC / source)}", f"  flags = {' '.join(map(shlex.quote, flags))}"]
    lines += ["", f"build {name}.so: link {' '.join(objects)}", f"default {name}.so", ""]
    text = "\n".join(lines)
    path = folder / "build.ninja"
    if not path.exists() or path.read_text() != text:  # unchanged: ninja keeps its outputs up to date
        path.write_text(text)


def _build_and_load(folder: Path, name: str):
    """Bring the library in ``folder`` up to date with ninja (a first build compiles every source
    file, MAX_JOBS of them at once, else one per CPU: longest first, so the last to finish is a short
    one) and import it."""
    import importlib.util

    import torch  # noqa: F401  (the library links torch's libraries: torch loads them first)

    _write_ninja_file(folder, name)
    jobs = os.environ.get("MAX_JOBS", "")
    if not jobs.isdigit():  # the CPUs this process may run on
        jobs = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    done = subprocess.run([_ninja(), "-j", jobs], cwd=folder,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {folder} failed:\n{done.stdout[-4000:]}")
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def library():
    """The native kernel library (its parts as submodules: ``fused``, ``attention``, ``int8``,
    ``bf16``, ``lora``), built or loaded on first call; None, logged once, if it cannot be."""
    if _library or _failed:
        return _library[0] if _library else None
    with _lock:
        if not _library and not _failed:
            try:
                folder, name = build_folder(), extension_name()
                with _builder_lock(folder):
                    _library.append(_build_and_load(folder, name))
            except Exception as e:  # no compiler, no ninja, no headers, ...
                _failed.append(str(e))
                log.warning("acb: CPU kernels of %s unavailable (%s); using the PyTorch path", CSRC, e)
    return _library[0] if _library else None


# ACB_CPU_KERNEL_EMULATE's values: (build-folder suffix, the features left out); the CPU kinds each
# stands for are in csrc/avx512_emulated.h. An emulated build targets EMULATION_ARCH (AVX2 and FMA, no
# AVX-512), not this CPU: the AVX-512 macros then come from avx512_emulated.h alone.
EMULATION_ARCH = "-march=x86-64-v3"
# avx2: no emulation, the AVX2 build an AVX-512 CPU never makes of itself (its AVX2 paths, tested natively)
_AVX2 = ("_avx2", [])
_EMULATIONS = {
    "avx2": _AVX2,
    "avx512": ("_emu512", []),
    "avx512-vnni": ("_emu512vnni", ["-DACB_EMULATE_NO_BF16"]),
    "avx512-base": ("_emu512base", ["-DACB_EMULATE_NO_BF16", "-DACB_EMULATE_NO_VNNI"]),
}


def _emulation() -> tuple[str, list[str]] | None:
    """``ACB_CPU_KERNEL_EMULATE=avx512`` (AVX-512 with VNNI and BF16), ``avx512-vnni`` (without BF16)
    or ``avx512-base`` (neither): build the kernels' AVX-512 paths against SIMDe's portable
    intrinsics (``csrc/avx512_emulated.h``; needs Debian's ``libsimde-dev`` or SIMDe's headers on the
    include path), so a CPU without AVX-512 runs and tests them - slowly; never for speed.
    ``avx2``: the AVX2 build (no AVX-512, no emulation), so an AVX-512 CPU tests the paths an AVX2
    one runs. Any other value is refused by name rather than ignored."""
    value = os.environ.get("ACB_CPU_KERNEL_EMULATE", "")
    if value and value not in _EMULATIONS:
        raise ValueError(f"ACB_CPU_KERNEL_EMULATE={value!r}: the emulations acb builds are "
                         + ", ".join(map(repr, _EMULATIONS)))
    return _EMULATIONS.get(value)


def start_building(*kernels) -> None:
    """Build (or load) the library on a thread of its own and return at once; whoever calls a
    getter (``kernels``: this module's getters, ``fused_kernels``, ...; all parts of the one
    library) later waits for it. ninja compiles its source files side by side."""
    if kernels and not _library and not _failed:
        threading.Thread(target=library, name="acb-build-kernels", daemon=True).start()


def _part(name: str):
    lib = library()
    return getattr(lib, name) if lib is not None else None


def paged_decode_kernel():
    """The decode- and prefill-attention kernels (``paged_decode_cpu.cpp``), or None when unavailable."""
    return _part("attention")


def fused_kernels():
    """The fused elementwise kernels (``fused_cpu.cpp``: RMSNorm, RoPE, the gated activation, greedy
    argmax, the weight watch), or None. No fast-math: their results match transformers' modules."""
    return _part("fused")


def int8_kernels():
    """The int8 GEMMs (``int8_cpu.cpp``: W8A8 on AVX-512 VNNI, or AVX2) and their decode loop, or None."""
    return _part("int8")


def bf16_kernels():
    """The bf16 GEMMs (``bf16_cpu.cpp``: bf16 x bf16 -> float32 or bf16 on AVX-512 BF16, or AVX2
    widening the weights) and their decode loop, or None; ``native()`` says whether they were
    built with AVX-512 BF16."""
    return _part("bf16")


def lora_kernels():
    """The LoRA kernels (``lora_cpu.cpp``: the deltas of a projection group per row group, and
    act(g) * u), or None. Float32 on AVX-512; ``available()`` says whether they were built with
    AVX-512."""
    return _part("lora")


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
