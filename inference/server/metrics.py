"""The server's Prometheus metrics, in one registry per app (``GET /metrics``, text format).

- ``coinrag_requests_total{endpoint, method, status}``: requests answered, by endpoint
  (``query``, ``stream``), RAG method (``-`` when the request named none that is served, or
  was refused before its body was read: 401, a 429 for the rate) and HTTP status;
- ``coinrag_ttft_seconds``, ``coinrag_retrieval_seconds``, ``coinrag_kv_load_seconds``,
  ``coinrag_prefill_seconds``, ``coinrag_request_seconds`` (end to end, admission to last byte
  computed) ``{method}``: histograms of the answers' timings;
- ``coinrag_served_run_info{run_id}`` (1 for the run served now), ``coinrag_version_swaps_total``,
  ``coinrag_version_refusals_total``, ``coinrag_queue_depth`` (requests admitted, not finished),
  ``coinrag_cancelled_total`` (generations stopped by a client that went away);
- ``coinrag_unauthorized_total{endpoint}`` (401: no valid API key; ``/health`` without one is
  answered, barely, and not counted), ``coinrag_client_limited_total{reason}`` (429: a client
  over its share, ``reason`` ``queue`` or ``rate``; ``inference/server/limits.py``). No label
  names a key or a client.

With ``--workers N`` (N processes on one port: uvicorn), every process writes its values to
files in one folder (``prometheus_client``'s multiprocess mode, ``$PROMETHEUS_MULTIPROC_DIR``,
made by :func:`inference.server.app.serve`), and ``GET /metrics`` from any of them reports the
sum over all: counters and histograms add up, ``coinrag_queue_depth`` sums the live processes,
``coinrag_served_run_info`` is the max over the live processes per ``run_id`` (a run no process
serves any more reads 0). A process that exits is marked dead (:meth:`ServerMetrics.close`).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's: set for --workers N > 1

# Seconds: 5 ms .. 30 s (a warm TTFT is ~0.1-0.3 s on a CPU; a loaded machine reaches seconds).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
TIMINGS = ("ttft", "retrieval", "kv_load", "prefill")  # Answer.timings keys (milliseconds)


def multiprocess_dir() -> str | None:
    """The folder the worker processes share their values in, or None (one process)."""
    return os.environ.get(MULTIPROC_ENV) or None


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.shared = multiprocess_dir()  # values in files summed over processes
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
            "coinrag_served_run_info",
            "The published run served now (1).",
            ["run_id"],
            registry=r,
            multiprocess_mode="max",
        )
        self.swaps = Counter("coinrag_version_swaps", "Published versions swapped in.", registry=r)
        self.refusals = Counter(
            "coinrag_version_refusals", "Published versions refused.", registry=r
        )
        self.queue_depth = Gauge(
            "coinrag_queue_depth",
            "Requests admitted and not finished.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.cancelled = Counter(
            "coinrag_cancelled", "Generations stopped by a disconnected client.", registry=r
        )
        self.unauthorized = Counter(
            "coinrag_unauthorized",
            "Requests refused for a missing or wrong API key.",
            ["endpoint"],
            registry=r,
        )
        self.limited = Counter(
            "coinrag_client_limited",
            "Requests refused because their client was over its share.",
            ["reason"],
            registry=r,
        )
        self._run_id: str | None = None

    def serve_run(self, run_id: str) -> None:
        if self._run_id is not None:
            self.served.labels(self._run_id).set(0)  # a shared file keeps a removed label's value
            if not self.shared:
                self.served.remove(self._run_id)
            self.swaps.inc()
        self.served.labels(run_id).set(1)
        self._run_id = run_id

    def answered(self, method: str, timings: dict[str, float], seconds: float) -> None:
        for name in TIMINGS:
            self.timings[name].labels(method).observe(timings.get(name, 0.0) / 1000.0)
        self.request_seconds.labels(method).observe(seconds)

    def text(self) -> bytes:
        """The Prometheus text of this process, or of all processes in multiprocess mode."""
        if not self.shared:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, path=self.shared)
        return generate_latest(merged)

    def close(self) -> None:
        """This process exits: its live gauges stop counting (multiprocess mode)."""
        if self.shared:
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(os.getpid(), path=self.shared)
