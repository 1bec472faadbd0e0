"""The engine's step loop: one event-loop task that plans, launches, awaits, updates
and delivers steps, overlapping the planning of step N+1 with step N's compute::

    plan N+1  ->  launch N+1  ->  await N  ->  update + deliver N  ->  fill N+1's masks  ->  repeat

A token sampled at step N reaches step N+1's input on the device (carry-over), not
through the host. Every mutation of requests, scheduler and cache happens on the
event loop's thread between awaits, so a cancel never races a step's bookkeeping.
Steps run on one worker thread (never on the event loop); a step queued on a CUDA
stream is polled, not waited on.

The one hook: a structured-output step's token masks need every earlier token taken
into its rows' grammars, so they are filled after the step before it is delivered,
while the new step's forward runs, on a thread of their own (the worker waits for them
only at sampling, and that step's tokens reach the grammars only after it).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anyio

from ..core.errors import DeviceError, RequestFailedError, as_device_error, caused
from ..core.eventloop import LoopHandle
from ..core.kv_events import KVEventPublisher
from ..core.lifecycle import EngineState, Lifecycle
from ..core.outputs import EngineStats
from ..core.pooling import plan_pooling
from ..core.prompt_logprobs import plan_rows
from ..core.step import StepOutput, StepPlan
from ..worker.runner import ModelRunner, PendingOutput
from .assembly import release_runner
from .live import sampling_batch
from .output_processor import Outputs
from .request_table import RequestTable

log = logging.getLogger("acb")

_POLL_INTERVAL = 0.0002  # s between polls of a step queued on the device
# With requests queued or running, no step in flight and nothing the scheduler will plan, only a
# new request or a cancel changes anything: a scheduler fault. After this long the loop fails
# the stuck requests by name (they would never end) instead of spinning on them for good.
STALL_S = 2.0


@dataclasses.dataclass(slots=True)
class Launched:
    """A step handed to the worker: its plan, the worker's future, its token masks."""

    plan: StepPlan
    future: Future
    masks: Any = None  # acb.engine.structured.TokenMasks, to fill before the worker samples
    filler: Any = None  # the one-thread executor that fills masks, off the event loop

    def fill_masks(self) -> None:
        """Fill the step's masks on the mask thread (a 49k vocabulary inside a large enum
        takes ~30 ms a row: never on the loop). The worker waits for them when it samples;
        the step's tokens, and so the next fill's inputs, are taken in only after that."""
        if self.masks is not None:
            self.filler.submit(self.masks.fill)
            self.masks = None


