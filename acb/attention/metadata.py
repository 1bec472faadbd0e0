"""A step's rows packed for one forward, and its attention metadata built from them.

The metadata types: :class:`StepAttention` (what every layer's attention reads: the
decode rows, the prefill spans, one :class:`PagePool` view per page pool), made of
:class:`DecodeRows` and :class:`PrefillSpan`. Four small builders, each returning
something complete:

- :func:`pack` (packing): one pass over the step's columns into flat lists -- input ids, positions,
  each token's block-table row, the rows whose logits are kept, carried tokens -- with
  the decode and prefill rows apart (the KV slots and page tables are gathered from the
  block-table store, ``acb.attention.block_tables``, by row);
- :meth:`AttentionBuilder.decode`: the decode rows' :class:`DecodeRows`
  and the kernel path that serves them;
- :meth:`AttentionBuilder.prefill`: the prefill rows' spans (and the native kernel's
  batch of fresh prompts);
- :meth:`AttentionBuilder.pool`: one page pool's view (slots and page tables); hybrid
  models build a second, sliding one the same way.

The metadata names its kernel path (``native``, ``triton``, ``torch``); the attention
function looks the kernel modules up by that name (``acb.attention.selector.KERNELS``). CUDA
graphs build their static decode metadata with the same :meth:`DecodeRows.build`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..core.step import StepInput
    from .block_tables import BlockTables


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
    padded: bool = False  # a decode-only step padded to a CUDA-graph bucket (acb/worker/cuda_graphs.py)
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
    or ``torch``): the attention function takes its modules from ``acb.attention.selector.KERNELS``."""

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


@dataclass(slots=True)
class Packed:
    """A step's rows as flat lists (what :func:`pack` returns). Decode rows are those of
    one token but a prompt's (``StepInput.prompt_singles``); ``prefill_rows`` holds (first
    packed token, tokens, past tokens) per prefill row. Page tables are named by block-table
    row (``acb.attention.block_tables``): the KV slots of the tokens and the rows' page tables are
    gathered from the store."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_rows: list[int] = field(default_factory=list)  # the block-table row of each packed token
    keep: list[int] = field(default_factory=list)  # packed index of each sampled row's logits
    carry_pos: list[int] = field(default_factory=list)  # packed index of each carried token
    carry_src: list[int] = field(default_factory=list)  # its index in the previous step's sampled ids
    decode_q: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # decode rows' context lengths
    table_rows: list[int] = field(default_factory=list)  # decode rows' block-table rows (-1: padding)
    prefill_rows: list[tuple[int, int, int]] = field(default_factory=list)
    prefill_table_rows: list[int] = field(default_factory=list)


def pack(step: StepInput) -> Packed:
    """The packing builder: the step's columns into flat lists for one forward."""
    p = Packed(tokens=list(step.token_ids))  # a copy: decode padding appends to it
    t_off, rows, carry, sample = step.token_offsets, step.table_rows, step.carry_from, step.sample
    positions, token_rows, keep = p.positions, p.token_rows, p.keep
    drafts = step.drafts
    singles = step.prompt_singles  # one-token prompt rows: prefill rows (usually none)
    for i, start in enumerate(step.starts):
        q0 = t_off[i]
        n = t_off[i + 1] - q0
        if n == 0:  # a forked choice: it samples from the logits of the row before it
            if sample[i]:  # (not on the ranks other than 0 of tensor parallelism: they sample nothing)
                keep.append(q0 - 1)
            continue
        row = rows[i]
        if carry[i] >= 0:
            p.carry_pos.append(q0 + n - 1)
            p.carry_src.append(carry[i])
        if sample[i]:
            if drafts and drafts[i]:  # a row verifying proposals: the logits of its last drafts + 1 positions
                keep += range(q0 + n - 1 - drafts[i], q0 + n)
            else:
                keep.append(q0 + n - 1)
        if n == 1 and not (singles and i in singles):
            positions.append(start)
            token_rows.append(row)
            p.decode_q.append(q0)
            p.lengths.append(start + 1)
            p.table_rows.append(row)
        else:
            positions += range(start, start + n)
            token_rows += [row] * n
            p.prefill_rows.append((q0, n, start))
            p.prefill_table_rows.append(row)
    return p


