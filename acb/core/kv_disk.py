"""The prefix cache's disk tier (``EngineConfig.kv_disk_path`` / ``kv_disk_space``): full
pages that complete a prompt or leave a finished request (and so may be evicted from the
page pool) are written to files, and a prompt whose prefix is found there loads those pages
instead of computing them, in this process or a later one. Plain Python, no torch: the
bytes of a page come from and go to the runner (``acb.worker.disk_pages``).

Who does what:

- the event loop (the scheduler's parts) offers pages (``offer``), looks prompts up
  (``lookup``: which of their next pages are on disk), and takes what the threads report
  (``poll``); the index of the files here is its alone;
- the step thread copies offered pages' bytes out of the KV tensors (``take_copies`` names
  them; they are queued on the step thread ahead of any step that could overwrite them) and
  hands them to ``submit_writes``;
- a writer thread writes them (``acb.core.kv_disk_files``: temp file, fsync, rename) and keeps
  the directory within ``kv_disk_space`` (least recently used files first, by mtime: a read
  touches its file, so the order survives restarts and is shared by engines on one directory);
- a reader thread reads and checks the pages a waiting prompt needs before it is admitted
  (a *prefetch*), so a file found bad is counted, deleted and recomputed, never served.

A directory that stops taking writes (read-only, full) turns writing off with one warning;
reads go on. Anything unexpected in a file is a miss, never an error a request sees.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from . import kv_disk_files as files

log = logging.getLogger("acb")

_QUEUED_BYTES_CAP = 1 << 30  # page bytes waiting for the writer; beyond it new writes are dropped
_RESCAN_EVERY = 64  # writes between rescans of the directory (other engines write there too)
# reader threads: a page's read and CRC release the GIL, so two read ~twice as fast as one
# (~0.6 GB/s each on a Zen 3 core), and a prompt waits for them
_READERS = 2
_READ_BATCH = 16  # pages a reader takes at a time


@dataclass(slots=True)
class DiskStats:
    """Counters of the disk tier since start (``EngineStats.disk_*``)."""

    hit_pages: int = 0  # pages admitted from disk instead of computed
    pages_read: int = 0  # page files read and checked
    pages_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0  # files found corrupt, truncated or foreign (deleted), and failed writes
    dropped_writes: int = 0  # writes skipped: the writer was behind, or the directory takes no writes
    load_s: float = 0.0  # seconds the readers spent reading and checking pages (summed over the threads)
    copy_s: float = 0.0  # seconds the step thread spent copying pages out of the KV tensors


class DiskTier:
    """The disk tier of one engine over ``path`` (checked by ``kv_disk_files.check_directory``),
    holding at most ``space`` bytes of page files of ``page_bytes`` bytes each (plus a header).
    Inactive until ``open(fingerprint)``."""

    def __init__(self, path: str, space: int, page_bytes: int, page_size: int) -> None:
        self.path = path
        self.space = space
        self.page_bytes = page_bytes
        self.page_size = page_size
        self.file_bytes = files.HEADER_SIZE + page_bytes
        self.stats = DiskStats()
        self.fingerprint: bytes | None = None
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self.writable = True
        self._pending: list[tuple[int, bytes, int]] = []  # (page, key, chain hash) to copy out
        self._queued: set[bytes] = set()  # keys copied out or offered, not yet written
        self._ready: OrderedDict[bytes, bytearray] = OrderedDict()  # prefetched and checked
        self._fetching: set[bytes] = set()
        self._results: deque[tuple] = deque()  # what the threads report, taken by poll()
        self._writes: queue.SimpleQueue = queue.SimpleQueue()  # batches for the writer thread
        self._reads: queue.SimpleQueue = queue.SimpleQueue()  # keys for the reader threads
        self._queued_bytes = 0
        self._writer_busy = 0  # batches submitted and not yet written (the writer's)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._dir_bytes = 0  # the writer's estimate of the directory's page bytes
        self._since_scan = 0

    @property
    def active(self) -> bool:
        return self.fingerprint is not None

    def open(self, fingerprint: bytes) -> None:
        """Start serving under ``fingerprint`` (the model's, ``acb.worker.disk_pages``): index the
        files here, delete temporaries of writers that are gone, start the threads."""
        if self.fingerprint == fingerprint and self._threads:
            return
        self.close()
        self.writable = True
        self.fingerprint = fingerprint
        removed = files.remove_stale_temporaries(self.path)
        if removed:
            log.info("acb: removed %d unfinished page files left in %s by a process that ended", removed, self.path)
        entries = sorted(files.scan(self.path), key=lambda e: e[2])
        self.index = OrderedDict((key, size) for key, size, _ in entries)
        self._dir_bytes = sum(size for _, size, _ in entries)
        if self._dir_bytes > self.space:  # a smaller kv_disk_space than the last run's
            self._make_room()
            self.poll()
        # each pair of threads has its own queues and fingerprint: a tier turned off (``disable``)
        # lets its writer finish in the background, under the fingerprint its pages were copied under
        self._writes, self._reads = queue.SimpleQueue(), queue.SimpleQueue()
        for target, name, work in ((self._write_loop, "acb-kv-disk-writer", self._writes),
                                   *[(self._read_loop, "acb-kv-disk-reader", self._reads)] * _READERS):
            thread = threading.Thread(target=target, args=(work, fingerprint), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, timeout: float | None = 60.0) -> None:
        """Finish the writes queued and stop the threads (the index stays); ``timeout`` None:
        do not wait for them."""
        if not self._threads:
            return
        self._writes.put(None)
        for _ in range(_READERS):
            self._reads.put(None)
        if timeout is not None:
            for thread in self._threads:
                thread.join(timeout)
        self._threads = []
        self.poll()

    def disable(self, why: str) -> None:
        """Stop using the tier until the engine starts again (the model changed under it: the
        fingerprint, and so every key, is another one then)."""
        if self.active:
            log.warning("acb: %s: the KV disk tier (EngineConfig.kv_disk_path) is off until the engine starts "
                        "again", why)
        self.close(timeout=None)
        self.fingerprint = None
        self._fetching.clear()
        self._pending.clear()
        self._queued.clear()
        self._ready.clear()

    # ------------------------------------------------------------------ the event loop's side
    def keys(self, token_ids: Sequence[int], num_pages: int, lora_id: int | None) -> list[bytes]:
        return files.disk_keys(files.disk_root(self.fingerprint, lora_id), token_ids, self.page_size, num_pages)

    def offer(self, pages: Sequence[int], token_ids: Sequence[int], chains: Sequence[int],
              lora_id: int | None) -> None:
        """``pages`` (full, computed, in chain order from the first page of ``token_ids``) hold
        those tokens' KV; ``chains``: their in-memory hashes. Those not on disk yet are to be
        copied out (``take_copies``) and written."""
        if not self.active or not self.writable or not pages:
            return
        for page, key, chain in zip(pages, self.keys(token_ids, len(pages), lora_id), chains, strict=False):
            if page >= 0 and key not in self.index and key not in self._queued:
                self._queued.add(key)
                self._pending.append((page, key, chain))

    def take_copies(self) -> list[tuple[int, bytes, int]]:
        """The (page, key, chain hash) offered since the last call: the caller copies their bytes
        out on the step thread before any step it launches later, then calls ``submit_writes``."""
        pending, self._pending = self._pending, []
        return pending

    def lookup(self, token_ids: Sequence[int], first_page: int, lora_id: int | None,
               limit: int) -> list[bytes] | None:
        """The keys of the run of pages of ``token_ids`` from ``first_page`` on that are on disk and
        already read and checked (at most ``limit``, and never the page of the last token); None
        while some are being read: the prompt waits for them (``busy``)."""
        self.poll()
        if not self.active:
            return []
        if self._fetching:
            # the head of the queue's pages are being read: it (or, if it left, the next) asks again
            # once they are in; hashing its prompt again at every poll would take the GIL from the reader
            return None
        usable = min((len(token_ids) - 1) // self.page_size, first_page + limit)
        if usable <= first_page:
            return []
        run: list[bytes] = []
        keys = files.iter_disk_keys(files.disk_root(self.fingerprint, lora_id), token_ids, self.page_size, usable)
        for i, key in enumerate(keys):
            if i < first_page:
                continue  # (in the page pool: matched there)
            if key in self._ready or key in self.index or self._found(key):
                run.append(key)
            else:
                break
        missing = [key for key in run if key not in self._ready]
        if not missing:
            return run
        if not self._fetching.issuperset(missing):
            for key in [k for k in self._ready if k not in run]:
                del self._ready[key]  # one prompt's pages at a time: the head of the queue's
            fetch = [key for key in missing if key not in self._fetching]
            self._fetching.update(fetch)
            for first in range(0, len(fetch), _READ_BATCH):
                self._reads.put(fetch[first : first + _READ_BATCH])
        return None

    def take(self, keys: list[bytes]) -> list[bytearray]:
        """The checked payloads of ``keys`` (a run ``lookup`` returned), handed over."""
        payloads = [self._ready.pop(key) for key in keys]
        self.stats.hit_pages += len(keys)
        for key in keys:
            if key in self.index:
                self.index.move_to_end(key)
        return payloads

    def idle(self) -> bool:
        """Whether every page offered so far is written (or given up on): nothing to copy out,
        nothing queued for the writer."""
        self.poll()
        with self._lock:
            writing = self._writer_busy
        return not self._pending and not self._queued and not writing

    def busy(self) -> bool:
        """Whether pages a prompt waits for are being read (the engine is not stalled)."""
        return bool(self._fetching)

    def poll(self) -> None:
        """Take what the writer and reader threads reported into the index and counters."""
        results = self._results
        while results:
            kind, key, *rest = results.popleft()
            if kind == "written":
                self._queued.discard(key)
                if rest[0]:
                    self.index[key] = rest[0]
                    self.index.move_to_end(key)
            elif kind == "evicted":
                self.index.pop(key, None)
            elif kind == "read":
                self._fetching.discard(key)
                self._ready[key] = rest[0]
                if key not in self.index:
                    self.index[key] = self.file_bytes
            else:  # "bad" (counted by the reader) or "missing" (deleted by another engine): recompute
                self._fetching.discard(key)
                self._ready.pop(key, None)
                self.index.pop(key, None)

    def stat_fields(self) -> dict[str, int | float]:
        """The ``EngineStats.disk_*`` fields."""
        self.poll()
        d = self.stats
        return dict(disk_hits=d.hit_pages, disk_pages_read=d.pages_read, disk_pages_written=d.pages_written,
                    disk_bytes_read=d.bytes_read, disk_bytes_written=d.bytes_written, disk_errors=d.errors,
                    disk_dropped_writes=d.dropped_writes, disk_load_s=d.load_s, disk_copy_s=d.copy_s,
                    disk_blocks=len(self.index),
                    disk_bytes=sum(self.index.values()))

    def forget_ready(self) -> None:
        """Nothing waits: drop prefetched pages (their memory)."""
        self._ready.clear()

    def _found(self, key: bytes) -> bool:
        """A file another engine on this directory wrote since the index was made."""
        path = files.page_path(self.path, key)
        try:
            size = os.stat(path).st_size
        except OSError:
            return False
        self.index[key] = size
        return True

    # ------------------------------------------------------------------ the step thread's side
    def submit_writes(self, entries: list[tuple[int, bytes, int]], payloads: list, copy_s: float = 0.0) -> None:
        """Queue the pages ``entries`` (``take_copies``') with their bytes for the writer (``copy_s``:
        the seconds their copy took). Never blocks: beyond ``_QUEUED_BYTES_CAP`` waiting, the writes
        are dropped (counted)."""
        size = sum(memoryview(p).nbytes for p in payloads)
        with self._lock:
            self.stats.copy_s += copy_s
            drop = self._queued_bytes + size > _QUEUED_BYTES_CAP or not self.writable or not self._threads
            if not drop:
                self._queued_bytes += size
                self._writer_busy += 1
        if drop:
            self.abandon(entries)
            return
        self._writes.put((entries, payloads, size))

    def abandon(self, entries: list[tuple[int, bytes, int]]) -> None:
        """The pages ``entries`` will not be written (their copy failed)."""
        with self._lock:
            self.stats.dropped_writes += len(entries)
        self._results.extend(("written", key, 0) for _, key, _ in entries)

    # ------------------------------------------------------------------ the threads
    def _write_loop(self, work: queue.SimpleQueue, fingerprint: bytes) -> None:
        while (batch := work.get()) is not None:
            entries, payloads, size = batch
            try:
                for (_, key, chain), payload in zip(entries, payloads, strict=True):
                    self._results.append(("written", key, self._write(key, chain, payload, fingerprint)))
            finally:
                with self._lock:
                    self._queued_bytes -= size
                    self._writer_busy -= 1

    def _write(self, key: bytes, chain: int, payload, fingerprint: bytes) -> int:
        """Write one page (making room first); its file size, 0 if not written."""
        if not self.writable:
            with self._lock:
                self.stats.dropped_writes += 1
            return 0
        path = files.page_path(self.path, key)
        if os.path.exists(path):  # another engine wrote it
            return self.file_bytes
        self._since_scan += 1
        if self._dir_bytes + self.file_bytes > self.space or self._since_scan >= _RESCAN_EVERY:
            self._make_room()
        try:
            size = files.write_page(self.path, key, fingerprint, chain, payload)
        except OSError as e:
            if e.errno in files.UNWRITABLE:
                self.writable = False
                log.warning("acb: the KV disk tier cannot write to %s (%s): pages are no longer written there, "
                            "prompts are computed instead (EngineConfig.kv_disk_path)", self.path, e.strerror)
                with self._lock:
                    self.stats.dropped_writes += 1
            else:
                with self._lock:
                    self.stats.errors += 1
                log.warning("acb: writing a KV page file in %s failed: %r", self.path, e)
            return 0
        self._dir_bytes += size
        self.stats.pages_written += 1
        self.stats.bytes_written += size
        return size

    def _make_room(self) -> None:
        """Delete the least recently used page files until one more fits in ``space``, with a
        tenth of it to spare (so the directory is not scanned again at every write)."""
        self._since_scan = 0
        entries = sorted(files.scan(self.path), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        room = max(self.space * 9 // 10, self.file_bytes) if total + self.file_bytes > self.space else self.space
        for key, size, _ in entries:
            if total + self.file_bytes <= room:
                break
            try:
                os.unlink(files.page_path(self.path, key))
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            self._results.append(("evicted", key))
        self._dir_bytes = total

    def _read_loop(self, work: queue.SimpleQueue, fingerprint: bytes) -> None:
        while (keys := work.get()) is not None:
            for key in keys:
                self._results.append(self._read(key, fingerprint))

    def _read(self, key: bytes, fingerprint: bytes) -> tuple:
        path = files.page_path(self.path, key)
        start = time.perf_counter()
        try:
            payload = files.read_page(path, fingerprint, key, self.page_bytes)
        except FileNotFoundError:
            return ("missing", key)
        except (files.CorruptPage, OSError) as e:
            with self._lock:
                self.stats.errors += 1
            log.warning("acb: KV page file %s is not served (%s); it is deleted and its tokens recomputed", path, e)
            try:
                os.unlink(path)
            except OSError:
                pass
            return ("bad", key)
        try:
            os.utime(path)  # last use, for the LRU order (shared across engines and restarts)
        except OSError:
            pass
        with self._lock:  # (two readers)
            self.stats.pages_read += 1
            self.stats.bytes_read += files.HEADER_SIZE + len(payload)
            self.stats.load_s += time.perf_counter() - start
        return ("read", key, payload)

    # ------------------------------------------------------------------ checks
    def check_integrity(self, free_pages: Sequence[int]) -> None:
        """Assert the tier's invariants (``EngineConfig.debug_checks``): no page waits to be copied
        out while it is free (it would be read after another owner wrote it); no page is both
        being read and read; with the writer idle, the directory (as its last scan and its own
        writes since tell) is within ``space``. (The index is a dict: a file is in it once.)"""
        self.poll()
        free = set(free_pages)
        assert not [p for p, _, _ in self._pending if p in free], "a page waits to be copied to disk while free"
        assert not self._fetching & set(self._ready), "a page is both being read and read"
        with self._lock:
            idle = self._writer_busy == 0 and bool(self._threads)
        if idle:
            assert self._dir_bytes <= self.space, \
                f"the disk tier's directory holds {self._dir_bytes} bytes, over kv_disk_space ({self.space})"
