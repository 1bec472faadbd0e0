"""The CPU fast path's fused pieces against what they replace: the fused forward of
Llama-family decoders against transformers' own forward (same step, same cache), its
native RMSNorm and RoPE against transformers' modules, the native prefill attention
against a float64 reference, and greedy parity of whole engines with each piece on and
off."""

from __future__ import annotations

import pytest
import torch

from acb import EngineConfig
from acb.attention import selector
from acb.attention.context import ForwardContext, run
from acb.core.step import StepInput
from acb.kernels.cpu import fused_kernels, paged_decode_kernel
from acb.model import fused
from acb.model.fused import native_bf16
from acb.testing import random_prompts, reference_greedy, runner_of, tiny_engine, tiny_model
from acb.worker.runner import ModelRunner
from acb.worker.sampling import greedy

FUSED_ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]


def _kernels_or_skip():
    if fused_kernels() is None or paged_decode_kernel() is None:
        pytest.skip("the native CPU kernels did not build here")


def _one_call_or_skip():
    _kernels_or_skip()
    if not paged_decode_kernel().decode_into():
        pytest.skip("the one-call decode runs with AVX-512 or AVX2 + FMA only")


def _bf16_fused_or_skip():
    _kernels_or_skip()
    if native_bf16() is None:
        pytest.skip("acb's bf16 GEMMs are not built here (neither AVX-512 BF16 nor AVX2): bf16 runs "
                    "transformers' forward (test_adapters_run_in_bfloat16 checks that the engine says so)")


def _runner(model, pages=64, page_size=8):
    runner = ModelRunner(model, pages, page_size)
    runner.configure_fast_paths(EngineConfig(), 16)
    return runner


def fresh_rows(prompts, spare=1, page_size=8):
    """One packed step's rows (tokens, start, pages) for fresh ``prompts``, each on pages of its own
    (numbered on from 0) with room for ``spare`` more tokens."""
    rows, nxt = [], 0
    for p in prompts:
        need = (len(p) + spare + page_size - 1) // page_size
        rows.append((p, 0, list(range(nxt, nxt + need))))
        nxt += need
    return rows


def _logits(runner, forward, rows, prompt=False):
    """The logits of a step of ``rows`` (tokens, start, pages), every row sampled; ``prompt``:
    the rows are prompt chunks (one of one token is then a prefill row, as the scheduler marks it)."""
    step = StepInput()
    for tokens, start, pages in rows:
        step.add_row(tokens, start, pages, prompt=prompt)
    runner.kv.update_tables(step)  # the block-table deltas, as ModelRunner.execute applies them first
    input_ids, position_ids, keep, meta = runner._build(step)
    with torch.inference_mode():  # (acb.attention.context.run: as the runner hands a forward its step)
        return run(forward, ForwardContext(meta), input_ids=input_ids.unsqueeze(0),
                   position_ids=position_ids.unsqueeze(0), attention_mask=None, use_cache=False,
                   logits_to_keep=keep).logits[0]


# The architectures whose layers a DecodeLoop takes whole (Qwen3's q/k norms and Gemma's four norms keep
# the Python loop)
NATIVE_LOOP_ARCHS = ("llama", "qwen2", "mistral")


