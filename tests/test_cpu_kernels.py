"""The CPU fast paths against plain PyTorch: the native paged decode-attention kernel
(every head layout it specialises, sliding windows, soft-capping, scattered pages)
and the oneDNN-prepacked linear layers (restored bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from acb.kernels import cpu_linear
from acb.kernels.cpu import paged_decode_kernel
from acb.testing import tiny_model


def _reference(q, kc, vc, pages, lengths, ps, scale, softcap, window):
    out = torch.empty_like(q)
    kvh = kc.shape[0]
    b_, h, d = q.shape
    for b in range(b_):
        length = int(lengths[b])
        first = max(0, length - window) if window else 0
        pos = torch.arange(first, length)
        slots = pages[b, pos // ps] * ps + pos % ps
        qq = q[b].view(kvh, h // kvh, d).double()
        s = torch.einsum("kgd,kld->kgl", qq, kc[:, slots].double()) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        out[b] = torch.einsum("kgl,kld->kgd", s.softmax(-1), vc[:, slots].double()).reshape(h, d).float()
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256), (8, 8, 128), (16, 2, 64), (6, 2, 32),
                                                (20, 2, 64)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (0, 30.0)])
def test_native_decode_kernel_matches_pytorch(heads, kv_heads, dim, window, softcap):
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the native CPU kernel did not build here")
    torch.manual_seed(heads * dim + window)
    ps, rows = 16, 7
    lengths = torch.tensor([1, 2, 15, 16, 17, 100, 203])
    npages = int((lengths.max() + ps - 1) // ps)
    kc = torch.randn(kv_heads, (rows * npages + 1) * ps, dim)
    vc = torch.randn_like(kc)
    pages = torch.randperm(rows * npages).view(rows, npages)  # scattered pages
    q = torch.randn(rows, heads, dim)
    out = torch.empty_like(q)
    kernel.paged_decode(q, kc, vc, pages, lengths, out, ps, dim**-0.5, softcap, window)
    torch.testing.assert_close(out, _reference(q, kc, vc, pages, lengths, ps, dim**-0.5, softcap, window),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 8, 128), (6, 2, 32)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (0, 30.0)])
def test_native_decode_kernel_reads_half_precision_pages(page_dtype, heads, kv_heads, dim, window, softcap):
    """bf16/fp16 pages are widened as they are read and everything after is float32: the
    result equals the float32 kernel's over the same (rounded) values."""
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the native CPU kernel did not build here")
    torch.manual_seed(heads * dim + window + 1)
    ps, rows = 16, 5
    lengths = torch.tensor([1, 16, 17, 100, 203])
    npages = int((lengths.max() + ps - 1) // ps)
    kc = torch.randn(kv_heads, (rows * npages + 1) * ps, dim).to(page_dtype)
    vc = torch.randn_like(kc)
    pages = torch.randperm(rows * npages).view(rows, npages)
    q = torch.randn(rows, heads, dim)
    out, want = torch.empty_like(q), torch.empty_like(q)
    kernel.paged_decode(q, kc, vc, pages, lengths, out, ps, dim**-0.5, softcap, window)
    kernel.paged_decode(q, kc.float(), vc.float(), pages, lengths, want, ps, dim**-0.5, softcap, window)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, _reference(q, kc.float(), vc.float(), pages, lengths, ps, dim**-0.5, softcap,
                                               window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 256), (4, 2, 16), (6, 2, 32),
                                                (16, 2, 64), (5, 5, 64)])
