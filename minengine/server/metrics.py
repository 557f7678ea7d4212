"""Prometheus metrics of the server (the names are part of the API)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series, as vLLM does

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_pages_total", "kv_pages_in_use", "kv_pages_cached")


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.gauges = {name: Gauge(f"minengine:{name}", name.replace("_", " "), registry=r) for name in GAUGES}
        self.prompt_tokens = Counter("minengine:prompt_tokens", "prompt tokens received", registry=r)
        self.generation_tokens = Counter("minengine:generation_tokens", "tokens generated", registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "minengine:prefix_cache_hit_tokens", "prompt tokens served by the prefix cache", registry=r
        )
        self.request_success = Counter(
            "minengine:request_success", "finished requests", ["finished_reason"], registry=r
        )
        self.aborted = Counter("minengine:num_aborted_requests", "aborted requests", registry=r)
        self.preemptions = Counter(
            "minengine:num_preemptions", "requests preempted (KV dropped, resumed by recompute)", registry=r
        )
        self._preemptions_seen = 0
        self.ttft = Histogram(
            "minengine:time_to_first_token_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "minengine:inter_token_latency_seconds", "time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "minengine:e2e_request_latency_seconds", "request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        for reason in ("stop", "length"):
            self.request_success.labels(finished_reason=reason)
        self.delayer_outcomes = Counter(
            "minengine:prefill_delayer_outcomes",
            "prefill delayer decisions per scheduling pass",
            ["output_allow", "output_reason", "actual_execution"],
            registry=r,
        )
        self.delayer_wait_passes = Histogram(
            "minengine:prefill_delayer_wait_forward_passes",
            "passes a prefill was held",
            buckets=(0, 1, 2, 3, 5, 8, 12, 20, 30, 50, 100),
            registry=r,
        )
        self.delayer_wait_seconds = Histogram(
            "minengine:prefill_delayer_wait_seconds", "time a prefill was held", buckets=_LATENCY_BUCKETS, registry=r
        )

        self.kv_transfer_pages = Counter(
            "minengine:kv_transfer_pages", "KV pages received from prefill servers", registry=r
        )
        self.kv_transfer_bytes = Counter(
            "minengine:kv_transfer_bytes", "KV bytes received from prefill servers", registry=r
        )
        self.kv_transfer_seconds = Histogram(
            "minengine:kv_transfer_seconds",
            "time from asking for a request's KV to having it",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_pages_sent = Counter("minengine:kv_transfer_pages_sent", "KV pages sent to decode servers", registry=r)

    def record_transfers(self, received, pages_sent: int) -> None:
        for pages, nbytes, seconds in received:
            self.kv_transfer_pages.inc(pages)
            self.kv_transfer_bytes.inc(nbytes)
            self.kv_transfer_seconds.observe(seconds)
        if pages_sent:
            self.kv_pages_sent.inc(pages_sent)

    def record_delayer(self, outcomes) -> None:
        for o in outcomes:
            allow, actual = str(o.allow).lower(), str(o.actual_prefill).lower()
            labels = dict(output_allow=allow, output_reason=o.reason, actual_execution=actual)
            self.delayer_outcomes.labels(**labels).inc(o.passes)
            if o.waited_passes is not None:
                self.delayer_wait_passes.observe(o.waited_passes)
                self.delayer_wait_seconds.observe(o.waited_seconds)

    def set_gauges(self, stats: dict[str, int]) -> None:
        for name, value in stats.items():
            if name in self.gauges:
                self.gauges[name].set(value)
        # the workers count preemptions since their start; their sum only grows
        if stats.get("num_preemptions", 0) > self._preemptions_seen:
            self.preemptions.inc(stats["num_preemptions"] - self._preemptions_seen)
            self._preemptions_seen = stats["num_preemptions"]

    def render(self) -> bytes:
        return generate_latest(self.registry)
