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


def build(name: str, path: str | None = None, limit: int | None = None, rate: float = 2.0, seed: int = 0) -> Workload:
    """Workload ``name``; ``seed`` picks the real-text workload's passages (0: the recorded one; others
    cut other windows of the same texts, prompts no run tuned on)."""
    if seed != 0 and name != "realtext":
        raise ValueError(f"seed picks the realtext workload's passages; {name!r} has none to pick")
    if name == "standard":
        return standard(path, limit)
    if name == "prefix":
        return prefix_heavy(path, limit)
    if name == "stream":
        return streaming(path, limit, rate)
    if name == "realtext":
        from transformers import AutoTokenizer

        from acb.model.loading import _converted_gguf, smollm2

        return real_text(AutoTokenizer.from_pretrained(str(_converted_gguf(*smollm2()))), seed=seed, limit=limit)
    raise ValueError(f"unknown workload {name!r}")


# Real English prose for input-grounded prompts: the license texts every Debian system ships
# (the same held-out text benchmarks/quality.py scores perplexity on).
LICENSES = Path("/usr/share/common-licenses")
_GROUNDED_TEXTS = ("Apache-2.0", "GPL-3", "MPL-2.0", "LGPL-2.1", "Artistic", "GFDL-1.3", "CC0-1.0")
_GROUNDED_TASKS = (
    "Quote the passage below exactly, word for word, from its first sentence on.",
    "Summarise the passage below in a few sentences, keeping its own wording where you can.",
    "Rewrite the passage below with every occurrence of \"License\" replaced by \"Agreement\"; change nothing else.",
    "Continue the passage below: repeat its last paragraph, then go on in the same style.",
)


def _passages(words: int, rng: random.Random) -> list[str]:
    """Windows of about ``words`` words from the license texts, each starting at a paragraph."""
    out = []
    for name in _GROUNDED_TEXTS:
        path = LICENSES / name
        if not path.is_file():
            continue
        paragraphs = [" ".join(p.split()) for p in path.read_text(errors="replace").split("\n\n") if p.strip()]
        starts = list(range(len(paragraphs)))
        rng.shuffle(starts)
        for i in starts[:6]:
            text, j = [], i
            while j < len(paragraphs) and sum(len(t.split()) for t in text) < words:
                text.append(paragraphs[j])
                j += 1
            if sum(len(t.split()) for t in text) >= words // 2:
                out.append("\n\n".join(text))
    if not out:
        raise FileNotFoundError(f"no license texts under {LICENSES}: the input-grounded workload needs real text")
    return out


def input_grounded(tokenizer, n: int = 48, words: int = 160, max_new_tokens: int = 128, seed: int = 0) -> Workload:
    """Chat prompts that ask SmolLM2 to quote, summarise, edit or continue a passage of real
    text (a window of one of the license texts in /usr/share/common-licenses) given in the
    prompt: what retrieval-augmented answers, editors and quoting assistants send, and what
    n-gram speculative decoding is for. The four tasks take turns; ``n`` prompts, seeded."""
    rng = random.Random(seed)
    passages = _passages(words, rng)
    rng.shuffle(passages)
    prompts = []
    for i in range(n):
        task = _GROUNDED_TASKS[i % len(_GROUNDED_TASKS)]
        passage = passages[i % len(passages)]
        messages = [{"role": "user", "content": f"{task}\n\n{passage}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return Workload("grounded", prompts, max_new_tokens, seed=seed,
                    notes=f"{n} chat prompts: quote / summarise / edit / continue a ~{words}-word passage of the "
                          f"license texts in {LICENSES}; {max_new_tokens} new tokens, greedy, EOS ends a request")


def real_text(tokenizer, n: int = 48, max_new_tokens: int = 96, seed: int = 0, limit: int | None = None) -> Workload:
    """Plain-text prompts cut from real prose (windows of 60-480 words of the license texts
    in /usr/share/common-licenses, each starting at a paragraph), continued for
    ``max_new_tokens`` tokens: issue 28's second workload (its table: 48 prompts, ~15.8k
    prompt tokens, 96 new tokens each). Longer prompts than the standard workload's, so
    prefill and its attention weigh more. Seeded."""
    rng = random.Random(seed)
    pool = [p for words in (60, 120, 240, 480) for p in _passages(words, rng)]
    rng.shuffle(pool)
    prompts = [list(tokenizer.encode(text, add_special_tokens=False)) for text in pool[:n]]
    prompts = prompts[:limit] if limit else prompts
    return Workload("realtext", prompts, max_new_tokens, seed=seed,
                    notes=f"{len(prompts)} plain-text prompts cut from the license texts in {LICENSES}; "
                          f"{max_new_tokens} new tokens each")
