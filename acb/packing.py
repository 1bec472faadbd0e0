"""A step's rows packed for one forward, and its attention metadata built from them.

The metadata types: :class:`StepAttention` (what every layer's attention reads: the
decode rows, the prefill spans, one :class:`PagePool` view per page pool), made of
:class:`DecodeRows` and :class:`PrefillSpan`. Four small builders, each returning
something complete:

- :func:`pack` (packing): one pass over the step's columns into flat lists -- input ids, positions,
  KV slots, the rows whose logits are kept, carried tokens, pages used for the first
  time -- with the decode and prefill rows apart;
- :meth:`AttentionBuilder.decode`: the decode rows' :class:`DecodeRows`
  and the kernel path that serves them;
- :meth:`AttentionBuilder.prefill`: the prefill rows' spans (and the native kernel's
  batch of fresh prompts);
- :meth:`AttentionBuilder.pool`: one page pool's view (slots and page tables); hybrid
  models build a second, sliding one the same way.

The metadata names its kernel path (``native``, ``triton``, ``torch``); the attention
function looks the kernel modules up by that name (``acb.attention.KERNELS``). CUDA
graphs build their static decode metadata with the same :meth:`DecodeRows.build`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .step import StepInput


@dataclass(slots=True, frozen=True)
class PrefillSpan:
    """One prefill row of the packed step (a prompt, or a chunk continuing one)."""

    q_start: int  # first packed token of this row
    q_end: int
    past: int  # tokens of context before the row (0 = fresh prompt)
    kernel_row: torch.Tensor | None = None  # native path, past > 0: [[q_start, q_end, 0, past]]


@dataclass(slots=True, frozen=True)
class DecodeRows:
    """The step's decode rows (one query token each), the same in both page pools."""

    token_idx: torch.Tensor  # [Bd] packed index of each decode row's token
    lengths: torch.Tensor  # [Bd] context length of each row
    kernel: str  # "native" / "triton": a kernel reads the pages in place; "torch": gathered, masked
    padded: bool = False  # a decode-only step padded to a CUDA-graph bucket (acb/cuda_graphs.py)
    key_pos: torch.Tensor | None = None  # "torch": [1, P * page_size] key positions
    q_pos: torch.Tensor | None = None  # "torch": [Bd, 1] each query's position (length - 1)
    valid: torch.Tensor | None = None  # "torch": [Bd, 1, P * page_size] True where a key exists

    @classmethod
    def build(cls, token_idx: torch.Tensor, lengths: torch.Tensor, width: int, kernel: str, padded: bool = False,
              key_pos: torch.Tensor | None = None) -> DecodeRows:
        """The rows' metadata for kernel path ``kernel``, over page tables covering ``width``
        tokens; PyTorch's path gets its masks (from ``key_pos`` when given: a graph's constant)."""
        if kernel != "torch":
            return cls(token_idx, lengths, kernel, padded)
        if key_pos is None:
            key_pos = torch.arange(width, device=lengths.device).unsqueeze(0)
        valid = (key_pos < lengths.unsqueeze(1)).view(lengths.shape[0], 1, width)
        return cls(token_idx, lengths, kernel, padded, key_pos, (lengths - 1).unsqueeze(1), valid)


@dataclass(slots=True, frozen=True)
class PagePool:
    """One page pool's view of the step: its KV tensors, where the new tokens go and the
    rows' page tables. Hybrid models have two pools (full and sliding layers)."""

    k_cache: list[torch.Tensor]  # per layer [kv_heads, num_slots, head_dim]
    v_cache: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] where each new token's k/v goes
    decode_pages: torch.Tensor | None = None  # [Bd, P] pages of each decode row's context (padding: zero page)
    # per prefill span: the pages holding its past and new tokens when past > 0 (not "triton")
    context_pages: tuple[torch.Tensor | None, ...] = ()
    triton_prefill: object | None = None  # "triton": acb.kernels.triton_attention.PrefillRows


@dataclass(slots=True, frozen=True)
class StepAttention:
    """Per-step attention metadata shared by every layer, complete when built (by
    :class:`AttentionBuilder`). ``kernel`` names the backend's kernel path (``native``, ``triton``
    or ``torch``): the attention function takes its modules from ``acb.attention.KERNELS``."""

    kernel: str
    page_size: int
    pool: PagePool
    decode: DecodeRows | None = None
    prefills: tuple[PrefillSpan, ...] = ()
    # "native": the fresh prompts' rows, (first, end, first, 0) each: all attended in one call per layer
    fresh_spans: torch.Tensor | None = None
    sliding: PagePool | None = None  # hybrid models: the pool of the layers in ``sliding_layers``
    sliding_layers: frozenset[int] = frozenset()


