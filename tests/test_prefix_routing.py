"""acb.integrations.prefix_index: the prefix-aware router's state, rebuilt from KV-cache
events, and its choice on hand-made replica states (no Ray: the Ray router only wraps it)."""

import subprocess
import sys

import pytest

import acb
from acb import prefix_page_hashes
from acb.core.kv_cache import KVCacheManager, chain_hash
from acb.core.kv_events import KVEventPublisher
from acb.integrations.prefix_index import Load, PrefixIndex, rank_replicas, wire_batch

PAGE = 4
IDLE = Load(queue_depth=0, free_pages=100)


def _stored(hashes: list[int]) -> tuple[bool, list[tuple]]:
    return False, [("stored", hashes)]


def _resync(hashes: list[int]) -> tuple[bool, list[tuple]]:
    return True, [("cleared",), ("stored", hashes)]


def _index_with(**held: list[int]) -> PrefixIndex:
    """An index where each replica (keyword) holds the first pages of a prompt (its tokens)."""
    index = PrefixIndex()
    for replica, tokens in held.items():
        index.apply(replica, "s1", 1, PAGE, [_resync(prefix_page_hashes(tokens + [0], PAGE))])
    return index


def test_prefix_page_hashes_are_the_engines_chained_hashes():
    tokens = list(range(10, 23))  # 13 tokens: 3 full pages, all usable (the last token is on page 4)
    h0 = chain_hash(None, tokens[:4])
    h1 = chain_hash(h0, tokens[4:8])
    assert prefix_page_hashes(tokens, PAGE) == [h0, h1, chain_hash(h1, tokens[8:12])]
    # the page holding the last prompt token is never taken from the cache: not hashed
    assert prefix_page_hashes(tokens[:12], PAGE) == [h0, h1]


def test_page_hashes_are_the_same_in_another_process():
    """A router runs in another process than the engines: the hashes must not depend on it
    (CPython < 3.12 hashes None by address, so a chain rooted at None would)."""
    code = "from acb.core.kv_cache import chain_hash; print(chain_hash(chain_hash(None, [1, 2, 3]), [4, 5, 6]))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(other) == chain_hash(chain_hash(None, [1, 2, 3]), [4, 5, 6])


def test_index_rebuilt_from_the_cache_events_matches_what_the_cache_would_hit():
    publisher = KVEventPublisher(lambda: kv.registered())
    kv = KVCacheManager(16, PAGE, events=publisher.pending)
    stream = publisher.subscribe(max_batches=8)
    prompt = list(range(1, 15))  # 14 tokens: 3 full pages
    pages = kv.allocate(4)
    kv.register_full_pages(pages, prompt, 0, None, len(prompt))
    publisher.flush()
    index = PrefixIndex()
    assert index.apply("r1", "s1", 1, PAGE, [wire_batch(b) for b in stream.pending()])
    hit, _ = kv.match_prefix(prompt[:9] + [99, 98, 97])  # shares 2 pages, then differs
    assert index.match(prompt[:9] + [99, 98, 97], ["r1"]) == {"r1": len(hit)} == {"r1": 2}
    assert index.match(prompt, ["r1"]) == {"r1": 3}
    assert index.match([7] * 14, ["r1"]) == {"r1": 0}


def test_removed_pages_no_longer_match():
    tokens = list(range(1, 14))
    index = _index_with(r1=tokens[:12])
    hashes = prefix_page_hashes(tokens, PAGE)
    assert index.apply("r1", "s1", 2, PAGE, [(False, [("removed", hashes[1:2])])])
    assert index.match(tokens, ["r1"]) == {"r1": 1}  # the run stops at the first missing page


def test_longest_cached_prefix_wins():
    doc = list(range(1, 33))
    index = _index_with(a=doc[:8], b=doc[:24], c=[])
    matches = index.match(doc + [5, 6], ["a", "b", "c"])
    assert matches == {"a": 2, "b": 6, "c": 0}
    assert rank_replicas(matches, {"a": IDLE, "b": IDLE, "c": IDLE})[0] == ["b"]


