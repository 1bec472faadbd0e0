"""acb's bf16 GEMMs (``acb/kernels/csrc/bf16_cpu.cpp``) against float64 references, and the bf16 fused
forward that runs on them: bf16 into every GEMM, float32 between them (the residual stream,
RoPE, the logits)."""

from __future__ import annotations

import pytest
import torch

from acb import EngineConfig
from acb.kernels import cpu_linear
from acb.kernels.cpu import fused_kernels, paged_decode_kernel
from acb.model.fused import native_bf16
from acb.testing import random_prompts, tiny_model
from acb.worker.runner import ModelRunner


def _native_or_skip():
    module = native_bf16()
    if module is None or fused_kernels() is None or paged_decode_kernel() is None:
        pytest.skip("acb's bf16 GEMMs need AVX-512 BF16 or AVX2 and a C++ compiler")
    return module


def _reference(x, w, bias=None, other=None):
    """x [M, K] bf16 @ w [N, K] bf16 (+ bias, + other) in float64."""
    out = x.double() @ w.double().T
    if bias is not None:
        out += bias.double()
    if other is not None:
        out += other.double()
    return out


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 46, 97, 200])  # every tile height (8 rows a tile)
@pytest.mark.parametrize("n,k", [(16, 64), (50, 576), (80, 64), (96, 1536), (33, 2)])  # 1-6 blocks of 16
def test_linear_computes_in_float32_and_writes_float32(m, n, k):
    bf16 = _native_or_skip()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    got = bf16.linear(x, bf16.pack(w), n, dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    want = _reference(x, w)
    # float32 sums of exact bf16 products: within float32's rounding of the sum, far under bf16's
    tol = 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((got.double() - want).abs() <= 4 * k * tol).all()
    assert (got != got.bfloat16().float()).any()  # not rounded to bf16 on the way out


@pytest.mark.parametrize("m", [1, 6, 7])
def test_a_few_rows_over_a_wide_weight_take_one_block_tiles_and_the_same_sums(m):
    """An lm_head-like weight (>= 512 blocks of 16) under 1-6 rows is read one block a tile; 7 rows
    take the 3-block tiles: both the float32 sums of the exact products, the last block partial."""
    bf16 = _native_or_skip()
    g = torch.Generator().manual_seed(m)
    n, k = 16 * 520 + 5, 64
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    got = bf16.linear(x, bf16.pack(w), n, dtype=torch.float32)
    tol = 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((got.double() - _reference(x, w)).abs() <= 4 * k * tol).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_adds_bias_and_the_residual_in_the_output_dtype(dtype):
    bf16 = _native_or_skip()
    g = torch.Generator().manual_seed(1)
    m, n, k = 13, 40, 96  # 40 columns: two full 16-column blocks and a masked tail of 8
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    bias = torch.randn(n, generator=g)
    other = torch.randn(m, n, generator=g).to(dtype)
    got = bf16.linear(x, bf16.pack(w), n, bias, other, dtype=dtype)
    assert got.dtype == dtype
    want = _reference(x, w, bias, other)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # rounded once, to nearest: within half a bf16 step of the exact sum
        assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-6).all()


