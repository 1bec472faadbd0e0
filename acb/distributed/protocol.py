"""The one message per step that rank 0 broadcasts to the other ranks.

A step (``acb.runner.StepInput``) travels as one flat int32 tensor, never pickled::

    header   op, length, rows, tokens, pages, sliding pages, swap-outs, swap-ins
    rows     per row: tokens, start, pages, sliding pages (-1: none)
    tokens   every row's input ids, in row order (carried ids filled in by rank 0)
    pages    every row's block-table prefix
    sliding  every row's sliding-pool table prefix (hybrid models)
    swaps    swap-outs then swap-ins, three ints each (-1 pads a pair)

A token that rank 0 carries over from the previous step's sampling (it never reached
the host) is written into the message from rank 0's sampled ids, on its device, so the
other ranks need neither the sampler nor the previous step's output. The other ranks
only compute: their rows sample nothing, so they keep no logits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch

OP_IDLE, OP_STEP, OP_STOP, OP_RESIZE = 0, 1, 2, 3
HEADER = 8
ROW = 4
SWAP = 3


def pack(rows: Sequence[tuple], swap_out: Sequence[tuple[int, ...]],
         swap_in: Sequence[tuple[int, ...]]) -> tuple[list[int], list[int], list[int]]:
    """(message, message positions of carried tokens, their indexes into the previous
    step's sampled ids)."""
    meta: list[int] = []
    tokens: list[int] = []
    pages: list[int] = []
    swa: list[int] = []
    carry_pos: list[int] = []
    carry_src: list[int] = []
    for row_tokens, start, row_pages, carry_from, _sample, swa_pages in rows:
        if carry_from >= 0:
            carry_pos.append(len(tokens) + len(row_tokens) - 1)
            carry_src.append(carry_from)
        tokens.extend(row_tokens)
        pages.extend(row_pages)
        if swa_pages is not None:
            swa.extend(swa_pages)
        meta += (len(row_tokens), start, len(row_pages), -1 if swa_pages is None else len(swa_pages))
    swaps: list[int] = []
    for pair in (*swap_out, *swap_in):
        swaps += (*pair, *(-1,) * (SWAP - len(pair)))
    header = [OP_STEP, 0, len(rows), len(tokens), len(pages), len(swa), len(swap_out), len(swap_in)]
    message = header + meta + tokens + pages + swa + swaps
    message[1] = len(message)
    offset = HEADER + len(meta)
    return message, [offset + p for p in carry_pos], carry_src


def unpack(message: list[int]) -> tuple[list[tuple], list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(rows in ``RowInput``'s field order, swap-outs, swap-ins) of a step message."""
    _, _, n_rows, n_tokens, n_pages, n_swa, n_out, n_in = message[:HEADER]
    meta = message[HEADER: HEADER + ROW * n_rows]
    cursor = HEADER + ROW * n_rows
    tokens = iter(message[cursor: cursor + n_tokens])
    cursor += n_tokens
    pages = iter(message[cursor: cursor + n_pages])
    cursor += n_pages
    swa = iter(message[cursor: cursor + n_swa])
    cursor += n_swa
    rows = []
    for i in range(0, len(meta), ROW):
        n, start, n_pg, n_sw = meta[i: i + ROW]
        rows.append((_take(tokens, n), start, _take(pages, n_pg), -1, False,
                     None if n_sw < 0 else _take(swa, n_sw)))
    swaps = [tuple(message[j: j + SWAP]) for j in range(cursor, cursor + SWAP * (n_out + n_in), SWAP)]
    return rows, swaps[:n_out], swaps[n_out:]


def _take(values: Iterator[int], n: int) -> tuple[int, ...]:
    return tuple(next(values) for _ in range(n))


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

    def send(self, message: list[int], carry_pos: list[int] = (), carry_src: list[int] = (),
             sampled: torch.Tensor | None = None) -> None:
        """Rank 0: broadcast ``message``, its carried tokens taken from ``sampled``."""
        if len(message) > self.buffer.numel():
            self.send_op(OP_RESIZE, len(message))
            self._grow(len(message))
        self.buffer[: len(message)] = torch.tensor(message, dtype=torch.int32)
        if carry_pos and sampled is not None:
            idx = torch.tensor(carry_pos, device=self.device)
            self.buffer[idx] = sampled[torch.tensor(carry_src, device=sampled.device)].to(torch.int32)
        self._broadcast()

    def send_op(self, op: int, length: int = HEADER) -> None:
        """Rank 0: broadcast a message without a step (idle, stop, resize)."""
        self.buffer[:2] = torch.tensor([op, length], dtype=torch.int32)
        self._broadcast()

    def receive(self) -> tuple[int, list[int]]:
        """The other ranks: (op, message) of rank 0's next broadcast."""
        while True:
            self._broadcast()
            op, length = self.buffer[:2].tolist()
            if op != OP_RESIZE:
                return op, self.buffer[:length].tolist() if op == OP_STEP else []
            self._grow(length)
