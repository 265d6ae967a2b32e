"""``storage/exit_gate.py``: scans that an exit waits for, and fetched bytes in Arrow's memory.
The process-level check (a daemon thread scanning an S3 store's tables at exit) is
``tests/storage/test_object_store_exit.py``."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from coinrag.storage import exit_gate


@pytest.fixture
def gate(monkeypatch):
    """The gate's state as a fresh process has it, put back after the test (a drained gate
    would hold every later scan of other threads)."""
    monkeypatch.setattr(exit_gate, "_running", 0)
    monkeypatch.setattr(exit_gate, "_closing", False)
    return exit_gate


def test_drain_waits_for_a_running_scan_and_holds_new_ones(gate) -> None:
    inside, release = threading.Event(), threading.Event()
    entered_late = threading.Event()

    def running() -> None:
        with gate.native_scan():
            inside.set()
            release.wait(10)

    def late() -> None:
        with gate.native_scan():
            entered_late.set()

    first = threading.Thread(target=running, daemon=True)
    first.start()
    assert inside.wait(10)
    assert not gate.drain(timeout=0.2)  # the running scan keeps it from draining
    second = threading.Thread(target=late, daemon=True)
    second.start()
    release.set()
    first.join(10)
    assert gate.drain(timeout=5)  # nothing runs now
    assert not entered_late.wait(0.3)  # held at the gate, in Python
    with gate.native_scan():  # the main thread (another exit hook) is never held
        pass
    with gate._state:  # reopened (no process does this): the held thread goes on
        gate._closing = False
        gate._state.notify_all()
    second.join(10)
    assert entered_late.is_set() and gate._running == 0


def test_arrow_owned_copies_the_bytes() -> None:
    blob = bytes(range(256)) * 3
    buffer = exit_gate.arrow_owned(blob)
    assert buffer.to_pybytes() == blob and buffer.size == len(blob)
    assert pa.BufferReader(buffer).read(5) == blob[:5]
    assert exit_gate.arrow_owned(b"").size == 0