def decode_both_ways(runner, forward_cls, monkeypatch, label: str, prompts: int = 4, longest: int = 30) -> None:
    """Three decode steps after a prefill, each run through the forward's Python loop and then through
    its native DecodeLoop (the same new keys and values written twice): the same logits to the bit,
    the native loop taking every step where the architecture and the one-call attention allow it. With
    16 ``prompts`` or more, the DecodeLoop runs each step twice more: whole, and as two halves of rows on
    two threads (``split_rows``, acb/kernels/csrc/decode_loop.h), both the same bits."""
    native = []
    decode_layers = forward_cls._decode_layers

    def counted(self, *args):
        out = decode_layers(self, *args)
        native.append(out is not None)
        return out

    monkeypatch.setattr(forward_cls, "_decode_layers", counted)
    forward = runner.fast_paths.fused
    assert type(forward) is forward_cls
    arch_ok = runner.model.config.model_type in NATIVE_LOOP_ARCHS
    assert (forward.loop is not None) == arch_ok, label
    takes = arch_ok and paged_decode_kernel().decode_into()
    rows = fresh_rows(random_prompts(prompts, 5, longest, seed=7), spare=8)
    tokens = _logits(runner, forward, rows).argmax(-1).tolist()
    # (split_rows, whether the step runs as halves): the default, then whole and halves on two threads
    ways = [(None, False)] if prompts < 16 or not takes else [(0, False), (2, True)]
    if len(ways) > 1:
        with pytest.raises(RuntimeError, match="split_rows must be >= 0"):
            forward.loop.split_rows = -1
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for step in range(3):
            decode = [([t], len(p) + step, pg) for t, (p, _, pg) in zip(tokens, rows, strict=True)]
            monkeypatch.setattr(fused, "NATIVE_DECODE_LOOP", False)
            want = _logits(runner, forward, decode)
            monkeypatch.setattr(fused, "NATIVE_DECODE_LOOP", True)
            for split, halves in ways:
                if split is not None:
                    forward.loop.split_rows = split
                    before = forward.loop.split_steps
                native.clear()
                got = _logits(runner, forward, decode)
                assert native == [True] if takes else True not in native, label  # the native loop ran the step
                assert torch.equal(got, want), f"{label}: step {step}, split_rows {split}"
                if split is not None:
                    assert forward.loop.split_steps == before + halves, f"{label}: split_rows {split}"
            tokens = got.argmax(-1).tolist()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_a_bf16_decode_step_runs_its_layers_in_one_native_call_with_the_same_bits(arch, kv, monkeypatch):
    _bf16_fused_or_skip()
    runner = ModelRunner(tiny_model(arch, seed=3).to(torch.bfloat16), 128, 8, kv_cache_dtype=kv)
    runner.configure_fast_paths(EngineConfig(), 16)
    try:
        decode_both_ways(runner, fused.FusedForward, monkeypatch, f"{arch} {kv}")
        if arch in NATIVE_LOOP_ARCHS:  # a step of 20 rows: whole, and as two halves on two threads
            decode_both_ways(runner, fused.FusedForward, monkeypatch, f"{arch} {kv}, 20 rows", prompts=20, longest=20)
    finally:
        runner.release()


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fused_forward_computes_the_models_logits(arch):
    _kernels_or_skip()
    model = tiny_model(arch, seed=3)
    runner = _runner(model)
    try:
        assert runner.fast_paths.fused is not None, f"{arch}: the fused forward should stand in for transformers'"
        rows = fresh_rows(random_prompts(3, 5, 40, seed=7))  # three fresh prompts in one packed step
        want = _logits(runner, runner.model, rows)
        got = _logits(runner, runner.fast_paths.fused, rows)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # then a decode step over the cache the prefill wrote
        nxt = want.argmax(-1).tolist()
        rows = [([t], len(p), pg) for t, (p, _, pg) in zip(nxt, rows, strict=True)]
        want = _logits(runner, runner.model, rows)
        got = _logits(runner, runner.fast_paths.fused, rows)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        runner.release()


@torch.inference_mode()
def test_the_fused_forward_frees_the_packs_it_replaces_and_a_module_packs_again_when_used():
    """q/k/v and gate/up run as two side-by-side GEMMs, so their own packed copies are freed
    (a third copy of two thirds of the weights); o/down keep theirs (the fused forward reads
    them). A module's own forward, if transformers' ever runs, packs from the weight as it is."""
    _kernels_or_skip()
    model = tiny_model("llama", seed=3)
    runner = _runner(model)
    try:
        packs = runner.fast_paths.packed.layers
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            assert all(packs[m].packed is None for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj,
                                                          mlp.up_proj))
            assert packs[attn.o_proj].packed is not None and packs[mlp.down_proj].packed is not None
        attn = model.model.layers[0].self_attn
        x = torch.randn(5, attn.q_proj.in_features)
        torch.testing.assert_close(attn.q_proj(x), x @ attn.q_proj.weight.T, rtol=1e-4, atol=1e-4)
        assert packs[attn.q_proj].packed is not None  # packed again by its own forward
        runner.fast_paths.packed.refresh(force=True)  # (reload_weights) repacks what is packed, no more
        assert packs[attn.k_proj].packed is None and packs[attn.o_proj].packed is not None
        attn.k_proj.weight.mul_(2)  # edited while its copy is freed
        torch.testing.assert_close(attn.k_proj(x), x @ attn.k_proj.weight.T, rtol=1e-4, atol=1e-4)
        assert packs[attn.k_proj].fresh()
    finally:
        runner.release()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
@torch.inference_mode()
def test_a_runner_packs_each_weight_it_reads_once_at_start(monkeypatch, fused):
    """Packing is lazy: with the fused forward, only what it reads is packed (q/k/v and gate/up
    side by side, o, down, lm_head: 4 per layer and one), never q/k/v/gate/up on their own; with
    transformers' forward, every linear is packed before the first step (7 per layer and one)."""
    _kernels_or_skip()
    reorder = torch.ops.mkldnn._reorder_linear_weight
    packed = []
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda w, *a: packed.append(tuple(w.shape)) or reorder(w, *a))
    model = tiny_model("llama", seed=3)
    runner = ModelRunner(model, 64, 8)
    runner.configure_fast_paths(EngineConfig(cpu_fused_forward=fused), 16)
    try:
        layers = model.config.num_hidden_layers
        assert (runner.fast_paths.fused is not None) == fused
        assert len(packed) == (4 * layers + 1 if fused else 7 * layers + 1), packed
        entries = runner.fast_paths.packed.layers.values()
        assert sum(e.packed is not None for e in entries) == (2 * layers + 1 if fused else 7 * layers + 1)
    finally:
        runner.release()


def test_a_layer_it_does_not_reproduce_keeps_transformers_forward(caplog):
    _kernels_or_skip()
    caplog.set_level("INFO", logger="acb")
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = torch.nn.ReLU()
    runner = _runner(model)
    try:
        assert runner.fast_paths.fused is None and runner.fast_paths.decode_forward is runner.model
        assert "fused CPU forward not used" in caplog.text
        assert runner.forward_path == "transformers" and "ReLU" in runner.forward_reason
    finally:
        runner.release()