def test_a_busier_holder_still_wins_within_the_queue_gap():
    matches = {"a": 0, "b": 5}
    loads = {"a": Load(0, 100), "b": Load(8, 10)}
    assert rank_replicas(matches, loads, max_queue_gap=8)[0] == ["b"]


def test_an_overloaded_holder_falls_back_to_load():
    matches = {"a": 0, "b": 5}
    loads = {"a": Load(0, 100), "b": Load(9, 10)}
    ranks = rank_replicas(matches, loads, max_queue_gap=8)
    assert ranks == [["a", "b"]]  # the free-pages order: most free pages first


def test_a_young_request_is_offered_to_the_holders_alone():
    """PrefixAwareRouter's first holder_wait_s: Serve retries the holders (a probe that missed its
    deadline, a queue it last saw full) instead of going on to a replica without the prefix."""
    matches = {"a": 0, "b": 5, "c": 5}
    loads = {"a": Load(0, 100), "b": Load(3, 10), "c": Load(1, 10)}
    assert sorted(rank_replicas(matches, loads, holders_only=True)[0]) == ["b", "c"]
    assert len(rank_replicas(matches, loads, holders_only=True)) == 1
    assert rank_replicas(matches, loads)[1:] == [["a", "c"], ["b"]]  # later: the load ranks behind them
    # no holder, or only overloaded ones: load decides at once, young or not
    assert rank_replicas({"a": 0, "b": 0}, {"a": Load(0, 100), "b": IDLE}, holders_only=True) == [["a", "b"]]
    overloaded = {"a": Load(0, 100), "b": Load(9, 10)}
    assert rank_replicas({"a": 0, "b": 5}, overloaded, max_queue_gap=8, holders_only=True) == [["a", "b"]]


def test_ties_go_to_every_holder_and_serve_picks_the_shorter_queue():
    matches = {"a": 3, "b": 3, "c": 1}
    loads = {"a": Load(2, 50), "b": Load(1, 60), "c": Load(0, 90)}
    assert sorted(rank_replicas(matches, loads)[0]) == ["a", "b"]


def test_no_prefix_anywhere_ranks_by_free_pages_then_queue():
    loads = {"a": Load(0, 10), "b": Load(3, 90), "c": Load(1, 90), "d": Load(0, 5)}
    assert rank_replicas({"a": 0, "b": 0, "c": 0, "d": 0}, loads) == [["c", "b"], ["a", "d"]]
    assert rank_replicas({}, loads) == [["c", "b"], ["a", "d"]]  # no prompt to match
    assert rank_replicas({"a": 1, "b": 0}, {"a": IDLE, "b": IDLE}, min_match_pages=2) == [["a", "b"]]


def test_a_replica_is_unknown_until_its_first_resync():
    index = PrefixIndex()
    assert not index.apply("r1", "s1", 1, PAGE, [_stored([1, 2])])  # a stream must start with a resync
    assert index.match(list(range(20)), ["r1", "r2"]) == {"r1": None, "r2": None}
    assert rank_replicas({"r1": None, "r2": None}, {"r1": IDLE, "r2": IDLE}) == [["r1", "r2"]] or \
        rank_replicas({"r1": None, "r2": None}, {"r1": IDLE, "r2": IDLE}) == [["r2", "r1"]]


def test_a_missing_push_makes_the_replica_unknown_until_a_resync_rebuilds_it():
    tokens = list(range(1, 14))
    hashes = prefix_page_hashes(tokens, PAGE)
    index = _index_with(r1=tokens[:12])
    assert not index.apply("r1", "s1", 3, PAGE, [_stored([42])])  # push 2 never came
    assert index.match(tokens, ["r1"]) == {"r1": None}
    assert index.summary()["r1"]["gaps"] == 1
    assert not index.apply("r1", "s1", 4, PAGE, [])  # still lost: a heartbeat does not rebuild it
    assert index.apply("r1", "s2", 1, PAGE, [_resync(hashes[:1])])  # a new subscription's resync
    assert index.match(tokens, ["r1"]) == {"r1": 1}


