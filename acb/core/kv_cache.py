"""The page allocator of the paged KV cache: ids and counts only, no tensors.

A block-table entry of ``RECYCLED`` (-1) marks a page given back because it fell
wholly outside every layer's sliding window.

A page holds ``page_size`` consecutive tokens of one sequence. A page is in exactly
one of three states:

- *used*: refcount > 0, listed in the block table of every sequence that holds it;
- *cached*: refcount == 0 but it still holds a full page of a known token chain
  (its hash is registered), kept in an LRU and reused on a prefix hit or evicted
  when free pages run out;
- *free*: refcount == 0 and no hash.

``free + used + cached == total`` always holds; ``check_integrity`` verifies it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

RECYCLED = -1


# What a chain's first page hashes as its parent. Not None: CPython before 3.12 hashes None
# by its address, which differs from process to process, and a router in another process
# hashes prompts to match the hashes kv_events() publishes (acb.integrations.prefix_index).
# Ints and tuples of ints hash alike in every process (PYTHONHASHSEED salts only str/bytes).
ROOT_PARENT_HASH = 0x2545F4914F6CDD1D


def chain_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of a full page: its tokens *and* its parent's hash, so equal pages at
    different positions or after different prefixes never collide by construction.
    The same in every process for the same token ids."""
    return hash((ROOT_PARENT_HASH if parent is None else parent, tuple(tokens)))


def adapter_root(lora_id: int | None) -> int | None:
    """The parent hash of a chain's first page under the LoRA adapter ``lora_id`` (its
    weights' digest, ``acb.model.lora``), so its pages never match the base model's or another
    adapter's; None for the base model, whose hashes stay as they were."""
    return None if lora_id is None else hash((ROOT_PARENT_HASH, lora_id))


