"""Structured outputs: ``json_schema``, ``regex`` and ``choice`` constrained by xgrammar.

xgrammar was picked over llguidance by measured cost per generated token (fill the
next-token bitmask, then accept the token): 4.7 against 13.9 us on SmolLM2's
tokenizer, 1.7 against 8.5 us on the tests' byte-level one
(``benchmarks/grammar.py``; docs/performance.md).

Each constrained request has its own matcher, advanced on the event loop as its
tokens arrive. A step's masks are filled (``TokenMasks.fill``) once every earlier
step's tokens are in, which, with step overlap, is while the step's own forward
runs; its sampling waits for them (``TokenMasks.__call__``, on the runner's thread).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch

from .config import SamplingParams
from .errors import InvalidRequestError

log = logging.getLogger("acb")


class Grammars:
    """One engine's grammar compiler over its tokenizer (built on first use: the
    tokenizer's info takes ~2 s for a 49k vocabulary). Compiled grammars are cached."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._compiler = None

    def matcher(self, params: SamplingParams) -> Any:
        """A fresh matcher for ``params``' constraint; InvalidRequestError names the field
        whose grammar does not compile."""
        if self.tokenizer is None:
            field = "json_schema" if params.json_schema is not None else "regex" if params.regex else "choice"
            raise InvalidRequestError("structured output needs the engine's tokenizer", param=field)
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(self.eos_ids) or None)
            self._compiler = xgr.GrammarCompiler(info)
        try:
            if params.json_schema is not None:
                schema = params.json_schema
                field = "json_schema"
                # compact JSON: small models otherwise loop on whitespace the schema allows
                compiled = self._compiler.compile_json_schema(
                    schema if isinstance(schema, str) else json.dumps(schema), any_whitespace=False)
            elif params.regex is not None:
                field = "regex"
                compiled = self._compiler.compile_regex(params.regex)
            else:
                field = "choice"
                ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
                compiled = self._compiler.compile_grammar(ebnf)
        except RuntimeError as e:  # xgrammar reports bad schemas and regexes so
            raise InvalidRequestError(f"{field} cannot be compiled: {str(e).strip()}", param=field) from e
        return xgr.GrammarMatcher(compiled)


class TokenMasks:
    """The structured-output masks of one step's constrained rows (see the module doc)."""

    __slots__ = ("rows", "matchers", "vocab_size", "bitmask", "_done")

    def __init__(self, rows: list[int], matchers: list[Any], vocab_size: int) -> None:
        self.rows = rows
        self.matchers = matchers
        self.vocab_size = vocab_size
        self.bitmask: torch.Tensor | None = None
        self._done = threading.Event()

    def fill(self) -> None:
        """On the event loop, once every earlier step's tokens have been accepted."""
        try:
            bitmask = torch.full((len(self.rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
            for i, matcher in enumerate(self.matchers):
                if not matcher.is_terminated():  # else its request has ended: the row's token is dropped
                    matcher.fill_next_token_bitmask(bitmask, i)
            self.bitmask = bitmask
        except Exception:  # never leave the sampler waiting
            log.exception("acb: filling structured-output masks failed; this step samples unconstrained")
        finally:
            self._done.set()

    def abandon(self) -> None:
        """Release a sampler waiting on masks that will never be filled (its step's
        tokens are dropped: a hard stop or a crashed loop)."""
        self._done.set()

    def __call__(self) -> tuple[list[int], torch.Tensor] | None:
        self._done.wait()
        return (self.rows, self.bitmask) if self.bitmask is not None else None
