"""GGUF files at their own widths (``quantization="gguf"``, acb.model.gguf_native): every block type
decoded and widened bit for bit as the ``gguf`` package dequantizes it, the low-bit kernels against
that widening, and the setting's refusals. The real files (SmolLM2's Q4_1, Gemma 3's Q4_K_M) are in
test_gguf_native_real.py (CI's extras)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import acb
from acb.model import gguf_native
from acb.model.int8_weights import native_kernels

BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
               "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
# where each block's float16 fields lie (byte offsets)
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A tensor's bytes [n, row bytes] of random blocks of ``kind``, its float16 scales finite and small."""
    rng = np.random.default_rng(seed)
    per, size = BLOCK_BYTES[kind]
    data = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for at in HALVES[kind]:
        data[..., at: at + 2] = rng.normal(0, 0.02, size=(n, k // per)).astype(np.float16)[..., None].view(np.uint8)
    return data.reshape(n, -1)


def _needs_kernels():
    if native_kernels() is None:
        pytest.skip("acb's int8/low-bit kernels need AVX2 and a compiler")


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_each_block_type_widens_to_the_gguf_package_dequantization_bit_for_bit(kind):
    from gguf import GGMLQuantizationType, dequantize

    n, k = 40, 512  # 40 rows: padded to 48 in the packed form
    data = random_blocks(kind, n, k)
    want = torch.from_numpy(np.ascontiguousarray(dequantize(data, GGMLQuantizationType[kind]), np.float32)
                            ).reshape(n, k)
    module = gguf_native._module(kind, data, k, None, None)
    got = module.dequantize()
    assert got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, signed zeros included
    ids = torch.tensor([0, 7, 8, 15, 16, 39])
    rows = module.rows(ids)
    assert torch.equal(rows, want[ids])
    if kind != "Q8_0":
        assert module.kind == kind and module.weight.shape[2] == {"4": 8, "5": 10, "6": 16}[kind[1]]


def _quantized_reference(k8, x: torch.Tensor, w: torch.Tensor, group: int):
    """(the kernel's inputs, x's quantized values widened @ w^T in float64): what the kernel computes, exactly."""
    xq = k8.quantize_rows(x, None, False, 1e-6, group, None, False)
    q, s, _ = xq
    widened = (q.double().view(x.shape[0], -1, group) * s.double()[:, :, None]).view(x.shape)
    return xq, widened @ w.double().T


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_the_low_bit_gemm_equals_its_widened_weights_times_the_quantized_inputs(kind, rows):
    _needs_kernels()
    k8 = native_kernels()
    n, k = 48, 512
    module = gguf_native._module(kind, random_blocks(kind, n, k, seed=rows), k, None, torch.randn(n))
    torch.manual_seed(rows)
    x = torch.randn(rows, k)
    xq, want = _quantized_reference(k8, x, module.dequantize(), module.group)
    want = want + module.bias.double()[:n]
    got = k8.linear(*xq, *module.args, None, torch.float32)[:, :n]
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    other = torch.randn(rows, module.weight.shape[0] * 16)  # the residual add, fused
    added = k8.linear(*xq, *module.args, other, torch.float32)[:, :n]
    assert torch.allclose(added, got + other[:, :n], atol=1e-5)
    bf16 = k8.linear(*xq, *module.args, None, torch.bfloat16)[:, :n]
    assert torch.allclose(bf16.float(), got, rtol=1e-2, atol=1e-2 * got.abs().max())


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q6_K"])
def test_the_low_bit_glu_is_act_of_the_gate_times_the_up(kind):
    _needs_kernels()
    k8 = native_kernels()
    n, k = 64, 256
    gate = gguf_native._module(kind, random_blocks(kind, n, k, 1), k, None, None)
    up = gguf_native._module(kind, random_blocks(kind, n, k, 2), k, None, None)
    x = torch.randn(5, k)
    xq, g = _quantized_reference(k8, x, gate.dequantize(), gate.group)
    _, u = _quantized_reference(k8, x, up.dequantize(), up.group)
    got = k8.glu(*xq, *gate.args, *up.args, 0, torch.float32)
    want = torch.nn.functional.silu(g) * u
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max())


def test_a_gate_and_up_of_two_formats_are_refused_by_name():
    _needs_kernels()
    k8 = native_kernels()
    gate = gguf_native._module("Q4_1", random_blocks("Q4_1", 32, 256), 256, None, None)
    up = gguf_native._module("Q8_0", random_blocks("Q8_0", 32, 256), 256, None, None)
    xq = k8.quantize_rows(torch.randn(2, 256), None, False, 1e-6, 32, None, False)
    with pytest.raises(RuntimeError, match="same weight format|same shape"):
        k8.glu(*xq, *gate.args, *up.args, 0, torch.float32)


def test_q_k_v_of_one_format_are_joined_into_one_gemm_and_of_two_are_not():
    same = [gguf_native._module("Q4_1", random_blocks("Q4_1", n, 256, n), 256, None, None) for n in (64, 32, 32)]
    joined = gguf_native._joined(same)
    assert all(j.weight.untyped_storage().data_ptr() == joined[0].weight.untyped_storage().data_ptr()
               for j in joined)
    assert [torch.equal(a.dequantize(), b.dequantize()) for a, b in zip(joined, same, strict=True)] == [True] * 3
    mixed = same[:2] + [gguf_native._module("Q8_0", random_blocks("Q8_0", 32, 256), 256, None, None)]
    assert gguf_native._joined(mixed) == mixed


def test_gguf_is_a_quantization_choice_and_refuses_what_it_cannot_run(tmp_path):
    assert acb.EngineConfig(quantization="gguf").quantization == "gguf"
    with pytest.raises(ValueError, match="quantization"):
        acb.EngineConfig(quantization="q4")
    from acb.model.loading import load

    with pytest.raises(ValueError, match="quantization='gguf' runs a GGUF file"):
        load(str(tmp_path), quantization="gguf")


def test_a_dense_model_is_refused_by_quantization_gguf():
    from acb.testing import tiny_model, tiny_tokenizer

    with pytest.raises(ValueError, match="quantization='gguf'.*GGUF file"):
        acb.Engine(tiny_model("llama"), tiny_tokenizer(), config=acb.EngineConfig(quantization="gguf"))


def test_a_gguf_file_of_an_architecture_transformers_cannot_read_is_refused_by_name(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "odd.gguf"), "notamodel")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _needs_kernels()
    with pytest.raises(ValueError, match="quantization='gguf'.*odd.gguf.*architecture"):
        gguf_native.load(str(tmp_path), "odd.gguf", torch.float32)