@pytest.mark.parametrize("window,ps", [(0, 16), (37, 16), (0, 12)])
def test_decode_in_one_call_equals_the_separate_writes_and_conversions(dtype, heads, kv_heads, dim, window, ps):
    """paged_decode_into (a decode-only step's whole attention call: cache writes, strided
    queries, output in the model's dtype) gives what the separate path it replaces gives:
    index_copy_ into the pages, float32 queries, paged_decode, the output rounded. float32:
    the same bits. bf16 on a CPU with avx512_bf16 runs its own kernel (dot products on the bf16
    rows, float32 sums in another order): the same to bf16's last bit, and within bf16's
    rounding of the exact (float64) attention. Without avx512_bf16 (AVX2, or AVX-512 without BF16)
    the call runs paged_decode's own item between its writes and conversions: the same bits in both
    dtypes."""
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the native CPU kernel did not build here")
    if not kernel.decode_into():
        pytest.skip("paged_decode_into runs with AVX-512 or AVX2 + FMA (elsewhere it declines: "
                    "test_the_one_call_kernels_run_where_built_and_decline_what_they_do_not_cover)")
    torch.manual_seed(heads * dim + window + ps)
    rows, per_row = 13, 20
    kc = torch.randn(kv_heads, 400 * ps, dim).to(dtype)
    vc = torch.randn(kv_heads, 400 * ps, dim).to(dtype)
    pages = (torch.randperm(399)[: rows * per_row] + 1).view(rows, per_row).contiguous()
    lengths = torch.randint(1, per_row * ps, (rows,))
    slots = torch.stack([pages[b, (n - 1) // ps] * ps + (n - 1) % ps for b, n in enumerate(lengths.tolist())])
    qkv = torch.randn(rows + 3, (heads + 2 * kv_heads) * dim).to(dtype)  # the GEMM's output: column views
    q, k, v = (t[:rows].view(rows, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], 1))
    kc1, vc1 = kc.clone(), vc.clone()
    kc1.index_copy_(1, slots, k.transpose(0, 1))
    vc1.index_copy_(1, slots, v.transpose(0, 1))
    expected = torch.empty(rows, heads, dim)
    kernel.paged_decode(q.float().contiguous(), kc1, vc1, pages, lengths, expected, ps, dim**-0.5, 0.0, window)
    padded = torch.zeros(rows + 5, heads * dim, dtype=dtype)
    out = padded[:rows].view(rows, heads, dim)
    assert kernel.paged_decode_into(q, k, v, kc, vc, slots, pages, lengths, out, ps, dim**-0.5, 0.0, window)
    assert torch.equal(kc, kc1) and torch.equal(vc, vc1)
    if dtype == torch.float32 or not kernel.prefill_bf16():  # prefill_bf16(): built with avx512_bf16
        assert torch.equal(out, expected.to(dtype))
    else:
        rounded = expected.to(dtype)
        ulp = torch.finfo(dtype).eps * rounded.float().abs().clamp_min(torch.finfo(torch.float32).tiny)
        assert ((out.float() - rounded.float()).abs() <= ulp).all()  # at most one rounding step apart
        assert (out == rounded).float().mean() > 0.99
        exact = _reference(q.float(), kc1.float(), vc1.float(), pages, lengths, ps, dim**-0.5, 0.0, window)
        torch.testing.assert_close(out.float(), exact, rtol=2**-8, atol=1e-5)
    assert not padded[rows:].any()  # nothing written past the rows
    # what it does not cover it declines, untouched: soft-capping, mixed dtypes
    assert not kernel.paged_decode_into(q, k, v, kc, vc, slots, pages, lengths, out, ps, 0.1, 30.0, 0)
    assert not kernel.paged_decode_into(q.half(), k, v, kc, vc, slots, pages, lengths, out, ps, 0.1, 0.0, 0)
    assert torch.equal(kc, kc1)


def test_the_one_call_kernels_run_where_built_and_decline_what_they_do_not_cover():
    """paged_decode_into runs where the kernel was built with AVX-512 or AVX2 + FMA
    (``decode_into()``), prefill_attention in float32 likewise (``prefill_f32()``), bf16 prompts
    only with avx512_bf16 (``prefill_bf16()``; elsewhere the engine widens them first); a build with
    none of these returns False from each, having written nothing, and the engine takes the separate
    path. What no build covers is declined everywhere, untouched: soft-capping in the one-call decode,
    a head dim that is not a multiple of 8 (16 with AVX-512)."""
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the native CPU kernel did not build here")
    rows, heads, dim, ps = 3, 4, 64, 16
    kc, vc = torch.randn(2, 8 * ps, dim), torch.randn(2, 8 * ps, dim)
    before = kc.clone(), vc.clone()
    q, k, v = torch.randn(rows, heads, dim), torch.randn(rows, 2, dim), torch.randn(rows, 2, dim)
    pages = torch.arange(rows * 2).view(rows, 2)
    lengths, slots = torch.tensor([1, 5, 9]), torch.tensor([0, 2 * ps + 4, 4 * ps + 8])
    out = torch.zeros(rows, heads, dim)
    # soft-capping: declined, nothing written
    assert not kernel.paged_decode_into(q, k, v, kc, vc, slots, pages, lengths, out, ps, dim**-0.5, 30.0, 0)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]) and not out.any()
    # head dim 12: declined, nothing written
    q12, k12, v12 = q[..., :12].contiguous(), k[..., :12].contiguous(), v[..., :12].contiguous()
    kc12, vc12, out12 = kc[..., :12].contiguous(), vc[..., :12].contiguous(), torch.zeros(rows, heads, 12)
    assert not kernel.paged_decode_into(q12, k12, v12, kc12, vc12, slots, pages, lengths, out12, ps, 0.3, 0.0, 0)
    assert torch.equal(kc12, kc[..., :12]) and not out12.any()
    took = kernel.paged_decode_into(q, k, v, kc, vc, slots, pages, lengths, out, ps, dim**-0.5, 0.0, 0)
    assert took == kernel.decode_into() and bool(out.any()) == took
    assert took or (torch.equal(kc, before[0]) and torch.equal(vc, before[1]))
    spans = torch.tensor([[0, rows, 0, 0]])
    out = torch.zeros(rows, heads, dim)
    if not kernel.prefill_bf16():
        bf = torch.bfloat16
        assert not kernel.prefill_attention(q.to(bf), k.to(bf), v.to(bf), spans, out, dim**-0.5, 0.0, 0)
        assert not out.any()
    took = kernel.prefill_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), spans, out,
                                    dim**-0.5, 0.0, 0)
    assert took == kernel.prefill_f32() and bool(out.any()) == took


