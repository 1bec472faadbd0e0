"""The one message per step that rank 0 broadcasts to the other ranks.

A step travels as ``acb.step.StepInput.pack()``'s flat int32 tensor, never pickled,
behind two ints of its own::

    op, length (of the whole message), then the packed step (OP_STEP only)

A token that rank 0 carries over from the previous step's sampling (it never reached
the host) is written into the message from rank 0's sampled ids, on its device, so the
other ranks need neither the sampler nor the previous step's output. The other ranks
only compute: they sample nothing, so they keep no logits.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from ..step import StepInput

OP_IDLE, OP_STEP, OP_STOP, OP_RESIZE = 0, 1, 2, 3
HEADER = 2


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
        packed = step.pack()
        length = HEADER + packed.numel()
        if length > self.buffer.numel():
            self.send_op(OP_RESIZE, length)
            self._grow(length)
        self.buffer[:HEADER] = torch.tensor([OP_STEP, length], dtype=torch.int32)
        self.buffer[HEADER:length] = packed
        carry_pos, carry_src = step.carried_positions()
        if carry_pos and sampled is not None:
            idx = torch.tensor([HEADER + p for p in carry_pos], device=self.device)
            self.buffer[idx] = sampled[torch.tensor(carry_src, device=sampled.device)].to(torch.int32)
        self._broadcast()

    def send_op(self, op: int, length: int = HEADER) -> None:
        """Rank 0: broadcast a message without a step (idle, stop, resize)."""
        self.buffer[:2] = torch.tensor([op, length], dtype=torch.int32)
        self._broadcast()

    def receive(self) -> tuple[int, StepInput | None]:
        """The other ranks: (op, step) of rank 0's next broadcast (step None unless OP_STEP)."""
        while True:
            self._broadcast()
            op, length = self.buffer[:HEADER].tolist()
            if op != OP_RESIZE:
                return op, StepInput.unpack(self.buffer[HEADER:length]) if op == OP_STEP else None
            self._grow(length)