def test_an_unknown_holder_is_not_trusted_even_with_the_pages():
    tokens = list(range(1, 14))
    index = _index_with(a=tokens[:12], b=[])
    index.apply("a", "s1", 5, PAGE, [])  # a gap: a's set is stale
    matches = index.match(tokens, ["a", "b"])
    assert matches == {"a": None, "b": 0}
    assert rank_replicas(matches, {"a": IDLE, "b": Load(0, 200)}) == [["b", "a"]]


def test_a_resync_in_the_stream_rebuilds_the_set():
    """The engine's stream drops batches for a slow reader and hands it a resync instead."""
    index = _index_with(r1=list(range(1, 13)))
    assert index.apply("r1", "s1", 2, PAGE, [_resync([7]), _stored([8])])
    assert index.replicas["r1"].hashes == {7, 8} and index.summary()["r1"]["resyncs"] == 2


def test_an_index_restarted_asks_a_live_stream_to_resubscribe():
    index = PrefixIndex()  # a fresh index: it never saw r1's stream
    assert not index.apply("r1", "s1", 17, PAGE, [])


def test_stopped_replicas_are_forgotten():
    index = _index_with(a=[1, 2, 3, 4], b=[1, 2, 3, 4])
    index.retain(["b"])
    assert set(index.replicas) == {"b"}


def test_bad_options_are_refused_by_name():
    with pytest.raises(ValueError, match="max_queue_gap"):
        rank_replicas({}, {}, max_queue_gap=-1)
    with pytest.raises(ValueError, match="min_match_pages"):
        rank_replicas({}, {}, min_match_pages=0)
    with pytest.raises(ValueError, match="page_size"):
        PrefixIndex().apply("r", "s", 1, 0, [])
    with pytest.raises(ValueError, match="page_size"):
        prefix_page_hashes([1, 2, 3], 0)


async def test_index_follows_a_live_engine_and_matches_its_hits():
    """Replaying a real engine's kv_events() into the index: a prompt sharing a finished
    request's prefix matches as many pages as the engine then hits."""
    async with acb.testing.tiny_engine(kv_events=True, page_size=8, num_blocks=64) as engine:
        stream = engine.kv_events()
        doc = list(range(3, 43))  # 40 tokens: 5 pages
        await engine.generate(doc + [50, 51], max_new_tokens=2)
        index = PrefixIndex()
        assert index.apply("r1", "s1", 1, engine.page_size, [wire_batch(b) for b in stream.pending()])
        question = doc + [60, 61, 62]
        expected = index.match(question, ["r1"])["r1"]
        done = await engine.generate(question, max_new_tokens=2)
        assert expected == 5
        assert done.metrics.num_cached_prompt_tokens == expected * engine.page_size
        stream.close()


def test_a_silent_replica_goes_stale_until_it_pushes_again():
    """A replica's publisher pushes at least a heartbeat every 2 s: one silent for longer is
    gone or stuck, and its set is not trusted."""
    now = [100.0]
    index = PrefixIndex(stale_after_s=10.0, clock=lambda: now[0])
    tokens = list(range(1, 14))
    assert index.apply("r1", "s1", 1, PAGE, [_resync(prefix_page_hashes(tokens, PAGE))])
    now[0] += 10.5
    assert index.match(tokens, ["r1"]) == {"r1": None} and not index.summary()["r1"]["known"]
    assert index.apply("r1", "s1", 2, PAGE, [])  # its heartbeat: the stream is whole, the set trusted again
    assert index.match(tokens, ["r1"]) == {"r1": 3}
    with pytest.raises(ValueError, match="stale_after_s"):
        PrefixIndex(stale_after_s=0)
