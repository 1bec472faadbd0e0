"""The Triton paged-attention kernels (acb/kernels/triton_attention.py) against a float64
PyTorch reference (acb/testing/attention_cases.py), run on CPU tensors by Triton's
interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before anything imports
triton). Shapes are small (the interpreter is slow) but cross page boundaries, with GQA
ratios 1/3/8, sliding windows, soft-caps, float32/bfloat16/float16, split-K, empty
rows and single-token rows. benchmarks/gpu_check.py runs the same cases on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

from acb.testing import attention_cases as cases

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1"
tk = pytest.importorskip("acb.kernels.triton_attention", reason="triton is installed by scripts/setup.sh")


@pytest.mark.parametrize(("groups", "dtype", "page_size", "window", "softcap", "splits"), cases.DECODE_CASES)
def test_paged_decode_matches_reference(groups, dtype, page_size, window, softcap, splits):
    cases.check_decode(groups, dtype, page_size, window, softcap, splits)


@pytest.mark.parametrize(("groups", "dtype", "page_size", "window", "softcap"), cases.PREFILL_CASES)
def test_paged_prefill_matches_reference(groups, dtype, page_size, window, softcap):
    cases.check_prefill(groups, dtype, page_size, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_each_token_in_its_slot(dtype):
    cases.check_write(dtype)


def test_paged_decode_with_no_rows_is_a_no_op():
    k_cache, v_cache = cases.make_cache(1, 2, 4, 16, torch.float32, 0)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out = torch.zeros(0, 2, 16)
    result = tk.paged_decode(torch.zeros(2, 0, 16), out, k_cache, v_cache, torch.zeros(0, dtype=torch.long),
                             torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long), 4, 0.25)
    # returns at once (no launch over an empty grid, which Triton refuses) and touches no page
    assert result is None and out.shape == (0, 2, 16)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


def test_split_count_depends_on_load_and_width():
    assert tk.num_splits(rows=256, kv_heads=8, width=4096) == 1  # enough programs already
    assert tk.num_splits(rows=1, kv_heads=2, width=100) == 1  # a short context is not split
    assert tk.num_splits(rows=1, kv_heads=2, width=8192) == tk.MAX_SPLITS
