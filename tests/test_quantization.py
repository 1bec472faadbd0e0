"""int8 (``EngineConfig(quantization="int8")``): the VNNI GEMM against a dequantized
float64 reference, the smoothing, the int8 fused forward against the quantized model's own
forward, agreement with float32, the memory it saves, and every refusal by name."""

from __future__ import annotations

import pytest
import torch
from test_fused_forward import NATIVE_LOOP_ARCHS, _logits, _PrefillCalls, _runner, decode_both_ways, fresh_rows

from acb import Engine, EngineConfig
from acb.attention import kv_quant, selector
from acb.attention.context import ForwardContext, run
from acb.core.step import StepInput
from acb.kernels.cpu import int8_kernels
from acb.model import int8_calibration, int8_forward, int8_weights, quantization
from acb.model.int8_weights import Bf16Linear, Int8Linear, quantize_weight
from acb.testing import random_prompts, reference_greedy, tiny_model, tiny_tokenizer
from acb.worker.runner import ModelRunner

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]


def _q8():
    k = int8_kernels()
    if k is None or not k.available():
        pytest.skip("acb's int8 kernels need AVX-512 VNNI or AVX2 and a compiler")
    return k


def _int8(n: int, k: int, seed: int, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    w[:, 3] *= 30  # an outlier input channel: only its own group's weight scales pay for it
    return quantize_weight(w, group)


def _dequantized_rows(xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    """The activations the kernel multiplies: q times each group's scale, float64."""
    m, k = xq.shape
    groups = xs.shape[1]
    return (xq.double().view(m, groups, k // groups) * xs.double()[:, :, None]).view(m, k)


def _quantize(q8, x: torch.Tensor, group: int, norm=None, mult=None):
    return q8.quantize_rows(x, norm, False, 1e-6, group, mult)


@pytest.mark.parametrize("m", [1, 5, 6, 7, 64, 200])
@pytest.mark.parametrize("n,k,group", [(16, 4, 4), (48, 64, 64), (48, 64, 16), (192, 576, 576), (192, 576, 64),
                                       (192, 576, 32), (80, 100, 100), (80, 100, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemm_matches_a_dequantized_reference(m, n, k, group, dtype):
    """Weights per output channel and group, activations per token and the same groups: int32
    within a group, the groups' scales applied in float32; against float64 over the same int8 values."""
    q8 = _q8()
    wq, ws = _int8(n, k, seed=m + n, group=group)
    assert ws.shape == (n, k // group)
    layer = Int8Linear.from_int8(wq, ws, torch.randn(n))
    assert layer.group == group
    x = torch.randn(m, k) * 3
    x[:, 1] *= 40  # an outlier channel: its group's scale, not the row's, pays for it
    xq, xs, xo = _quantize(q8, x.to(dtype), group)
    assert xq.dtype == torch.int8 and xs.shape == xo.shape == (m, k // group)
    w = wq.double() * ws.double().repeat_interleave(group, 1)
    want = _dequantized_rows(xq, xs) @ w.T + layer.bias.double()
    residual = torch.randn(m, n).to(dtype)
    got = q8.linear(xq, xs, xo, *layer.args, None, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=tol * want.abs().max().item())
    got = q8.linear(xq, xs, xo, *layer.args, residual, dtype)  # the residual add fused
    want = want + residual.double()
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("m", [1, 4, 9])
def test_int8_gemm_is_exact_at_the_extreme_bytes(m):
    """Weights of -128 and 127 (a GGUF Q8_0 block may hold -128) against activations of +-127: every
    pair of products at its largest (2 x 128 x 127), where a kernel that multiplies unsigned by signed
    bytes in int16 (AVX2's vpmaddubsw) would saturate. The int32 sums are exact, so the output equals a
    float64 reference over the same integers to float32's rounding."""
    q8 = _q8()
    n, k, group = 48, 128, 64
    g = torch.Generator().manual_seed(m)
    wq = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    wq[:, ::2] = -128
    wq[: n // 2, 1::2] = 127
    ws = torch.rand(n, k // group, generator=g) * 1e-2 + 1e-3
    layer = Int8Linear.from_int8(wq, ws, torch.randn(n, generator=g))
    x = torch.randn(m, k, generator=g)
    xq, xs, xo = _quantize(q8, x, group)
    xq[:, ::2] = 127
    xq[:, 1::4] = -127
    xo = 128 * xq.float().view(m, k // group, group).sum(2) * xs  # the offsets of these bytes (quantize_rows' rule)
    want = _dequantized_rows(xq, xs) @ (wq.double() * ws.double().repeat_interleave(group, 1)).T + layer.bias.double()
    got = q8.linear(xq, xs, xo, *layer.args, None, torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("act,fn", [(0, torch.nn.functional.silu),
                                    (1, lambda t: torch.nn.functional.gelu(t, approximate="tanh"))])
@pytest.mark.parametrize("m", [3, 70])
@pytest.mark.parametrize("group", [64, 16])
@pytest.mark.parametrize("n", [96, 80])  # whole tiles of 2 blocks of 16; two tiles and one block left
def test_int8_glu_matches_a_dequantized_reference(act, fn, m, group, n):
    q8 = _q8()
    gate = Int8Linear.from_int8(*_int8(n, 64, 1, group))
    up = Int8Linear.from_int8(*_int8(n, 64, 2, group))
    xq, xs, xo = _quantize(q8, torch.randn(m, 64) * 2, group)
    x = _dequantized_rows(xq, xs)
    want = fn(x @ gate.dequantize().double().T) * (x @ up.dequantize().double().T)
    got = q8.glu(xq, xs, xo, *gate.args, *up.args, act, torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("group", [64, 16])
def test_activations_are_quantized_per_token_and_group_with_the_norm_fused(group):
    q8 = _q8()
    x = torch.randn(9, 64)
    x[3] *= 100  # an outlier token keeps its own scale: the others lose no precision to it
    x[:, 5] = 60 * x.abs().amax(1)  # an outlier channel: with groups, only its own group's channels share its scale
    w = torch.rand(64) + 0.5
    xq, xs, xo = _quantize(q8, x, group, w)
    normed = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    grouped = normed.view(9, 64 // group, group)
    torch.testing.assert_close(xs, grouped.abs().amax(2) / 127)
    assert xq.abs().max() == 127
    # the offset takes the weights' +128 back out: 128 * sum(q) * scale per group
    torch.testing.assert_close(xo, 128 * xq.float().view(9, 64 // group, group).sum(2) * xs)
    err = (_dequantized_rows(xq, xs).float() - normed).view(9, 64 // group, group).abs().amax(2)
    assert (err <= xs / 2 + 1e-6).all()  # round to nearest: half a step at most, per group
    if group < 64:  # the channels outside the outlier's group keep a finer step than the row's
        assert (xs[:, 1:] < xs[:, :1] / 4).all()


@pytest.mark.parametrize("k,group", [(1536, 64), (1536, 32), (576, 64), (48, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_group_of_a_wide_row_gets_exactly_its_own_scale_bytes_and_offset(k, group, dtype):
    """Rows of many groups (the kernel reduces sixteen groups' maxima and sums at a time: 1,536 / 32
    is three batches, the last one full; 1,536 / 64 two, the second half empty): each group's scale
    max|v| / 127, bytes round(v * (127 / max|v|)) (to nearest even) and offset 128 * sum(q) * scale,
    all float32, equal bit for bit to the formula; a group of zeros gives zeros."""
    q8 = _q8()
    x = (torch.randn(7, k) * torch.rand(1, k).mul(8).exp()).to(dtype)
    x[2, group: 2 * group] = 0  # a group of zeros
    x[4, -group:] = 0  # the last group of a batch
    xq, xs, xo = _quantize(q8, x, group)
    v = x.float().view(7, k // group, group)
    top = v.abs().amax(2)
    assert torch.equal(xs, top / 127)
    # a tensor over a tensor: torch takes a number over a tensor as 127 * (1 / top), a last bit off 127 / top
    qs = torch.where(top > 0, torch.full_like(top, 127) / top, torch.zeros_like(top))
    want = torch.round(v * qs[:, :, None]).clamp(-128, 127).to(torch.int8).view(7, k)
    assert torch.equal(xq, want)
    assert torch.equal(xo, 128 * want.float().view(7, k // group, group).sum(2) * xs)
    assert xs[2, 1] == 0 and xo[2, 1] == 0 and xs[4, -1] == 0 and (xq[4, -group:] == 0).all()


def test_the_smoothing_multiplier_applies_after_the_norm():
    """mult (the smoothing's 1/s) multiplies the normed row, as the model's forward multiplies
    the norm's output; without a norm, the row itself."""
    q8 = _q8()
    x = torch.randn(5, 64)
    w, s = torch.rand(64) + 0.5, torch.rand(64) * 4 + 0.1
    normed = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    for got, want in ((_quantize(q8, x, 32, w, s), normed * s), (_quantize(q8, x, 32, None, s), x * s)):
        torch.testing.assert_close(got[1], want.view(5, 2, 32).abs().amax(2) / 127)
        assert ((_dequantized_rows(got[0], got[1]).float() - want).abs() <= got[1].repeat_interleave(32, 1) / 2
                + 1e-6).all()


def test_smoothing_moves_an_activation_outlier_into_the_weights():
    """A layer smoothed with s keeps its dense output (x / s) (W s) = x W, and an outlier input
    channel costs the other channels of its group less than unsmoothed."""
    _q8()
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 32)
    x = torch.randn(256, 64)
    x[:, 7] *= 80
    want = dense(x)
    plain = Int8Linear.from_dense(dense, rotate=False)
    s = x.abs().amax(0) ** 0.5 / dense.weight.detach().abs().amax(0) ** 0.5  # SmoothQuant, a = 0.5
    smoothed = Int8Linear.from_dense(dense, s, rotate=False)
    torch.testing.assert_close(smoothed.input_scale, 1 / s)
    # the weight on the layer's own inputs is the dense one within half a step of its (smoothed) groups
    step = int8_weights.unpack_scales(smoothed.weight_scale).repeat_interleave(smoothed.group, 1) * smoothed.input_scale
    assert ((smoothed.dequantize() * smoothed.input_scale - dense.weight.detach()).abs() <= step / 2 + 1e-7).all()
    torch.testing.assert_close(smoothed.effective(), smoothed.dequantize() * smoothed.input_scale)
    err_plain = (plain(x) - want).pow(2).mean().sqrt()
    err_smooth = (smoothed(x) - want).pow(2).mean().sqrt()
    assert err_smooth < 0.5 * err_plain, (err_smooth, err_plain)


def test_quantize_smooths_each_projection_group_with_maxima_calibrated_on_the_shipped_text():
    """quantize_ reads acb/data/calibration.txt with the tokenizer, records each projection
    group's input maxima in the model's own forward and divides the inputs by s = max|x|^0.5 /
    max|w|^0.5 (one tensor per group sharing an input)."""
    _q8()
    model = tiny_model("llama", seed=3)
    tok = tiny_tokenizer()
    ids = int8_calibration.calibration_ids(tok, model.config.vocab_size)
    assert len(ids) >= int8_calibration.CALIBRATION_WINDOW and ids[:40] == tok(
        int8_calibration.CALIBRATION.read_text())["input_ids"][:40]
    maxima = int8_calibration.input_maxima(model, ids)
    layer = model.model.layers[0]
    w = int8_calibration.CALIBRATION_WINDOW
    with torch.no_grad():  # the first layer's q/k/v input: the embedding, normed
        want = torch.stack([layer.input_layernorm(model.model.embed_tokens(torch.tensor([ids[i: i + w]])))[0]
                            .abs().amax(0) for i in range(0, len(ids) - w + 1, w)]).amax(0)
    torch.testing.assert_close(maxima["model.layers.0.self_attn.q_proj.weight"], want)
    assert len(maxima) == 4 * model.config.num_hidden_layers  # q/k/v, o, gate/up, down per layer
    factors = int8_calibration.smoothing_factors(model, maxima)
    attn = layer.self_attn
    wmax = torch.stack([attn.q_proj.weight.abs().amax(0), attn.k_proj.weight.abs().amax(0),
                        attn.v_proj.weight.abs().amax(0)]).amax(0).detach()
    s = (want ** 0.5 / wmax ** 0.5)
    torch.testing.assert_close(factors["model.layers.0.self_attn.q_proj.weight"], s)
    assert factors["model.layers.0.self_attn.k_proj.weight"] is factors["model.layers.0.self_attn.q_proj.weight"]
    quantization.quantize_(model, tokenizer=tok)
    torch.testing.assert_close(model.model.layers[0].self_attn.q_proj.input_scale, 1 / s)
    mlp = model.model.layers[0].mlp
    assert mlp.up_proj.input_scale is mlp.gate_proj.input_scale and mlp.down_proj.input_scale is not None


def test_without_a_usable_tokenizer_the_calibration_draws_ids_and_says_so(caplog):
    class Broken:
        def __call__(self, text):
            raise TypeError("not a text tokenizer")

    for tokenizer, reason in ((None, "no tokenizer"), (Broken(), "TypeError: not a text tokenizer")):
        caplog.clear()
        ids = int8_calibration.calibration_ids(tokenizer, 100)
        assert len(ids) >= int8_calibration.CALIBRATION_WINDOW and all(0 <= i < 100 for i in ids)
        assert ids == int8_calibration.calibration_ids(None, 100)  # a fixed draw: the same model quantizes the same way
        assert reason in caplog.text and "random token ids" in caplog.text


def test_a_bfloat16_norm_weight_quantizes_as_its_float32_value():
    """The int8_bf16 forward hands the kernel bf16 norm weights: widened exactly, same result."""
    q8 = _q8()
    x = torch.randn(5, 64)
    w = (torch.rand(64) + 0.5).bfloat16()
    got = _quantize(q8, x, 16, w)
    want = _quantize(q8, x, 16, w.float())
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        _quantize(q8, x, 16, w.half())


def test_weights_are_packed_as_unsigned_bytes_with_their_scales_per_group():
    _q8()
    wq, ws = _int8(32, 64, 4, group=16)
    layer = Int8Linear.from_int8(wq, ws)
    assert layer.weight.dtype == torch.uint8 and layer.weight_scale.shape == (2, 4, 16)
    assert torch.equal(int8_weights.unpack(layer.weight), wq)
    assert torch.equal(int8_weights.unpack_scales(layer.weight_scale), ws)
    again = Int8Linear.from_packed(layer.packed)  # what the GGUF cache stores
    assert torch.equal(again.dequantize(), layer.dequantize()) and again.group == 16
    per_channel = Int8Linear.from_int8(wq, ws[:, 0])  # one scale per row: repeated over the groups
    assert per_channel.group == int8_weights.activation_group(64) == 64


def test_the_activation_group_divides_the_input_width():
    assert [int8_weights.activation_group(k) for k in (576, 1536, 640, 96, 48, 100, 4)] == [64, 64, 64, 32, 16, 4, 4]


def test_activations_quantized_in_other_groups_than_the_weight_expects_are_refused():
    q8 = _q8()
    layer = Int8Linear.from_int8(*_int8(32, 64, 0, group=16))
    xq, xs, xo = _quantize(q8, torch.randn(2, 64), 64)
    with pytest.raises(RuntimeError, match="1 group"):
        q8.linear(xq, xs, xo, *layer.args, None, torch.float32)


def _sylvester(k: int) -> torch.Tensor:
    """The +-1 Walsh-Hadamard matrix over blocks of the largest power of two dividing k (what
    acb.model.int8_weights.hadamard multiplies by): the int8 pages' key rotation matrix, built by
    Sylvester's construction in acb.attention.kv_quant."""
    return kv_quant.rotate_keys(torch.eye(k))


@pytest.mark.parametrize("k", [4, 12, 40, 64, 96, 576, 1536, 2048])
def test_the_input_rotation_is_the_block_hadamard_matrix(k):
    x = torch.randn(7, k)
    h = _sylvester(k)
    torch.testing.assert_close(int8_weights.hadamard(x).double(), x.double() @ h.double(), rtol=1e-5,
                               atol=1e-5 * (k & -k) ** 0.5)
    torch.testing.assert_close(h @ h, (k & -k) * torch.eye(k))  # so W H / b undoes x H
    assert int8_weights.hadamard(x.view(7, 1, k)).shape == (7, 1, k)


# (K, group): rotation blocks of 32-512 in registers (K = 96: 32, 576: 64, 1536: 512) and the
# buffered path (K = 40: blocks of 8; 2048: a block past 512; a group of 4)
@pytest.mark.parametrize("k,group", [(96, 32), (576, 64), (576, 32), (1536, 64), (40, 4), (2048, 64), (576, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_quantization_rounds_the_rotated_row(k, group, dtype):
    """quantize_rows(rotate=True): the row (times the smoothing multiplier) rotated by the
    block Hadamard matrix, then quantized per group: the same bytes, scales and offsets as the
    unrotated kernel on acb.model.int8_weights.hadamard's rotation (the same sums in the same order)."""
    q8 = _q8()
    x = (torch.randn(9, k) * 2).to(dtype)
    x[:, 5] *= 50
    mult = torch.rand(k) + 0.5
    got = q8.quantize_rows(x, None, False, 1e-6, group, mult, True)
    want = _quantize(q8, int8_weights.hadamard(x.float() * mult).contiguous(), group)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # with the norm: the normed row rotated (the norm's sum is the kernel's own: within a step)
    w = torch.rand(k) + 0.5
    got = q8.quantize_rows(x, w, False, 1e-6, group, mult, True)
    xf = x.float()
    normed = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)) * mult
    rotated = int8_weights.hadamard(normed)
    torch.testing.assert_close(got[1], rotated.view(9, k // group, group).abs().amax(2) / 127, rtol=1e-5, atol=0)
    assert ((_dequantized_rows(got[0], got[1]).float() - rotated).abs() <= got[1].repeat_interleave(group, 1) * 0.51
            + 1e-5).all()


@pytest.mark.parametrize("k", [64, 96, 576])
def test_a_rotated_layer_computes_the_dense_product(k):
    """W rounded as (W s) H / b, inputs (x / s) H: the layer's weight on its own inputs is the
    dense one (effective(): the rounded weight rotated back), and its output the dense output
    within int8's error; the flag survives the packed form the GGUF cache stores."""
    _q8()
    torch.manual_seed(k)
    dense = torch.nn.Linear(k, 48)
    x = torch.randn(16, k)
    x[:, 3] *= 20
    s = torch.rand(k) + 0.5
    layer = Int8Linear.from_dense(dense, s, rotate=True)
    assert layer.rotated and "rotated" in repr(layer)
    b = k & -k
    step = int8_weights.unpack_scales(layer.weight_scale).repeat_interleave(layer.group, 1)
    # the rounded weight is (W s) H / b within half a step per element
    assert ((layer.dequantize() - int8_weights.rounded(dense.weight.detach(), s)).abs() <= step / 2 + 1e-7).all()
    torch.testing.assert_close(int8_weights.rounded(dense.weight.detach(), s),
                               (dense.weight.detach() * s) @ _sylvester(k) / b, rtol=1e-5, atol=1e-6)
    # rotated back (times H: (W s H / b) H = W s) and unsmoothed: the dense weight, within int8's error
    torch.testing.assert_close(layer.effective(), int8_weights.hadamard(layer.dequantize()) / s)
    w = dense.weight.detach()
    assert (layer.effective() - w).norm() < 0.01 * w.norm()
    want = dense(x)
    err = ((layer(x) - want).pow(2).mean() / want.pow(2).mean()).sqrt()
    assert err < 0.02, err
    plain = Int8Linear.from_dense(dense, s, rotate=False)
    assert not plain.rotated and (layer(x) - plain(x)).abs().max() < 0.1 * want.abs().max()
    again = Int8Linear.from_packed(layer.packed, dense.bias)
    assert again.rotated and torch.equal(again(x), layer(x))


def test_quantize_rotates_every_projection_and_the_fused_forward_follows():
    """quantize_ rounds every decoder projection rotated (ROTATION) and says so in the log; the
    int8 forward passes each projection's flag to the kernel."""
    _q8()
    model = tiny_model("llama", seed=3)
    quantization.quantize_(model, tokenizer=tiny_tokenizer())
    projections = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert projections and all(m.rotated for m in projections) and int8_weights.ROTATION
    runner = _runner(model)
    try:
        fused = runner.fast_paths.fused
        assert isinstance(fused, int8_forward.Int8Forward)
        assert fused.rotated == [(True, True, True, True)] * model.config.num_hidden_layers
    finally:
        runner.release()


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("n", [48, 259])
def test_the_bf16_lm_head_and_its_embedding_rows(n, path, monkeypatch):
    """The lm_head in bf16 (packed for acb's bf16 GEMM, float32 logits: vdpbf16ps, or widened to
    float32 on AVX2; PyTorch's float32 matmul where it is not built) and the tied
    embedding's rows read from the same packed table."""
    _q8()
    if path == "torch":
        monkeypatch.setattr(int8_weights.fused, "native_bf16", lambda: None)
    w = torch.randn(n, 24)
    head = Bf16Linear.from_dense(w)
    assert head.weight.dtype == torch.bfloat16 and head.weight.shape[0] * 16 >= n
    assert torch.equal(head.dense(), w.bfloat16())
    ids = torch.tensor([0, n - 1, 5, 5])
    assert torch.equal(head.rows(ids), w.bfloat16()[ids])
    with pytest.raises(IndexError, match="out of range"):
        head.rows(torch.tensor([n]))
    x = torch.randn(3, 24)
    got = head(x)
    assert got.dtype == torch.float32 and got.shape == (3, n)
    want = x.bfloat16().double() @ w.bfloat16().double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    emb = int8_weights.Bf16Embedding(head, torch.float32, 2.0)
    torch.testing.assert_close(emb(ids[None]), (w.bfloat16()[ids].float() * 2)[None], rtol=0, atol=0)


def test_rows_of_zeros_quantize_to_zero_outputs():
    q8 = _q8()
    layer = Int8Linear.from_int8(*_int8(32, 16, 0))
    xq, xs, xo = _quantize(q8, torch.zeros(2, 16), layer.group)
    assert q8.linear(xq, xs, xo, *layer.args, None, torch.float32).abs().max() == 0


def test_a_vocabulary_not_a_multiple_of_16_is_padded_and_the_padding_dropped():
    _q8()
    wq, ws = _int8(259, 64, 3)
    layer = Int8Linear.from_int8(wq, ws)
    assert layer.out_features == 259 and layer.weight.shape[0] * 16 == 272
    torch.testing.assert_close(layer.dequantize(), wq.float() * ws.repeat_interleave(layer.group, 1))
    assert layer(torch.randn(2, 3, 64)).shape == (2, 3, 259)


@pytest.mark.parametrize("arch", ARCHS)
def test_int8_fused_forward_computes_what_the_quantized_model_computes(arch):
    """acb's int8 forward against transformers' forward over the same Int8Linear modules
    (each computing through the kernel tested above): same math, fused differently."""
    _q8()
    model = tiny_model(arch, seed=3)
    quantization.quantize_(model)
    runner = _runner(model)
    try:
        assert isinstance(runner.fast_paths.fused, int8_forward.Int8Forward)
        rows = fresh_rows(random_prompts(3, 5, 40, seed=7))
        want = _logits(runner, runner.model, rows)
        got = _logits(runner, runner.fast_paths.fused, rows)
        # the fused RMSNorm + quantization sums its squares in another order (and takes 1 / sqrt
        # for rsqrt): an activation a hair from the middle of two int8 steps may round the other
        # way and move that token's logits (measured: 0.7 % of the largest logit, one row of 7);
        # a wrong scale, group or smoothing moves them by tens of %
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1.5e-2 * want.abs().max().item())
    finally:
        runner.release()


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_decode_step_runs_its_layers_in_one_native_call_with_the_same_bits(arch, dtype, kv, monkeypatch):
    """A decode-only step's layers in int8_cpu.cpp's DecodeLoop: the kernels the Python loop calls, in
    its order, so the same logits to the bit (test_fused_forward.decode_both_ways)."""
    _q8()
    model = tiny_model(arch, seed=3).to(dtype)
    quantization.quantize_(model)
    runner = ModelRunner(model, 128, 8, kv_cache_dtype=kv)
    runner.configure_fast_paths(EngineConfig(), 16)
    try:
        decode_both_ways(runner, int8_forward.Int8Forward, monkeypatch, f"{arch} {dtype} {kv}")
        if arch in NATIVE_LOOP_ARCHS:  # a step of 20 rows: whole, and as two halves on two threads
            decode_both_ways(runner, int8_forward.Int8Forward, monkeypatch, f"{arch} {dtype} {kv}, 20 rows",
                             prompts=20, longest=20)
    finally:
        runner.release()


def _every_logit(runner, tokens: list[int], pages: list[int]) -> torch.Tensor:
    """The int8 forward's logits at every position of one fresh prompt."""
    step = StepInput()
    step.add_row(tokens, 0, pages)
    input_ids, position_ids, _, meta = runner._build(step)
    with torch.inference_mode():
        return run(runner.fast_paths.fused, ForwardContext(meta), input_ids=input_ids.unsqueeze(0),
                   position_ids=position_ids.unsqueeze(0), logits_to_keep=0).logits[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_int8_top1_agrees_with_float32_on_tiny_models(arch, dtype):
    """Teacher-forced next-token agreement with the float32 model, int8 GEMMs with float32 or
    bf16 (q/k/v, attention, KV pages) beside them. Random tiny models have narrow margins
    between their top tokens (real ones wider: SmolLM2's is measured in benchmarks/quality.py);
    measured 2026-12-04: 93.1-99.2 % (float32) and 93.1-98.9 % (bf16) here, asserted >= 90 %."""
    _q8()
    ref = tiny_model(arch, seed=5)
    model = tiny_model(arch, seed=5).to(dtype)
    quantization.quantize_(model, tokenizer=tiny_tokenizer())
    runner = _runner(model)
    try:
        agree = total = 0
        for i, p in enumerate(random_prompts(6, 30, 60, seed=13)):
            got = _every_logit(runner, p, list(range(8 * i, 8 * i + 8)))
            with torch.inference_mode():
                want = ref(torch.tensor([p])).logits[0]
            agree += (got.argmax(-1) == want.argmax(-1)).sum().item()
            total += len(p)
        print(f"{arch} {dtype}: top-1 agreement {agree / total:.3f}")
        assert agree / total >= 0.90, f"{arch}: top-1 agreement {agree / total:.3f}"
    finally:
        runner.release()


def test_quantized_weights_take_at_most_35_percent_of_float32():
    """Each int8 projection: its bytes and a float32 scale per 64 (26.6 % of float32); the lm_head
    and embedding bf16 (50 %). SmolLM2-135M's whole model is checked in tests/test_gguf_int8.py."""
    _q8()
    model = tiny_model("llama")
    quantization.quantize_(model)
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    smoothing = {m.input_scale.data_ptr(): 4 * m.input_scale.numel() for m in linears}  # shared by q/k/v, gate/up
    own = sum(m.weight.numel() + 4 * m.weight_scale.numel() for m in linears) + sum(smoothing.values())
    assert own <= 0.29 * sum(4 * m.in_features * m.out_features for m in linears)
    assert model.lm_head.weight.element_size() == 2
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules()), "a dense linear stayed resident"


async def test_an_int8_engine_runs_the_int8_forward_and_says_so():
    _q8()
    model = tiny_model("qwen3", seed=2)
    engine = Engine(model, tokenizer=tiny_tokenizer(), config=EngineConfig(num_blocks=256, page_size=8,
                                                                           quantization="int8"))
    prompts = random_prompts(4, 3, 40, seed=11)
    async with engine:
        stats = engine.stats()
        assert (stats.quantization, stats.forward_path, stats.dtype) == ("int8", "fused", "float32")
        got = await engine.generate_batch(prompts, max_new_tokens=8, ignore_eos=True)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int8Linear)  # quantized in place
    assert isinstance(model.lm_head, Bf16Linear)
    for prompt, result in zip(prompts, got, strict=True):
        # the quantized model's own forward (transformers', over the Int8Linear modules)
        want = reference_greedy(model, prompt, 8)
        agree = sum(a == b for a, b in zip(result.token_ids, want, strict=True))
        assert agree >= 6 or result.token_ids[:4] == want[:4]


@pytest.mark.parametrize("quant", ["int8", None])
async def test_only_the_int8_forward_rounds_its_prompt_attentions_softmax_weights(monkeypatch, quant):
    """A bf16 step's prompt rows go to the bf16 prefill kernel with ``bf16_weights`` set under int8
    (the weights rounded to bf16 for the value product: measured no loss of int8's agreement) and
    unset for a bf16 model (whose forward keeps ~16 bits of each weight, at its 99 % line)."""
    from acb.kernels.cpu import paged_decode_kernel

    _q8()
    if paged_decode_kernel() is None or not paged_decode_kernel().prefill_bf16():
        pytest.skip("the native kernels have no bf16 prefill here (no avx512_bf16)")
    model = tiny_model("llama", seed=2)
    engine = Engine(model, tokenizer=tiny_tokenizer(), config=EngineConfig(
        num_blocks=128, page_size=8, dtype="bfloat16", quantization=quant, max_batch_tokens=32))
    async with engine:
        assert engine.stats().forward_path == "fused"
        spy = _PrefillCalls(selector.KERNELS["native"])
        monkeypatch.setitem(selector.KERNELS, "native", spy)
        await engine.generate_batch(random_prompts(3, 20, 40, seed=4), max_new_tokens=3, ignore_eos=True)
    seen = [(q.dtype, flag) for q, _, flag in spy.calls]
    assert seen and all(dtype == torch.bfloat16 for dtype, _ in seen), seen
    assert {flag for _, flag in seen} == {quant == "int8"}


async def test_weights_edited_in_place_are_seen_under_int8():
    """The weight-change contract holds: the int8 forward reads the modules' own tensors."""
    _q8()
    model = tiny_model("llama", seed=2)
    engine = Engine(model, tokenizer=tiny_tokenizer(), config=EngineConfig(num_blocks=256, page_size=8,
                                                                           quantization="int8"))
    prompt = random_prompts(1, 20, 20, seed=4)[0]
    async with engine:
        before = (await engine.generate_batch([prompt], max_new_tokens=6, ignore_eos=True))[0].token_ids
        with torch.no_grad():
            for layer in model.model.layers:  # the int8 projections: every MLP's down scales zeroed
                layer.mlp.down_proj.weight_scale.zero_()
        no_mlp = (await engine.generate_batch([prompt], max_new_tokens=6, ignore_eos=True))[0].token_ids
        with torch.no_grad():
            model.lm_head.weight.zero_()  # every logit 0 (the bf16 lm_head): greedy picks token 0
        zeroed = (await engine.generate_batch([prompt], max_new_tokens=6, ignore_eos=True))[0].token_ids
        await engine.reload_weights()
    # the model's own forward over the same edited modules: what the engine must have run
    assert before != [0] * 6 and zeroed == [0] * 6
    assert no_mlp != before


async def test_a_model_quantized_by_an_earlier_engine_runs_again_and_is_refused_where_int8_cannot_run():
    """An engine quantizes the caller's model in place: a later engine over the same object runs
    it as int8 (the same tokens), and refuses by name what int8 cannot do (a step used to fail
    on every request instead: the cast reached the float32 scales, or no int8 path was there)."""
    _q8()
    model = tiny_model("qwen3", seed=2)
    prompt = random_prompts(1, 12, 12, seed=3)[0]

    def config(**fields):
        return EngineConfig(num_blocks=64, page_size=8, **fields)

    async with Engine(model, tokenizer=tiny_tokenizer(), config=config(quantization="int8")) as engine:
        first = (await engine.generate(prompt, max_new_tokens=6, ignore_eos=True)).token_ids
    async with Engine(model, tokenizer=tiny_tokenizer(), config=config()) as engine:
        assert (engine.stats().quantization, engine.stats().forward_path) == ("int8", "fused")
        assert (await engine.generate(prompt, max_new_tokens=6, ignore_eos=True)).token_ids == first
    for fields, needle in [(dict(dtype="bfloat16"), r"EngineConfig.dtype='bfloat16' cannot be applied: the model "
                            r"holds acb's int8 layers"),
                           (dict(cpu_kernels=False), r"holds acb's int8 layers .* needs cpu_kernels"),
                           (dict(cpu_fused_forward=False), r"holds acb's int8 layers .* needs cpu_kernels and "
                            r"cpu_fused_forward")]:
        with pytest.raises(ValueError, match=needle):
            Engine(model, tokenizer=tiny_tokenizer(), config=config(**fields))
    scale = model.model.layers[0].mlp.down_proj.weight_scale
    assert scale.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32  # nothing was cast


@pytest.mark.parametrize("fields,needle", [
    (dict(quantization="int4"), "must be None, 'int8' or 'gguf'"),
    (dict(quantization="int8", tensor_parallel_size=2), "tensor_parallel_size"),
    (dict(quantization="int8", compile_level=1), "compile_level"),
])
def test_configs_int8_cannot_honour_are_refused_by_name(fields, needle):
    with pytest.raises(ValueError, match="quantization") as e:
        EngineConfig(**fields)
    assert needle in str(e.value)


def test_int8_on_a_device_other_than_the_cpu_is_refused_by_name():
    model = tiny_model("llama").to("meta")  # stands in for a CUDA model on a machine without one
    with pytest.raises(ValueError, match="quantization='int8' runs on the CPU only"):
        quantization.prepare(model, EngineConfig(quantization="int8"))


def test_int8_without_the_fused_forward_is_refused_by_name(monkeypatch):
    _q8()
    monkeypatch.setenv("ACB_CPU_FUSED", "0")
    with pytest.raises(ValueError, match="EngineConfig.quantization needs cpu_kernels and cpu_fused_forward.*"
                       "ACB_CPU_FUSED=0"):
        Engine(tiny_model("llama"), tokenizer=tiny_tokenizer(), config=EngineConfig(num_blocks=64, quantization="int8"))


def test_int8_on_an_architecture_without_it_is_refused_by_name():
    _q8()
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(tf.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="quantization='int8' cannot run on this model"):
        Engine(model, config=EngineConfig(num_blocks=64, quantization="int8"))
    assert type(model.lm_head) is torch.nn.Linear  # left as it was


def test_int8_on_float16_weights_is_refused_by_name():
    model = tiny_model("llama").half()
    with pytest.raises(ValueError, match="quantization='int8' runs with float32 or bfloat16"):
        quantization.prepare(model, EngineConfig(quantization="int8"))


def test_the_cli_passes_quantization_to_the_engine_config():
    from acb.serving.cli import _model_source, build_parser

    args = build_parser().parse_args(["serve", "--tiny", "--quantization", "int8"])
    assert _model_source(args)[2].quantization == "int8"
