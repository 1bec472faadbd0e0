"""One engine step as data: what the scheduler planned (``StepPlan``), what the runner
executes (``StepInput``) and what comes back (``StepOutput``).

Every type is *columnar*: one flat list per field, row ``i`` of a step being index
``i`` of each column (token ids are a flat list cut by offsets; page tables go as deltas
to the runner's block-table store, ``acb.attention.block_tables``). A step with a thousand rows
holds a dozen lists, not a thousand row objects: lists of ints cost CPython's cyclic GC
one object each, however long, and nothing is allocated per row that could live long
enough to reach the GC's old generation (the full collections that followed, each over
every object torch and transformers keep, made the engine's cost per request grow with
the number of requests; see benchmarks/overhead.py).

Plain data only, no torch: how a ``StepInput`` travels to the other ranks of a
tensor-parallel engine (one flat int32 tensor) is ``acb.distributed.protocol``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# The payloads a step carries: sampling settings per sampled row (acb.worker.sampling reads
# them) and the prompt positions to score (acb.core.prompt_logprobs fills them).

@dataclass(slots=True)
class Controls:
    """Per-row logit processors of one step, for the batch rows that use them.

    ``penalized`` rows have a token history (prompt and output ids known on the host;
    ``carry`` >= 0 appends the previous step's sampled id at that index, still on the
    device) and their ``repetition`` / ``presence`` / ``frequency`` penalties.
    ``banned`` and ``bias`` are (row, token[, bias]) triples; ``min_p`` is per batch row.
    ``token_mask``, when set, blocks until the structured-output masks of this step are
    computed (the engine fills them while the forward runs) and returns (rows, packed
    int32 bitmask [len(rows), ceil(vocab / 32)]: bit ``t % 32`` of word ``t // 32``
    allows token ``t``). ``processors``: the rows whose requests bring their own logits
    processors (``SamplingParams.logits_processors``); ``failures`` is where sampling records
    (request id, processor, error) of each one that raised or returned another shape, for the
    engine to fail that request."""

    penalized: list[int]
    history: list[list[int]]
    num_prompt: list[int]
    carry: list[int]
    repetition: list[float]
    presence: list[float]
    frequency: list[float]
    banned: list[tuple[int, int]]
    bias: list[tuple[int, int, float]]
    min_p: list[float] | None = None
    token_mask: Callable[[], tuple[list[int], torch.Tensor] | None] | None = None
    processors: list[RowProcessors] = field(default_factory=list)
    failures: list[tuple[str, Any, BaseException]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class RowProcessors:
    """One sampled row's own logits processors and the ids they read: ``ids`` (the prompt
    and output ids known on the host, an int64 CPU tensor [L]) and, when ``carry`` >= 0, the
    previous step's sampled id at that index (still on the device) after them."""

    row: int
    request_id: str
    processors: tuple[Callable[[Any, Any], Any], ...]
    ids: torch.Tensor
    carry: int = -1


@dataclass(slots=True)
class SamplingBatch:
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int | None]  # per row: None, or the seed mixed with the token index
    want_logprobs: bool
    top_logprobs: int = 0  # alternatives per row (the most any row asks for)
    controls: Controls | None = None

    @classmethod
    def from_rows(cls, rows: list[tuple[float, int, float, int | None, int]], want_logprobs: bool,
                  top_logprobs: int = 0, controls: Controls | None = None) -> SamplingBatch:
        """rows: (temperature, top_k, top_p, seed, token_index)."""
        seeds = [None if s is None else mix_seed(s, i) for (_, _, _, s, i) in rows]
        return cls([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], seeds, want_logprobs,
                   top_logprobs, controls)


def mix_seed(seed: int, index: int) -> int:
    """The seed of token ``index`` of a request seeded with ``seed``."""
    # splitmix64-style mixing so consecutive token indices give unrelated streams
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


@dataclass(slots=True, eq=False)
class PromptLogprobRows:
    """The prompt positions a step scores, columnar (on ``StepInput``; rank 0 of a
    tensor-parallel engine only, the one that keeps logits): row ``rows[j]`` of the step
    scores ``counts[j]`` positions from token ``first[j]`` of the row, whose targets (the
    next prompt token of each position) are the next ``counts[j]`` ids of ``targets``."""

    rows: list[int] = field(default_factory=list)
    first: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    k: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)

    def add(self, row: int, first: int, targets: list[int], k: int) -> None:
        self.rows.append(row)
        self.first.append(first)
        self.counts.append(len(targets))
        self.k.append(k)
        self.targets += targets

    def keep(self, token_offsets: list[int]) -> list[int]:
        """The packed indexes of the scored positions (rows are packed in order, token
        ``t`` of row ``i`` at ``token_offsets[i] + t``)."""
        out: list[int] = []
        for row, first, count in zip(self.rows, self.first, self.counts, strict=True):
            q0 = token_offsets[row] + first
            out.extend(range(q0, q0 + count))
        return out

    def __len__(self) -> int:
        return len(self.targets)


