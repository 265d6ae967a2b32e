"""The model thread and the bounded queue in front of it.

One thread per server process runs every model call (answers and warm-ups), one at a time: the
model's rotary state is reset per forward (``inference.rope.reset_rotary``) and the CPU is the
bottleneck anyway, so parallel generations would only slow each other down. Up to ``limit``
requests wait behind the running one; :meth:`ModelQueue.submit` raises :class:`QueueFull` past
that (the app answers 503 with ``Retry-After``).

A job gets a :class:`Cancel` token: the app sets it when the client disconnects, and the job's
per-token callback raises :class:`Cancelled` at the next token (a job still waiting is skipped).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class QueueFull(RuntimeError):
    """More requests than the model thread and its queue take."""

    http_status = 503


class Cancelled(RuntimeError):
    """The client went away: the generation stopped."""

    http_status = 499  # nginx's "client closed request": only counted, nobody reads it


class Cancel:
    """Set by the app when the client disconnects; checked by the job at every token."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled("the client disconnected")


class ModelQueue:
    """One model thread; at most ``1 + limit`` jobs admitted (one running, ``limit`` waiting)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coinrag-model")
        self._lock = threading.Lock()
        self.admitted = 0

    def submit(self, job: Callable[..., T], *args: Any, force: bool = False) -> Future[T]:
        """Run ``job(*args)`` on the model thread; :class:`QueueFull` when ``1 + limit`` jobs
        are admitted already (``force``: admit anyway, for the server's own warm-ups)."""
        with self._lock:
            if not force and self.admitted >= 1 + self.limit:
                raise QueueFull(
                    f"{self.admitted} requests in progress or queued (the limit is 1 running + "
                    f"{self.limit} waiting)"
                )
            self.admitted += 1

        def run() -> T:
            try:
                return job(*args)
            finally:
                with self._lock:
                    self.admitted -= 1

        try:
            return self._pool.submit(run)
        except RuntimeError:  # shut down
            with self._lock:
                self.admitted -= 1
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