def test_fused_forward_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("ACB_CPU_FUSED", "0")
    runner = _runner(tiny_model("llama"))
    try:
        assert runner.fast_paths.fused is None
    finally:
        runner.release()


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3"])
async def test_greedy_parity_with_the_fused_forward_on_and_off(arch, fused, monkeypatch):
    monkeypatch.setenv("ACB_CPU_FUSED", fused)
    prompts = random_prompts(6, 3, 50, seed=11)
    async with tiny_engine(arch, seed=2) as engine:
        assert (runner_of(engine).fast_paths.fused is not None) == (fused == "1" and fused_kernels() is not None)
        got = await engine.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
        for prompt, result in zip(prompts, got, strict=True):
            assert result.token_ids == reference_greedy(engine.model, prompt, 12)


class _CountingKernels:
    """selector.KERNELS["native"] with its paged_decode_into calls counted by what they returned;
    ``decline=True``: every call declined unrun (the separate write and paged_decode path)."""

    def __init__(self, module, decline: bool = False) -> None:
        self.module, self.decline, self.took, self.declined = module, decline, 0, 0

    def __getattr__(self, name):
        return getattr(self.module, name)

    def paged_decode_into(self, *args):
        took = not self.decline and self.module.paged_decode_into(*args)
        self.took += took
        self.declined += not took
        return took


class _PrefillCalls:
    """selector.KERNELS["native"] with its prefill_attention calls recorded in ``calls``, each as
    (q, k, bf16_weights), and passed on."""

    def __init__(self, module) -> None:
        self.module, self.calls = module, []

    def __getattr__(self, name):
        return getattr(self.module, name)

    def prefill_attention(self, q, k, v, spans, out, scale, cap, window, bf16_weights=False):
        self.calls.append((q, k, bf16_weights))
        return self.module.prefill_attention(q, k, v, spans, out, scale, cap, window, bf16_weights)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma2"])
async def test_decode_only_steps_attend_in_one_native_call(arch, dtype, monkeypatch):
    """A fused decode-only step's attention is one native call per layer (paged_decode_into:
    the cache writes, the attention and the output in the model's dtype), Gemma 3's sliding
    layers over their own pool included; Gemma 2's soft-capping is declined there and takes
    the separate path. In float32 the tokens are generate's either way."""
    _one_call_or_skip()
    # the Python loop's calls, counted here (a DecodeLoop calls the kernel in C++, unseen here, and takes every
    # decode-only step or none: test_a_bf16_decode_step_runs_its_layers_in_one_native_call_with_the_same_bits)
    monkeypatch.setattr(fused, "NATIVE_DECODE_LOOP", False)
    prompts = random_prompts(5, 3, 40, seed=13)
    async with tiny_engine(arch, seed=2, dtype=dtype) as engine:
        assert runner_of(engine).fast_paths.fused is not None
        counting = _CountingKernels(selector.KERNELS["native"])
        monkeypatch.setitem(selector.KERNELS, "native", counting)
        got = await engine.generate_batch(prompts, max_new_tokens=10, ignore_eos=True)
    if arch == "gemma2":
        assert counting.took == 0 and counting.declined > 0
    else:
        assert counting.took > 0 and counting.declined == 0
    if dtype == "float32":
        for prompt, result in zip(prompts, got, strict=True):
            assert result.token_ids == reference_greedy(engine.model, prompt, 10)
    else:
        assert all(len(r.token_ids) == 10 for r in got)


# A prompt cut at every place the scheduler may cut it: a first chunk of one token, chunks of
# seven, a last chunk of two, one-token chunks in the middle and at the end, and whole beside
# another prompt in the same step
_CUTS = ([7, 7, 5], [1, 18], [17, 2], [5, 14], [18, 1], [9, 9, 1], [16, 1, 2])


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_a_prompts_logits_do_not_depend_on_how_it_was_chunked(arch, dtype, kv):
    """The last position's logits are the same bits whether the prompt ran whole (beside
    another prompt) or in chunks, so a request's tokens do not change with what shares its
    steps. int8 pages: every chunk attends to its keys and values as the pages hold them,
    its own too (found by benchmarks/fuzz.py: seeded twins differed when one was chunked and
    read the earlier chunk's keys rounded, its own exact). A chunk of one token runs as a
    prefill row (``StepInput.prompt_singles``; as a decode row, the decode kernel's float32
    sums moved its logits by ~4e-6). gemma3: a sliding window of 8 and the hybrid pools."""
    _kernels_or_skip()
    if dtype == torch.bfloat16 and not native_bf16():
        pytest.skip("no bf16 fused path here")
    model = tiny_model(arch, seed=3).to(dtype)
    prompt, other = random_prompts(2, 19, 19, seed=7)

    def last_logits(cuts, beside=()):
        runner = ModelRunner(model, 64, 8, kv_cache_dtype=kv)
        runner.configure_fast_paths(EngineConfig(), 16)
        try:
            assert runner.fast_paths.fused is not None
            start = 0
            for cut in cuts:
                rows = [(prompt[start:start + cut], start, [0, 1, 2, 3])]
                rows += [(p, 0, [4 + 4 * i + j for j in range(4)]) for i, p in enumerate(beside)]
                out = _logits(runner, runner.fast_paths.fused, rows, prompt=True)
                start += cut
            return out[0]
        finally:
            runner.release()

    whole = last_logits([19], beside=[other])
    assert torch.equal(whole, last_logits([19]))
    for cuts in _CUTS:
        assert torch.equal(last_logits(cuts), whole), cuts


