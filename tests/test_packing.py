"""The runner's step builders (acb/packing.py), fed hand-made steps: packing a step's
columns into flat lists, and attention metadata that is complete when built and names
its kernel path instead of carrying kernel modules."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from acb.packing import AttentionBuilder, DeviceIds, StepAttention, pack
from acb.step import StepInput

PS = 4  # tokens per page


def _step() -> StepInput:
    step = StepInput()
    step.add_row([5, 6, 7, 8, 9], start=0, pages=[3, 1], sample=True, swa_pages=[0, 2])  # a fresh prompt
    step.add_row([], start=0, pages=[], sample=True)  # a forked choice: samples the row before's logits
    step.add_row([11], start=6, pages=[4, 7], carry_from=0, swa_pages=[1, 3])  # a decode row, carried
    step.add_row([12, 13], start=4, pages=[2, 6], sample=False, swa_pages=[4, 5])  # a continued prefill chunk
    return step


def _builder(kernel: str, sliding: bool = False) -> AttentionBuilder:
    caches = [torch.zeros(1, 9 * PS, 2)]
    return AttentionBuilder(kernel, PS, DeviceIds(torch.device("cpu")), caches, caches, zero_page=8,
                            sliding_layers=frozenset({0}) if sliding else frozenset(), sliding_zero_page=6)


def test_pack_flattens_the_rows_and_finds_pages_written_for_the_first_time():
    written = bytearray(8)
    written[1] = 1  # page 1 was written by an earlier step
    p = pack(_step(), PS, written)
    assert p.tokens == [5, 6, 7, 8, 9, 11, 12, 13]
    assert p.positions == [0, 1, 2, 3, 4, 6, 4, 5]
    assert p.slots == [12, 13, 14, 15, 4, 7 * PS + 2, 6 * PS, 6 * PS + 1]
    assert p.keep == [4, 4, 5]  # the prompt's last token, the fork (the same row), the decode row
    assert (p.carry_pos, p.carry_src) == ([5], [0])
    assert p.fresh == [3, 7, 6] and all(written[page] for page in (1, 3, 6, 7))
    assert (p.decode_q, p.lengths, p.tables) == ([5], [7], [[4, 7]])
    assert p.prefill_rows == [(0, 5, 0), (6, 2, 4)]
    assert p.swa_slots == [] and p.swa_tables == [None]  # no sliding pool asked for


def test_pack_places_the_sliding_pool_on_hybrid_models():
    p = pack(_step(), PS, bytearray(8), bytearray(6))
    assert p.swa_slots == [0, 1, 2, 3, 2 * PS, 3 * PS + 2, 5 * PS, 5 * PS + 1]
    assert p.swa_tables == [[1, 3]] and p.swa_prefill_tables == [[0, 2], [4, 5]]


def _modules_in(meta: StepAttention) -> list[str]:
    found = []
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        parts = [value] if not isinstance(value, tuple) else list(value)
        if dataclasses.is_dataclass(value):
            parts = [getattr(value, g.name) for g in dataclasses.fields(value)]
        found += [f.name for v in parts if isinstance(v, types.ModuleType) or callable(getattr(v, "paged_decode", 0))]
    return found


def test_native_metadata_names_its_path_and_batches_the_fresh_prompts():
    p = pack(_step(), PS, bytearray(8))
    meta = _builder("native").build(p, torch.tensor(p.slots), width=7, padded=False, max_decode_blocks=None)
    assert meta.kernel == "native" and meta.decode.kernel == "native" and _modules_in(meta) == []
    assert meta.decode.valid is None  # masks are PyTorch's path's only
    assert meta.fresh_spans.tolist() == [[0, 5, 0, 0]]
    fresh, continued = meta.prefills
    assert fresh.kernel_row is None and continued.kernel_row.tolist() == [[6, 8, 0, 4]]
    assert meta.pool.decode_pages.tolist() == [[4, 7]]
    assert meta.pool.context_pages[0] is None and meta.pool.context_pages[1].tolist() == [[2, 6]]
    assert meta.sliding is None
    with pytest.raises(dataclasses.FrozenInstanceError):  # complete when built: never filled in later
        meta.decode = None


def test_a_decode_table_wider_than_max_decode_blocks_takes_pytorchs_path():
    p = pack(_step(), PS, bytearray(8))
    meta = _builder("native").build(p, torch.tensor(p.slots), width=7, padded=False, max_decode_blocks=1)
    assert meta.kernel == "native" and meta.decode.kernel == "torch"
    assert meta.decode.valid.tolist() == [[[True] * 7 + [False]]]
    assert meta.decode.q_pos.tolist() == [[6]]


def test_the_sliding_pool_is_built_beside_the_full_one():
    p = pack(_step(), PS, bytearray(8), bytearray(6))
    meta = _builder("torch", sliding=True).build(p, torch.tensor(p.slots), width=7, padded=False,
                                                 max_decode_blocks=None)
    assert meta.sliding_layers == frozenset({0})
    assert meta.sliding.slot_mapping.tolist() == p.swa_slots
    assert meta.sliding.decode_pages.tolist() == [[1, 3]] and meta.pool.decode_pages.tolist() == [[4, 7]]
    assert meta.sliding.context_pages[1].tolist() == [[4, 5]]
    assert meta.fresh_spans is None and all(span.kernel_row is None for span in meta.prefills)  # not "native"


def test_recycled_entries_and_padding_read_the_pools_zero_page():
    ids = DeviceIds(torch.device("cpu"))
    assert ids.table([[-1, 3], [5]], 12, PS, zero=8).tolist() == [[8, 3, 8], [5, 8, 8]]
