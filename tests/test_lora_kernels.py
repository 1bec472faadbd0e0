"""acb/kernels/csrc/lora_cpu.cpp against PyTorch: each adapter row of a step gets exactly its own
adapter's delta on every projection of a group (the shrink over the group's concatenated A,
the expand per projection), rows of no adapter and slots whose scale is 0 are left alone,
whatever the mix and order of slots; ``glu_add`` is the MLP's SiLU / GELU-tanh times up with
the gate's and up's deltas added first."""

from __future__ import annotations

import pytest
import torch

from acb.kernels.cpu import lora_kernels

kernels = lora_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.available(), reason="no AVX-512 LoRA kernels here")


def _rows(slots: list[int], n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    order, groups = [], []
    for s in range(n_slots):
        rows = [i for i, t in enumerate(slots) if t == s]
        if rows:
            groups.append((s, len(order), len(rows)))
            order += rows
    return torch.tensor(order, dtype=torch.long), torch.tensor(groups, dtype=torch.long).view(-1, 3)


@pytest.mark.parametrize("slots", [
    [0] * 13,  # one adapter on every row (a prompt chunk, or every decode row on one adapter)
    [0, -1, 1, 1, 2, 0, 0, 0, 0, 0, 1, -1, 2, 2, 2, 2, 2, 1, 0, 0, -1],  # interleaved, and base rows
    [2, 1, 0, 2, 1, 0, 2],  # no two rows of one slot side by side (tiles of one row)
])
def test_add_matches_pytorch(slots):
    gen = torch.Generator().manual_seed(len(slots))
    S, K, R = 3, 80, 8  # K and the outputs not multiples of 16: the masked tails
    outs = (96, 40, 70)
    x = torch.randn(len(slots) + 3, K, generator=gen)  # 3 padding rows past the step's
    at = torch.randn(S, K, 3 * R, generator=gen)
    bts = [torch.randn(S, R, n, generator=gen) for n in outs]
    scales = [torch.tensor([0.5, 2.0, 0.0]), torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0.25, 0.5, 1.0])]
    ys = [torch.randn(x.shape[0], n, generator=gen) for n in outs]
    want = [y.clone() for y in ys]
    for i, s in enumerate(slots):
        if s >= 0:
            t = x[i] @ at[s]
            for p in range(3):
                want[p][i] += scales[p][s] * (t[p * R:(p + 1) * R] @ bts[p][s])
    kernels.add_(ys, x, at, bts, scales, *_rows(slots, S))
    for got, ref in zip(ys, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    base = [i for i, s in enumerate(slots) if s < 0] + list(range(len(slots), x.shape[0]))
    for got, ref in zip(ys, want):  # untouched, bit for bit
        assert torch.equal(got[base], ref[base])


def test_add_on_strided_rows_and_one_projection():
    """o / down: one projection, its output a view with a row stride (the fused residual sum)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 48, generator=gen)
    at, bt = torch.randn(2, 48, 4, generator=gen), torch.randn(2, 4, 32, generator=gen)
    wide = torch.zeros(6, 50)
    y = wide[:, 2:34]
    kernels.add_([y], x, at, [bt], [torch.tensor([1.5, 0.5])], *_rows([1, 1, 0, -1, 1, 0], 2))
    want = torch.zeros(6, 32)
    for i, s in enumerate([1, 1, 0, -1, 1, 0]):
        if s >= 0:
            want[i] = [1.5, 0.5][s] * (x[i] @ at[s]) @ bt[s]
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(wide[:, :2], torch.zeros(6, 2)) and torch.equal(wide[:, 34:], torch.zeros(6, 16))


def test_glu_add_of_no_adapter_rows_is_the_plain_mlp():
    gen = torch.Generator().manual_seed(4)
    g, u = torch.randn(9, 70, generator=gen) * 4, torch.randn(9, 70, generator=gen)
    x, at, bt = torch.randn(9, 16), torch.randn(2, 16, 8), torch.randn(2, 4, 70)
    none = (torch.zeros(0, dtype=torch.long), torch.zeros(0, 3, dtype=torch.long))
    torch.testing.assert_close(kernels.glu_add(g, u, x, at, [bt, bt], [torch.ones(2)] * 2, *none, 0),
                               torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kernels.glu_add(g, u, x, at, [bt, bt], [torch.ones(2)] * 2, *none, 1),
                               torch.nn.functional.gelu(g, approximate="tanh") * u, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    x = torch.randn(4, 16)
    at, bt, sc = torch.randn(2, 16, 4), torch.randn(2, 4, 8), torch.ones(2)
    order, groups = _rows([0, 1, 0, 1], 2)
    with pytest.raises(RuntimeError, match="order holds a row out of range"):
        kernels.add_([torch.zeros(4, 8)], x, at, [bt], [sc], torch.tensor([0, 9]), groups)
    with pytest.raises(RuntimeError, match="bad group"):
        kernels.add_([torch.zeros(4, 8)], x, at, [bt], [sc], order, torch.tensor([[5, 0, 2]]))
    with pytest.raises(RuntimeError, match="bt must be"):
        kernels.add_([torch.zeros(4, 9)], x, at, [bt], [sc], order, groups)


@pytest.mark.parametrize("act", [0, 1])
def test_glu_add_matches_pytorch(act):
    """The MLP in one pass: the gate's and up's deltas before the activation and the product on
    the adapter rows, act(g) * u on the others (the padding too)."""
    gen = torch.Generator().manual_seed(5 + act)
    S, K, R, N = 3, 48, 4, 70
    slots = [1, -1, 0, 0, 2, 1, 1, 1, 1, -1, 0]
    x = torch.randn(len(slots) + 2, K, generator=gen)
    at = torch.randn(S, K, 2 * R, generator=gen)
    bts = [torch.randn(S, R, N, generator=gen) for _ in range(2)]
    scales = [torch.tensor([0.5, 2.0, 0.0]), torch.tensor([1.0, 0.25, 3.0])]
    g, u = torch.randn(x.shape[0], N, generator=gen) * 3, torch.randn(x.shape[0], N, generator=gen)
    gd, ud = g.clone(), u.clone()
    for i, s in enumerate(slots):
        if s >= 0:
            t = x[i] @ at[s]
            gd[i] += scales[0][s] * (t[:R] @ bts[0][s])
            ud[i] += scales[1][s] * (t[R:] @ bts[1][s])
    fn = torch.nn.functional.silu if act == 0 else (lambda v: torch.nn.functional.gelu(v, approximate="tanh"))
    got = kernels.glu_add(g, u, x, at, bts, scales, *_rows(slots, S), act)
    torch.testing.assert_close(got, fn(gd) * ud, rtol=1e-5, atol=1e-4)