def test_native_argmax_is_torchs_argmax():
    """acb.worker.sampling.greedy through the kernel: the first index of each row's maximum, of its
    first NaN (PyTorch takes NaN as the largest), over ties, infinities, signed zeros, widths
    that are no multiple of 8 lanes and strided rows."""
    _kernels_or_skip()
    k = fused_kernels()
    g = torch.Generator().manual_seed(3)
    for width in (1, 7, 8, 9, 37, 4096, 49152):
        x = torch.randn(13, width, generator=g)
        assert torch.equal(k.argmax_rows(x), x.argmax(dim=-1)), width
    y = torch.randn(9, 37, generator=g)
    y[0, 5] = y[0, 9] = float("nan")
    y[1] = 0.0
    y[1, 3] = -0.0
    y[2] = float("-inf")
    y[3, 30] = y[3, 36] = float("inf")
    y[4, 36] = float("nan")  # in the scalar tail
    y[5] = 1.0  # all tied
    y[6, 2] = y[6, 35] = 1e30  # tied in the vector part and the tail
    y[7, 0] = float("nan")
    y[8, 12] = y[8, 20] = 4.0  # tied in two lanes of different vectors
    assert k.argmax_rows(y).tolist() == y.argmax(dim=-1).tolist() == [5, 0, 0, 30, 36, 0, 2, 0, 12]
    wide = torch.randn(6, 100, generator=g)[:, 3:53]  # strided rows
    assert torch.equal(k.argmax_rows(wide), wide.argmax(dim=-1))
    assert torch.equal(greedy(wide, k), greedy(wide))
    with pytest.raises(RuntimeError, match="float32"):
        k.argmax_rows(wide.bfloat16())


async def test_the_engine_takes_greedy_ids_from_the_native_argmax(monkeypatch):
    _kernels_or_skip()
    calls = []

    class Counting:
        def __init__(self, module):
            self.module = module

        def __getattr__(self, name):
            return getattr(self.module, name)

        def argmax_rows(self, x):
            calls.append(tuple(x.shape))
            return self.module.argmax_rows(x)

    model = tiny_model("llama")
    prompts = random_prompts(3, 4, 12, seed=5)
    expected = [reference_greedy(model, p, 5) for p in prompts]
    async with tiny_engine() as engine:
        fast_paths = runner_of(engine).fast_paths
        assert fast_paths.sampling_kernels is not None
        monkeypatch.setattr(fast_paths, "sampling_kernels", Counting(fast_paths.sampling_kernels))
        results = await engine.generate_batch(prompts, max_new_tokens=5, ignore_eos=True)
    assert [r.token_ids for r in results] == expected
    assert calls and all(rows <= 3 for rows, _ in calls)


def test_native_rms_norm_matches_transformers():
    _kernels_or_skip()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(37, 96) * 3
    got = fused_kernels().rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    torch.testing.assert_close(got, norm(x).detach(), rtol=1e-6, atol=1e-6)
    strided = torch.randn(37, 200)[:, 10:106]  # rows of a wider tensor
    torch.testing.assert_close(fused_kernels().rms_norm(strided, norm.weight.detach(), 1e-5),
                               norm(strided.contiguous()).detach(), rtol=1e-6, atol=1e-6)


def test_native_rope_is_bit_identical_to_transformers():
    _kernels_or_skip()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(1)
    t, heads, kv_heads, d = 29, 6, 2, 32
    cos, sin = torch.randn(t, d), torch.randn(t, d)
    q, k = torch.randn(t, heads * d), torch.randn(t, kv_heads * d)
    want_q, want_k = apply_rotary_pos_emb(q.view(1, t, heads, d).transpose(1, 2),
                                          k.view(1, t, kv_heads, d).transpose(1, 2), cos[None], sin[None])
    fused_kernels().rope_(q, cos, sin, d)
    fused_kernels().rope_(k, cos, sin, d)
    assert torch.equal(q, want_q[0].transpose(0, 1).reshape(t, -1))
    assert torch.equal(k, want_k[0].transpose(0, 1).reshape(t, -1))


def test_native_rms_norm_rounds_where_transformers_bf16_module_rounds():
    _kernels_or_skip()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(37, 96) * 3).bfloat16()
    got = fused_kernels().rms_norm(x, norm.weight.detach(), norm.variance_epsilon)
    assert got.dtype == torch.bfloat16
    # the sum of squares is accumulated in another order than PyTorch's: at most one bf16 step apart
    want = norm(x).detach()
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()
    assert (got == want).float().mean() > 0.95