class DeviceIds:
    """Host lists of ints -> long tensors on ``device``; on CUDA through pinned memory,
    without making the host wait for the copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"

    def __call__(self, values: list) -> torch.Tensor:
        if not self.pinned:
            return torch.tensor(values, dtype=torch.long)
        return torch.tensor(values, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)

    def table(self, tables: Sequence[Sequence[int]], length: int, page_size: int, zero: int) -> torch.Tensor:
        """[B, P] pages covering ``length`` positions per row; the ``zero`` page pads and
        stands in for recycled (negative) entries."""
        npages = -(-length // page_size)
        return self([[p if p >= 0 else zero for p in t[:npages]] + [zero] * (npages - len(t[:npages]))
                     for t in tables])


@dataclass(slots=True)
class Packed:
    """A step's rows as flat lists (what :func:`pack` returns). Decode rows are those of
    one token; ``prefill_rows`` holds (first packed token, tokens, past tokens) per
    prefill row. The ``swa_`` lists are the sliding pool's (hybrid models)."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)  # packed index of each sampled row's logits
    carry_pos: list[int] = field(default_factory=list)  # packed index of each carried token
    carry_src: list[int] = field(default_factory=list)  # its index in the previous step's sampled ids
    fresh: list[int] = field(default_factory=list)  # pages written for the first time (to be zeroed)
    decode_q: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # decode rows' context lengths
    tables: list[Sequence[int]] = field(default_factory=list)  # decode rows' block tables
    prefill_rows: list[tuple[int, int, int]] = field(default_factory=list)
    prefill_tables: list[Sequence[int]] = field(default_factory=list)
    swa_slots: list[int] = field(default_factory=list)
    swa_fresh: list[int] = field(default_factory=list)
    swa_tables: list[Sequence[int] | None] = field(default_factory=list)
    swa_prefill_tables: list[Sequence[int] | None] = field(default_factory=list)


