"""GET /metrics: the server's Prometheus metrics, kept by prometheus_client.

Where vLLM has a metric of the same meaning, it has vLLM's name after the
prefix (`vllm:` by default, server.py's --metrics-prefix), its `model_name`
label, and, for histograms, vLLM's buckets widened down to the millisecond a
small model's token takes: a dashboard made for vLLM reads these as they
are. Running
and waiting count prompts (a request of three prompts is three rows), as
vLLM counts sequences. The process's own metrics (resident memory, CPU
seconds, open files) come from prometheus_client's process collector, on
Linux.
"""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.exposition import choose_encoder

disable_created_metrics()  # no `_created` series beside each counter: vLLM leaves them out too

PREFIX = "vllm:"  # vLLM's: its dashboards read these unchanged

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0, 160.0, 640.0)
PER_TOKEN_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                     1.0, 2.5, 5.0, 10.0)
REQUEST_SECONDS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0)


class Metrics:
    """What the engine and the HTTP side report, and the text /metrics
    answers with. prometheus_client's metrics are safe across threads: the
    engine's thread and the event loop's both write here."""

    def __init__(self, model_name: str, running=lambda: 0, waiting=lambda: 0, prefix: str = PREFIX, budget=None,
                 peak=lambda: 0):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        label = {"model_name": model_name}

        def make(kind, name, help, labels=(), **options):
            metric = kind(prefix + name, help, ["model_name", *labels], registry=self.registry, **options)
            return metric if labels else metric.labels(**label)

        self.running = make(Gauge, "num_requests_running", "Prompts decoding, or encoded to decode (rows of a batch).")
        self.running.set_function(running)
        self.waiting = make(Gauge, "num_requests_waiting", "Prompts waiting for a row.")
        self.waiting.set_function(waiting)
        if budget is not None:  # serving.budget.Budget: the rows taken hold at most `used` of its `limit`
            make(Gauge, "cache_budget_bytes", "The caches' budget (--cache-memory).").set(budget.limit)
            make(Gauge, "cache_held_bytes", "What the rows taken may come to hold, at most.").set_function(
                lambda: budget.used)
            make(Gauge, "kv_cache_usage_perc", "cache_held_bytes over cache_budget_bytes (1: full).").set_function(
                lambda: budget.used / budget.limit)
        make(Gauge, "memory_peak_bytes", "The most memory MLX has held at once (weights included).").set_function(peak)
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens encoded.")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens decoded.")
        self.audio_seconds = make(Counter, "audio_seconds", "Seconds of audio taken to transcribe or translate.")
        self.finished = make(Counter, "request_success", "Prompts ended, by finish reason (abort: the client left).",
                             ("finished_reason",))
        self.errors = make(Counter, "request_errors", "Error responses, by HTTP status.", ("status",))
        self.first_token = make(Histogram, "time_to_first_token_seconds",
                                "From a request's arrival to its first token decoded.", buckets=SECONDS)
        self.per_token = make(Histogram, "time_per_output_token_seconds",
                              "A prompt's decoding time over its tokens after the first.", buckets=PER_TOKEN_SECONDS)
        self.latency = make(Histogram, "e2e_request_latency_seconds", "From a request's arrival to its end.",
                            buckets=REQUEST_SECONDS)
        self.queue_time = make(Histogram, "request_queue_time_seconds", "From a request's arrival to its row.",
                               buckets=REQUEST_SECONDS)
        self.drafted = make(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed to the target.")
        self.accepted = make(Counter, "spec_decode_num_accepted_tokens", "Draft tokens the target accepted.")
        self.drafts = make(Counter, "spec_decode_num_drafts", "Target calls of prompts that drafted.")
        self.cancelled = make(Counter, "rows_cancelled", "Rows dropped before their end (a client gone, a stop string).")
        self.engine_seconds = make(Counter, "engine_seconds", "Where the engine's time went.", ("part",))
        self.parts = {part: self.engine_seconds.labels(model_name=model_name, part=part)
                      for part in ("encoding", "decoding", "idle")}
        self.model_name = model_name

    def error(self, status: int) -> None:
        self.errors.labels(model_name=self.model_name, status=str(status)).inc()

    def ended(self, times: "Times", stats, reason: str) -> None:
        """A prompt's end: its reason ("stop", "length", "abort" or "error"), its times and what it drafted."""
        self.finished.labels(model_name=self.model_name, finished_reason=reason).inc()
        now = time.perf_counter()
        self.latency.observe(now - times.arrived)
        if times.first_token is not None and stats.generated > 1:
            self.per_token.observe((now - times.first_token) / (stats.generated - 1))
        if stats.drafted:
            self.drafted.inc(stats.drafted)
            self.accepted.inc(stats.accepted)
            self.drafts.inc(stats.target_calls)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics in the format the scraper's Accept header asks for
        (Prometheus's text, or OpenMetrics), and its content type."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class Times:
    """A prompt's moments on the server's clock (time.perf_counter): its
    request's arrival (when its headers were read), its row, its first token."""

    def __init__(self, arrived: float | None = None):
        self.arrived = time.perf_counter() if arrived is None else arrived
        self.admitted: float | None = None
        self.first_token: float | None = None