@dataclass(slots=True, eq=False)
class PoolingRows:
    """The prompt positions whose final hidden states a step pools (embeddings,
    ``acb.core.pooling``), columnar, on ``StepInput`` (rank 0 only): entry ``j`` sums the
    hidden states of ``counts[j]`` positions from token ``first[j]`` of row ``rows[j]``."""

    rows: list[int] = field(default_factory=list)
    first: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, row: int, first: int, count: int) -> None:
        self.rows.append(row)
        self.first.append(first)
        self.counts.append(count)

    def keep(self, token_offsets: list[int]) -> list[int]:
        """The packed indexes of the pooled positions, entry after entry."""
        out: list[int] = []
        for row, first, count in zip(self.rows, self.first, self.counts, strict=True):
            q0 = token_offsets[row] + first
            out.extend(range(q0, q0 + count))
        return out

    def entries(self) -> list[int]:
        """The entry of each pooled position, in the order of :meth:`keep`."""
        out: list[int] = []
        for j, count in enumerate(self.counts):
            out += [j] * count
        return out

    def __len__(self) -> int:
        return len(self.rows)


# (logprob per scored position, rank per position, top ids per position, top logprobs per position)
Scores = tuple[list[float], list[int], list[list[int]], list[list[float]]]


@dataclass(slots=True, eq=False)
class PageMoves:
    """Page copies done before a step's forward, columnar: entry ``i`` copies ``src[i]``
    to ``dst[i]``, and on hybrid models the entry's sliding-layer page ``swa[i]`` with it
    (-1: none). Swap-outs copy device pages to host slots, swap-ins host slots to device
    pages, copy-on-write a shared device page to a fresh one."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    swa: list[int] = field(default_factory=list)

    def add(self, src: int, dst: int, swa: int = -1) -> None:
        """Append one entry."""
        self.src.append(src)
        self.dst.append(dst)
        self.swa.append(swa)

    def extend(self, other: PageMoves) -> None:
        """Append every entry of ``other``."""
        self.src += other.src
        self.dst += other.dst
        self.swa += other.swa

    def entries(self) -> list[tuple[int, int, int]]:
        """(src, dst, swa) per entry (for tests and logs; the runner reads the columns)."""
        return list(zip(self.src, self.dst, self.swa, strict=True))

    def __len__(self) -> int:
        return len(self.src)


@dataclass(slots=True, eq=False)
class StepInput:
    """What the runner executes: one entry per row in each column. Row ``i`` computes
    the tokens ``token_ids[token_offsets[i]:token_offsets[i + 1]]`` at positions from
    ``starts[i]``; its page table is row ``table_rows[i]`` of the runner's block-table
    store (``acb.attention.block_tables``), read as far as those positions reach. The store is
    kept current by deltas: entry ``k`` of the ``delta_`` columns sets column
    ``delta_cols[k]`` of store row ``delta_rows[k]`` to page ``delta_pages[k]`` (and, on
    hybrid models, the sliding pool's table to ``delta_swa[k]``), applied before the
    step's rows are read. The scheduler sends only what changed since a sequence's table
    was last sent (``Sequence.num_sent_pages``). ``carry_from[i]`` >= 0:
    the row's last token is a placeholder for the previous step's sampled id at that
    index (still on the device). ``sample[i]``: the row's last position is sampled
    (a row of no tokens samples from the row before it: a forked choice). ``drafts[i]``:
    the row's last ``drafts[i]`` tokens are speculative proposals (acb.core.speculative), and
    it samples at each of its last ``drafts[i] + 1`` positions (that many sampled entries,
    in order). ``prompt_singles``: the rows of one token that compute a prompt token (a
    prompt cut so that a chunk holds one token, or what a prefix hit leaves of it); they run
    as prefill rows, as that token would in a longer chunk, so a prompt's logits are the
    same bits however it was chunked (any other row of one token is a decode row). Safe to
    hand to another thread: nothing here is mutated once the step is launched."""

    starts: list[int] = field(default_factory=list)
    carry_from: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # empty: no row carries proposals (a tensor-parallel rank)
    token_ids: list[int] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=lambda: [0])
    table_rows: list[int] = field(default_factory=list)
    delta_rows: list[int] = field(default_factory=list)
    delta_cols: list[int] = field(default_factory=list)
    delta_pages: list[int] = field(default_factory=list)
    delta_swa: list[int] = field(default_factory=list)  # hybrid models only (else empty)
    sampling: SamplingBatch | None = None  # one entry per sampled row, in row order
    # before the forward, in this order: swap-outs, swap-ins, copy-on-write (hybrid models:
    # ``copy_swa_pages`` copies the sliding layers' pages within their own pool)
    swap_out: PageMoves = field(default_factory=PageMoves)
    swap_in: PageMoves = field(default_factory=PageMoves)
    copy_pages: PageMoves = field(default_factory=PageMoves)
    copy_swa_pages: PageMoves = field(default_factory=PageMoves)
    plain: bool = False  # run the model's own forward (no fused forward, compiled forward or graph)
    # the prompt positions whose logits are kept and scored too (prompt_logprobs; not in the
    # tensor-parallel message: only rank 0 keeps logits)
    prompt_logprobs: PromptLogprobRows | None = None
    # the prompt positions whose final hidden states are pooled (embeddings; rank 0 only, as above)
    pooling: PoolingRows | None = None
    refresh: bool = False  # the weights changed: rebuild the fast paths first (ModelRunner.check_model)
    # per row, the LoRA adapter slot it runs with (-1: the base model; acb.model.lora); not in the
    # tensor-parallel message: adapters are refused with tensor_parallel_size > 1
    adapters: list[int] = field(default_factory=list)
    prompt_singles: list[int] = field(default_factory=list)  # rows, ascending (usually none)
    # the prefix cache's disk tier (acb.core.kv_disk): pages whose KV is loaded from these checked
    # file payloads before the forward (after the swap-ins); not in the tensor-parallel message
    disk_pages: list[int] = field(default_factory=list)
    disk_payloads: list[Any] = field(default_factory=list)

    def add_row(self, tokens: Sequence[int], start: int, pages: Sequence[int], carry_from: int = -1,
                sample: bool = True, swa_pages: Sequence[int] = (), adapter: int = -1,
                table_row: int | None = None, drafts: int = 0, prompt: bool = False) -> None:
        """Append one row with its whole page table ``pages`` (and ``swa_pages``), sent as
        deltas to store row ``table_row`` (default: the row's index): for steps made by
        hand (tests, benchmarks); the scheduler sends only what changed (:meth:`send_table`).
        ``tokens``' last id is a placeholder when ``carry_from`` >= 0; ``adapter``: its LoRA
        slot, -1 for none; its last ``drafts`` ids are proposals to verify; ``prompt``: its
        tokens are a prompt's (a row of one runs as a prefill row: ``prompt_singles``)."""
        row = len(self.starts) if table_row is None else table_row
        self.send_table(row, 0, pages, swa_pages if swa_pages else None)
        self.add_table_row(tokens, start, row, carry_from, sample, adapter, drafts, prompt)

    def add_table_row(self, tokens: Sequence[int], start: int, table_row: int, carry_from: int = -1,
                      sample: bool = True, adapter: int = -1, drafts: int = 0, prompt: bool = False) -> None:
        """Append one row whose page table is store row ``table_row`` as it stands (its last
        ``drafts`` ids are proposals to verify; ``prompt``: its tokens are a prompt's)."""
        if prompt and len(tokens) == 1:
            self.prompt_singles.append(len(self.starts))
        self.starts.append(start)
        self.carry_from.append(carry_from)
        self.sample.append(sample)
        self.drafts.append(drafts)
        self.token_ids += tokens
        self.token_offsets.append(len(self.token_ids))
        self.table_rows.append(table_row)
        self.adapters.append(adapter)

    def send_table(self, row: int, first: int, pages: Sequence[int], swa_pages: Sequence[int] | None = None) -> None:
        """Deltas setting store row ``row`` from column ``first`` on to ``pages`` (and the
        sliding pool's to ``swa_pages``, as long, on hybrid models)."""
        n = len(pages)
        self.delta_rows += [row] * n
        self.delta_cols += range(first, first + n)
        self.delta_pages += pages
        if swa_pages is not None:
            self.delta_swa += swa_pages

    @property
    def num_rows(self) -> int:
        return len(self.starts)

    def counts(self) -> list[int]:
        """Tokens per row."""
        o = self.token_offsets
        return [o[i + 1] - o[i] for i in range(len(o) - 1)]

    def row_tokens(self, i: int) -> list[int]:
        return self.token_ids[self.token_offsets[i] : self.token_offsets[i + 1]]

    def tables(self) -> dict[int, tuple[dict[int, int], dict[int, int]]]:
        """The deltas per store row: {row: ({column: page}, {column: sliding page})} (for
        tests and logs; the runner applies the columns)."""
        out: dict[int, tuple[dict[int, int], dict[int, int]]] = {}
        swa = self.delta_swa
        for k, (row, col, page) in enumerate(zip(self.delta_rows, self.delta_cols, self.delta_pages, strict=True)):
            full, sliding = out.setdefault(row, ({}, {}))
            full[col] = page
            if swa:
                sliding[col] = swa[k]
        return out


@dataclass(slots=True, eq=False)
class StepPlan:
    """The scheduler's decision for one step: the runner's columns (``input``) plus, per
    row, the sequence it belongs to and that sequence's epoch when planned (a row of an
    older epoch than its sequence's is stale: preempted since). ``preempted``: the
    sequences this plan preempted; ``offloaded``: those whose swap-outs it carries;
    ``admitted``: those it took out of the waiting queue (choices forked from one included)."""

    index: int = 0
    seqs: list[Any] = field(default_factory=list)  # acb.core.scheduler.Sequence per row
    epochs: list[int] = field(default_factory=list)
    input: StepInput = field(default_factory=StepInput)
    preempted: list[Any] = field(default_factory=list)
    offloaded: list[Any] = field(default_factory=list)
    admitted: list[Any] = field(default_factory=list)  # sequences taken out of the queue by this plan
    num_sampled: int = 0  # sampled entries: one per sampled row, one more per proposal (StepOutput's length)
    num_drafts: int = 0  # proposals the plan's rows carry (0: no row speculates)
    # prompt_logprobs: per row that scores prompt positions, its request's sink and first position
    # (acb.core.prompt_logprobs.PromptSink, its row): the requests' sinks, engine-side state
    prompt_sinks: list[tuple[Any, int]] = field(default_factory=list)
    # embeddings: per StepInput.pooling entry, its live request (whose pool_sink takes the entry)
    pooled_requests: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the whole step."""
        return len(self.input.token_ids)

    def rows(self) -> Iterator[tuple[Any, int, int, bool, int]]:
        """(sequence, start, tokens, sampled, epoch) per row, for readers that want rows."""
        inp = self.input
        return zip(self.seqs, inp.starts, inp.counts(), inp.sample, self.epochs, strict=True)


@dataclass(slots=True)
class StepOutput:
    """What a step returns, one entry per sampled row in row order (a row carrying ``d``
    proposals has ``d + 1`` entries: the token sampled at each of its positions)."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None = None  # per sampled row: the k most likely tokens
    top_logprobs: list[list[float]] | None = None  # and their logprobs
    prompt_logprobs: Scores | None = None  # the scored prompt positions (StepInput.prompt_logprobs)
    # per StepInput.pooling entry, the sum of its positions' final hidden states: a float32 CPU tensor
    # [entries, hidden]
    pooled: Any = None
    # seconds the step computed: on CPU the worker thread's time in the step; on CUDA the
    # device's, between events around its work on the runner's stream (a step that samples
    # nothing is reported with the next one that does: its events complete no sooner)
    device_s: float = 0.0
    # a draft model's proposals (acb.worker.draft), in row order: what the rows' placeholders were
    # verified as; and its chain's decode steps and their time (CPU; 0 on CUDA: in device_s)
    proposals: list[int] | None = None
    draft_steps: int = 0
    draft_s: float = 0.0


@dataclass(slots=True, eq=False)
class StepUpdate:
    """What a finished step did to its sequences, as ``Scheduler.update`` reports it to
    the output side: one entry per sampled token taken into its sequence (rows that were
    stale by then are left out), in row order: the sequence, the index of the token in
    the ``StepOutput``, and why the sequence finished with it (``"stop"``: a stop token,
    ``"eos"``, ``"length"``; None: it goes on). A finished sequence's pages are already
    released."""

    seqs: list[Any] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    # the sequence's generated tokens up to and including this one (a row that verified
    # proposals takes in several tokens at once: the output side reads them one by one)
    ends: list[int] = field(default_factory=list)

    def add(self, seq: Any, sample: int, reason: str | None) -> None:
        self.seqs.append(seq)
        self.samples.append(sample)
        self.reasons.append(reason)
        self.ends.append(len(seq.output_ids))

    def finished(self) -> list[tuple[Any, str]]:
        """(sequence, reason) of each sequence this step finished."""
        return [(s, r) for s, r in zip(self.seqs, self.reasons, strict=True) if r is not None]

    def __len__(self) -> int:
        return len(self.seqs)
