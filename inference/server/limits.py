"""Each client's fair share of a server process, so that one client cannot take the queue.

A client is an API key (``auth.client_of_key``: a digest), else the client's address (a
server without keys). Two limits, per worker process:

- **in the queue**: at most ``queue_limit`` of a client's requests admitted (running or
  waiting for the model thread) at once; one more gets :class:`Limited` (``reason="queue"``,
  ``Retry-After`` = ``retry_after`` seconds) while the model queue still takes other clients'.
- **rate**: a token bucket of ``burst`` requests, refilled at ``rate`` per second (0: none);
  every request to ``/query`` takes one token before its body is read; one that finds less
  than a whole token gets :class:`Limited` (``reason="rate"``, ``Retry-After`` = the seconds
  until a token is back, rounded up).

Worked example: ``rate=0.5, burst=2``: requests at t = 0, 0, 0 s -> ok, ok, 429 (Retry-After 2);
at t = 2 s one token is back -> ok.

Clients idle long enough to have a full bucket and nothing admitted are forgotten once more
than :data:`MAX_CLIENTS` are known (memory stays bounded under many addresses).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_CLIENTS = 4096


class Limited(RuntimeError):
    """A client over its share: ``reason`` (``queue`` | ``rate``), ``retry_after`` seconds."""

    http_status = 429

    def __init__(self, reason: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


@dataclass
class _Share:
    tokens: float
    stamp: float  # when tokens was computed (clock seconds)
    admitted: int = 0


@dataclass(eq=False)
class ClientLimits:
    """Per-client admission (``queue_limit``) and token bucket (``rate`` per second,
    ``burst`` tokens); ``clock`` in seconds (monotonic)."""

    queue_limit: int
    rate: float
    burst: int
    retry_after: int = 1
    clock: Callable[[], float] = time.monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _shares: dict[str, _Share] = field(default_factory=dict, init=False, repr=False)

    def _share(self, client: str, now: float) -> _Share:
        share = self._shares.get(client)
        if share is None:
            if len(self._shares) >= MAX_CLIENTS:
                self._forget_idle(now)
            share = self._shares[client] = _Share(float(self.burst), now)
        elif self.rate > 0:
            share.tokens = min(self.burst, share.tokens + (now - share.stamp) * self.rate)
            share.stamp = now
        return share

    def _forget_idle(self, now: float) -> None:
        for client, share in list(self._shares.items()):
            full = self.rate <= 0 or share.tokens + (now - share.stamp) * self.rate >= self.burst
            if share.admitted == 0 and full:
                del self._shares[client]

    def take(self, client: str) -> None:
        """One request of ``client`` arrives: take a token, or :class:`Limited` (rate)."""
        if self.rate <= 0:
            return
        with self._lock:
            now = self.clock()
            share = self._share(client, now)
            if share.tokens < 1.0:
                wait = max(1, math.ceil((1.0 - share.tokens) / self.rate))
                raise Limited(
                    "rate",
                    f"too many requests: over {self.rate:g} per second (bursts of "
                    f"{self.burst}) for this client; retry in {wait} s",
                    wait,
                )
            share.tokens -= 1.0

    def enter(self, client: str) -> Callable[[], None]:
        """Admit one more request of ``client`` (the returned function releases it, once),
        or :class:`Limited` (queue) when ``queue_limit`` of its requests are admitted."""
        with self._lock:
            share = self._share(client, self.clock())
            if share.admitted >= self.queue_limit:
                raise Limited(
                    "queue",
                    f"too many requests in progress: this client has {share.admitted} "
                    f"running or queued (its limit is {self.queue_limit}); retry when one ends",
                    self.retry_after,
                )
            share.admitted += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    share.admitted -= 1

        return release

    def admitted(self, client: str) -> int:
        """Requests of ``client`` admitted now."""
        with self._lock:
            share = self._shares.get(client)
            return share.admitted if share else 0
