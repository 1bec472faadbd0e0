"""The output side on its own: a real scheduler and hand-made ``StepOutput``s (no model,
no engine loop), as vLLM tests ``update_from_output``. Tokens reach mailboxes as text;
stop strings, stop token ids, EOS and length end requests (their pages released);
rows that went stale (cancelled, preempted) are dropped; the choices of an n > 1
request each get their own tokens; a failed step fails its requests."""

from __future__ import annotations

import anyio
import pytest

from acb.core.errors import RequestFailedError
from acb.core.kv_cache import KVCacheManager
from acb.core.sampling_params import SamplingParams
from acb.core.scheduler import FINISHED, FORKING, RUNNING, WAITING, Scheduler
from acb.core.step import StepOutput, StepPlan
from acb.engine.live import Choices, LiveRequest
from acb.engine.output_processor import Outputs
from acb.engine.request_table import RequestTable
from acb.engine.structured import Grammars
from acb.testing import tiny_tokenizer

EOS = 2
GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, min_p=0.0, do_sample=False)


class Side:
    """A scheduler, the request table and the output side over them, driven one step at a time."""

    def __init__(self, num_pages: int = 64, page_size: int = 4) -> None:
        self.kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=False)
        self.scheduler = Scheduler(self.kv, max_batch_tokens=64, max_requests=8)
        self.tok = tiny_tokenizer()
        vocab = len(self.tok)
        self.table = RequestTable(self.scheduler, Grammars(self.tok, vocab, frozenset({EOS})), tokenizer=self.tok,
                                  defaults=SamplingParams(**GREEDY), generation_defaults={}, vocab_size=vocab,
                                  max_model_len=1024, eos_ids=frozenset({EOS}))
        self.table.event = anyio.Event
        self.out = Outputs(self.table)

    def submit(self, rid: str, prompt: str, **params) -> LiveRequest | Choices:
        """Check and register a request as the engine does (a streamed one: it has a mailbox)."""
        return self.table.register(self.table.prepare(prompt, rid, None, params), stream=True)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def deliver(self, plan: StepPlan, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """The step ``plan`` sampled ``tokens`` (one per sampled row)."""
        assert len(tokens) == plan.num_sampled
        out = StepOutput(tokens, logprobs)
        self.out.deliver(self.scheduler.update(plan, out), out)


def _chunk(req: LiveRequest):
    return req.mailbox.take()


def test_tokens_reach_the_mailbox_as_text_and_length_ends_the_request():
    side = Side()
    req = side.submit("a", "hi", max_new_tokens=3, logprobs=True)
    for i, token in enumerate(side.ids("abc")):
        side.deliver(side.scheduler.schedule(), [token], [-0.5 * i])
        if i == 0:
            chunk = _chunk(req)
            assert (chunk.token_ids, chunk.text, chunk.finish_reason) == ([token], "a", None)
    chunk = _chunk(req)
    assert (chunk.token_ids, chunk.text, chunk.finish_reason, chunk.logprobs) == (side.ids("bc"), "bc", "length",
                                                                                 [-0.5, -1.0])
    done = req.future.result()
    assert done.token_ids == side.ids("abc") and done.text == "abc" and done.finish_reason == "length"
    assert done.logprobs == [0.0, -0.5, -1.0]
    assert req.seq.status is FINISHED and side.kv.num_free == side.kv.num_pages
    assert "a" not in side.table and not side.scheduler.has_work()


@pytest.mark.parametrize(("params", "reason"), [({}, "eos"), ({"stop_token_ids": (EOS,)}, "stop")])
def test_eos_and_stop_token_ids_end_the_request_at_once(params, reason):
    side = Side()
    req = side.submit("a", "hi", max_new_tokens=10, **params)
    side.deliver(side.scheduler.schedule(), side.ids("o"))
    plan, out = side.scheduler.schedule(), StepOutput([EOS], None)
    update = side.scheduler.update(plan, out)
    # the scheduler ends the sequence (its pages back at once); the output side the request
    assert update.finished() == [(req.seq, reason)] and req.seq.status is FINISHED and not req.future.done()
    side.out.deliver(update, out)
    assert req.future.result().finish_reason == reason and req.future.result().token_ids == [*side.ids("o"), EOS]
    assert side.kv.num_free == side.kv.num_pages and not side.scheduler.has_work()


def test_ignore_eos_goes_on_past_eos():
    side = Side()
    req = side.submit("a", "hi", max_new_tokens=2, ignore_eos=True)
    side.deliver(side.scheduler.schedule(), [EOS])
    assert not req.future.done() and req.seq.status is RUNNING
    side.deliver(side.scheduler.schedule(), side.ids("x"))
    assert req.future.result().finish_reason == "length"


def test_a_stop_string_across_tokens_ends_the_request_before_it_and_frees_its_pages():
    side = Side()
    req = side.submit("a", "hi", max_new_tokens=20, stop=("END",))
    for token in side.ids("okEN"):
        side.deliver(side.scheduler.schedule(), [token])
    chunk = _chunk(req)
    assert chunk.text == "ok" and chunk.finish_reason is None  # "EN" held back: it may begin "END"
    side.deliver(side.scheduler.schedule(), side.ids("D"))
    chunk = _chunk(req)
    assert chunk.text == "" and chunk.finish_reason == "stop"
    assert req.future.result().text == "ok" and req.future.result().finish_reason == "stop"
    # the output side handed the finish back: the scheduler released the sequence
    assert req.seq.status is FINISHED and side.kv.num_free == side.kv.num_pages and not side.scheduler.has_work()


def test_rows_of_a_request_cancelled_after_its_step_was_planned_are_dropped():
    side = Side()
    a, b = side.submit("a", "hi", max_new_tokens=5), side.submit("b", "yo", max_new_tokens=5)
    plan = side.scheduler.schedule()
    side.out.finish(b, "cancelled", side.out.flush_text(b))
    side.deliver(plan, side.ids("xy"))
    assert _chunk(a).token_ids == side.ids("x")
    done = b.future.result()
    assert b.seq.output_ids == [] and done.token_ids == [] and done.finish_reason == "cancelled"


def test_a_preempted_requests_late_token_is_dropped_and_sampled_again():
    side = Side(num_pages=3, page_size=4)
    a, b = side.submit("a", "abcd", max_new_tokens=5), side.submit("b", "efgh", max_new_tokens=5)
    first = side.scheduler.schedule()  # both prompts: one page each
    # planned before the first step's tokens are in: a takes the last page, b is preempted
    # and computes its prompt again in the page it gave back (a new epoch)
    second = side.scheduler.schedule()
    assert second.preempted == [b.seq] and b.seq.status is RUNNING and second.seqs == [a.seq, b.seq]
    side.deliver(first, side.ids("xy"))
    assert a.seq.output_ids == side.ids("x") and b.seq.output_ids == []  # b's row was stale
    assert _chunk(a).text == "x" and _chunk(b) is None
    side.deliver(second, side.ids("zw"))
    assert a.seq.output_ids == side.ids("xz") and _chunk(b).token_ids == side.ids("w")


def test_each_choice_of_an_n_request_gets_its_own_tokens_and_the_request_completes_with_all():
    side = Side()
    group = side.submit("r", "hi", max_new_tokens=2, n=2)
    members = group.members
    assert [m.seq.status for m in members] == [WAITING, FORKING] and members[0].seq.forks == [members[1].seq]
    plan = side.scheduler.schedule()
    assert plan.seqs == [m.seq for m in members] and plan.input.counts()[1] == 0  # the fork samples the same logits
    side.deliver(plan, side.ids("ab"))
    side.deliver(side.scheduler.schedule(), side.ids("cd"))
    done = group.future.result()
    assert [c.text for c in done.choices] == ["ac", "bd"] and "r" not in side.table.groups
    assert [m.mailbox.take().token_ids for m in members] == [side.ids("ac"), side.ids("bd")]
    assert side.kv.num_free == side.kv.num_pages


def test_a_failed_step_fails_its_requests_and_frees_their_pages():
    side = Side()
    a = side.submit("a", "hi", max_new_tokens=5)
    side.deliver(side.scheduler.schedule(), side.ids("x"))
    plan = side.scheduler.schedule()
    side.out.step_failed(plan, RuntimeError("boom"))
    assert isinstance(a.future.exception(), RequestFailedError) and "boom" in str(a.future.exception())
    assert a.mailbox.error is a.future.exception() and _chunk(a).text == "x"  # what came before is kept
    assert a.seq.status is FINISHED and side.kv.num_free == side.kv.num_pages and "a" not in side.table
