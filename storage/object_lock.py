"""The one-writer lock of a store in object storage (``STORE/.lock``, one object).

An object store has no ``flock``, but it has conditional writes (S3 since 2024; MinIO, Ceph):

- **acquire**: create the object with ``If-None-Match: *``; a second writer's create fails
  (412) and it gets :class:`~storage.store.StoreLocked`, naming the holder from the object;
- **keep**: a heartbeat thread overwrites it every ``ttl / 4`` with ``If-Match: <our ETag>``,
  so the object's ``LastModified`` stays fresh while the holder lives;
- **release**: delete it with ``If-Match: <our ETag>`` (nothing if it is no longer ours);
- **a dead holder** stops beating: once ``LastModified`` is older than ``ttl``, the next writer
  takes the lock over with ``If-Match: <the stale ETag>``, so of two writers racing for a stale
  lock exactly one wins. A holder whose heartbeat fails (it stalled past ``ttl`` and was taken
  over, or lost the network) is marked ``lost``; it then refuses to publish (``check``).

``ttl`` is ``COINRAG_LOCK_TTL_S`` seconds (default 120). Clocks: ``LastModified`` is the
server's, compared with this machine's; a skew larger than ``ttl`` would let a writer take a
live lock over, so keep machines on NTP or raise ``ttl``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from datetime import UTC, datetime
from typing import Any

DEFAULT_TTL_S = 120.0


def lock_ttl_s() -> float:
    return float(os.environ.get("COINRAG_LOCK_TTL_S", DEFAULT_TTL_S))


class LockContention(RuntimeError):
    """The lock is held by a live writer; ``holder`` is what its object says."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def _precondition_failed(exc: BaseException) -> bool:
    """True when a conditional request was refused (412; 409 when S3 saw a concurrent one)."""
    text = f"{type(exc).__name__} {exc} {getattr(exc, '__cause__', '')}"
    return any(s in text for s in ("PreconditionFailed", "412", "ConditionalRequestConflict"))


class ObjectLock:
    """Hold ``path`` (``bucket/key`` on ``fs``, an s3fs file system) as a lease."""

    def __init__(self, fs: Any, path: str, info: str, ttl_s: float | None = None) -> None:
        self.fs = fs
        self.bucket, _, self.key = path.partition("/")
        self.info = info
        self.ttl_s = lock_ttl_s() if ttl_s is None else ttl_s
        self.etag: str | None = None
        self.lost: str | None = None  # why the lock was lost, if it was
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    def _body(self) -> bytes:
        now = datetime.now(UTC).isoformat(timespec="seconds")
        return json.dumps({"holder": self.info, "heartbeat": now, "ttl_s": self.ttl_s}).encode()

    def _put(self, **condition: str) -> str:
        response = self.fs.call_s3(
            "put_object", Bucket=self.bucket, Key=self.key, Body=self._body(), **condition
        )
        return str(response["ETag"])

    def acquire(self) -> None:
        """Take the lock or raise :class:`LockContention`."""
        try:
            self.etag = self._put(IfNoneMatch="*")
        except OSError as exc:
            if not _precondition_failed(exc):
                raise
            self._take_over_if_stale()
        self._thread = threading.Thread(target=self._beat, name="coinrag-lock", daemon=True)
        self._thread.start()

    def _take_over_if_stale(self) -> None:
        try:
            head = self.fs.call_s3("head_object", Bucket=self.bucket, Key=self.key)
        except FileNotFoundError:  # released meanwhile: try once more from scratch
            try:
                self.etag = self._put(IfNoneMatch="*")
                return
            except OSError as exc:
                if _precondition_failed(exc):
                    raise LockContention("another writer (it took the lock just now)") from None
                raise
        age = (datetime.now(UTC) - head["LastModified"]).total_seconds()
        holder = self._holder()
        if age <= self.ttl_s:
            raise LockContention(f"{holder}; its heartbeat is {age:.0f} s old")
        try:
            self.etag = self._put(IfMatch=str(head["ETag"]))
        except OSError as exc:
            if _precondition_failed(exc):
                raise LockContention(f"{holder} (taken over by another writer)") from None
            raise

    def _holder(self) -> str:
        try:
            data = json.loads(self.fs.cat_file(f"{self.bucket}/{self.key}"))
            return f"{data.get('holder', 'unknown')}, heartbeat {data.get('heartbeat', '?')}"
        except (OSError, ValueError):
            return "unknown"

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            with self._mutex:
                if self._stop.is_set():
                    return
                try:
                    self.etag = self._put(IfMatch=str(self.etag))
                except Exception as exc:  # noqa: BLE001 - any failure means we may not hold it
                    self.lost = f"heartbeat failed: {type(exc).__name__}: {exc}"
                    return

    def check(self) -> None:
        """Raise RuntimeError if the lock was lost (call before a commit point)."""
        if self.lost:
            raise RuntimeError(f"lost the store's write lock ({self.lost}); not publishing")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._mutex:
            if self.etag is None or self.lost:
                return
            try:
                self.fs.call_s3(
                    "delete_object", Bucket=self.bucket, Key=self.key, IfMatch=str(self.etag)
                )
            except OSError as exc:
                if not _precondition_failed(exc) and not isinstance(exc, FileNotFoundError):
                    raise


def holder_info(run_id: str) -> str:
    since = datetime.now(UTC).isoformat(timespec="seconds")
    return f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}, since {since}"
