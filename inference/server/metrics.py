"""The server's Prometheus metrics, in one registry per app (``GET /metrics``, text format).

- ``coinrag_requests_total{endpoint, method, status}``: requests answered, by endpoint
  (``query``, ``stream``), RAG method (``-`` when the request named none that is served) and
  HTTP status;
- ``coinrag_ttft_seconds``, ``coinrag_retrieval_seconds``, ``coinrag_kv_load_seconds``,
  ``coinrag_prefill_seconds``, ``coinrag_request_seconds`` (end to end, admission to last byte
  computed) ``{method}``: histograms of the answers' timings;
- ``coinrag_served_run_info{run_id}`` (1 for the run served now), ``coinrag_version_swaps_total``,
  ``coinrag_version_refusals_total``, ``coinrag_queue_depth`` (requests admitted, not finished),
  ``coinrag_cancelled_total`` (generations stopped by a client that went away).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: 5 ms .. 30 s (a warm TTFT is ~0.1-0.3 s on a CPU; a loaded machine reaches seconds).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
TIMINGS = ("ttft", "retrieval", "kv_load", "prefill")  # Answer.timings keys (milliseconds)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "coinrag_requests", "Requests answered.", ["endpoint", "method", "status"], registry=r
        )
        self.timings = {
            name: Histogram(
                f"coinrag_{name}_seconds",
                f"The answers' {name} time.",
                ["method"],
                buckets=BUCKETS,
                registry=r,
            )
            for name in TIMINGS
        }
        self.request_seconds = Histogram(
            "coinrag_request_seconds",
            "End-to-end time of answered requests, admission to answer.",
            ["method"],
            buckets=BUCKETS,
            registry=r,
        )
        self.served = Gauge(
            "coinrag_served_run_info", "The published run served now (1).", ["run_id"], registry=r
        )
        self.swaps = Counter("coinrag_version_swaps", "Published versions swapped in.", registry=r)
        self.refusals = Counter(
            "coinrag_version_refusals", "Published versions refused.", registry=r
        )
        self.queue_depth = Gauge(
            "coinrag_queue_depth", "Requests admitted and not finished.", registry=r
        )
        self.cancelled = Counter(
            "coinrag_cancelled", "Generations stopped by a disconnected client.", registry=r
        )
        self._run_id: str | None = None

    def serve_run(self, run_id: str) -> None:
        if self._run_id is not None:
            self.served.remove(self._run_id)
            self.swaps.inc()
        self.served.labels(run_id).set(1)
        self._run_id = run_id

    def answered(self, method: str, timings: dict[str, float], seconds: float) -> None:
        for name in TIMINGS:
            self.timings[name].labels(method).observe(timings.get(name, 0.0) / 1000.0)
        self.request_seconds.labels(method).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)
