"""The runner's step builders (acb/attention/metadata.py), fed hand-made steps: packing a step's
columns into flat lists, and attention metadata that is complete when built and names
its kernel path instead of carrying kernel modules."""

from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch

from acb.attention.block_tables import BlockTables
from acb.attention.metadata import AttentionBuilder, DeviceIds, StepAttention, pack
from acb.core.step import StepInput
from acb.worker.kv_store import KVStore

PS = 4  # tokens per page


def _step() -> StepInput:
    step = StepInput()
    step.add_row([5, 6, 7, 8, 9], start=0, pages=[3, 1], sample=True, swa_pages=[0, 2])  # a fresh prompt
    step.add_row([], start=0, pages=[], sample=True)  # a forked choice: samples the row before's logits
    step.add_row([11], start=6, pages=[4, 7], carry_from=0, swa_pages=[1, 3])  # a decode row, carried
    step.add_row([12, 13], start=4, pages=[2, 6], sample=False, swa_pages=[4, 5])  # a continued prefill chunk
    return step


def _tables(step: StepInput, sliding: bool = False) -> BlockTables:
    """The runner's block-table store with ``step``'s deltas applied (zero pages 8 and 6)."""
    tables = BlockTables(torch.device("cpu"), PS, 8, DeviceIds(torch.device("cpu")), 6 if sliding else None,
                         rows=2, cols=1)  # small: applying grows it
    tables.apply(step.delta_rows, step.delta_cols, step.delta_pages, step.delta_swa)
    return tables


def _builder(kernel: str, step: StepInput, sliding: bool = False) -> AttentionBuilder:
    caches = [torch.zeros(1, 9 * PS, 2)]
    return AttentionBuilder(kernel, PS, DeviceIds(torch.device("cpu")), caches, caches, _tables(step, sliding),
                            sliding_layers=frozenset({0}) if sliding else frozenset())


def _slots(builder: AttentionBuilder, p, sliding: bool = False) -> torch.Tensor:
    return builder.tables.slots(torch.tensor(p.token_rows), torch.tensor(p.positions), sliding)


def test_pack_flattens_the_rows_and_the_store_places_their_tokens():
    step = _step()
    p = pack(step)
    assert p.tokens == [5, 6, 7, 8, 9, 11, 12, 13]
    assert p.positions == [0, 1, 2, 3, 4, 6, 4, 5]
    assert p.token_rows == [0, 0, 0, 0, 0, 2, 3, 3]
    assert _slots(_builder("torch", step), p).tolist() == [12, 13, 14, 15, 4, 7 * PS + 2, 6 * PS, 6 * PS + 1]
    assert p.keep == [4, 4, 5]  # the prompt's last token, the fork (the same row), the decode row
    assert (p.carry_pos, p.carry_src) == ([5], [0])
    assert (p.decode_q, p.lengths, p.table_rows) == ([5], [7], [2])
    assert p.prefill_rows == [(0, 5, 0), (6, 2, 4)] and p.prefill_table_rows == [0, 3]


def test_the_sliding_pool_places_tokens_from_its_own_table():
    step = _step()
    builder = _builder("torch", step, sliding=True)
    assert _slots(builder, pack(step), sliding=True).tolist() == [0, 1, 2, 3, 2 * PS, 3 * PS + 2, 5 * PS, 5 * PS + 1]


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
    step = _step()
    p = pack(step)
    meta = _builder("native", step).build(p, torch.zeros(8), None, width=7, padded=False, max_decode_blocks=None)
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
    step = _step()
    p = pack(step)
    meta = _builder("native", step).build(p, torch.zeros(8), None, width=7, padded=False, max_decode_blocks=1)
    assert meta.kernel == "native" and meta.decode.kernel == "torch"
    assert meta.decode.valid.tolist() == [[[True] * 7 + [False]]]
    assert meta.decode.q_pos.tolist() == [[6]]


def test_the_sliding_pool_is_built_beside_the_full_one():
    step = _step()
    p = pack(step)
    builder = _builder("torch", step, sliding=True)
    swa_slots = _slots(builder, p, sliding=True)
    meta = builder.build(p, _slots(builder, p), swa_slots, width=7, padded=False, max_decode_blocks=None)
    assert meta.sliding_layers == frozenset({0})
    assert meta.sliding.slot_mapping is swa_slots
    assert meta.sliding.decode_pages.tolist() == [[1, 3]] and meta.pool.decode_pages.tolist() == [[4, 7]]
    assert meta.sliding.context_pages[1].tolist() == [[4, 5]]
    assert meta.fresh_spans is None and all(span.kernel_row is None for span in meta.prefills)  # not "native"


