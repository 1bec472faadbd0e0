"""Reasoning split: the thought a model writes between ``<think>`` and ``</think>`` apart
from its answer (``SamplingParams.reasoning_parser``; ``acb serve --reasoning-parser``).

Parsers (``PARSERS``):

- ``think``: reasoning is what follows ``<think>``, up to ``</think>``. The output is in
  its reasoning from the start when the prompt ends with ``<think>`` (templates that open
  the thought for the model: Qwen3 thinking-2507, DeepSeek-R1 0528, QwQ), or when the
  output itself begins with ``<think>`` (Qwen3, SmolLM3 with thinking on); otherwise all of
  it is the answer (thinking off, e.g. ``enable_thinking=False``).
- ``deepseek_r1``: the output is reasoning until ``</think>`` whether or not ``<think>``
  appears (DeepSeek-R1 and its distills, whose template may or may not print it).

The markers themselves belong to neither text. A tail that may begin a marker is held
back until it is known, so a marker split over tokens never leaks into either part.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("think", "deepseek_r1")


def _held_back(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one output's text, delta by delta, into (reasoning, answer).

    ``in_reasoning``: the prompt opened the thought (it ends with ``<think>``)."""

    __slots__ = ("state", "buffer", "always")

    def __init__(self, parser: str = "think", in_reasoning: bool = False) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from {', '.join(PARSERS)}")
        self.always = parser == "deepseek_r1"
        # "start": nothing seen yet; "reasoning"; "answer"
        self.state = "reasoning" if in_reasoning or self.always else "start"
        self.buffer = ""

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the reasoning (or may still open it)."""
        return self.state != "answer"

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new answer) after ``text``; ``final`` releases what was held back."""
        buf = self.buffer + text
        self.buffer = ""
        reasoning, answer = [], []
        while buf:
            if self.state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(START):
                    self.state, buf = "reasoning", stripped[len(START):]
                elif not final and START.startswith(stripped):  # may still become <think>
                    self.buffer = buf
                    break
                else:
                    self.state = "answer"
            elif self.state == "reasoning":
                if buf.startswith(START) and self.always:  # R1's template may print it, or the model
                    buf = buf[len(START):]
                i = buf.find(END)
                if i >= 0:
                    reasoning.append(buf[:i])
                    self.state, buf = "answer", buf[i + len(END):]
                    continue
                hold = 0 if final else max(_held_back(buf, END), _held_back(buf, START) if self.always else 0)
                reasoning.append(buf[: len(buf) - hold])
                self.buffer = buf[len(buf) - hold:]
                break
            else:
                answer.append(buf)
                break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        return self.push("", final=True)


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending with ``prompt_tail`` leaves the model inside its thought."""
    return prompt_tail.rstrip().endswith(START)


def parser_for_template(template: str | None) -> str | None:
    """``think`` for chat templates that show ``<think>``, else None."""
    if isinstance(template, dict):
        template = template.get("default")
    return "think" if template and START in template else None


__all__ = ["PARSERS", "ReasoningSplitter", "parser_for_template", "prompt_opens_reasoning"]