def prefix_page_hashes(token_ids: Sequence[int], page_size: int, lora_id: int | None = None) -> list[int]:
    """The hashes ``kv_events()`` names the pages of ``token_ids`` by, for the pages a
    prefix-cache lookup can take: full pages only, and never the page of the last token
    (that one is always computed). A page is cached where its hash was stored (and not
    removed since). The same in every process: a router elsewhere matches prompts with it.
    ``lora_id``: the pages of a request run with that adapter (``Engine.adapters()``'s ids).

    Example::

        hashes = acb.prefix_page_hashes(prompt_ids, page_size=16)
        held = next((i for i, h in enumerate(hashes) if h not in replica_hashes), len(hashes))
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    hashes: list[int] = []
    parent = adapter_root(lora_id)
    for i in range((len(token_ids) - 1) // page_size):
        parent = chain_hash(parent, token_ids[i * page_size : (i + 1) * page_size])
        hashes.append(parent)
    return hashes


class OutOfPagesError(RuntimeError):
    """Raised by ``allocate`` when fewer pages are allocatable than asked for."""


class KVCacheManager:
    """Pages of one pool. ``events``: a list the manager appends ``acb.core.kv_events`` events to
    as prefix hashes are registered and forgotten (None: no events); ``medium`` names the
    pool's memory in them."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 events: list[KVEvent] | None = None, medium: str | None = None) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.refcount = [0] * num_pages
        # A stack: the most recently freed page is reused first, so the memory a
        # lazily-allocated cache touches stays bounded by the peak in use.
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        # page -> (hash, tokens, parent hash) for full pages whose contents are registered
        self.page_key: dict[int, tuple[int, tuple[int, ...], int | None]] = {}
        self.page_lora: dict[int, int] = {}  # page -> lora_id, for the registered pages of an adapter's chains
        self.events = events
        self.medium = medium
        self.hash_to_page: dict[int, int] = {}
        self.cached_lru: OrderedDict[int, None] = OrderedDict()
        self.disk = None  # the disk tier below the pool (acb.core.kv_disk.DiskTier; EngineConfig.kv_disk_path)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached

    # -- counts ------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that ``allocate`` can hand out now (free plus evictable cached)."""
        return len(self.free_pages) + len(self.cached_lru)

    @property
    def num_cached(self) -> int:
        return len(self.cached_lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free_pages) - len(self.cached_lru)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- allocation ----------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` pages (refcount 1 each), evicting least recently used cached pages
        only when no plain free page is left; in ascending order.

        Ascending: a finished sequence's pages go back onto the stack in its block table's
        order, so the next sequence would pop them as a descending run, and the CPU decode
        kernel reads a descending run of bf16 pages ~20 % slower than an ascending one (45
        rows x ~450 keys: 445 against 373 us a layer, ``benchmarks/decode_attention.py
        --pages descending|ascending``; over int8 pages 299 against 290 us)."""
        if n > self.num_free:
            raise OutOfPagesError(f"asked for {n} pages, {self.num_free} allocatable")
        pages: list[int] = []
        for _ in range(n):
            if self.free_pages:
                page = self.free_pages.pop()
            else:
                page, _ = self.cached_lru.popitem(last=False)
                self._forget(page)
            self.refcount[page] = 1
            pages.append(page)
        pages.sort()
        return pages

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; a page reaching zero becomes cached (if it
        holds a registered full page) or free."""
        for page in pages:
            if page < 0:
                continue  # a slot of a block table whose page was recycled (sliding window)
            count = self.refcount[page]
            if count <= 0:
                raise AssertionError(f"page {page} released with refcount {count}")
            self.refcount[page] = count - 1
            if count == 1:
                if page in self.page_key:
                    self.cached_lru[page] = None
                else:
                    self.free_pages.append(page)

    def share(self, pages: Iterable[int]) -> None:
        """Take one more reference to each page in use (a forked sequence holds them too)."""
        for page in pages:
            if page >= 0:
                assert self.refcount[page] > 0, f"page {page} shared while not in use"
                self.refcount[page] += 1

    def _forget(self, page: int) -> None:
        key = self.page_key.pop(page, None)
        self.page_lora.pop(page, None)
        if key is not None and self.hash_to_page.get(key[0]) == page:
            del self.hash_to_page[key[0]]
            events = self.events
            if events is not None:
                last = events[-1] if events else None
                if type(last) is BlockRemoved:
                    last.block_hashes.append(key[0])  # one event for a run of evictions
                else:
                    events.append(BlockRemoved([key[0]], self.medium))

    # -- prefix caching --------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int], root: int | None = None) -> tuple[list[int], int | None]:
        """Find the longest run of cached full pages that starts ``token_ids`` and take a
        reference to each. Returns the pages and the hash of the last one.

        At least one token is always left to compute, so the caller gets logits for the
        last prompt token: if every full page of the prompt hits, the last page is
        not reused (it will be recomputed into a fresh page; shared pages are never
        written). ``root``: the chain's first parent (``adapter_root``; None: the base model)."""
        if not self.enable_prefix_caching:
            return [], root
        ps = self.page_size
        usable = (len(token_ids) - 1) // ps
        pages: list[int] = []
        parent = root
        for i in range(usable):
            chunk = tuple(token_ids[i * ps : (i + 1) * ps])
            h = chain_hash(parent, chunk)
            page = self.hash_to_page.get(h)
            if page is None or self.page_key[page][1] != chunk:
                break
            pages.append(page)
            parent = h
        for page in pages:
            if self.refcount[page] == 0:
                del self.cached_lru[page]
            self.refcount[page] += 1
        return pages, parent

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted prompt's lookup in the hit-rate statistics."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    def register_full_pages(
        self, block_table: Sequence[int], token_ids: Sequence[int], num_registered: int,
        parent: int | None, num_computed: int, lora_id: int | None = None,
    ) -> tuple[int, int | None]:
        """Register the pages of ``block_table`` that became full (all ``page_size`` tokens
        computed) since ``num_registered``. Returns the new (num_registered, parent hash).
        A page whose chain is already cached elsewhere stays private (first one wins).
        ``lora_id``: the adapter the sequence runs (its events carry it), None for the base model."""
        if not self.enable_prefix_caching:
            return num_registered, parent
        ps = self.page_size
        full = min(num_computed // ps, len(block_table))
        events = self.events
        stored: BlockStored | None = None  # the event of the run of pages registered just now
        for i in range(num_registered, full):
            chunk = tuple(token_ids[i * ps : (i + 1) * ps])
            h = chain_hash(parent, chunk)
            page = block_table[i]
            if h not in self.hash_to_page and page not in self.page_key:
                self.hash_to_page[h] = page
                self.page_key[page] = (h, chunk, parent)
                if lora_id is not None:
                    self.page_lora[page] = lora_id
                if events is not None:
                    if stored is None:
                        stored = BlockStored([], parent, [], ps, lora_id, self.medium)
                        events.append(stored)
                    stored.block_hashes.append(h)
                    stored.token_ids.extend(chunk)
            else:
                stored = None  # a page left out breaks the run: the next one names its parent
            parent = h
        return max(full, num_registered), parent

    def evict_all_cached(self) -> None:
        while self.cached_lru:
            page, _ = self.cached_lru.popitem(last=False)
            self._forget(page)
            self.free_pages.append(page)

    def forget_prefixes(self) -> None:
        """Forget every registered prefix (the model changed: its KV is another model's).
        Cached pages become free; pages in use stay with their requests, unshared."""
        events, self.events = self.events, None  # one AllBlocksCleared says it all
        try:
            self.evict_all_cached()
            for page in list(self.page_key):
                self._forget(page)
        finally:
            self.events = events
        if events is not None:
            events.append(AllBlocksCleared())

    def registered(self) -> Iterator[BlockStored]:
        """One ``BlockStored`` per page whose prefix hash is registered now (in use or
        cached): the current set, as a resync of ``kv_events()`` describes it."""
        for page, (h, chunk, parent) in self.page_key.items():
            yield BlockStored([h], parent, list(chunk), self.page_size, self.page_lora.get(page), self.medium)

    # -- checks ------------------------------------------------------------------------
    def check_integrity(self, block_tables: Iterable[Sequence[int]] = ()) -> None:
        """Raise AssertionError unless free + used + cached == total, the free list holds no
        page twice, no block table holds a page twice, and every refcount equals the number
        of block tables that hold the page (with a disk tier, its own invariants too)."""
        free = set(self.free_pages)
        cached = set(self.cached_lru)
        assert len(free) == len(self.free_pages), "a page is twice in the free list"
        assert not free & cached, "a page is both free and cached"
        uses = [0] * self.num_pages
        for table in block_tables:
            held = [page for page in table if page >= 0]
            assert len(held) == len(set(held)), f"a block table holds a page twice: {table}"
            for page in held:
                uses[page] += 1
        for page in range(self.num_pages):
            rc = self.refcount[page]
            assert rc == uses[page], f"page {page}: refcount {rc} but {uses[page]} block-table uses"
            if rc == 0:
                assert (page in free) != (page in cached), f"page {page} unreferenced but not free/cached"
                assert (page in cached) == (page in self.page_key), f"page {page}: cached iff hashed"
            else:
                assert page not in free and page not in cached, f"page {page} in use and free/cached"
        for h, page in self.hash_to_page.items():
            assert self.page_key.get(page, (None,))[0] == h, f"hash index of page {page} is stale"
        assert len(free) + len(cached) + sum(1 for c in self.refcount if c) == self.num_pages
        if self.disk is not None:
            self.disk.check_integrity(self.free_pages)


class HostPool:
    """Slots of the CPU offload pool (``EngineConfig.cpu_offload_space``): ids only.

    A preempted sequence's pages are copied into host slots and come back into fresh
    device pages when it resumes, so nothing is recomputed. A slot read by a swap-in
    is given back only when the *next* plan is made (``end_plan``): the runner does a
    step's swap-outs before its swap-ins, so a slot freed and reused within one plan
    would be overwritten before it is read.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._releasing: list[int] = []
        self.num_offloads = 0  # preemptions whose pages went to the pool
        self.num_restores = 0  # resumptions that read them back

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    @property
    def num_used(self) -> int:
        """Slots holding a preempted sequence's KV (not those waiting for the next plan)."""
        return self.num_slots - len(self.free_slots) - len(self._releasing)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_slots):
            raise OutOfPagesError(f"asked for {n} host slots, {len(self.free_slots)} free")
        return [self.free_slots.pop() for _ in range(n)]

    def release_after_plan(self, slots: Iterable[int]) -> None:
        self._releasing.extend(slots)

    def offload(self, n: int) -> list[int]:
        """Slots for a preempted sequence's ``n`` pages (``OutOfPagesError`` if fewer are
        free); counted in ``num_offloads``."""
        slots = self.allocate(n)
        self.num_offloads += 1
        return slots

    def restore(self, slots: Iterable[int]) -> None:
        """A resumed sequence's pages are read back from ``slots``: they are free from the
        next plan on; counted in ``num_restores``."""
        self.release_after_plan(slots)
        self.num_restores += 1

    def end_plan(self) -> None:
        if self._releasing:
            self.free_slots.extend(self._releasing)
            self._releasing.clear()

    def check_integrity(self, tables: Iterable[Sequence[int]] = ()) -> None:
        held = [s for t in tables for s in t if s >= 0]
        everything = held + self.free_slots + self._releasing
        assert len(everything) == len(set(everything)), "a host slot is held twice"
        assert len(everything) == self.num_slots, (
            f"host slots leaked: {self.num_slots - len(everything)} of {self.num_slots}")
