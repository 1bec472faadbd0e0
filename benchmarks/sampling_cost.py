"""Per-step cost of the sampling pass, with and without sampling controls.

    python benchmarks/sampling_cost.py                       # 64, 256 and 1024 rows, SmolLM2's vocabulary
    python benchmarks/sampling_cost.py --baseline d5ea2bb,HEAD   # also the sampler at other revisions

Times ``acb.worker.sampling.sample`` on random logits [rows, vocab] the way the runner calls
it (the ``SamplingBatch`` built from per-row tuples, ``Controls`` built from per-row
lists as ``Outputs`` builds them), median of ``--reps`` calls after warm-up, in CPU
time of the calling thread (torch runs on that one thread, ``--threads 1``), so a
machine shared with other jobs slows the figures less than wall time would:

- ``greedy`` / ``sampled``: no row uses a control (``controls`` is None: the plain path);
- ``+controls 10%`` / ``+controls all``: that share of rows sets repetition, presence and
  frequency penalties over a ``--history``-token history, two ``logit_bias`` entries,
  ``min_new_tokens`` (one banned id) and, when sampled, ``min_p``.

With ``--baseline REV[,REV...]`` the same cases also run through ``acb/worker/sampling.py`` as
it was at each git revision (loaded from ``git show``; the cases with controls only
where that revision has them), in the same process and interleaved, so machine load
affects every version alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from acb.worker import sampling  # noqa: E402


def _load_revision(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:acb/worker/sampling.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / f"sampling_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"sampling_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _controls(module, rows: list[int], histories: list[list[int]], num_rows: int, sampled: bool):
    """What ``Outputs._controls`` builds for ``rows`` (each with every control on)."""
    c = module.Controls([], [], [], [], [], [], [], [], [])
    for row in rows:
        c.penalized.append(row)
        c.history.append(list(histories[row]))
        c.num_prompt.append(len(histories[row]) // 2)
        c.carry.append(-1)
        c.repetition.append(1.1)
        c.presence.append(0.5)
        c.frequency.append(0.3)
        c.bias.extend(((row, 11, 2.0), (row, 12, -1.5)))
        c.banned.append((row, 2))
    if sampled:
        min_p = [0.0] * num_rows
        for row in rows:
            min_p[row] = 0.05
        c.min_p = min_p
    return c


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def measure(module, rows: int, vocab: int, history: int, share: float, sampled: bool, reps: int,
            generator: torch.Generator) -> float | None:
    """Median seconds of one sampling pass (batch and controls built inside it)."""
    logits = torch.randn(rows, vocab, generator=generator) * 3
    temperature = 1.0 if sampled else 0.0
    per_row = [(temperature, 0, 1.0, None, 0)] * rows
    controlled = list(range(0, rows, round(1 / share))) if share else []
    histories = [torch.randint(0, vocab, (history,), generator=generator).tolist() for _ in range(rows)]

    has_controls = hasattr(module, "Controls")
    if controlled and not has_controls:
        return None

    def step() -> None:
        if has_controls:
            controls = _controls(module, controlled, histories, rows, sampled) if controlled else None
            batch = module.SamplingBatch.from_rows(per_row, False, 0, controls)
        else:
            batch = module.SamplingBatch.from_rows(per_row, False)
        module.sample(logits, batch, generator)

    return _time(step, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64,256,1024")
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    p.add_argument("--history", type=int, default=256, help="tokens of prompt plus output per penalised row")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default="greedy,sampled", help="which of greedy, sampled to run")
    p.add_argument("--baseline", default=None,
                   help="git revisions (comma-separated) whose acb/worker/sampling.py to time too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    versions = [(f" @{rev}", _load_revision(rev)) for rev in args.baseline.split(",")] if args.baseline else []
    versions.append(("", sampling))
    g = torch.Generator().manual_seed(0)
    cases = [("greedy", False, 0.0), ("greedy +controls 10%", False, 0.1), ("greedy +controls all", False, 1.0),
             ("sampled", True, 0.0), ("sampled +controls 10%", True, 0.1), ("sampled +controls all", True, 1.0)]
    print(f"vocab {args.vocab}, history {args.history} tokens, {args.threads} thread(s), median of {args.reps}; "
          "CPU ms of the calling thread")
    head = f"{'case':<32}" + "".join(f"{r:>10}" for r in args.rows.split(","))
    print(head + "\n" + "-" * len(head))
    rows = [int(r) for r in args.rows.split(",")]
    for name, sampled, share in cases:
        if name.split()[0] not in args.cases.split(","):
            continue
        # interleaved: each row count, every version, before the next row count
        times = {tag: [] for tag, _ in versions}
        for r in rows:
            for tag, module in versions:
                times[tag].append(measure(module, r, args.vocab, args.history, share, sampled, args.reps, g))
        for tag, seconds in times.items():
            if None not in seconds:
                print(f"{name + tag:<32}" + "".join(f"{1e3 * t:>10.2f}" for t in seconds), flush=True)


if __name__ == "__main__":
    main()