def test_recycled_entries_padding_and_entries_past_a_rows_length_read_the_zero_page():
    step = StepInput()
    step.send_table(0, 0, [-1, 3], [-1, 1])  # a page recycled behind a sliding window
    step.send_table(1, 0, [5, 2, 7], [0, 4, 5])  # its last two entries: an earlier owner's, or beyond its length
    tables = _tables(step, sliding=True)
    rows, lengths = torch.tensor([0, 1, -1]), torch.tensor([8, 3, 1])  # -1: a decode padding row
    assert tables.gather(rows, lengths, 12).tolist() == [[8, 3, 8], [5, 8, 8], [8, 8, 8]]
    assert tables.gather(rows, lengths, 12, sliding=True).tolist() == [[6, 1, 6], [0, 6, 6], [6, 6, 6]]
    assert tables.gather(rows, lengths, 24).shape == (3, 6)  # wider than the store: it grows
    tables.check([(0, [-1, 3], [-1, 1]), (1, [5, 2, 7], [0, 4, 5])])
    with pytest.raises(AssertionError, match="block-table row 1"):
        tables.check([(1, [5, 2, 6], None)])  # an entry changed but never sent


def _kv_config(layers=1, kv_heads=1, head_dim=8):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=layers, num_attention_heads=kv_heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=8)


def test_a_steps_deltas_zero_the_pages_they_bring_in_once():
    # where memory does not come zeroed (CUDA: torch.empty); forced here on the CPU
    ids = DeviceIds(torch.device("cpu"))
    kv = KVStore(_kv_config(), torch.float32, torch.device("cpu"), num_pages=4, page_size=PS, to_device=ids,
                 zero_on_first_use=True)
    for cache in kv.k_cache + kv.v_cache:
        cache[:, : 4 * PS].fill_(float("nan"))  # never-written memory may hold anything
    kv.zeroed[1] = 1  # page 1 was written before
    kv.k_cache[0][:, PS : 2 * PS] = 7.0
    step = StepInput()
    step.add_row([1, 2, 3, 4, 5], 0, [2, 1])
    kv.update_tables(step)
    kv.zero_new_pages(step)
    assert kv.zeroed == bytearray([0, 1, 1, 0])
    assert kv.k_cache[0][:, 2 * PS : 3 * PS].eq(0).all() and kv.k_cache[0][:, PS : 2 * PS].eq(7).all()
    assert kv.k_cache[0][:, :PS].isnan().all()  # not in any table: untouched
    kv.tables.check([(0, [2, 1], None)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_cpu_pages_come_zeroed_and_take_memory_only_where_written(dtype):
    # each CPU cache tensor is a fresh anonymous mapping: all zeros, so no step zeroes a page
    # (it cost ~1.7 ms a SmolLM2 step: an index_fill_ per layer tensor whenever a page was new),
    # and backed by memory only where written
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    ids = DeviceIds(torch.device("cpu"))
    config = _kv_config(layers=2, kv_heads=8, head_dim=128)
    KVStore(config, dtype, torch.device("cpu"), num_pages=4, page_size=PS, to_device=ids)  # (imports what it reads)
    before = rss()
    kv = KVStore(config, dtype, torch.device("cpu"), num_pages=4096, page_size=PS, to_device=ids)
    caches = kv.k_cache + kv.v_cache
    assert not kv.first_use_zeroing and len(caches) == 4
    assert sum(c.nbytes for c in caches) >= 64 << 20  # ~66 MiB of int8 rows, 256 MiB of float32
    assert rss() - before < 8 << 20
    for c in caches:
        assert not c.any()  # all zeros
    step = StepInput()
    step.add_row([1, 2, 3, 4, 5], 0, [2, 1])
    kv.update_tables(step)
    kv.k_cache[0][:, : 4 * PS] = 7
    kv.zero_new_pages(step)  # nothing to zero: pages 2 and 1 keep what was written
    assert kv.k_cache[0][:, : 4 * PS].eq(7).all()


@torch.inference_mode()
def test_a_step_that_fails_before_its_forward_still_applies_its_block_table_deltas():
    # the scheduler counts a step's deltas as sent once planned, and the next step's rows (of
    # sequences failed with this one, still run) build on them: a failure must not lose them
    from acb.testing import tiny_model
    from acb.worker.runner import ModelRunner

    runner = ModelRunner(tiny_model(), num_pages=8, page_size=PS)
    try:
        def fail(step):
            raise RuntimeError("page moves failed")

        runner.kv.move_pages = fail
        step = StepInput()
        step.add_row([1, 2, 3, 4, 5], 0, [6, 2], table_row=3)
        with pytest.raises(RuntimeError, match="page moves failed"):
            runner.forward(step)
        runner.kv.tables.check([(3, [6, 2], None)])
    finally:
        runner.release()
