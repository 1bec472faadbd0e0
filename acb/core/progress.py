"""Progress for long work: a tqdm bar over a batch of requests, and the one-line
throughput summary a server logs at an interval.

Example::

    results = await engine.generate_batch(prompts, max_new_tokens=64, progress=True)
    # generate_batch: 100%|██████████| 1000/1000 [00:41<00:00, 24.1req/s, 1542.3 tok/s]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import IO, Any, TypeVar

import anyio
from tqdm.auto import tqdm

from .outputs import Completion, EngineStats

log = logging.getLogger("acb")
T = TypeVar("T")


class BatchProgress:
    """A tqdm bar over a batch of requests: requests done out of the total, and the
    generated tokens per second since the bar started.

    Example::

        with BatchProgress(len(prompts)) as bar:
            results = await asyncio.gather(*(bar.track(engine.generate(p)) for p in prompts))
    """

    def __init__(self, total: int, *, desc: str = "generate_batch", file: IO[str] | None = None,
                 disable: bool = False) -> None:
        self.bar = tqdm(total=total, desc=desc, unit="req", file=file, disable=disable, dynamic_ncols=True)
        self.tokens = 0
        self.start = time.perf_counter()

    def done(self, completion: Completion) -> None:
        """Count one finished request and its generated tokens."""
        self.add(len(completion.token_ids))

    def add(self, tokens: int) -> None:
        """Count one finished request that generated ``tokens`` tokens."""
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:.1f} tok/s", refresh=False)
        self.bar.update(1)

    async def track(self, completion: Awaitable[Completion]) -> Completion:
        """Await one request's ``Completion`` and count it when it arrives."""
        result = await completion
        self.done(result)
        return result

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> BatchProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_progress(progress: Any) -> bool:
    """``progress`` as given to ``generate_batch``: a bool, or ``InvalidRequestError`` naming it."""
    from .errors import InvalidRequestError

    if not isinstance(progress, bool):
        raise InvalidRequestError(f"progress must be a bool, got {progress!r}", param="progress")
    return progress


async def gather_batch(requests: list[Any], event: Callable[[], Any], progress: bool,
                       cancel: Callable[[str], Any]) -> list[Completion]:
    """The completions of a registered batch (each with ``future`` and ``request_id``), in
    its order, with a bar when ``progress``. The first failure raises at once; a failure or
    cancellation of the wait cancels every request of the batch."""
    bar = BatchProgress(len(requests), disable=not progress)
    settled = event()
    left = [len(requests)]

    def on_done(outcome: Any) -> None:
        left[0] -= 1
        if outcome.exception() is None:
            if progress:
                bar.done(outcome.result())
        else:
            settled.set()  # one failed: raise it now
        if left[0] == 0:
            settled.set()

    try:
        for r in requests:
            r.future.add_done_callback(on_done)
        await settled.wait()
        for r in requests:  # the failure that woke us, wherever it stands in the batch
            if r.future.done() and r.future.exception() is not None:
                r.future.result()
        return [r.future.result() for r in requests]
    except BaseException:
        for r in requests:
            cancel(r.request_id)
        raise
    finally:
        bar.close()


class ThroughputSummary:
    """One line about the engine's recent work, built from two ``engine.stats()`` snapshots:
    generated tokens and steps per second since the previous line, the queue, and the KV cache.

    Example::

        summary = ThroughputSummary(engine.stats)
        ...
        log.info(summary.line())  # "throughput: 152.3 tok/s, 11.9 steps/s; running 12, waiting 3; ..."
    """

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats
        self.last = stats()
        self.last_time = time.monotonic()

    def line(self) -> str | None:
        """The summary since the previous call, or None when the engine was idle throughout."""
        now, s = time.monotonic(), self.stats()
        prev, elapsed = self.last, max(now - self.last_time, 1e-9)
        self.last, self.last_time = s, now
        if s.steps == prev.steps and not s.running and not s.waiting:
            return None
        used = 1 - s.free_blocks / s.total_blocks if s.total_blocks else 0.0
        return (f"throughput: {(s.generated_tokens - prev.generated_tokens) / elapsed:.1f} tok/s, "
                f"{(s.steps - prev.steps) / elapsed:.1f} steps/s; running {s.running}, waiting {s.waiting}; "
                f"KV cache {used:.0%} used, prefix hit rate {s.prefix_hit_rate:.0%}; "
                f"preemptions {s.preemptions - prev.preemptions}")


async def log_throughput(stats: Callable[[], EngineStats], interval: float,
                         logger: logging.Logger = log) -> None:
    """Log a ``ThroughputSummary`` line every ``interval`` seconds (idle periods stay
    quiet) until cancelled."""
    if interval <= 0:
        raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
    summary = ThroughputSummary(stats)
    while True:
        await anyio.sleep(interval)
        if (line := summary.line()) is not None:
            logger.info(line)
