"""Taking a finished step's sampled tokens into its sequences: the one owner of token appends
(``Intake.update``), speculative verification of rows that carried proposals, and the full
pages each row completed registered for prefix hits. Plain Python."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .page_tables import PageTables
from .sequence import Sequence, current, finish_reason
from .step import StepOutput, StepPlan, StepUpdate


class Intake:
    """``finish(seq)`` (the scheduler's) ends a sequence that met a stop token, EOS or its
    length; ``speculation`` (acb.core.speculative.Speculation, or None) hears each verification."""

    def __init__(self, pages: PageTables, finish: Callable[[Sequence], None]) -> None:
        self.pages = pages
        self.kv = pages.kv
        self._finish = finish
        self.speculation: Any = None
        self.num_generated_tokens = 0  # tokens taken into sequences by update()

    def update(self, plan: StepPlan, out: StepOutput) -> StepUpdate:
        """Each row of ``plan`` still current (not finished or preempted since the plan was
        made) registers the full pages it completed for prefix hits, and each sampled one
        appends its token and ends its sequence on a stop token, EOS or its length."""
        update = StepUpdate()
        kv = self.kv
        inp = plan.input
        register = kv.enable_prefix_caching
        drafts = inp.drafts if plan.num_drafts else None
        j = 0  # the row's first entry in ``out``
        d = 0  # its first proposal among the step's (a draft model's come back in ``out.proposals``)
        for i, seq in enumerate(plan.seqs):
            sample = inp.sample[i]
            first = j
            j += sample + (drafts[i] if drafts else 0)
            if drafts and drafts[i]:
                d += drafts[i]
                if current(seq, plan.epochs[i]):
                    self._verify(plan, i, first, out, update, d - drafts[i])
                continue
            if not current(seq, plan.epochs[i]):
                continue
            if register:
                done = inp.starts[i] + inp.token_offsets[i + 1] - inp.token_offsets[i]
                if done // kv.page_size > seq.num_registered_pages:
                    seq.num_registered_pages, seq.last_page_hash = kv.register_full_pages(
                        seq.block_table, seq.token_at(0, done), seq.num_registered_pages, seq.last_page_hash, done,
                        seq.lora_id)
            if sample:
                token = out.token_ids[first]
                seq.num_inflight -= 1
                seq.output_ids.append(token)
                self.num_generated_tokens += 1
                reason = finish_reason(seq, token)
                update.add(seq, first, reason)
                if reason is not None:
                    self._finish(seq)
                elif len(seq.output_ids) == 1:  # its prompt is computed: its full pages go to disk
                    self.pages.offer_to_disk(seq)
        return update

    def _verify(self, plan: StepPlan, i: int, first: int, out: StepOutput, update: StepUpdate, at: int) -> None:
        """Row ``i`` carried proposals (the step's ``at``-th on): take in those equal to the
        token sampled at their position, and the first sampled token that differs (or the
        one after the last proposal), truncated at a stop token, EOS or the length
        (acb.core.speculative says why this is exact). The pages its rejected proposals were
        written to go back now."""
        inp, seq = plan.input, plan.seqs[i]
        d = inp.drafts[i]
        if out.proposals is not None:  # a draft model's, computed on the device over placeholders
            proposals = out.proposals[at : at + d]
        else:
            proposals = inp.token_ids[inp.token_offsets[i + 1] - d : inp.token_offsets[i + 1]]
        ids = out.token_ids
        accepted = 0
        while accepted < d and ids[first + accepted] == proposals[accepted]:
            accepted += 1
        self.speculation.observe_row(seq.spec, d, accepted)
        seq.num_inflight -= 1
        seq.num_computed = inp.starts[i] + 1 + accepted  # the KV of the rejected ones is garbage
        for t in range(accepted + 1):
            seq.output_ids.append(ids[first + t])
            self.num_generated_tokens += 1
            reason = finish_reason(seq, ids[first + t])
            update.add(seq, first + t, reason)
            if reason is not None:
                self._finish(seq)
                return
        kv = self.kv
        if kv.enable_prefix_caching and seq.num_computed // kv.page_size > seq.num_registered_pages:
            seq.num_registered_pages, seq.last_page_hash = kv.register_full_pages(
                seq.block_table, seq.token_at(0, seq.num_computed), seq.num_registered_pages, seq.last_page_hash,
                seq.num_computed, seq.lora_id)
        self.pages.cut(seq, kv.pages_for(seq.num_computed))

    def truncate(self, seq: Sequence, end: int) -> None:
        """End ``seq`` after its first ``end`` generated tokens: the output side found its
        end (a stop string) inside a run of accepted proposals taken in at once."""
        self._finish(seq)
        self.num_generated_tokens -= max(len(seq.output_ids) - end, 0)
        del seq.output_ids[end:]
