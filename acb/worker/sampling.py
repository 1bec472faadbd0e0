"""Batched per-request sampling: logit processors, greedy, temperature, top-k,
top-p, min-p, seeds, logprobs and top logprobs.

One pass for the whole batch. Random choice uses the exponential-race trick
(``argmax(p / q)`` with ``q ~ Exp(1)``), which samples from ``p`` without a
cumulative sum or a device->host sync. A seeded request draws its noise from a
generator seeded by ``(seed, token index)``, so its tokens do not depend on what
else shares the batch: every processor and warper below works row by row.

The processors run in transformers' order (``logit_bias``, repetition penalty,
then acb's OpenAI-style presence / frequency penalties, a request's own logits processors,
then the structured-output token mask and minimum length); the warpers (temperature, top-k, top-p, min-p)
only for sampled rows. A batch without any control (``SamplingBatch.controls`` is
None) skips all of it: the per-step cost stays that of plain sampling.
"""

from __future__ import annotations

import torch

from ..core.step import Controls, RowProcessors, SamplingBatch, mix_seed  # noqa: F401  (the step's payloads)

MIN_TEMPERATURE = 1e-5


def sample(
    logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None,
    prev_sampled: torch.Tensor | None = None, kernels=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (token ids [B], logprobs of those ids [B] or None). Logprobs are the
    model's (before any processor or warper), as vLLM and OpenAI report them.
    ``prev_sampled`` is the previous step's sampled ids (for in-flight history);
    ``kernels``: acb's CPU kernels for the greedy ids (:func:`greedy`), or None."""
    logits = logits.float()
    raw = logits
    if batch.controls is not None:
        logits = process(logits, batch.controls, prev_sampled)
    ids = greedy(logits, kernels)
    # Below MIN_TEMPERATURE sampling is greedy: logits / 1e-40 overflow float32 to inf/NaN.
    sampled_rows = [i for i, t in enumerate(batch.temperature) if t >= MIN_TEMPERATURE]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        min_p = batch.controls.min_p if batch.controls is not None else None
        sub = warp(logits.index_select(0, rows), [batch.temperature[i] for i in sampled_rows],
                   [batch.top_k[i] for i in sampled_rows], [batch.top_p[i] for i in sampled_rows],
                   [min_p[i] for i in sampled_rows] if min_p is not None else None)
        probs = torch.softmax(sub, dim=-1)
        vocab = sub.shape[1]
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
        logprobs = torch.log_softmax(raw, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    return ids, logprobs


def greedy(logits: torch.Tensor, kernels=None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of float32 ``logits`` [B, V]: the first index of each row's
    largest value (of its first NaN, as PyTorch). With ``kernels`` (acb/kernels/csrc/fused_cpu.cpp's
    module) CPU rows go through its ``argmax_rows``: the same ids, ~1.6 ms -> ~0.2 ms for 48
    rows of a 49,152-token vocabulary on a 2-core host, on a step's critical path."""
    if kernels is not None and logits.device.type == "cpu" and logits.dim() == 2 and logits.stride(-1) == 1 \
            and logits.shape[-1] > 0:
        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def top_alternatives(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row and their logprobs (the model's, like
    ``sample``'s logprobs): (ids [B, k], logprobs [B, k]), most likely first."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return ids, values


def process(logits: torch.Tensor, c: Controls, prev_sampled: torch.Tensor | None = None) -> torch.Tensor:
    """Apply the logit processors of ``c`` to float32 ``logits`` [B, V] (a new tensor)."""
    logits = logits.clone()
    dev = logits.device
    if c.bias:
        rows, toks, values = zip(*c.bias, strict=True)
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)),
                          torch.tensor(values, device=dev), accumulate=True)
    if c.penalized:
        rows = torch.tensor(c.penalized, device=dev)
        logits[rows] = _penalize(logits.index_select(0, rows), c, prev_sampled)
    for own in c.processors:
        _run_own(logits, own, c, prev_sampled)
    if c.token_mask is not None:
        masked = c.token_mask()
        if masked is not None and masked[0]:
            rows = torch.tensor(masked[0], device=dev)
            allowed = unpack_bitmask(masked[1].to(dev), logits.shape[1])
            logits[rows] = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    if c.banned:  # min_new_tokens holds back the stop tokens
        rows, toks = (torch.tensor(v, device=dev) for v in zip(*c.banned, strict=True))
        held = logits[rows, toks]
        logits[rows, toks] = float("-inf")
        if c.token_mask is not None:
            # not where a grammar allows nothing else: it is complete, and any other token would
            # break it (the row sampled token 0); the grammar's end wins over min_new_tokens
            lifted = (logits.index_select(0, rows) == float("-inf")).all(dim=1)
            if bool(lifted.any()):
                logits[rows[lifted], toks[lifted]] = held[lifted]
    return logits


def _run_own(logits: torch.Tensor, own: RowProcessors, c: Controls, prev_sampled: torch.Tensor | None) -> None:
    """A request's own logits processors (``SamplingParams.logits_processors``), in order, on
    its row alone: transformers' call ``processor(input_ids [1, L], scores [1, V])`` on a copy
    of the row, written back only when every one returned a tensor of that shape. One that
    raises or returns anything else is recorded in ``c.failures`` (the engine fails that
    request) and the row keeps acb's own processing; no other row is read or written."""
    dev = logits.device
    ids = own.ids.to(dev)
    if own.carry >= 0 and prev_sampled is not None:  # the in-flight token, still on the device
        ids = torch.cat([ids, prev_sampled[own.carry : own.carry + 1].to(torch.long)])
    ids = ids.unsqueeze(0)
    scores = logits[own.row : own.row + 1].clone()
    for processor in own.processors:
        try:
            out = processor(ids, scores)
            if not isinstance(out, torch.Tensor) or out.shape != scores.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"returned {got}, not scores of shape {tuple(scores.shape)}")
        except Exception as e:
            c.failures.append((own.request_id, processor, e))
            return
        scores = out
    logits[own.row] = scores[0].to(device=dev, dtype=logits.dtype)


def _penalize(scores: torch.Tensor, c: Controls, prev_sampled: torch.Tensor | None) -> torch.Tensor:
    """Repetition penalty over each row's whole history (transformers'
    RepetitionPenaltyLogitsProcessor), then presence and frequency penalties over its
    output tokens (OpenAI's definition, as vLLM applies them), in place on ``scores``.

    Everything is gathered and scattered at the history's positions ([rows, history]),
    never over the vocabulary: a penalised row costs what its history costs."""
    dev = scores.device
    # the in-flight token (sampled by the previous step, on the device) goes after the host-known ones
    carried = [(r, len(h), src) for r, (h, src) in enumerate(zip(c.history, c.carry, strict=True)) if src >= 0] \
        if prev_sampled is not None else []
    lengths = [len(h) for h in c.history]
    for r, _, _ in carried:
        lengths[r] += 1
    width = max(lengths)
    # pad with each row's first token (a repetition rewrites it with the same value; the
    # frequency and presence weights below are 0 there)
    hist = torch.tensor([h + h[:1] * (width - len(h)) for h in c.history], device=dev)
    if carried:
        r, pos, src = (torch.tensor(v, device=dev) for v in zip(*carried, strict=True))
        hist[r, pos] = prev_sampled.index_select(0, src)
    seen = scores.gather(1, hist)
    rep = torch.tensor(c.repetition, device=dev).unsqueeze(1)
    scores.scatter_(1, hist, torch.where(seen < 0, seen * rep, seen / rep))
    positions = torch.arange(width, device=dev).unsqueeze(0)
    output = (positions >= torch.tensor(c.num_prompt, device=dev).unsqueeze(1)) & (
        positions < torch.tensor(lengths, device=dev).unsqueeze(1))
    # each output token once (at the end of its run in the row's sorted output tokens), with its count
    vocab = scores.shape[1]
    tokens, order = torch.where(output, hist, vocab).sort(dim=1, stable=True)
    first = torch.ones_like(output)
    first[:, 1:] = tokens[:, 1:] != tokens[:, :-1]
    first &= tokens < vocab
    run_start = torch.where(first, positions, 0).cummax(dim=1).values
    count = (positions - run_start + 1).float()  # occurrences so far in the run: the run's count at its end
    last = torch.ones_like(output)
    last[:, :-1] = tokens[:, 1:] != tokens[:, :-1]
    last &= tokens < vocab
    frequency = torch.tensor(c.frequency, device=dev).unsqueeze(1)
    presence = torch.tensor(c.presence, device=dev).unsqueeze(1)
    penalty = torch.where(last, frequency * count + presence, 0.0)
    scores.scatter_add_(1, hist.gather(1, order), -penalty)
    return scores


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 bitmask [R, W] -> bool [R, vocab] (tokens past 32 * W are blocked:
    a model's vocabulary may have padding rows no tokenizer id names)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def warp(scores: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
         min_p: list[float] | None = None) -> torch.Tensor:
    """transformers' warpers for sampled rows, in its order: temperature, top-k, top-p, min-p."""
    dev = scores.device
    scores = scores / torch.tensor(temperature, device=dev).unsqueeze(1)
    vocab = scores.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        scores = _filter_top_k_top_p(scores, top_k, top_p)
    if min_p is not None and any(min_p):
        probs = torch.softmax(scores, dim=-1)
        floor = torch.tensor(min_p, device=dev).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < floor, float("-inf"))
    return scores


def _filter_top_k_top_p(scores: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k, then outside the top-p nucleus of what
    is left (transformers applies top-p after top-k), with -inf."""
    vocab = scores.shape[1]
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k], device=scores.device)
    p = torch.tensor(top_p, device=scores.device, dtype=scores.dtype)
    return filter_top_k_top_p(scores, k, p)


def filter_top_k_top_p(scores: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`_filter_top_k_top_p` with the bounds as device tensors (``k`` in 1..vocab):
    no host value, so a CUDA graph can hold it."""
    sorted_scores, _ = scores.sort(dim=-1, descending=True)
    beyond_k = torch.arange(scores.shape[1], device=scores.device).unsqueeze(0) >= k.unsqueeze(1)
    probs = torch.softmax(sorted_scores.masked_fill(beyond_k, float("-inf")), dim=-1)
    # tokens before position j hold (cum - probs[j]); keep j while that is < p
    before = probs.cumsum(dim=-1) - probs
    nucleus = (before < p.unsqueeze(1)).sum(dim=-1).clamp_min(1)
    keep = torch.minimum(k, nucleus)
    threshold = sorted_scores.gather(1, (keep - 1).unsqueeze(1))
    return scores.masked_fill(scores < threshold, float("-inf"))