def test_linear_reads_strided_rows_and_refuses_what_does_not_fit():
    bf16 = _native_or_skip()
    x = torch.randn(8, 128).bfloat16()
    w = (torch.randn(32, 64) * 0.1).bfloat16()
    packed = bf16.pack(w)
    view = x[:, 64:]  # rows 128 apart
    torch.testing.assert_close(bf16.linear(view, packed, 32).double(), _reference(view, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="K"):
        bf16.linear(x, packed, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16.linear(view.float(), packed, 32)
    with pytest.raises(RuntimeError, match="n"):
        bf16.linear(view, packed, 40)
    with pytest.raises(RuntimeError, match="even"):
        bf16.pack(torch.randn(16, 63).bfloat16())


def _act(t, act):
    return torch.nn.functional.silu(t) if act == 0 else torch.nn.functional.gelu(t, approximate="tanh")


@pytest.mark.parametrize("m", [1, 6, 7, 8, 97])
@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("bias", [False, True])
def test_glu_keeps_gate_and_up_float32_until_the_product(m, act, bias):
    bf16 = _native_or_skip()
    g = torch.Generator().manual_seed(m * 10 + act)
    n, k = 80, 192  # 5 blocks of 16 per projection: a 3-block tile and the 2 blocks left
    x = torch.randn(m, k, generator=g).bfloat16()
    wg, wu = ((torch.randn(n, k, generator=g) * 0.1).bfloat16() for _ in range(2))
    b = torch.randn(2 * n, generator=g) if bias else None
    gate, up = _reference(x, wg), _reference(x, wu)
    if bias:
        gate, up = gate + b[:n].double(), up + b[n:].double()
    want = _act(gate, act) * up
    packed = bf16.pack(torch.cat([wg, wu]))
    got = bf16.glu(x, packed, n, b, act, dtype=torch.float32)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # float32 sums and activation: far closer than gate and up rounded to bf16 first would be
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
    rounded_first = _act(gate.bfloat16().double(), act) * up.bfloat16().double()
    assert (got.double() - want).abs().max() < (rounded_first - want).abs().max() / 10
    out = bf16.glu(x, packed, n, b, act)  # bf16 by default: the product rounded once
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, got.bfloat16())


def test_glu_refuses_what_it_cannot_split():
    bf16 = _native_or_skip()
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        bf16.glu(x, bf16.pack(torch.randn(40, 64).bfloat16()), 20)
    with pytest.raises(RuntimeError, match="act"):
        bf16.glu(x, bf16.pack(torch.randn(64, 64).bfloat16()), 32, None, 2)
    with pytest.raises(RuntimeError, match="bias"):
        bf16.glu(x, bf16.pack(torch.randn(64, 64).bfloat16()), 32, torch.zeros(32))


@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_of_float32_rows_rounds_once(gemma):
    bf16 = _native_or_skip()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 576, generator=g) * 3
    eps = 1e-6
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:  # float32 1 + weight
        w = 1 + torch.randn(576, generator=g) * 0.1
        want = (normed * w).bfloat16()
    else:  # the bf16 weight widened, the product rounded once (transformers' bf16 LlamaRMSNorm rounds the
        # normed row first: that second rounding is what this kernel leaves out)
        w = (1 + torch.randn(576, generator=g) * 0.1).bfloat16()
        want = (normed * w.float()).bfloat16()
        assert (want != w * normed.bfloat16()).any()  # the two orders differ on this data
    got = bf16.rms_norm(x, w, eps, gemma)
    assert got.dtype == torch.bfloat16
    # the sum of squares in another order: at most one bf16 step apart, nearly all equal
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0**-7).all()
    assert (got == want).float().mean() > 0.98


class _Spy:
    """A kernel module whose calls are recorded: (name, args, kwargs)."""

    def __init__(self, module, calls, prefix=""):
        self._m, self._calls, self._prefix = module, calls, prefix

    def __getattr__(self, name):
        fn = getattr(self._m, name)

        def call(*args, **kwargs):
            self._calls.append((self._prefix + name, args, kwargs))
            return fn(*args, **kwargs)
        return call


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_the_bf16_fused_forward_keeps_float32_between_its_bf16_gemms(arch):
    """On acb's GEMMs the bf16 forward rounds only the GEMMs' inputs and what the bf16 pages hold:
    the residual stream and the logits stay float32, RoPE runs in float32 (its cos/sin too). Each
    rounding it drops moved SmolLM2's top-1 next token against float32 (benchmarks/bf16_sensitivity.py:
    the logits' 1.5 %, RoPE's 0.5 %, gate's and up's 0.2 %); the engine's top-1 agreement went
    97.27 -> 98.79 %."""
    from test_fused_forward import _logits, fresh_rows

    _native_or_skip()
    model = tiny_model(arch, seed=3).to(torch.bfloat16)
    prompts = random_prompts(3, 20, 40, seed=7)
    with torch.inference_mode():
        theirs = [model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in prompts]
    runner = ModelRunner(model, 64, 8)
    runner.configure_fast_paths(EngineConfig(), 16)
    calls: list = []
    try:
        fused = runner.fast_paths.fused
        assert fused is not None and fused.bf16 is not None, arch
        fused.bf16, fused.k = _Spy(fused.bf16, calls, "bf16."), _Spy(fused.k, calls)
        ours = _logits(runner, fused, fresh_rows(prompts))
    finally:
        runner.release()
    layers = model.config.num_hidden_layers
    gemms = [(a, k) for name, a, k in calls if name == "bf16.linear"]
    assert all(a[0].dtype == torch.bfloat16 for a, _ in gemms)  # bf16 in
    residual = [k["other"] for _, k in gemms if k.get("other") is not None]
    if arch == "gemma3":  # its post-norms come between the projection and the add: a float32 add there
        assert residual == []
    else:  # o's and down's outputs summed into the float32 stream in the GEMMs' epilogue
        assert len(residual) == 2 * layers and all(r.dtype == torch.float32 for r in residual)
    assert gemms[-1][1]["dtype"] == torch.float32  # the lm_head's, float32 out
    # the MLP's gate and up in one pass, float32 until their product (rounded once, down's input)
    glus = [a for name, a, _ in calls if name == "bf16.glu"]
    assert len(glus) == layers and not any(name == "glu" for name, _, _ in calls)
    assert ours.dtype == torch.float32 and (ours != ours.bfloat16().float()).any()  # not bf16 steps
    ropes = [a for name, a, _ in calls if name == "rope_"]
    assert len(ropes) == 2 * layers and all(t.dtype == torch.float32 for a in ropes for t in a[:3])
    for g, w in zip(ours, theirs, strict=True):  # still transformers' bf16 model, within bf16's error
        torch.testing.assert_close(g, w, rtol=0, atol=0.25)