def test_native_rope_in_bf16_is_bit_identical_to_transformers():
    _kernels_or_skip()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(1)
    t, heads, kv_heads, d = 29, 6, 2, 32
    cos, sin = torch.randn(t, d).bfloat16(), torch.randn(t, d).bfloat16()
    q, k = torch.randn(t, heads * d).bfloat16(), torch.randn(t, kv_heads * d).bfloat16()
    want_q, want_k = apply_rotary_pos_emb(q.view(1, t, heads, d).transpose(1, 2),
                                          k.view(1, t, kv_heads, d).transpose(1, 2), cos[None], sin[None])
    fused_kernels().rope_(q, cos, sin, d)
    fused_kernels().rope_(k, cos, sin, d)
    assert torch.equal(q, want_q[0].transpose(0, 1).reshape(t, -1))
    assert torch.equal(k, want_k[0].transpose(0, 1).reshape(t, -1))


# bf16 tolerance against transformers' own bf16 forward: logits of these tiny models are
# O(5); the fused epilogues round once where transformers rounds twice, and attention
# accumulates in float32 where transformers' SDPA rounds its output. Measured: max
# |diff| 0.04-0.09 over 2 layers; a few bf16 steps (2**-8 relative) per layer.
BF16_ATOL = 0.25


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fused_forward_in_bf16_agrees_with_transformers_bf16_forward(arch):
    _bf16_fused_or_skip()
    model = tiny_model(arch, seed=3).to(torch.bfloat16)
    prompts = random_prompts(3, 5, 40, seed=7)
    # transformers' own bf16 forward, its own attention, one prompt at a time
    with torch.inference_mode():
        want = [model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in prompts]
    runner = _runner(model)
    try:
        assert runner.fast_paths.fused is not None and runner.attn_backend == "native", arch
        got = _logits(runner, runner.fast_paths.fused, fresh_rows(prompts))
        assert got.dtype == torch.float32  # logits handed to sampling are float32
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=BF16_ATOL)
            assert g.argmax() == w.argmax()
    finally:
        runner.release()


def _attention_reference(q, k, v, past, scale, softcap, window):
    """q [H, n, d] at positions past.., k/v [KVH, past + n, d] -> [n, H, d], in float64."""
    groups = q.shape[0] // k.shape[0]
    length = k.shape[1]
    s = q.double() @ k.double().repeat_interleave(groups, 0).transpose(1, 2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(past, length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    allowed = j <= i
    if window:
        allowed &= j > i - window
    probs = s.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v.double().repeat_interleave(groups, 0)).transpose(0, 1).float()


def _fresh_spans(lengths: list[int], first: int) -> list[tuple[int, int, int, int]]:
    """The kernel's span rows for fresh prompts of ``lengths`` packed from row ``first`` on."""
    spans, t = [], first
    for n in lengths:
        spans.append((t, t + n, t, 0))
        t += n
    return spans


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 16), (8, 8, 128), (4, 2, 32), (4, 1, 256)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (0, 20.0)])
def test_native_prefill_attention_matches_a_reference(heads, kv_heads, dim, window, softcap):
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the native CPU kernel did not build here")
    if not kernel.prefill_f32():
        pytest.skip("prefill_attention runs with AVX-512 or AVX2 + FMA (elsewhere it declines: "
                    "test_the_one_call_kernels_run_where_built_and_decline_what_they_do_not_cover)")
    torch.manual_seed(heads + dim + window)
    lengths = [1, 5, 31, 32, 33, 100, 203]  # around the 32-key blocks and 16-query items
    total = sum(lengths) + 3
    # packed step layout: [T, H, d] storage seen as [H, T, d], as the attention function gets it
    q = torch.randn(total, heads, dim).transpose(0, 1)
    k = torch.randn(total, kv_heads, dim).transpose(0, 1)
    v = torch.randn(total, kv_heads, dim).transpose(0, 1)
    spans = _fresh_spans(lengths, 2)
    out = torch.zeros(total, heads, dim)
    assert kernel.prefill_attention(q, k, v, torch.tensor(spans), out, dim**-0.5, softcap, window)
    for first, end, _, _ in spans:
        want = _attention_reference(q[:, first:end], k[:, first:end], v[:, first:end], 0, dim**-0.5, softcap, window)
        torch.testing.assert_close(out[first:end], want, rtol=1e-5, atol=1e-5)
    assert not out[:2].any() and not out[-1].any()  # rows outside every span untouched
    # a continued chunk: 40 queries at positions 75.. over a separate 115-key context
    past, n = 75, 40
    ctx_k = torch.randn(past + n, kv_heads, dim).transpose(0, 1)
    ctx_v = torch.randn(past + n, kv_heads, dim).transpose(0, 1)
    out = torch.zeros(total, heads, dim)
    assert kernel.prefill_attention(q, ctx_k, ctx_v, torch.tensor([[5, 5 + n, 0, past]]), out, dim**-0.5,
                                    softcap, window)
    want = _attention_reference(q[:, 5:5 + n], ctx_k, ctx_v, past, dim**-0.5, softcap, window)
    torch.testing.assert_close(out[5:5 + n], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 16), (8, 8, 128), (4, 2, 32), (4, 1, 256)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (0, 20.0)])
