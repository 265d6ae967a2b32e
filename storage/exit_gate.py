"""Native table scans that an exiting interpreter waits for, over memory Arrow owns.

A scan (Arrow reading Parquet) runs in C++ with the GIL released, on Arrow's thread pool. A
daemon thread caught in one when the process exits (a server's store watcher, a user's
background reader) keeps running while the C++ runtime destroys that pool, and the process
aborts after all its work is done ("terminate called without an active exception", exit 134;
``tests/storage/test_object_store_exit.py``: 1 run in 8 before this gate). So every scan runs
inside :func:`native_scan`, and at exit (an ``atexit`` hook: daemon threads still run then)
new scans wait in Python and the hook waits for the running ones to finish, at most
:data:`DRAIN_SECONDS`. A scan started by the main thread after the hook (another exit hook)
runs at once: only other threads are held.

A scan's last references can also be dropped by Arrow's own worker threads after the scan has
returned; a buffer that wraps Python ``bytes`` then takes the GIL to free them, and in a
finalizing process that aborts it the same way. Fetched bytes are therefore copied into
Arrow's memory first (:func:`arrow_owned`).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa

DRAIN_SECONDS = 30.0
"""The longest an exit waits for scans that run in other threads."""

_state = threading.Condition()
_running = 0
_closing = False


@contextmanager
def native_scan() -> Iterator[None]:
    """Run the body as one native scan: counted while it runs; after the exit hook, a thread
    other than the main one waits here (forever: finalization stops it in Python)."""
    global _running
    with _state:
        while _closing and threading.current_thread() is not threading.main_thread():
            _state.wait()
        _running += 1
    try:
        yield
    finally:
        with _state:
            _running -= 1
            _state.notify_all()


def drain(timeout: float = DRAIN_SECONDS) -> bool:
    """Hold new scans of other threads and wait for the running ones; True when none runs."""
    global _closing
    with _state:
        _closing = True
        return _state.wait_for(lambda: _running == 0, timeout)


atexit.register(drain)


def arrow_owned(blob: bytes) -> pa.Buffer:
    """``blob``'s bytes in a buffer of Arrow's memory pool (freed without the GIL)."""
    buffer = pa.allocate_buffer(len(blob))
    memoryview(buffer).cast("B")[:] = blob
    return buffer
