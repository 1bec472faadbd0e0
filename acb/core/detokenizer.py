"""Incremental detokenization and stop-string matching.

``Detokenizer`` turns a growing list of token ids into text deltas whose
concatenation equals ``tokenizer.decode(ids, skip_special_tokens=True,
clean_up_tokenization_spaces=False)``: it re-decodes a small window of recent
tokens and emits only the new suffix, holding text back while it ends in an
incomplete UTF-8 sequence (decoded as U+FFFD). The window keeps SentencePiece
word-boundary spaces, which decoding tokens one by one would lose.

``StopMatcher`` finds stop strings across chunk boundaries by holding back any
tail of the text that could still begin a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Text deltas of a growing list of ids: ``ids`` (by default its own) is read, never
    copied, so a request's generated ids live in one list, its sequence's."""

    def __init__(self, tokenizer, ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = [] if ids is None else ids
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` to ``ids``; the text they complete (see ``step``)."""
        self.ids.extend(new_ids)
        return self.step()

    def step(self, end: int | None = None) -> str:
        """The text the ids appended since the last call complete (held back while it
        ends in an incomplete UTF-8 sequence); only ``ids[:end]`` when ``end`` is given
        (several ids appended at once, read one by one)."""
        end = len(self.ids) if end is None else end
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset : end])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = end
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string matched).
        On a match the emitted text ends right before the stop string."""
        if not self.stops:
            return text, False
        pending = self.held + text
        first = -1
        for stop in self.stops:
            i = pending.find(stop)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first != -1:
            self.held = ""
            return pending[:first], True
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(pending)), keep, -1):
                if pending.endswith(stop[:k]):
                    keep = k
                    break
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
