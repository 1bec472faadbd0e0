"""What a request's own logits processors (``SamplingParams.logits_processors``) cost per token.

    python benchmarks/logits_processors.py            # 64 greedy rows, SmolLM2's vocabulary

Times ``acb.worker.sampling.sample`` on random logits [rows, vocab] as the runner calls it,
the fastest of ``--reps`` calls after warm-up, in CPU time of the calling thread (torch on one
thread), for: no processor anywhere (the plain path), and 1 or 8 of the rows with one
processor each: a no-op callable (``lambda ids, scores: scores``: what acb adds around any
processor: the row's ids as a tensor, a copy of its scores, the call, the shape check, the
write back) and transformers' ``NoBadWordsLogitsProcessor`` with 20 one-token banned words
(the processor's own work on top), over a ``--history``-token prompt + output. Prints the
microseconds each processor row adds per step, i.e. per generated token of its request, and
what the first one in a step adds besides.
(The engine hands the ids over as a tensor it extends by each step's new tokens, a few
microseconds: not in these figures.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from acb.worker import sampling  # noqa: E402


def _batch(rows: int, own: list[int], processor, history: torch.Tensor | None) -> sampling.SamplingBatch:
    controls = None
    if own:
        controls = sampling.Controls([], [], [], [], [], [], [], [], [])
        controls.processors = [sampling.RowProcessors(r, f"r{r}", (processor,), history) for r in own]
    return sampling.SamplingBatch.from_rows([(0.0, 0, 1.0, None, 0)] * rows, False, controls=controls)


def _time(logits: torch.Tensor, batch: sampling.SamplingBatch, reps: int) -> float:
    for _ in range(3):
        sampling.sample(logits, batch)
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        sampling.sample(logits, batch)
        times.append(time.thread_time() - t0)
    return min(times)  # (the machine's other jobs only ever add time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--history", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import NoBadWordsLogitsProcessor

    logits = torch.randn(args.rows, args.vocab)
    processors = {"no-op callable": lambda ids, scores: scores,
                  "NoBadWords (20 words)": NoBadWordsLogitsProcessor([[t] for t in range(100, 120)], eos_token_id=2)}
    plain = _time(logits, _batch(args.rows, [], None, None), args.reps)
    print(f"{args.rows} greedy rows, vocab {args.vocab}: plain sampling {plain * 1e6:.0f} us/step")
    for history in args.history:
        ids = torch.arange(3, 3 + history)
        for name, processor in processors.items():
            one, eight = (_time(logits, _batch(args.rows, list(range(count)), processor, ids), args.reps)
                          for count in (1, 8))
            print(f"  history {history:5d}, {name:22s}: 1 row {one * 1e6:6.0f} us/step, 8 rows {eight * 1e6:6.0f}"
                  f" us/step: {(eight - one) * 1e6 / 7:4.0f} us per processor row, plus {(one - plain) * 1e6:5.0f}"
                  f" us per step the first one costs (the batch's logits copied, as any sampling control does)")


if __name__ == "__main__":
    main()
