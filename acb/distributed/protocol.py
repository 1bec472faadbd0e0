"""The one message per step that rank 0 broadcasts to the other ranks.

A step travels as one flat int32 tensor (:func:`pack_step`), never pickled, behind two
ints of its own::

    op, length (of the whole message), then the packed step (OP_STEP only)
    or the packed tables to check (OP_CHECK: see :func:`pack_tables`)

The packed step: a header (rows, tokens, block-table deltas, sliding deltas, swap-outs,
swap-ins, copies, sliding copies, flags, one-token prompt rows), then the columns of
``acb.core.step.StepInput``: starts, carry sources, sample flags, block-table rows, token
offsets (rows + 1), token ids, the block-table deltas (rows, columns, pages, sliding
pages), the page moves (src, dst, swa columns of each) and the one-token prompt rows.
Page tables travel as deltas only: each rank's block-table store (``acb.attention.block_tables``)
applies them, as rank 0's does. Its sampling batch and prompt-logprob rows stay on rank 0.

A token that rank 0 carries over from the previous step's sampling (it never reached
the host) is written into the message from rank 0's sampled ids, on its device, so the
other ranks need neither the sampler nor the previous step's output. The other ranks
only compute: they sample nothing, so they keep no logits.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from ..core.step import PageMoves, StepInput

OP_IDLE, OP_STEP, OP_STOP, OP_RESIZE, OP_CHECK = 0, 1, 2, 3, 4
HEADER = 2
STEP_HEADER = 10  # the packed step's own header


def pack_step(step: StepInput) -> torch.Tensor:
    """``step`` (not its sampling batch) as one flat int32 tensor on the host."""
    moves = (step.swap_out, step.swap_in, step.copy_pages, step.copy_swa_pages)
    header = [step.num_rows, len(step.token_ids), len(step.delta_rows), len(step.delta_swa),
              *(len(m) for m in moves), step.plain | step.refresh << 1, len(step.prompt_singles)]
    flat = header + step.starts + step.carry_from + step.sample + step.table_rows + step.token_offsets \
        + step.token_ids + step.delta_rows + step.delta_cols + step.delta_pages + step.delta_swa
    for m in moves:
        flat += m.src + m.dst + m.swa
    flat += step.prompt_singles
    return torch.tensor(flat, dtype=torch.int32)


def carried_positions(step: StepInput) -> tuple[list[int], list[int]]:
    """(positions in :func:`pack_step`'s tensor of ``step``'s carried placeholder ids,
    their indexes into the previous step's sampled ids): the sender writes them in on
    the device."""
    base = STEP_HEADER + 5 * step.num_rows + 1
    o = step.token_offsets
    rows = [i for i, c in enumerate(step.carry_from) if c >= 0]
    return [base + o[i + 1] - 1 for i in rows], [step.carry_from[i] for i in rows]


def unpack_step(packed: torch.Tensor | list[int]) -> StepInput:
    """The step :func:`pack_step` made (its sampling batch None)."""
    flat = packed.tolist() if hasattr(packed, "tolist") else list(packed)
    rows, n_tokens, n_deltas, n_swa, n_out, n_in, n_copy, n_copy_swa, flags, n_singles = flat[:STEP_HEADER]
    it = _Cursor(flat, STEP_HEADER)
    step = StepInput(starts=it.take(rows), carry_from=it.take(rows), sample=[bool(s) for s in it.take(rows)],
                     table_rows=it.take(rows), token_offsets=it.take(rows + 1), token_ids=it.take(n_tokens),
                     delta_rows=it.take(n_deltas), delta_cols=it.take(n_deltas), delta_pages=it.take(n_deltas),
                     delta_swa=it.take(n_swa), plain=bool(flags & 1), refresh=bool(flags & 2))
    step.swap_out, step.swap_in, step.copy_pages, step.copy_swa_pages = (
        PageMoves(it.take(n), it.take(n), it.take(n)) for n in (n_out, n_in, n_copy, n_copy_swa))
    step.prompt_singles = it.take(n_singles)
    return step


Tables = list[tuple[int, list[int], "list[int] | None"]]


def pack_tables(tables: Tables) -> list[int]:
    """The scheduler's sent block tables ((row, pages, sliding pages or None) per running
    sequence: ``Scheduler.sent_tables``) as flat ints, for every rank to check its store."""
    flat = [len(tables)]
    for row, pages, swa in tables:
        flat += [row, len(pages), -1 if swa is None else len(swa), *pages, *(swa or ())]
    return flat


def unpack_tables(flat: list[int]) -> Tables:
    it = _Cursor(flat, 1)
    tables = []
    for _ in range(flat[0]):
        row, n, n_swa = it.take(3)
        tables.append((row, it.take(n), None if n_swa < 0 else it.take(n_swa)))
    return tables


class _Cursor:
    __slots__ = ("flat", "at")

    def __init__(self, flat: list[int], at: int) -> None:
        self.flat = flat
        self.at = at

    def take(self, n: int) -> list[int]:
        self.at += n
        return self.flat[self.at - n : self.at]


class Channel:
    """Both ends of the per-step broadcast over ``group``: a fixed-size int32 buffer on
    the ranks' device (so a collective's size is known to every rank), grown by a
    resize message when a step needs more."""

    def __init__(self, group, device: torch.device, timeout: timedelta, capacity: int = 1 << 14) -> None:
        self.group = group
        self.device = device
        self.timeout = timeout
        self.buffer = torch.zeros(capacity, dtype=torch.int32, device=device)

    def _broadcast(self) -> None:
        self.group.broadcast(self.buffer, 0, self.timeout).wait()

    def _grow(self, length: int) -> None:
        self.buffer = torch.zeros(1 << (length - 1).bit_length(), dtype=torch.int32, device=self.device)

    def send(self, step: StepInput, sampled: torch.Tensor | None = None) -> None:
        """Rank 0: broadcast ``step``, its carried tokens taken from ``sampled`` (the
        previous step's sampled ids, on the device)."""
        packed = pack_step(step)
        length = HEADER + packed.numel()
        if length > self.buffer.numel():
            self.send_op(OP_RESIZE, length)
            self._grow(length)
        self.buffer[:HEADER] = torch.tensor([OP_STEP, length], dtype=torch.int32)
        self.buffer[HEADER:length] = packed
        carry_pos, carry_src = carried_positions(step)
        if carry_pos and sampled is not None:
            idx = torch.tensor([HEADER + p for p in carry_pos], device=self.device)
            self.buffer[idx] = sampled[torch.tensor(carry_src, device=sampled.device)].to(torch.int32)
        self._broadcast()

    def send_check(self, tables: Tables) -> None:
        """Rank 0: send the scheduler's tables for every rank to check its block-table store
        against (each answers in :meth:`agree`)."""
        flat = pack_tables(tables)
        length = HEADER + len(flat)
        if length > self.buffer.numel():
            self.send_op(OP_RESIZE, length)
            self._grow(length)
        self.buffer[:length] = torch.tensor([OP_CHECK, length, *flat], dtype=torch.int32)
        self._broadcast()

    def agree(self, bad: int) -> int:
        """Every rank: the largest ``bad`` over the ranks (a failed check's rank, else 0)."""
        flag = torch.tensor([bad], dtype=torch.int32, device=self.device)
        options = torch.distributed.AllreduceOptions()
        options.reduceOp = torch.distributed.ReduceOp.MAX
        options.timeout = self.timeout
        self.group.allreduce([flag], options).wait()
        return int(flag)

    def send_op(self, op: int, length: int = HEADER) -> None:
        """Rank 0: broadcast a message without a step (idle, stop, resize)."""
        self.buffer[:2] = torch.tensor([op, length], dtype=torch.int32)
        self._broadcast()

    def receive(self) -> tuple[int, Any]:
        """The other ranks: (op, payload) of rank 0's next broadcast: the step (OP_STEP), the
        tables to check (OP_CHECK), else None."""
        while True:
            self._broadcast()
            op, length = self.buffer[:HEADER].tolist()
            if op == OP_STEP:
                return op, unpack_step(self.buffer[HEADER:length])
            if op == OP_CHECK:
                return op, unpack_tables(self.buffer[HEADER:length].tolist())
            if op != OP_RESIZE:
                return op, None
            self._grow(length)