def _place(table: Sequence[int], start: int, n: int, page_size: int, written: bytearray, slots: list[int],
           fresh: list[int]) -> None:
    """Append the slots of positions [start, start + n) under ``table``, and the pages
    they touch that were never written before (marking them written)."""
    ps = page_size
    slots.extend(table[p // ps] * ps + p % ps for p in range(start, start + n))
    for page in table[start // ps : (start + n - 1) // ps + 1]:
        if not written[page]:
            written[page] = 1
            fresh.append(page)


def pack(step: StepInput, page_size: int, written: bytearray, swa_written: bytearray | None = None) -> Packed:
    """The packing builder: the step's columns into flat lists for one forward.
    ``written`` (and ``swa_written``, hybrid models) mark the pages ever written."""
    p = Packed(tokens=list(step.token_ids))  # a copy: decode padding appends to it
    t_off, p_off, s_off = step.token_offsets, step.page_offsets, step.swa_offsets
    for i, start in enumerate(step.starts):
        q0 = t_off[i]
        n = t_off[i + 1] - q0
        if n == 0:  # a forked choice: it samples from the logits of the row before it
            if step.sample[i]:  # (not on the ranks other than 0 of tensor parallelism: they sample nothing)
                p.keep.append(q0 - 1)
            continue
        pages = step.pages[p_off[i] : p_off[i + 1]]
        p.positions.extend(range(start, start + n))
        _place(pages, start, n, page_size, written, p.slots, p.fresh)
        swa_pages = None
        if swa_written is not None:
            swa_pages = step.swa_pages[s_off[i] : s_off[i + 1]]
            _place(swa_pages, start, n, page_size, swa_written, p.swa_slots, p.swa_fresh)
        if step.carry_from[i] >= 0:
            p.carry_pos.append(q0 + n - 1)
            p.carry_src.append(step.carry_from[i])
        if step.sample[i]:
            p.keep.append(q0 + n - 1)
        if n == 1:
            p.decode_q.append(q0)
            p.lengths.append(start + 1)
            p.tables.append(pages)
            p.swa_tables.append(swa_pages)
        else:
            p.prefill_rows.append((q0, n, start))
            p.prefill_tables.append(pages)
            p.swa_prefill_tables.append(swa_pages)
    return p


@dataclass(slots=True)
class AttentionBuilder:
    """Builds a step's :class:`StepAttention` for one runner: its kernel
    path, page size, KV tensors and zero pages (one per pool)."""

    kernel: str  # the backend's kernel path: "native" | "triton" | "torch"
    page_size: int
    to_device: DeviceIds
    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    zero_page: int
    sliding_layers: frozenset[int] = frozenset()
    sliding_zero_page: int = 0

    def build(self, p: Packed, slots: torch.Tensor, width: int, padded: bool,
              max_decode_blocks: int | None) -> StepAttention:
        """The whole step's metadata: decode rows (page tables ``width`` tokens wide,
        ``padded`` to a graph bucket), prefill spans, the full pool (new tokens at
        ``slots``) and, for hybrid models, the sliding one."""
        decode = self.decode(p, width, padded, max_decode_blocks)
        prefills, fresh_spans = self.prefill(p)
        sliding = None
        if self.sliding_layers:
            sliding = self.pool(self.to_device(p.swa_slots), p.swa_tables, p.prefill_rows, p.swa_prefill_tables,
                                width, self.sliding_zero_page)
        pool = self.pool(slots, p.tables, p.prefill_rows, p.prefill_tables, width, self.zero_page)
        return StepAttention(self.kernel, self.page_size, pool, decode, prefills, fresh_spans, sliding,
                             self.sliding_layers)

    def decode(self, p: Packed, width: int, padded: bool, max_decode_blocks: int | None) -> DecodeRows | None:
        """The decode builder: the rows' lengths and kernel path -- the backend's, or
        PyTorch's when the page table is wider than ``max_decode_blocks`` pages."""
        if not p.decode_q:
            return None
        fits = max_decode_blocks is None or -(-width // self.page_size) <= max_decode_blocks
        kernel = self.kernel if fits else "torch"
        return DecodeRows.build(self.to_device(p.decode_q), self.to_device(p.lengths),
                                -(-width // self.page_size) * self.page_size, kernel, padded)

    def prefill(self, p: Packed) -> tuple[tuple[PrefillSpan, ...], torch.Tensor | None]:
        """The prefill builder: one span per prefill row; on the native path a continued
        row carries its kernel row, and the fresh prompts go to the kernel in one batch."""
        if not p.prefill_rows:
            return (), None
        native = self.kernel == "native"
        spans = tuple(PrefillSpan(q0, q0 + n, past, torch.tensor([[q0, q0 + n, 0, past]], dtype=torch.int64)
                                  if native and past > 0 else None) for q0, n, past in p.prefill_rows)
        fresh = [(q0, q0 + n, q0, 0) for q0, n, past in p.prefill_rows if past == 0]
        return spans, torch.tensor(fresh, dtype=torch.int64) if native and fresh else None

    def pool(self, slots: torch.Tensor, decode_tables: list, prefill_rows: list[tuple[int, int, int]],
             prefill_tables: list, width: int, zero: int) -> PagePool:
        """One page pool's view (the sliding builder is this one over the sliding pool's
        tables): decode rows' page table, prefill rows' context pages or Triton rows."""
        ids = self.to_device
        ps = self.page_size
        decode_pages = ids.table(decode_tables, width, ps, zero) if decode_tables else None
        caches = (self.k_cache, self.v_cache)
        if self.kernel == "triton":
            triton_prefill = self._triton_rows(prefill_rows, prefill_tables, zero) if prefill_rows else None
            return PagePool(*caches, slots, decode_pages, (None,) * len(prefill_rows), triton_prefill)
        context = tuple(ids.table([t], past + n, ps, zero) if past > 0 else None
                        for (_, n, past), t in zip(prefill_rows, prefill_tables, strict=True))
        return PagePool(*caches, slots, decode_pages, context)

    def _triton_rows(self, rows: list[tuple[int, int, int]], tables: list, zero: int):
        """The Triton prefill kernel's view of the prefill rows over one pool's tables."""
        from .kernels.triton_attention import PrefillRows

        width = max(start + n for _, n, start in rows)
        programs = PrefillRows.programs_for([n for _, n, _ in rows])
        return PrefillRows(self.to_device(rows), self.to_device.table(tables, width, self.page_size, zero),
                           self.to_device(programs))
