"""Batched per-request sampling: greedy, temperature, top-k, top-p, seeds, logprobs.

One pass for the whole batch. Random choice uses the exponential-race trick
(``argmax(p / q)`` with ``q ~ Exp(1)``), which samples from ``p`` without a
cumulative sum or a device->host sync. A seeded request draws its noise from a
generator seeded by ``(seed, token index)``, so its tokens do not depend on what
else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingBatch:
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int | None]  # per row: None, or the seed mixed with the token index
    want_logprobs: bool

    @classmethod
    def from_rows(cls, rows: list[tuple[float, int, float, int | None, int]], want_logprobs: bool):
        """rows: (temperature, top_k, top_p, seed, token_index)."""
        seeds = [None if s is None else _mix(s, i) for (_, _, _, s, i) in rows]
        return cls([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], seeds, want_logprobs)


def _mix(seed: int, index: int) -> int:
    # splitmix64-style mixing so consecutive token indices give unrelated streams
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def sample(
    logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (token ids [B], logprobs of those ids [B] or None)."""
    logits = logits.float()
    ids = logits.argmax(dim=-1)
    # Below MIN_TEMPERATURE sampling is greedy: logits / 1e-40 overflow float32 to inf/NaN.
    sampled_rows = [i for i, t in enumerate(batch.temperature) if t >= MIN_TEMPERATURE]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        sub = logits.index_select(0, rows)
        temp = torch.tensor([batch.temperature[i] for i in sampled_rows], device=logits.device)
        sub = sub / temp.unsqueeze(1)
        vocab = sub.shape[1]
        top_k = [batch.top_k[i] for i in sampled_rows]
        top_p = [batch.top_p[i] for i in sampled_rows]
        if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sub = _filter_top_k_top_p(sub, top_k, top_p)
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(sampled_rows) if batch.seeds[i] is None]
        if unseeded:
            block = torch.empty(len(unseeded), vocab, device=logits.device)
            block.exponential_(generator=generator)
            noise[unseeded] = block
        for j, i in enumerate(sampled_rows):
            seed = batch.seeds[i]
            if seed is not None:
                g = torch.Generator(device=logits.device).manual_seed(seed)
                noise[j].exponential_(generator=g)
        choice = (probs / noise).argmax(dim=-1)
        ids = ids.index_copy(0, rows, choice)
    logprobs = None
    if batch.want_logprobs:
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    return ids, logprobs


def _filter_top_k_top_p(scores: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf."""
    vocab = scores.shape[1]
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=scores.device)
    p = torch.tensor(top_p, device=scores.device, dtype=scores.dtype)
    return filter_top_k_top_p(scores, k, p)


def filter_top_k_top_p(scores: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`_filter_top_k_top_p` with the bounds as device tensors (``k`` in 1..vocab):
    no host value, so a CUDA graph can hold it."""
    sorted_scores, _ = scores.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    # tokens before position j hold (cum - probs[j]); keep j while that is < p
    before = probs.cumsum(dim=-1) - probs
    nucleus = (before < p.unsqueeze(1)).sum(dim=-1).clamp_min(1)
    keep = torch.minimum(k, nucleus)
    threshold = sorted_scores.gather(1, (keep - 1).unsqueeze(1))
    return scores.masked_fill(scores < threshold, float("-inf"))
