"""A real ``coinrag api`` server for tests and benchmarks: the app of ``inference/server`` on
uvicorn, on 127.0.0.1 at a free port, in a thread of the calling process (stopped on exit),
and small SSE / metrics readers for a real HTTP client (httpx)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serving(config: Any, log_level: str = "warning") -> Iterator[tuple[str, Any]]:
    """``(base URL, ApiServer)`` of a server for ``config`` (an ``inference.server.app
    .ServerConfig``), loaded and warmed before the port opens; stopped (watcher, model thread,
    uvicorn) on exit. ``log_level``: uvicorn's ("info" keeps its access log)."""
    import uvicorn

    from coinrag.inference.server.app import ApiServer, create_app

    server = ApiServer.open(config)
    port = free_port()
    uv = uvicorn.Server(
        uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level=log_level)
    )
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        uv.should_exit = True
        thread.join(timeout=60)


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    """``(event, data as JSON)`` of a server-sent-events body, in order."""
    event, data = "message", []
    for line in lines:
        if line == "":
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[len("event:") :].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:") :].strip())
    if data:
        yield event, json.loads("\n".join(data))


def stream_query(client: httpx.Client, base: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every event of one streamed query, with the time each arrived (seconds after sending)."""
    out = []
    t0 = time.perf_counter()
    with client.stream("POST", f"{base}/query/stream", json=body) as response:
        response.raise_for_status()
        for event, data in sse_events(response.iter_lines()):
            out.append((event, data, time.perf_counter() - t0))
    return out


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(sample name, sorted labels): value}`` of a Prometheus text exposition (parsed by
    prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values
