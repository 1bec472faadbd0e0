"""Benchmark workloads: token ids for SmolLM2, reproducible from a seed."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

STANDARD = Path(__file__).resolve().parents[1].parent / "shared" / "bench" / "standard-workload.json"


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    arrival_rate: float | None = None  # requests/s (Poisson) for streaming; None = all at once
    seed: int = 0
    notes: str = ""
    peers: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def arrivals(self) -> list[float]:
        """Seconds after the start at which each request arrives."""
        if not self.arrival_rate:
            return [0.0] * len(self.prompts)
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for _ in self.prompts:
            out.append(t)
            t += rng.expovariate(self.arrival_rate)
        return out


def _standard_file(path: str | None) -> Path:
    p = Path(path) if path else STANDARD
    if not p.is_file():
        raise FileNotFoundError(f"standard workload not found at {p} (pass --workload-file)")
    return p


def standard(path: str | None = None, limit: int | None = None) -> Workload:
    data = json.loads(_standard_file(path).read_text())
    prompts = data["prompts"][:limit] if limit else data["prompts"]
    return Workload("standard", prompts, data["max_new_tokens"], notes=data.get("description", ""))


def prefix_heavy(path: str | None = None, limit: int | None = None, prefix_len: int = 400) -> Workload:
    """The standard prompts' last user turns behind one shared 400-token system prompt."""
    data = json.loads(_standard_file(path).read_text())
    prompts = data["prompts"][:limit] if limit else data["prompts"]
    longest = max(data["prompts"], key=len)
    pool = [t for p in data["prompts"] for t in p[1:]]
    shared = (longest + pool)[:prefix_len]
    out = [shared + p[-min(len(p), 16 + (i * 37) % 96):] for i, p in enumerate(prompts)]
    return Workload("prefix", out, data["max_new_tokens"], notes=f"shared {prefix_len}-token prefix")


def streaming(path: str | None = None, limit: int | None = None, rate: float = 2.0, seed: int = 0) -> Workload:
    w = standard(path, limit)
    return Workload("stream", w.prompts, w.max_new_tokens, arrival_rate=rate, seed=seed,
                    notes=f"Poisson arrivals at {rate} req/s, every consumer streams")


def build(name: str, path: str | None = None, limit: int | None = None, rate: float = 2.0) -> Workload:
    if name == "standard":
        return standard(path, limit)
    if name == "prefix":
        return prefix_heavy(path, limit)
    if name == "stream":
        return streaming(path, limit, rate)
    raise ValueError(f"unknown workload {name!r}")