@pytest.mark.parametrize("how", ["config", "environment"])
def test_cpu_bf16_gemm_off_keeps_onednn(how, monkeypatch):
    """``EngineConfig.cpu_bf16_gemm=False``, or ``ACB_CPU_BF16_GEMM=0`` (through acb.core.defaults):
    a bf16 model's fused forward on oneDNN's prepacked linears, not acb's bf16 GEMMs."""
    _native_or_skip()
    if how == "environment":
        monkeypatch.setenv("ACB_CPU_BF16_GEMM", "0")
    runner = ModelRunner(tiny_model("llama").to(torch.bfloat16), 64, 8)
    runner.configure_fast_paths(EngineConfig(cpu_bf16_gemm=how == "environment"), 16)
    try:
        if cpu_linear.available(torch.bfloat16):  # oneDNN's native bf16 linears compute the fused forward
            assert runner.fast_paths.fused is not None and runner.fast_paths.fused.bf16 is None
        else:  # no native bf16 in oneDNN (AVX2): transformers' forward, and the reason names the setting
            assert runner.fast_paths.fused is None
            reason = runner.fast_paths.forward_reason
            assert "EngineConfig.cpu_bf16_gemm=False" in reason and "ACB_CPU_BF16_GEMM=0" in reason
    finally:
        runner.release()
    runner = ModelRunner(tiny_model("llama").to(torch.bfloat16), 64, 8)  # on by default: acb's bf16 GEMMs
    monkeypatch.delenv("ACB_CPU_BF16_GEMM", raising=False)
    runner.configure_fast_paths(EngineConfig(), 16)
    try:
        assert runner.fast_paths.fused is not None and runner.fast_paths.fused.bf16 is not None
    finally:
        runner.release()


async def test_a_bf16_engine_builds_the_bf16_gemms_beside_the_attention_kernel(monkeypatch):
    from acb.kernels import cpu
    from acb.testing import runner_of, tiny_engine

    _native_or_skip()
    started = []
    real = cpu.start_building
    monkeypatch.setattr(cpu, "start_building", lambda *k: (started.extend(k), real(*k)))
    async with tiny_engine("llama", dtype="bfloat16") as engine:
        assert runner_of(engine).fast_paths.fused.bf16 is not None
        got = await engine.generate_batch(random_prompts(3, 3, 20, seed=1), max_new_tokens=4, ignore_eos=True)
    assert started == [cpu.fused_kernels, cpu.bf16_kernels]
    assert all(len(r.token_ids) == 4 for r in got)


def test_a_wrapped_projection_keeps_the_bf16_forward_off_and_says_why():
    """acb's bf16 GEMMs pack each projection's own weight: a projection that is not a plain
    torch.nn.Linear (a subclass with its own forward, an adapter's wrapper) would be computed
    without what it adds, so the fused forward does not run and the reason names it."""
    _native_or_skip()

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = tiny_model("llama").to(torch.bfloat16)
    attn = model.model.layers[0].self_attn
    wrapped = Scaled(attn.q_proj.in_features, attn.q_proj.out_features, bias=False, dtype=torch.bfloat16)
    wrapped.weight.data.copy_(attn.q_proj.weight.data)
    attn.q_proj = wrapped
    runner = ModelRunner(model, 64, 8)
    runner.configure_fast_paths(EngineConfig(), 16)
    try:
        assert runner.fast_paths.fused is None
        assert "Scaled, not a plain torch.nn.Linear" in runner.fast_paths.forward_reason
    finally:
        runner.release()