class StepLoop:
    """Runs the steps of one engine while its lifecycle is running, draining or halting."""

    def __init__(self, table: RequestTable, outputs: Outputs, lifecycle: Lifecycle, *, vocab_size: int,
                 kv_events: KVEventPublisher | None, async_batching: bool, debug_checks: bool,
                 watch_model: bool) -> None:
        self.table = table
        self.scheduler = table.scheduler
        self.outputs = outputs
        self.life = lifecycle
        self.vocab_size = vocab_size
        self.kv_events = kv_events
        self.async_batching = async_batching
        self.debug_checks = debug_checks
        self.watch_model = watch_model  # False with tensor parallelism: the ranks run copies made at start
        self.steps = 0
        self.device_s = 0.0  # the steps' StepOutput.device_s, summed
        self.hooked: str | None = None  # why the model's own forward runs, as of the last step
        self.runner: ModelRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._filler: ThreadPoolExecutor | None = None  # fills structured-output masks (made on first use)
        self._last_launched: Launched | None = None  # the step submitted last to the step thread
        self._tables_check: Future | None = None  # a block-table check queued behind steps in flight
        self._loop: LoopHandle | None = None
        self._omp_reset = None
        self._wakeup: anyio.Event | None = None
        self.finished: anyio.Event | None = None  # set when the loop task has ended
        self.task: Any = None  # the asyncio task (trio: None, a system task); kept referenced

    def start(self, runner: ModelRunner, loop: LoopHandle, cpu: bool) -> None:
        """Spawn the loop task on ``loop``, stepping ``runner`` on the step thread."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acb-step")
        self.runner, self._loop = runner, loop
        if cpu:
            from ..kernels.cpu import release_calling_thread_omp_pool

            self._omp_reset = release_calling_thread_omp_pool
        self._wakeup = loop.Event()
        self.finished = loop.Event()
        self.task = loop.spawn(self._run, "acb-engine")

    def close(self, cpu: bool) -> None:
        """Release the runner (its cache and packed weights) and the step thread."""
        disk = self.scheduler.kv.disk
        if self.runner is not None:
            if disk is not None:
                self.copy_out_for_disk(wait=True)
                disk.close()  # the writes queued are finished: a later process finds them
            release_runner(self.runner, cpu)
            self.runner = None
        for pool in (self._executor, self._filler):
            if pool is not None:
                pool.shutdown(wait=True)
        self._executor = self._filler = None

    async def reload_weights(self) -> None:
        """Repack every weight and rebuild the fast paths on the step thread (after the
        step in flight), and forget the prefix cache."""
        if self.runner is None:
            return  # nothing packed yet: start() takes the weights as they are
        self.copy_out_for_disk()
        await self._loop.wait_future(self._executor.submit(self.runner.refresh_weights, True))
        self.scheduler.kv.forget_prefixes()
        if self.scheduler.kv.disk is not None:
            self.scheduler.kv.disk.disable("the weights were reloaded")
        if self.kv_events is not None:
            self.kv_events.flush()

    async def between_steps(self, fn) -> None:
        """Run ``fn`` on the step thread after the step in flight (at once before the loop
        ever started: no step runs)."""
        if self._executor is None:
            fn()
        else:
            await self._loop.wait_future(self._executor.submit(fn))

    def wake(self) -> None:
        """Something to do (a request, a stop): the idle loop goes on."""
        if self._wakeup is not None:
            self._wakeup.set()

    async def _run(self) -> None:
        inflight: Launched | None = None
        cancelled = anyio.get_cancelled_exc_class()
        stalled_since: float | None = None
        try:
            while not self.life.halting:
                if self.table.deadlines:
                    self.outputs.expire(time.monotonic())
                if inflight is not None and self._wait_before_plan(inflight):
                    inflight, waited = None, inflight
                    await self._complete(waited)
                launched = self._launch() if self.scheduler.has_work() else None
                planned = launched is not None  # (without async batching it is done by the time of the check below)
                if launched is not None and not self.async_batching:
                    launched.fill_masks()
                    await self._complete(launched)
                    launched = None
                if inflight is not None:
                    try:
                        await self._complete(inflight)
                    finally:
                        if launched is not None:
                            launched.fill_masks()  # needs the tokens just delivered
                elif launched is not None:
                    launched.fill_masks()
                inflight = launched
                if self.kv_events is not None:
                    self.kv_events.flush()  # this iteration's: what schedule() evicted, update() stored
                if planned or inflight is not None:
                    stalled_since = None
                    await anyio.sleep(0)  # let consumers and submitters run
                elif self.scheduler.has_work():  # nothing planned, nothing in flight (see STALL_S)
                    now = time.monotonic()
                    disk = self.scheduler.kv.disk
                    stalled_since = None if disk is not None and disk.busy() else stalled_since or now
                    if stalled_since is not None and now - stalled_since >= STALL_S:
                        self._fail_stalled(now - stalled_since)
                        stalled_since = None
                    await anyio.sleep(0.001)
                elif not await self._idle():
                    break
        except BaseException as e:
            if not isinstance(e, cancelled):
                log.exception("acb engine loop crashed")
            error = caused(RequestFailedError(f"the engine loop failed: {e!r}"), e)
            self.outputs.fail_all(lambda req: error)
            self.life.move(EngineState.STOPPED)
            if isinstance(e, cancelled):
                raise
        finally:
            await self._wind_down(inflight)

    def _fail_stalled(self, seconds: float) -> None:
        """Fail the requests the scheduler has planned nothing for in ``seconds`` (see
        ``STALL_S``), naming it; the engine goes on serving new ones."""
        stuck = [*self.scheduler.running, *self.scheduler.waiting, *self.scheduler.queues.prefill_only]
        log.error("acb: the scheduler planned no step for %.1f s with %d requests live and none in flight "
                  "(id, status, computed, tokens, pages: %s): failing them (a bug in acb, please report it)",
                  seconds, len(stuck), [(seq.seq_id, seq.status.name, seq.num_computed, seq.num_tokens,
                                         len(seq.block_table)) for seq in stuck[:8]])
        stuck_ids = {seq.seq_id for seq in stuck}
        for req in [r for r in self.table.live.values() if r.seq.seq_id in stuck_ids]:
            if req.request_id in self.table.live:  # not failed with another choice of its request
                self.outputs.fail(req, RequestFailedError(
                    f"request {req.request_id}: acb planned no step for it in {seconds:.1f} s (a scheduler fault, "
                    f"logged; the engine goes on serving)", req.request_id))

    def _wait_before_plan(self, inflight: Launched) -> bool:
        """Whether the next plan waits for the step in flight instead of overlapping it:
        speculative decoding. A row verifying proposals has a length no one knows until
        its step is delivered (it is not planned before: ``Scheduler._tokens_wanted``), and
        a row proposes only when its last token is known on the host (the n-gram lookup
        needs it), so while any row would propose the loop plans after each step, not
        while it computes. The overlap it gives up is the host's planning time, small
        beside a step; ``Speculation`` stops asking when proposals stop paying."""
        speculation = self.scheduler.speculation
        if speculation is None:
            return False
        return inflight.plan.num_drafts > 0 or speculation.want_known_tokens(self.scheduler.running)

    def _launch(self) -> Launched | None:
        """Plan the next step and hand it to the worker (None: nothing to compute now)."""
        if self._omp_reset is not None:
            self._omp_reset()
        hooked, refresh = self._check_model()
        plan = self.scheduler.schedule()
        self.copy_out_for_disk()  # before this step, which may reuse pages the plan evicted
        if plan.admitted:
            self.table.scheduled(plan, time.monotonic())
        if not plan.seqs:
            return None
        step = plan.input
        step.sampling = sampling_batch(plan, self.table.columns, self.vocab_size)
        if self.table.scoring:
            step.prompt_logprobs, plan.prompt_sinks = plan_rows(plan, self.table.live)
        if self.table.pooling:
            step.pooling, plan.pooled_requests = plan_pooling(plan, self.table.live)
        step.plain = hooked is not None
        step.refresh = refresh
        controls = step.sampling.controls
        masks = controls.token_mask if controls is not None else None
        if masks is not None and self._filler is None:
            self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acb-masks")
        self._last_launched = Launched(plan, self._executor.submit(self.runner.execute, step), masks, self._filler)
        return self._last_launched

    async def _complete(self, launched: Launched) -> None:
        """Await a launched step and deliver its tokens (or fail its requests)."""
        plan = launched.plan
        try:
            out: StepOutput | PendingOutput = await self._loop.wait_future(launched.future)
            if isinstance(out, PendingOutput):
                # queued on the device: poll its event without blocking the loop
                # (sub-millisecond sleeps keep latency low for short steps)
                while not out.ready():
                    await anyio.sleep(_POLL_INTERVAL)
                out = out.result()
        except Exception as e:
            self.steps += 1
            device_error = as_device_error(e)
            if device_error is not None:
                self._device_failed(device_error)
            else:
                log.warning("step failed: %r", e)
                self.outputs.step_failed(plan, e)
            return
        self.steps += 1
        self.device_s += out.device_s
        speculation = self.scheduler.speculation
        if speculation is not None and plan.num_tokens <= plan.num_sampled:
            # decode and verification steps only: what proposals add to (prefill chunks cost otherwise);
            # a draft model's chain is timed apart (acb.core.speculative.DraftSpeculation)
            speculation.observe_step(plan.num_tokens, out.device_s - out.draft_s)
        if out.draft_s:
            speculation.observe_draft(out.draft_steps, out.draft_s)
        controls = plan.input.sampling.controls
        if controls is not None and controls.failures:  # before delivery: their tokens never go out
            self.outputs.processors_failed(controls.failures)
        if plan.prompt_sinks:
            self.outputs.deliver_prompt_logprobs(plan, out)
        self.outputs.deliver(self.scheduler.update(plan, out), out)
        if plan.pooled_requests:  # after the update: a finished prompt's pages are registered first
            self.outputs.deliver_pooled(plan, out)
        if self._tables_check is not None and self._tables_check.done():
            check, self._tables_check = self._tables_check, None
            check.result()  # a failed block-table check (AssertionError) stops the loop
        if self.kv_events is not None:
            # before anyone awaiting a request that just finished runs: its pages' events are out
            self.kv_events.flush()

    async def _idle(self) -> bool:
        """Wait for work (or the nearest deadline); False when a drain is complete."""
        if self.life.state is EngineState.DRAINING and not self.table.live:
            return False
        if not self.scheduler.has_work():
            disk = self.scheduler.kv.disk
            if disk is not None:
                self.copy_out_for_disk()
                disk.forget_ready()  # nothing waits for prefetched pages
            if self.debug_checks:
                self.check_integrity()
            # nothing else runs between the check and the new event, so a submission
            # either saw work or sets this event
            self._wakeup = wakeup = self._loop.Event()
            deadline = self.table.next_deadline() if self.table.deadlines else None
            if deadline is None:
                await wakeup.wait()
            else:  # wake up in time to end the request whose deadline is nearest
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                    await wakeup.wait()
        return True

    async def _wind_down(self, inflight: Launched | None) -> None:
        try:
            if inflight is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await self._loop.wait_future(inflight.future)  # never leave the worker mid-step
                    except Exception:
                        pass
            if self.life.halting:
                for seq in [*self.scheduler.running, *self.scheduler.waiting, *self.scheduler.queues.prefill_only]:
                    self.scheduler.finish(seq)
                if self.life.reason is not None:  # ended by a device failure, not by stop()
                    self.life.move(EngineState.STOPPED)
            self.copy_out_for_disk()
        finally:
            if self.kv_events is not None:
                self.kv_events.close()  # every kv_events() stream ends with the loop
            self.finished.set()  # stop() waits for this

    def check_integrity(self) -> None:
        """Assert the caches' invariants against the live requests' page tables, and the
        runner's block-table store against the scheduler's tables, on the step thread after
        the steps launched so far (this waits for them). Not while the last one waits for
        its grammar masks, which this thread hands out: the store check is then queued
        behind it, and a failure stops the loop when the next step completes."""
        self.table.check_integrity()
        if self.runner is None:
            return
        tables = self.scheduler.sent_tables()
        last = self._last_launched
        if last is None or last.masks is None or last.future.done():
            self._executor.submit(self.runner.check_tables, tables).result()
        elif self._tables_check is None:
            self._tables_check = self._executor.submit(self.runner.check_tables, tables)

    def stats(self, **fields: Any) -> EngineStats:
        """The counters of the scheduler, its pools and the steps, with ``fields``."""
        kv, host, swa, sched, runner = self.scheduler.kv, self.scheduler.host_pool, self.scheduler.kv_swa, \
            self.scheduler, self.runner
        spec = sched.speculation
        return EngineStats(
            running=len(sched.running), waiting=len(sched.waiting), total_blocks=kv.num_pages,
            free_blocks=kv.num_free, cached_blocks=kv.num_cached, used_blocks=kv.num_used,
            prefix_hit_rate=kv.hit_rate, steps=self.steps, generated_tokens=sched.num_generated_tokens,
            preemptions=sched.num_preemptions, recomputed_tokens=sched.num_recomputed_tokens,
            host_blocks=host.num_slots if host else 0, offloaded_blocks=host.num_used if host else 0,
            offloads=host.num_offloads if host else 0, restores=host.num_restores if host else 0,
            sliding_total_blocks=swa.num_pages if swa else 0, sliding_free_blocks=swa.num_free if swa else 0,
            device_time_s=self.device_s, hashed_blocks=len(kv.page_key),
            forward_path=runner.forward_path if runner is not None else "",
            forward_reason=runner.forward_reason if runner is not None else "",
            spec_proposed_tokens=spec.proposed if spec else 0, spec_accepted_tokens=spec.accepted if spec else 0,
            spec_acceptance_rate=spec.acceptance_rate if spec else 0.0,
            embeddings_waiting=len(sched.queues.prefill_only),
            **(kv.disk.stat_fields() if kv.disk is not None else {}), **fields)

    def copy_out_for_disk(self, wait: bool = False) -> None:
        """Hand the pages offered to the disk tier since the last call to the step thread, which
        copies them out after the steps launched so far and before any launched later (the only
        ones that could overwrite them), then to the tier's writer thread. ``wait``: until copied."""
        disk = self.scheduler.kv.disk
        if disk is None or self.runner is None:
            return
        copies = disk.take_copies()
        if not copies:
            return
        if self._executor is None:
            self.runner.save_disk_pages(copies, disk)
            return
        done = self._executor.submit(self.runner.save_disk_pages, copies, disk)
        if wait:
            done.result()

    def _check_model(self) -> tuple[str | None, bool]:
        """Has the model changed since the last step (hooks, forwards, weights)? When it
        has, KV cached for prefix hits was computed by another model: forget it."""
        if not self.watch_model:
            return None, False
        hooked, changed = self.runner.check_model()
        if changed or hooked != self.hooked:
            if hooked != self.hooked:
                log.info("acb: %s", f"{hooked}: the model's own forward runs" if hooked
                         else "the model's fast paths are back on")
            self.hooked = hooked
            self.scheduler.kv.forget_prefixes()
            if self.scheduler.kv.disk is not None:
                self.scheduler.kv.disk.disable("the model changed since the engine started")
        return hooked, changed

    def _device_failed(self, error: DeviceError) -> None:
        """The device is unusable: fail every unfinished request and end the loop (never
        hang). ``start()`` may be tried again."""
        log.error("acb: %s; stopping the engine", error)
        self.outputs.fail_all(lambda req: caused(
            RequestFailedError(f"request {req.request_id} failed: {error}", req.request_id), error))
        self.life.move(EngineState.HALTING, f"the engine stopped after a device failure: {error}")