def test_native_prefill_attention_in_bf16_matches_a_reference(heads, kv_heads, dim, window, softcap):
    """bf16 queries, keys and values (a bf16 model's prompt rows) through the avx512_bf16 dot
    products: float32 scores and softmax, the weights as two bf16 parts (hi + lo) in the second
    product, so within ~2^-16 of each weight of the exact attention over the same inputs (the
    weights rounded to bf16 alone were ~2^-9 off: a mean error of ~1e-3 here, which this fails)."""
    kernel = paged_decode_kernel()
    if kernel is None or not kernel.prefill_bf16():
        pytest.skip("the native CPU kernel has no avx512_bf16 build here")
    torch.manual_seed(heads + dim + window)
    lengths = [1, 5, 31, 32, 33, 100, 203]
    total = sum(lengths) + 3
    bf = torch.bfloat16
    q = torch.randn(total, heads, dim).to(bf).transpose(0, 1)
    k = torch.randn(total, kv_heads, dim).to(bf).transpose(0, 1)
    v = torch.randn(total, kv_heads, dim).to(bf).transpose(0, 1)
    spans = _fresh_spans(lengths, 2)
    out = torch.zeros(total, heads, dim)
    assert kernel.prefill_attention(q, k, v, torch.tensor(spans), out, dim**-0.5, softcap, window)
    errors = []
    for first, end, _, _ in spans:
        want = _attention_reference(q[:, first:end].float(), k[:, first:end].float(), v[:, first:end].float(), 0,
                                    dim**-0.5, softcap, window)
        torch.testing.assert_close(out[first:end], want, rtol=0, atol=1e-4)  # |v| <= ~4.5, weights to ~2^-16
        errors.append((out[first:end] - want).abs().mean().item())
    assert max(errors) < 5e-6  # measured ~5e-7 (1e-3 with the weights rounded to bf16 once)
    assert not out[:2].any() and not out[-1].any()
    past, n = 75, 40  # a continued chunk over a separate context, read from bf16 pages
    ctx_k = torch.randn(past + n, kv_heads, dim).to(bf).transpose(0, 1)
    ctx_v = torch.randn(past + n, kv_heads, dim).to(bf).transpose(0, 1)
    out = torch.zeros(total, heads, dim)
    assert kernel.prefill_attention(q, ctx_k, ctx_v, torch.tensor([[5, 5 + n, 0, past]]), out, dim**-0.5,
                                    softcap, window)
    want = _attention_reference(q[:, 5:5 + n].float(), ctx_k.float(), ctx_v.float(), past, dim**-0.5, softcap, window)
    torch.testing.assert_close(out[5:5 + n], want, rtol=0, atol=1e-4)
    # mixed dtypes are declined, touching nothing
    out = torch.zeros(total, heads, dim)
    assert not kernel.prefill_attention(q, k.float(), v.float(), torch.tensor(spans), out, dim**-0.5, softcap, window)
    assert not out.any()


def _attention_with_bf16_weights(q, k, v, scale: float) -> torch.Tensor:
    """Causal attention of a fresh prompt (q [H, n, d], k/v [kvh, n, d]) as the bf16 prefill kernel
    computes it with ``bf16_weights``: each 32-key block's weights exp(s - m) taken against the row's
    running max m at that block (online softmax) and rounded to bf16 for the value product, rescaled
    as the max moves; the sum of the unrounded weights divides. float64 otherwise -> [n, H, d]."""
    heads, n, _ = q.shape
    groups = heads // k.shape[0]
    kd, vd = k.double().repeat_interleave(groups, 0), v.double().repeat_interleave(groups, 0)
    s = (q.double() @ kd.transpose(1, 2)) * scale  # [H, n, n]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.zeros(heads, n, q.shape[2], dtype=torch.float64)
    m = torch.full((heads, n, 1), float("-inf"), dtype=torch.float64)
    total = torch.zeros(heads, n, 1, dtype=torch.float64)
    for kb in range(0, n, 32):
        block = s[:, :, kb:kb + 32]
        m_new = torch.maximum(m, block.amax(-1, keepdim=True))
        seen = m_new > float("-inf")  # rows that have seen a key by this block
        corr = torch.where(m > float("-inf"), (m - m_new).exp(), torch.zeros_like(m))
        p = torch.where(seen, (block - torch.where(seen, m_new, 0)).exp(), torch.zeros_like(block))
        out = torch.where(seen, out * corr + p.float().bfloat16().double() @ vd[:, kb:kb + 32], out)
        total = torch.where(seen, total * corr + p.sum(-1, keepdim=True), total)
        m = torch.where(seen, m_new, m)
    return (out / total).transpose(0, 1).float()


