"""``inference/llm/calls.py``: calls run ``concurrency`` at a time, in request order, and a
fatal error stops the rest of the run (not the next run)."""

from __future__ import annotations

import threading

import pytest

from coinrag.inference.llm.calls import ConcurrentCalls
from coinrag.inference.llm.client import LlmEndpoint


def _calls(concurrency: int) -> ConcurrentCalls:
    endpoint = LlmEndpoint("m", base_url="http://127.0.0.1:9/v1", api_key="sk-test")
    return ConcurrentCalls(endpoint, concurrency, timeout_s=1.0)


def test_results_come_in_request_order_on_at_most_concurrency_threads() -> None:
    calls = _calls(3)
    names: set[str] = set()

    def square(n: int) -> int:
        names.add(threading.current_thread().name)
        return n * n

    assert calls.each(square, list(range(20)), "probe") == [n * n for n in range(20)]
    assert 1 <= len(names) <= 3 and all(n.startswith("probe") for n in names)
    assert calls.each(square, [], "probe") == [] and calls.llm_model == "m"


def test_a_fatal_error_aborts_the_rest_of_the_run_only() -> None:
    calls = _calls(1)

    def ask(n: int) -> str | None:
        if n == 1:
            calls.stop_run("401 invalid key")
        return calls.aborted

    aborted = "aborted: 401 invalid key"
    assert calls.each(ask, [0, 1, 2], "probe") == [None, aborted, aborted]
    assert calls.each(ask, [0], "probe") == [None]  # a new run starts clean


def test_concurrency_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="concurrency must be >= 1, got 0"):
        _calls(0)
