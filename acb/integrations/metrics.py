"""Prometheus text exposition for a served engine: the engine's gauges and counters
(read from ``engine.stats()`` at scrape time) plus per-request histograms.

Example::

    metrics = ServerMetrics()
    metrics.observe(completion)           # once per finished request
    text = metrics.render(engine.stats())  # the body of GET /metrics
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

import acb

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Histogram:
    """A cumulative Prometheus histogram with fixed bucket bounds."""

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help = help
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            total += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {total}')
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {total}"]
        return lines


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def request_metrics(metrics: acb.RequestMetrics) -> dict[str, float | int | None]:
    """One request's metrics as the ``metrics`` object of an OpenAI response: vLLM's names
    (PR #46768: ``time_to_first_token_ms``, ``generation_time_ms``, ``queue_time_ms``,
    ``mean_itl_ms``, ``tokens_per_second``) plus acb's own (the prefill/decode split, the
    end-to-end latency, preemptions and prefix-cache hits). A span that did not happen
    (no token generated, one token and so no inter-token latency) is null."""
    m = metrics
    tps = m.tokens_per_s
    return {
        "time_to_first_token_ms": _ms(m.ttft_s),
        "generation_time_ms": _ms(m.generation_time_s),
        "queue_time_ms": _ms(m.queue_time_s),
        "mean_itl_ms": _ms(m.mean_itl_s),
        "tokens_per_second": None if tps is None else round(tps, 3),
        "prefill_time_ms": _ms(m.prefill_time_s),
        "decode_time_ms": _ms(m.decode_time_s),
        "e2e_latency_ms": _ms(m.latency_s),
        "prompt_tokens": m.num_prompt_tokens,
        "completion_tokens": m.num_generated_tokens,
        "cached_prompt_tokens": m.num_cached_prompt_tokens,
        "num_preemptions": m.num_preemptions,
    }


def _metric(name: str, kind: str, help: str, value: float) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]


class ServerMetrics:
    """What a server records about the requests it answered."""

    def __init__(self) -> None:
        self.ttft = Histogram("acb_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated token.", TTFT_BUCKETS)
        self.latency = Histogram("acb_request_latency_seconds",
                                 "Seconds from a request's arrival to its end.", LATENCY_BUCKETS)
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = 0

    def observe(self, completion: acb.Completion) -> None:
        """Record one finished request."""
        m = completion.metrics
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        if m.latency_s is not None:
            self.latency.observe(m.latency_s)
        self.finished[completion.finish_reason or "unknown"] += 1
        self.prompt_tokens += len(completion.prompt_token_ids)

    def render(self, stats: acb.EngineStats) -> str:
        """The whole exposition, engine stats included."""
        lines: list[str] = []
        lines += _metric("acb_kv_total_blocks", "gauge", "KV cache pages in total.", stats.total_blocks)
        lines += _metric("acb_kv_free_blocks", "gauge", "KV cache pages a request can take now.", stats.free_blocks)
        lines += _metric("acb_kv_cached_blocks", "gauge", "Unreferenced pages kept for prefix hits.",
                         stats.cached_blocks)
        lines += _metric("acb_requests_running", "gauge", "Requests being computed.", stats.running)
        lines += _metric("acb_requests_waiting", "gauge", "Requests queued for admission.", stats.waiting)
        lines += _metric("acb_embeddings_waiting", "gauge", "Embedding prompts queued for admission.",
                         stats.embeddings_waiting)
        lines += _metric("acb_prefix_cache_hit_rate", "gauge", "Fraction of prompt tokens found in the cache.",
                         stats.prefix_hit_rate)
        lines += _metric("acb_generated_tokens_total", "counter", "Tokens generated by the engine.",
                         stats.generated_tokens)
        lines += _metric("acb_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                         self.prompt_tokens)
        lines += _metric("acb_engine_steps_total", "counter", "Forward passes run.", stats.steps)
        lines += _metric("acb_device_seconds_total", "counter", "Seconds the engine's steps computed on the device.",
                         stats.device_time_s)
        lines += _metric("acb_preemptions_total", "counter", "Requests preempted for lack of pages.",
                         stats.preemptions)
        lines += _metric("acb_kv_offloaded_blocks", "gauge", "Preempted requests' pages in the CPU offload pool.",
                         stats.offloaded_blocks)
        lines += _metric("acb_offloads_total", "counter", "Preemptions whose KV went to the CPU offload pool.",
                         stats.offloads)
        lines += _metric("acb_restores_total", "counter", "Resumptions that copied offloaded KV back.", stats.restores)
        lines += _metric("acb_kv_disk_hits_total", "counter", "KV pages admitted from the disk tier, not computed.",
                         stats.disk_hits)
        lines += _metric("acb_kv_disk_pages_read_total", "counter", "Page files read and checked by the disk tier.",
                         stats.disk_pages_read)
        lines += _metric("acb_kv_disk_pages_written_total", "counter", "Page files written by the disk tier.",
                         stats.disk_pages_written)
        lines += _metric("acb_kv_disk_read_bytes_total", "counter", "Bytes of page files read.", stats.disk_bytes_read)
        lines += _metric("acb_kv_disk_written_bytes_total", "counter", "Bytes of page files written.",
                         stats.disk_bytes_written)
        lines += _metric("acb_kv_disk_errors_total", "counter", "Page files found corrupt, truncated or foreign "
                         "(deleted, recomputed), and failed writes.", stats.disk_errors)
        lines += _metric("acb_kv_disk_load_seconds_total", "counter", "Seconds spent reading and checking page files.",
                         stats.disk_load_s)
        lines += _metric("acb_kv_disk_copy_seconds_total", "counter", "Seconds the step thread spent copying pages "
                         "out for the disk tier.", stats.disk_copy_s)
        lines += _metric("acb_kv_disk_blocks", "gauge", "Page files the disk tier indexes.", stats.disk_blocks)
        lines += _metric("acb_kv_disk_bytes", "gauge", "Bytes of the page files the disk tier indexes.",
                         stats.disk_bytes)
        lines += _metric("acb_spec_proposed_tokens_total", "counter", "Speculative tokens proposed and verified.",
                         stats.spec_proposed_tokens)
        lines += _metric("acb_spec_accepted_tokens_total", "counter", "Speculative tokens accepted.",
                         stats.spec_accepted_tokens)
        lines += _metric("acb_spec_acceptance_rate", "gauge", "Accepted over proposed speculative tokens.",
                         stats.spec_acceptance_rate)
        lines += ["# HELP acb_attention_backend_info The attention backend serving the engine (label).",
                  "# TYPE acb_attention_backend_info gauge",
                  f'acb_attention_backend_info{{backend="{stats.attn_backend}"}} 1']
        lines += ["# HELP acb_requests_finished_total Finished requests by finish reason.",
                  "# TYPE acb_requests_finished_total counter"]
        lines += [f'acb_requests_finished_total{{finish_reason="{reason}"}} {count}'
                  for reason, count in sorted(self.finished.items())]
        lines += self.ttft.render()
        lines += self.latency.render()
        return "\n".join(lines) + "\n"