def test_native_prefill_attention_with_bf16_weights_rounds_the_softmax_weights_alone():
    """``bf16_weights`` (acb's int8 forward): the value product takes each softmax weight rounded to
    bf16 (one VDPBF16PS, as flash attention on GPUs), nothing else rounded: the kernel's outputs sit
    on a float64 emulation of exactly that (each 32-key block rounded against the running max), far
    closer than the exact attention is to it; without the flag the kernel keeps to the exact one."""
    kernel = paged_decode_kernel()
    if kernel is None or not kernel.prefill_bf16():
        pytest.skip("the native CPU kernel has no avx512_bf16 build here")
    torch.manual_seed(7)
    heads, kv_heads, dim = 9, 3, 64
    lengths = [5, 32, 70, 203]
    total = sum(lengths) + 2
    bf = torch.bfloat16
    q = (2 * torch.randn(total, heads, dim)).to(bf).transpose(0, 1)  # peaked softmax rows, as real ones are
    k = torch.randn(total, kv_heads, dim).to(bf).transpose(0, 1)
    v = torch.randn(total, kv_heads, dim).to(bf).transpose(0, 1)
    spans = _fresh_spans(lengths, 1)
    out16 = torch.zeros(total, heads, dim)
    out = torch.zeros(total, heads, dim)
    assert kernel.prefill_attention(q, k, v, torch.tensor(spans), out16, dim**-0.5, 0.0, 0, bf16_weights=True)
    assert kernel.prefill_attention(q, k, v, torch.tensor(spans), out, dim**-0.5, 0.0, 0, bf16_weights=False)
    for first, end, _, _ in spans:
        qs, ks, vs = q[:, first:end], k[:, first:end], v[:, first:end]
        rounded = _attention_with_bf16_weights(qs, ks, vs, dim**-0.5)
        exact = _attention_reference(qs.float(), ks.float(), vs.float(), 0, dim**-0.5, 0.0, 0)
        apart = (rounded - exact).abs().mean().item()  # what rounding the weights moves
        assert apart > 1e-4, apart
        # measured: 2-3e-4 apart; the kernel 2e-8 to 1.3e-7 from its emulation, 3-4e-7 from the exact one
        assert (out16[first:end] - rounded).abs().mean().item() < 0.01 * apart
        assert (out[first:end] - exact).abs().mean().item() < 0.01 * apart
        # at most a weight whose rounding went the other way (its exp's last bit): 3e-4 measured
        torch.testing.assert_close(out16[first:end], rounded, rtol=0, atol=2e-3)
    assert not out16[0].any() and not out16[-1].any()  # rows outside every span untouched


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (37, 0.0), (0, 20.0)])
def test_native_prefill_attention_writes_bf16_outputs_as_its_float32_ones_rounded(window, softcap):
    """With a bf16 ``out`` (a bf16 step's prompt rows, acb.attention.native), the bf16 kernel rounds each
    output as it writes it: exactly its float32 output rounded to bf16 (to nearest even, as PyTorch's
    conversion), for fresh prompts and a continued chunk. float32 inputs with a bf16 out are declined."""
    kernel = paged_decode_kernel()
    if kernel is None or not kernel.prefill_bf16():
        pytest.skip("the native CPU kernel has no avx512_bf16 build here")
    torch.manual_seed(window + int(softcap))
    heads, kv_heads, dim = 9, 3, 64
    lengths = [1, 5, 31, 33, 100, 203]
    total = sum(lengths) + 3
    bf = torch.bfloat16
    q = torch.randn(total, heads, dim).to(bf).transpose(0, 1)
    k = torch.randn(total, kv_heads, dim).to(bf).transpose(0, 1)
    v = torch.randn(total, kv_heads, dim).to(bf).transpose(0, 1)
    spans = torch.tensor(_fresh_spans(lengths, 2))
    out32 = torch.zeros(total, heads, dim)
    out16 = torch.zeros(total, heads, dim, dtype=bf)
    assert kernel.prefill_attention(q, k, v, spans, out32, dim**-0.5, softcap, window)
    assert kernel.prefill_attention(q, k, v, spans, out16, dim**-0.5, softcap, window)
    assert torch.equal(out16, out32.to(bf))
    assert out16.float().abs().sum() > 0
    past, n = 75, 40  # a continued chunk over a separate context
    ctx_k = torch.randn(past + n, kv_heads, dim).to(bf).transpose(0, 1)
    ctx_v = torch.randn(past + n, kv_heads, dim).to(bf).transpose(0, 1)
    chunk = torch.tensor([[5, 5 + n, 0, past]])
    assert kernel.prefill_attention(q, ctx_k, ctx_v, chunk, out32, dim**-0.5, softcap, window)
    assert kernel.prefill_attention(q, ctx_k, ctx_v, chunk, out16, dim**-0.5, softcap, window)
    assert torch.equal(out16, out32.to(bf))
    untouched = torch.zeros(total, heads, dim, dtype=bf)
    assert not kernel.prefill_attention(q.float(), k.float(), v.float(), spans, untouched, dim**-0.5, softcap, window)
    assert not untouched.any()


def test_native_prefill_attention_declines_what_it_does_not_cover():
    kernel = paged_decode_kernel()
    if kernel is None:
        pytest.skip("the native CPU kernel did not build here")
    q, k, v = torch.randn(2, 10, 24), torch.randn(1, 10, 24), torch.randn(1, 10, 24)  # head dim 24
    out = torch.zeros(10, 2, 24)
    assert not kernel.prefill_attention(q, k, v, torch.tensor([[0, 10, 0, 0]]), out, 0.2, 0.0, 0)
    assert not out.any()