@dataclass(slots=True)
class AttentionBuilder:
    """Builds a step's :class:`StepAttention` for one runner: its kernel
    path, page size, KV tensors and block tables (whose zero pages pad, one per pool)."""

    kernel: str  # the backend's kernel path: "native" | "triton" | "torch"
    page_size: int
    to_device: DeviceIds
    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    tables: BlockTables
    sliding_layers: frozenset[int] = frozenset()

    def build(self, p: Packed, slots: torch.Tensor, swa_slots: torch.Tensor | None, width: int, padded: bool,
              max_decode_blocks: int | None) -> StepAttention:
        """The whole step's metadata: decode rows (page tables ``width`` tokens wide,
        ``padded`` to a graph bucket), prefill spans, the full pool (new tokens at
        ``slots``) and, for hybrid models, the sliding one (at ``swa_slots``)."""
        rows = lengths = None
        if p.decode_q:
            rows, lengths = self.to_device(p.table_rows), self.to_device(p.lengths)
        decode = self.decode(p, lengths, width, padded, max_decode_blocks)
        prefills, fresh_spans = self.prefill(p)
        sliding = None
        if self.sliding_layers:
            sliding = self.pool(swa_slots, rows, lengths, p, width, sliding=True)
        pool = self.pool(slots, rows, lengths, p, width, sliding=False)
        return StepAttention(self.kernel, self.page_size, pool, decode, prefills, fresh_spans, sliding,
                             self.sliding_layers)

    def decode(self, p: Packed, lengths: torch.Tensor | None, width: int, padded: bool,
               max_decode_blocks: int | None) -> DecodeRows | None:
        """The decode builder: the rows' lengths and kernel path -- the backend's, or
        PyTorch's when the page table is wider than ``max_decode_blocks`` pages."""
        if not p.decode_q:
            return None
        fits = max_decode_blocks is None or -(-width // self.page_size) <= max_decode_blocks
        kernel = self.kernel if fits else "torch"
        return DecodeRows.build(self.to_device(p.decode_q), lengths, -(-width // self.page_size) * self.page_size,
                                kernel, padded)

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

    def pool(self, slots: torch.Tensor, rows: torch.Tensor | None, lengths: torch.Tensor | None, p: Packed,
             width: int, sliding: bool) -> PagePool:
        """One page pool's view (the sliding builder is this one over the sliding pool's
        tables): decode rows' page table, prefill rows' context pages or Triton rows."""
        tables = self.tables
        decode_pages = tables.gather(rows, lengths, width, sliding) if rows is not None else None
        caches = (self.k_cache, self.v_cache)
        if self.kernel == "triton":
            triton_prefill = self._triton_rows(p, sliding) if p.prefill_rows else None
            return PagePool(*caches, slots, decode_pages, (None,) * len(p.prefill_rows), triton_prefill)
        ids = self.to_device
        context = tuple(tables.gather(ids([row]), ids([past + n]), past + n, sliding) if past > 0 else None
                        for (_, n, past), row in zip(p.prefill_rows, p.prefill_table_rows, strict=True))
        return PagePool(*caches, slots, decode_pages, context)

    def _triton_rows(self, p: Packed, sliding: bool):
        """The Triton prefill kernel's view of the prefill rows over one pool's tables."""
        from ..kernels.triton_attention import PrefillRows

        rows = p.prefill_rows
        ends = [start + n for _, n, start in rows]
        programs = PrefillRows.programs_for([n for _, n, _ in rows])
        ids = self.to_device
        return PrefillRows(ids(rows), self.tables.gather(ids(p.prefill_table_rows), ids(ends), max(ends), sliding),
                           ids(programs))