def test_native_decode_kernel_refuses_what_it_cannot_read():
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the native CPU kernel did not build here")
    kc = torch.zeros(1, 32, 64, dtype=torch.float64)
    q, pages, lengths = torch.zeros(1, 1, 64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="float32, bfloat16, float16 or int8"):
        kernel.paged_decode(q, kc, kc, pages, lengths, torch.empty_like(q), 16, 0.125, 0.0, 0)
    k8 = torch.zeros(1, 32, 64, dtype=torch.int8)  # int8 rows carry 4 bytes of scale: 68 wide
    with pytest.raises(RuntimeError, match="cache rows of 64 elements for a head dim of 64"):
        kernel.paged_decode(q, k8, k8, pages, lengths, torch.empty_like(q), 16, 0.125, 0.0, 0)
    with pytest.raises(RuntimeError, match="q and out must be contiguous float32"):
        kernel.paged_decode(q.bfloat16(), kc.float(), kc.float(), pages, lengths, torch.empty_like(q), 16, 0.125,
                            0.0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_prompt_steps_page_writes_put_each_row_where_index_copy_would(dtype):
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the native CPU kernel did not build here")
    torch.manual_seed(0)
    kvh, t, d, slots_in_pool = 3, 300, 64, 1024
    cache = torch.randn(kvh, slots_in_pool, d).to(dtype)
    slots = torch.randperm(slots_in_pool)[:t]
    src = torch.randn(t, kvh, d).to(dtype).transpose(0, 1)  # [kvh, T, d] as the projection's view lies
    want = cache.clone().index_copy_(1, slots, src)
    kernel.write_kv(src, cache, slots)
    assert torch.equal(cache, want)  # every row in its slot, the rest of the pool untouched
    with pytest.raises(RuntimeError, match="slot 1024 out of range"):
        kernel.write_kv(src, cache, torch.cat([slots[:-1], torch.tensor([slots_in_pool])]))
    with pytest.raises(RuntimeError, match="cache must be a contiguous"):
        kernel.write_kv(src.double(), cache, slots)
    with pytest.raises(RuntimeError, match="slots must be int64"):
        kernel.write_kv(src, cache, slots[:-1])


@torch.inference_mode()
def test_prepacked_linears_compute_the_same_and_restore_the_weights_exactly():
    if not cpu_linear.available(torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    model = tiny_model("qwen2", seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 200, (1, 23))
    want = model(input_ids=ids).logits
    cpu_linear.acquire(model)
    cpu_linear.acquire(model)  # a second engine over the same model shares the packing
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and all("forward" in m.__dict__ for m in linears)
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    cpu_linear.release(model)
    assert all("forward" in m.__dict__ for m in linears)  # still held by the other one
    cpu_linear.release(model)
    assert not any("forward" in m.__dict__ for m in linears)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@torch.inference_mode()
def test_prepacking_leaves_an_already_wrapped_linear_alone():
    if not cpu_linear.available(torch.float32):
        pytest.skip("oneDNN is not available in this torch build")
    model = tiny_model("llama", seed=5)
    hooked = model.model.layers[0].mlp.up_proj
    original = hooked.forward
    calls = []

    def wrapper(x):  # what accelerate's hooks look like: an instance-level forward
        calls.append(1)
        return original(x)

    hooked.forward = wrapper
    try:
        cpu_linear.acquire(model)
        assert hooked.forward is wrapper and hooked.weight.numel() > 0
        model(input_ids=torch.randint(0, 200, (1, 5)))
        assert calls
        cpu_linear.release(model)
        assert hooked.forward is wrapper
    finally:
        del hooked.forward


def test_a_kernel_build_killed_midway_does_not_hang_later_loads():
    """A build killed midway (Ctrl-C, OOM, a killed test) must hold no later load up: torch's
    builds marked themselves with a ``lock`` file only the builder removed, and one killed midway
    left every later engine start waiting forever. The library's build folder is locked with the
    OS's ``flock``, dropped when its holder dies: a process killed while it holds the lock, then a
    fresh one loads the library within the test's timeout."""
    import signal
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from acb.kernels import cpu\n"
        "with cpu._builder_lock(cpu.build_folder()):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    script = "from acb.kernels import cpu\nassert cpu.fused_kernels() is not None\nprint('loaded')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "loaded" in done.stdout


GETTERS = ("paged_decode_kernel", "fused_kernels", "int8_kernels", "bf16_kernels", "lora_kernels")
PARTS = ("attention", "fused", "int8", "bf16", "lora")


def test_every_kernel_comes_from_one_build_of_one_library(tmp_path, monkeypatch):
    """The kernels are one library (acb/kernels/csrc/): an engine's ``start_building`` and every
    getter called meanwhile, from any thread, share a single build, and each getter hands out its
    part of it. The build is replaced by a fake that counts the builds."""
    import threading
    import time
    import types

    from acb.kernels import cpu

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_library", [])
    monkeypatch.setattr(cpu, "_failed", [])
    built = []

    def fake_build(folder, name):
        built.append((folder, name))
        time.sleep(0.3)
        return types.SimpleNamespace(**{part: object() for part in PARTS})

    monkeypatch.setattr(cpu, "_build_and_load", fake_build)
    cpu.start_building(cpu.fused_kernels, cpu.int8_kernels, cpu.fused_kernels)
    got = {}
    threads = [threading.Thread(target=lambda g=g: got.__setitem__(g, getattr(cpu, g)())) for g in GETTERS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert built == [(cpu.build_folder(), cpu.extension_name())]
    library = cpu.library()
    assert got == {g: getattr(library, part) for g, part in zip(GETTERS, PARTS, strict=True)}


def test_an_emulated_build_has_folders_of_its_own_and_a_bad_emulation_is_refused(monkeypatch):
    """ACB_CPU_KERNEL_EMULATE (scripts/test-avx512-emulated.sh) builds the AVX-512 paths on SIMDe:
    each kind of AVX-512 in a folder of its own, never the native build's (a later native load
    would take the slow one)."""
    from acb.kernels import cpu

    monkeypatch.delenv("ACB_CPU_KERNEL_EMULATE", raising=False)
    native = cpu.extension_name()
    folders = {native}
    for emulation in ("avx512", "avx512-vnni", "avx512-base", "avx2"):
        monkeypatch.setenv("ACB_CPU_KERNEL_EMULATE", emulation)
        folders.add(cpu.extension_name())
    assert len(folders) == 5 and all(f.startswith(native) for f in folders)
    monkeypatch.setenv("ACB_CPU_KERNEL_EMULATE", "avx1024")
    with pytest.raises(ValueError, match="ACB_CPU_KERNEL_EMULATE='avx1024'"):
        cpu.extension_name()


@pytest.mark.parametrize("emulation,left_out", [("", []), ("avx512", []), ("avx512-vnni", ["-DACB_EMULATE_NO_BF16"]),
                                                 ("avx2", [])])
def test_an_emulated_build_targets_avx2_whatever_this_cpu_has(tmp_path, monkeypatch, emulation, left_out):
    """An emulated build compiles for AVX2 + FMA (EMULATION_ARCH), not -march=native: on an AVX-512
    CPU with BF16 the native flags defined the ISA macros the emulation leaves out, so the
    'without BF16' kind built (and tested) the BF16 kernels. A native build keeps -march=native.
    Every source file's flags, as the ninja file the build runs writes them."""
    import shlex

    from acb.kernels import cpu

    monkeypatch.setenv("ACB_CPU_KERNEL_EMULATE", emulation)
    flags = cpu.compile_flags()
    assert list(flags) == list(cpu.SOURCES) and all((cpu.CSRC / source).is_file() for source in flags)
    for name, cflags in flags.items():
        if emulation == "avx2":  # AVX2 itself, nothing emulated
            assert "-march=native" not in cflags and cpu.EMULATION_ARCH in cflags and "-include" not in cflags
        elif emulation:
            assert "-march=native" not in cflags and cpu.EMULATION_ARCH in cflags, (name, cflags)
            assert "-O1" in cflags and "-O3" not in cflags  # SIMDe compiles ~5x faster; correctness only
            assert cflags[-2:] == ["-include", str(Path(cpu.__file__).parent / "csrc" / "avx512_emulated.h")]
            assert [f for f in cflags if f.startswith("-DACB_EMULATE")] == left_out
        else:
            assert "-march=native" in cflags and cpu.EMULATION_ARCH not in cflags and "-include" not in cflags
    cpu._write_ninja_file(tmp_path, "acb_test")
    ninja = (tmp_path / "build.ninja").read_text().splitlines()
    for source, cflags in flags.items():
        at = next(i for i, line in enumerate(ninja) if line.startswith("build ") and line.endswith("/" + source))
        assert ninja[at + 1] == f"  flags = {' '.join(map(shlex.quote, cflags))}"


def test_each_source_file_keeps_the_flags_it_was_built_with_alone(monkeypatch):
    """One library, the same bits: each source file compiles with the flags it had as an extension
    of its own (the fused ops without FMA contraction, to match transformers' modules; decode
    attention with -ffast-math; the rest with neither), and the link takes no -ffast-math (GCC's
    crtfastmath.o would set flush-to-zero for the whole process)."""
    from acb.kernels import cpu

    monkeypatch.delenv("ACB_CPU_KERNEL_EMULATE", raising=False)  # (an emulated build's -march differs)
    flags = cpu.compile_flags()
    assert "-ffp-contract=off" in flags["fused_cpu.cpp"] and "-ffast-math" not in flags["fused_cpu.cpp"]
    assert "-ffast-math" in flags["paged_decode_cpu.cpp"]
    for source in ("int8_cpu.cpp", "bf16_cpu.cpp", "lora_cpu.cpp", "torch_bindings.cpp"):
        assert not {"-ffast-math", "-ffp-contract=off"} & set(flags[source]), source
    assert all(f[:3] == ["-O3", "-march=native", "-fopenmp"] for f in flags.values())
    assert "-ffast-math" not in cpu.LINK_FLAGS


def test_without_a_compiler_every_kernel_is_none_and_acb_says_so_once(tmp_path, monkeypatch, caplog):
    """No compiler (or no ninja, or no headers): every getter returns None, so acb runs its PyTorch
    path, and the log says why once, not once per getter."""
    import logging

    from acb.kernels import cpu

    monkeypatch.delenv("ACB_CPU_KERNEL_EMULATE", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler-here"))
    monkeypatch.setattr(cpu, "_library", [])
    monkeypatch.setattr(cpu, "_failed", [])
    with caplog.at_level(logging.WARNING, logger="acb"):
        assert [getattr(cpu, g)() for g in GETTERS] == [None] * len(GETTERS)
        assert cpu.library() is None
    said = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(said) == 1 and "no-compiler-here" in said[0] and "using the PyTorch path" in said[0], said


def test_every_native_kernel_builds_and_loads_beside_the_others():
    """On an x86 CPU with AVX2 and FMA and a C++ compiler, every CPU kernel module builds and loads
    into one process: the other tests skip where a module is missing, so a module that stopped
    building (or clashed with another on loading: each module's DecodeLoop is a pybind11 type of its
    own) would otherwise only show as more skips."""
    import shutil

    from acb.kernels import cpu

    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if not {"avx2", "fma"} <= set(flags) or shutil.which("c++") is None:
        pytest.skip("not an x86 CPU with AVX2 and FMA and a C++ compiler")
    modules = {getter.__name__: getter() for getter in (cpu.paged_decode_kernel, cpu.fused_kernels, cpu.int8_kernels,
                                                        cpu.bf16_kernels, cpu.lora_kernels)}
    assert None not in modules.values(), [name for name, module in modules.items() if module is None]
    assert modules["int8_kernels"].available() and modules["bf16_kernels"].available()
    assert hasattr(modules["int8_kernels"], "DecodeLoop") and hasattr(modules["bf16_kernels"], "DecodeLoop")