def test_padded_rows_bounds_the_row_counts_and_the_padding():
    from acb.kernels.cpu_linear import padded_rows

    assert len({padded_rows(m) for m in range(1, 2049)}) == 40  # not 2048 oneDNN primitives
    assert [padded_rows(m) for m in (1, 8, 9, 16, 17, 33, 65, 129, 2048)] == [1, 8, 10, 16, 20, 40, 80, 160, 2048]
    for m in range(1, 5000):
        assert m <= padded_rows(m) < 1.25 * m and padded_rows(padded_rows(m)) == padded_rows(m)


async def test_the_engines_gemms_see_only_padded_row_counts_and_stay_exact(monkeypatch):
    """oneDNN JIT-compiles and caches a primitive (~0.57 MB) for every row count it is
    handed: an overloaded server, whose steps have ever-different counts, grew by
    hundreds of MB. Every oneDNN linear of the fused forward and of the prepacked
    linears under transformers' forward (a hook forces it) must see a padded count."""
    from acb.kernels.cpu_linear import padded_rows

    _kernels_or_skip()
    real = torch.ops.mkldnn._linear_pointwise
    rows: set[int] = set()

    class Recorder:  # the real op, recording the row count it is handed
        def __call__(self, x, *args):
            rows.add(x.numel() // x.shape[-1])
            return real(x, *args)

        def binary(self, x, other, *args):
            rows.add(x.numel() // x.shape[-1])
            return real.binary(x, other, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Recorder())
    prompts = random_prompts(20, 3, 30, seed=5)
    async with tiny_engine(num_blocks=256, page_size=8) as engine:
        assert runner_of(engine).fast_paths.fused is not None and runner_of(engine).fast_paths.prepacked
        got = await engine.generate_batch(prompts[:9], max_new_tokens=5, ignore_eos=True)  # 9 decode rows
        layer = engine.model.model.layers[0]
        with layer.register_forward_hook(lambda *a: None):  # transformers' forward, packed linears
            got += await engine.generate_batch(prompts[9:], max_new_tokens=5, ignore_eos=True)  # 11 rows
    for prompt, result in zip(prompts, got, strict=True):
        assert result.token_ids == reference_greedy(engine.model, prompt, 5)
    assert rows and sorted(r for r in rows if padded_rows(r) != r) == []  # decode steps of 9 and 11 rows ran at 10, 12


async def test_a_bf16_engine_runs_the_fused_forward_on_bf16_pages_and_says_so(steady_ram):
    _bf16_fused_or_skip()
    from acb.worker import sizing

    fp32 = sizing.layout(tiny_model("llama"), EngineConfig(max_memory_percent=0.01))
    bf16 = sizing.layout(tiny_model("llama").to(torch.bfloat16), EngineConfig(max_memory_percent=0.01))
    assert bf16.num_pages >= 2 * fp32.num_pages - 1  # half the bytes per token: twice the pages
    prompts = random_prompts(4, 3, 30, seed=5)
    async with tiny_engine("llama", seed=2, dtype="bfloat16") as engine:
        runner = runner_of(engine)
        assert runner.kv.k_cache[0].dtype == torch.bfloat16
        got = await engine.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
        stats = engine.stats()
        assert (stats.dtype, stats.forward_path, stats.forward_reason, stats.attn_backend) == \
            ("bfloat16", "fused", "", "native")
        assert runner.fast_decode_steps > 0
    assert all(len(r.token_ids) == 8 for r in got)


async def test_stats_name_the_forward_path_and_why_not_fused(monkeypatch):
    monkeypatch.setenv("ACB_CPU_FUSED", "0")
    async with tiny_engine("llama") as engine:
        stats = engine.stats()
    assert (stats.forward_path, stats.forward_reason) == ("transformers", "EngineConfig.cpu_fused_forward=False")
    monkeypatch.delenv("ACB_CPU_FUSED")
    async with tiny_engine("gemma3") as engine:
        stats = engine.stats()
    assert (stats.forward_path, stats.forward_reason) == ("fused", "")


@pytest.mark.parametrize("fused", [True, False])
async def test_an_engine_builds_the_fused_kernels_beside_the_attention_kernel(fused, monkeypatch):
    """An engine that will want the fused forward starts building its kernels before its runner
    builds the attention kernel (the two compile side by side in a fresh cache); one with
    ``cpu_fused_forward=False`` builds none for it."""
    from acb.kernels import cpu

    _kernels_or_skip()
    started = []
    real = cpu.start_building
    monkeypatch.setattr(cpu, "start_building", lambda *k: (started.extend(k), real(*k)))
    async with tiny_engine("llama", cpu_fused_forward=fused) as engine:
        assert runner_of(engine).attn_backend == "native"
        assert (runner_of(engine).fast_paths.fused is not None) == fused
    assert started == ([cpu.fused_kernels] if fused else [])
