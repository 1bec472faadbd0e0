"""The page allocator on plain data (no torch, no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acb.core.kv_cache import KVCacheManager, OutOfPagesError


def test_allocate_and_release_round_trip():
    kv = KVCacheManager(8, 4)
    pages = kv.allocate(5)
    assert len(set(pages)) == 5 and kv.num_free == 3
    kv.check_integrity([pages])
    kv.release(pages)
    assert kv.num_free == 8
    kv.check_integrity([])


def test_pages_come_out_ascending_even_after_a_sequence_gave_them_back():
    kv = KVCacheManager(16, 4)
    first = kv.allocate(6)
    assert first == sorted(first)
    kv.release(first)  # back on the free stack in the table's order: popped, they would run downwards
    again = kv.allocate(6)
    assert again == sorted(again) and set(again) == set(first)


def test_allocating_more_than_free_raises():
    kv = KVCacheManager(4, 4)
    kv.allocate(3)
    with pytest.raises(OutOfPagesError):
        kv.allocate(2)


def test_double_release_is_caught():
    kv = KVCacheManager(4, 4)
    pages = kv.allocate(1)
    kv.release(pages)
    with pytest.raises(AssertionError):
        kv.release(pages)


def test_prefix_hit_shares_full_pages_and_leaves_a_token_to_compute():
    kv = KVCacheManager(16, 4)
    tokens = list(range(10))  # two full pages + 2 tokens
    table = kv.allocate(3)
    kv.register_full_pages(table, tokens, 0, None, num_computed=10)
    kv.release(table)
    assert kv.num_cached == 2 and kv.num_free == 16
    hit, _ = kv.match_prefix(tokens)
    assert hit == table[:2]
    # a prompt that is exactly the two cached pages reuses only the first: the
    # last token must be computed to get logits
    hit2, _ = kv.match_prefix(tokens[:8])
    assert hit2 == table[:1]
    kv.check_integrity([hit, hit2])


def test_hash_chain_depends_on_the_parent():
    kv = KVCacheManager(16, 2)
    a = kv.allocate(2)
    kv.register_full_pages(a, [1, 2, 3, 4], 0, None, 4)
    hit, _ = kv.match_prefix([9, 9, 3, 4, 5])  # same second page after another first page
    assert hit == []


def test_cached_pages_are_evicted_lru_only_when_free_pages_run_out():
    kv = KVCacheManager(4, 2)
    a = kv.allocate(2)
    kv.register_full_pages(a, [1, 2, 3, 4], 0, None, 4)
    kv.release(a)
    b = kv.allocate(2)  # the two never-used pages first
    assert set(b).isdisjoint(a) and kv.num_cached == 2
    c = kv.allocate(1)  # now evicts the least recently used cached page
    assert c[0] in a and kv.num_cached == 1
    kv.check_integrity([b, c])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "share", "cache"]),
                          st.integers(0, 6), st.integers(0, 3)), max_size=80))
def test_random_operations_never_leak_or_double_free(ops):
    kv = KVCacheManager(12, 2)
    tables: list[list[int]] = []
    for op, n, which in ops:
        if op == "alloc" and n <= kv.num_free:
            tables.append(kv.allocate(n))
        elif op == "release" and tables:
            kv.release(tables.pop(which % len(tables)))
        elif op == "cache" and tables:
            t = tables[which % len(tables)]
            tokens = [len(t) * 7 + i % 3 for i in range(len(t) * 2)]
            kv.register_full_pages(t, tokens, 0, None, len(tokens))
        elif op == "share" and tables:
            t = tables[which % len(tables)]
            tokens = [len(t) * 7 + i % 3 for i in range(len(t) * 2)] + [0]
            hit, _ = kv.match_prefix(tokens)
            tables.append(hit)
        kv.check_integrity(tables)
    for t in tables:
        kv.release(t)
    kv.check_integrity([])
    assert kv.num_free == 12
