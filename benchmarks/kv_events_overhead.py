"""What KV-cache events cost per step: the scheduler and cache manager alone (no model, no
event loop), 256 live decoding requests, with events off and on (one subscriber draining and
replaying every batch), alternating runs, best of each. CPU time, so a busy machine's other
work counts less than in wall time.

    python benchmarks/kv_events_overhead.py                 # 256 live, 16-token pages
    python benchmarks/kv_events_overhead.py --live 1024 --page-size 8

Each request registers a page every ``page_size`` steps, so 256 requests store about
256 / page_size pages a step; a small cache adds evictions (BlockRemoved).
"""

from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from acb.core.kv_cache import KVCacheManager  # noqa: E402
from acb.core.kv_events import AllBlocksCleared, BlockStored, KVEventPublisher  # noqa: E402
from acb.core.scheduler import Scheduler, Sequence  # noqa: E402
from acb.core.step import StepOutput  # noqa: E402


def run(live: int, page_size: int, steps: int, events_on: bool) -> tuple[float, float]:
    """(CPU seconds per step, events per step) over ``steps`` decode steps."""
    publisher = KVEventPublisher(lambda: ()) if events_on else None
    kv = KVCacheManager(live * 10, page_size, events=publisher.pending if publisher else None)
    if publisher:
        publisher.snapshot = kv.registered
    s = Scheduler(kv, max_batch_tokens=live * 8, max_requests=live)
    for i in range(live):
        s.add(Sequence(f"r{i}", [i % 97, i // 97, 3, 4], 1 << 30, arrival=i))
    stream = publisher.subscribe(1 << 20) if publisher else None
    cached: set[int] = set()
    n_events = 0

    def step(token: int) -> None:
        nonlocal n_events
        plan = s.schedule()
        s.update(plan, StepOutput([token] * plan.num_sampled, None))
        if publisher:
            publisher.flush()
            for batch in stream.pending():  # the subscriber's side: replay into a set
                for event in batch.events:
                    n_events += 1
                    if isinstance(event, BlockStored):
                        cached.update(event.block_hashes)
                    elif isinstance(event, AllBlocksCleared):
                        cached.clear()
                    else:
                        cached.difference_update(event.block_hashes)

    for k in range(page_size * 2):  # warm up past the prompts' first pages
        step(k % 50)
    n_events = 0
    t0 = time.process_time()
    for k in range(steps):
        step(k % 50)
    return (time.process_time() - t0) / steps, n_events / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--live", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    best = {False: float("inf"), True: float("inf")}
    rate = 0.0
    for _ in range(args.repeats):
        for on in (False, True):
            per_step, events = run(args.live, args.page_size, args.steps, on)
            best[on] = min(best[on], per_step)
            rate = events if on else rate
    print(f"{args.live} live requests, {args.page_size}-token pages, best of {args.repeats} x {args.steps} steps")
    print(f"events off: {1e3 * best[False]:.3f} ms/step   on: {1e3 * best[True]:.3f} ms/step   "
          f"(+{1e6 * (best[True] - best[False]):.1f} us/step, {rate:.1f} events/step)")


if __name__ == "__main__":
    main()
