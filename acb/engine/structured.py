"""Structured outputs: ``json_schema``, ``regex`` and ``choice`` constrained by xgrammar.

xgrammar was picked over llguidance by measured cost per generated token (fill the
next-token bitmask, then accept the token): 4.7 against 13.9 us on SmolLM2's
tokenizer, 1.7 against 8.5 us on the tests' byte-level one
(``benchmarks/grammar.py``; docs/performance.md).

Each constrained request has its own matcher, advanced on the event loop as its
tokens arrive. A step's masks are filled (``TokenMasks.fill``) once every earlier
step's tokens are in, which, with step overlap, is while the step's own forward
runs; its sampling waits for them (``TokenMasks.__call__``, on the runner's thread).

Compiling a grammar is the heavy part (a string enum of 20,000 values: seconds), so it
never runs on the event loop in the async paths (``Engine.asubmit``, ``generate``,
``generate_batch``, ``acb serve``): it runs on ``Grammars``' own worker threads, which
xgrammar leaves the GIL to for nearly all of the compile (measured: the loop's longest
pause while a 20,000-value enum compiles beside it is tens of milliseconds, against the
whole compile inline; docs/serving.md, "Nothing heavy on the event loop").
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import anyio
import torch

from ..core.errors import InvalidRequestError
from ..core.sampling_params import SamplingParams

log = logging.getLogger("acb")


def grammar_source(params: SamplingParams) -> tuple[str, str]:
    """(field, text): which field constrains ``params`` and its grammar as canonical text
    (compact JSON for a schema; key order kept, as it is the order of the output's
    properties; an EBNF rule for ``choice``). With the tokenizer, fixed per engine, it
    is the key compiled grammars are cached by."""
    if params.json_schema is not None:
        schema = params.json_schema
        if isinstance(schema, str):  # SamplingParams checked that it parses
            schema = json.loads(schema)
        return "json_schema", json.dumps(schema, separators=(",", ":"))
    if params.regex is not None:
        return "regex", params.regex
    return "choice", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)


class Grammars:
    """One engine's grammar compiler over its tokenizer, and an LRU cache of what it compiled.

    Compiles run on worker threads of their own (``acb-grammar``; xgrammar releases the GIL
    for nearly all of a compile), two at a time so one huge schema does not hold up every
    other. A request whose grammar is compiling already waits for that compile instead of
    starting another. Compiled grammars are kept by ``grammar_source`` (field and canonical
    text; the tokenizer is the engine's) up to ``cache_size`` of them, least recently used
    first out: an identical request later compiles nothing.

    ``threads``: xgrammar's threads within one compile. The engine gives 1 when it computes
    on the CPU: there the step's OpenMP pool has every core, and xgrammar's 8 threads took
    them from it (measured with ``acb serve`` on 2 cores: a stream beside a 20,000-value enum
    compile went 6.0 s without a chunk with 8 threads, 1.9 s with 1, while the compile alone
    took 4.95 against 5.58 s).

    A request waits at most ``timeout_s`` for its grammar (time queued for a worker
    included), then is refused with ``InvalidRequestError`` naming its field. A compile
    cannot be stopped once started (one call into xgrammar's C++), so a timed-out one runs
    to its end on its worker and its grammar goes into the cache: the work is not thrown
    away, and the same grammar asked again after that is served from the cache.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int], *, cache_size: int = 256,
                 timeout_s: float | None = None, threads: int = 8) -> None:
        self.tokenizer = tokenizer
        self.threads = threads  # xgrammar's threads per compile
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.compiles = 0  # grammars compiled (those that failed to compile included)
        self.hits = 0  # requests served a grammar from the cache or from a compile already running
        self._compiler = None
        self._lock = threading.Lock()  # the cache, the running compiles and the counters
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._running: dict[tuple[str, str], Future] = {}
        self._executor: ThreadPoolExecutor | None = None

    def compiled(self, params: SamplingParams) -> Any:
        """``params``' compiled grammar, waiting for it on this thread (at most ``timeout_s``):
        the sync path (``Engine.submit``, ``stream``). InvalidRequestError names the field whose
        grammar does not compile, or does not compile in time."""
        key, grammar, future = self._lookup(params)
        if grammar is not None:
            return grammar
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._too_slow(key[0]) from None
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=e.param) from None  # one error object per request

    async def compiled_async(self, params: SamplingParams, wait_future: Callable[[Future], Awaitable[Any]]) -> Any:
        """``compiled`` without blocking the event loop: the compile's future is awaited with
        ``wait_future`` (the engine's ``LoopHandle.wait_future``). A cancelled wait leaves the
        compile running into the cache."""
        key, grammar, future = self._lookup(params)
        if grammar is not None:
            return grammar
        try:
            with anyio.fail_after(self.timeout_s):
                return await wait_future(future)
        except TimeoutError:
            raise self._too_slow(key[0]) from None
        except InvalidRequestError as e:
            raise InvalidRequestError(str(e), param=e.param) from None

    def matcher(self, grammar: Any) -> Any:
        """A fresh matcher over a compiled grammar (one per request: it holds its parse state)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(grammar)

    def close(self) -> None:
        """Let the workers go once the compiles running end (they cannot be stopped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def _lookup(self, params: SamplingParams) -> tuple[tuple[str, str], Any, Future | None]:
        """(key, cached grammar or None, the future of its compile when not cached)."""
        key = grammar_source(params)
        if self.tokenizer is None:
            raise InvalidRequestError("structured output needs the engine's tokenizer", param=key[0])
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return key, grammar, None
            future = self._running.get(key)
            if future is not None:
                self.hits += 1
                return key, None, future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="acb-grammar")
            future = self._executor.submit(self._compile, key)
            self._running[key] = future
            return key, None, future

    def _compile(self, key: tuple[str, str]) -> Any:
        """On a grammar worker: compile ``key`` into the cache."""
        field, text = key
        try:
            compiler = self._grammar_compiler()
            try:
                if field == "json_schema":
                    # compact JSON: small models otherwise loop on whitespace the schema allows
                    grammar = compiler.compile_json_schema(text, any_whitespace=False)
                elif field == "regex":
                    grammar = compiler.compile_regex(text)
                else:
                    grammar = compiler.compile_grammar(text)
            except RuntimeError as e:  # xgrammar reports bad schemas and regexes so
                raise InvalidRequestError(f"{field} cannot be compiled: {str(e).strip()}", param=field) from e
            with self._lock:
                if self.cache_size:
                    self._cache[key] = grammar
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
            return grammar
        finally:
            with self._lock:
                self.compiles += 1
                del self._running[key]

    def _grammar_compiler(self) -> Any:
        """xgrammar's compiler over the tokenizer, built on first use (the tokenizer's info
        takes ~0.4-2 s for a 49k vocabulary: on the worker, not on the loop)."""
        with self._lock:
            compiler = self._compiler
        if compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(self.eos_ids) or None)
            # xgrammar's own cache is unbounded by default: ours is the bounded one
            compiler = xgr.GrammarCompiler(info, cache_enabled=False, max_threads=self.threads)
            with self._lock:
                self._compiler = self._compiler or compiler
                compiler = self._compiler
        return compiler

    def _too_slow(self, field: str) -> InvalidRequestError:
        return InvalidRequestError(
            f"{field}: its grammar did not compile within {self.timeout_s:g} s (EngineConfig."
            "grammar_compile_timeout_s); simplify it, or raise the bound", param=field)


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
        """On the mask thread (acb.engine.step_loop), once every earlier step's tokens have been accepted."""
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
