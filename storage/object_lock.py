"""The one-writer lock of a store in object storage (``STORE/.lock``, one object).

An object store has no ``flock``, but it has conditional writes (S3 since 2024; MinIO, Ceph):

- **acquire**: create the object with ``If-None-Match: *``; a second writer's create fails
  (412) and it gets :class:`~storage.store.StoreLocked`, naming the holder from the object;
- **keep**: a heartbeat thread rewrites it every ``ttl / 4`` with ``If-Match: <our ETag>``,
  so the object's ``LastModified`` stays fresh while the holder lives;
- **release**: delete it with ``If-Match: <our ETag>`` (nothing if it is no longer ours);
- **a dead holder** stops beating: once ``LastModified`` is older than the lease's ``ttl``
  (the larger of the holder's, recorded in the object, and the contender's; plus the second
  ``LastModified`` may round away), the next writer
  takes the lock over with ``If-Match: <the stale ETag>``, so of two writers racing for a stale
  lock exactly one wins.

**Fencing.** A holder counts its lease from the moment it *sent* its last successful write and
trusts it for ``ttl / 2`` only (a contender waits ``ttl`` after the server stored it): a holder
that stalled (a paused process, a heartbeat stuck in retries) finds its lease expired and
renews it with a conditional write before each commit point (:meth:`check`); if another writer
took over, the renewal fails and the holder refuses to publish. Shard numbers are claimed with
a conditional create too (``storage/kv/transport.py``), so two writers can never share one.

**Lost responses.** Each holder writes a random token into the object: a conditional write
refused with 412 whose object still carries our token was our own earlier write whose
response was lost (a retry); the holder adopts its ETag instead of giving up.

``ttl`` is ``COINRAG_LOCK_TTL_S`` seconds (default 120). ``LastModified`` is the server's clock,
compared with this machine's: keep clocks within ``ttl / 2`` of the server's (NTP).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

DEFAULT_TTL_S = 120.0


LAST_MODIFIED_RESOLUTION_S = 1.0  # HTTP dates (S3's LastModified) are in whole seconds


def lock_ttl_s() -> float:
    return float(os.environ.get("COINRAG_LOCK_TTL_S", DEFAULT_TTL_S))


class LockContention(RuntimeError):
    """The lock is held by a live writer; ``holder`` is what its object says."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


class LockLost(RuntimeError):
    """This process no longer holds the lease (taken over, or expired without renewal)."""


def precondition_failed(exc: BaseException) -> bool:
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
        self.token = uuid.uuid4().hex
        self.etag: str | None = None
        self.lost: str | None = None  # why the lock was lost, if it was
        self._sent_at = 0.0  # time.monotonic() when the last successful write was sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    # ------------------------------------------------------------------ requests

    def _body(self) -> bytes:
        now = datetime.now(UTC).isoformat(timespec="seconds")
        return json.dumps(
            {"holder": self.info, "token": self.token, "heartbeat": now, "ttl_s": self.ttl_s}
        ).encode()

    def _put(self, **condition: str) -> str:
        """One conditional write of our body; on success, our new ETag and lease start."""
        sent = time.monotonic()
        response = self.fs.call_s3(
            "put_object", Bucket=self.bucket, Key=self.key, Body=self._body(), **condition
        )
        self.etag, self._sent_at = str(response["ETag"]), sent
        return self.etag

    def _read(self) -> tuple[dict[str, Any], str, datetime] | None:
        """``(body, etag, last_modified)`` of the lock object, or None if there is none. The
        body is the version the ETag names (read between two HEADs that agree)."""
        path = f"{self.bucket}/{self.key}"
        for _ in range(5):
            try:
                before = self.fs.info(path, refresh=True)
                data = self.fs.cat_file(path)
                after = self.fs.info(path, refresh=True)
            except FileNotFoundError:
                return None
            if before["ETag"] == after["ETag"]:
                try:
                    body = json.loads(data)
                except ValueError:
                    body = {}
                return body, str(after["ETag"]), after["LastModified"]
        raise LockContention("the lock object keeps changing (another writer is active)")

    def _adopt_if_ours(self, state: tuple[dict[str, Any], str, datetime] | None) -> bool:
        """After a refused write: True (and the object's ETag taken) if the object is ours."""
        if state is not None and state[0].get("token") == self.token:
            self.etag = state[1]
            return True
        return False

    # ------------------------------------------------------------------ lease

    def acquire(self) -> None:
        """Take the lock or raise :class:`LockContention`."""
        try:
            self._put(IfNoneMatch="*")
        except OSError as exc:
            if not precondition_failed(exc):
                raise
            self._take_over_if_stale()
        self._thread = threading.Thread(target=self._beat, name="coinrag-lock", daemon=True)
        self._thread.start()

    def _take_over_if_stale(self) -> None:
        state = self._read()
        if state is None:  # released meanwhile: one more try from scratch
            try:
                self._put(IfNoneMatch="*")
                return
            except OSError as exc:
                if precondition_failed(exc):
                    raise LockContention("another writer (it took the lock just now)") from None
                raise
        if self._adopt_if_ours(state):  # our own create, whose response was lost
            self._put(IfMatch=str(self.etag))  # a fresh lease, timed from now
            return
        body, etag, modified = state
        holder = f"{body.get('holder', 'unknown')}, heartbeat {body.get('heartbeat', '?')}"
        ttl = max(self.ttl_s, float(body.get("ttl_s") or 0))
        age = (datetime.now(UTC) - modified).total_seconds()
        # LastModified has whole seconds: the write may be up to a second later than it says.
        if age <= ttl + LAST_MODIFIED_RESOLUTION_S:
            raise LockContention(f"{holder}; its heartbeat is {age:.0f} s old")
        try:
            self._put(IfMatch=etag)
        except FileNotFoundError:  # released just now
            try:
                self._put(IfNoneMatch="*")
            except OSError as exc:
                if precondition_failed(exc):
                    raise LockContention(f"{holder} (taken over by another writer)") from None
                raise
        except OSError as exc:
            if precondition_failed(exc):
                raise LockContention(f"{holder} (taken over by another writer)") from None
            raise

    def _renew(self) -> None:
        """One conditional rewrite; sets ``lost`` (and raises :class:`LockLost`) if the lock is
        no longer ours."""
        try:
            self._put(IfMatch=str(self.etag))
            return
        except Exception as exc:  # noqa: BLE001 - any failure: find out whether we still hold it
            refused = precondition_failed(exc)
            error = exc
        if refused:
            try:
                if self._adopt_if_ours(self._read()):  # our write, whose response was lost
                    self._put(IfMatch=str(self.etag))
                    return
            except Exception as exc:  # noqa: BLE001
                error = exc
        elif time.monotonic() - self._sent_at < self.ttl_s / 2:
            raise error  # a passing network error: the lease still stands; retried next beat
        self.lost = f"{type(error).__name__}: {error}"
        raise LockLost(f"lost the store's write lock ({self.lost})") from error

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            with self._mutex:
                if self._stop.is_set() or self.lost:
                    return
                try:
                    self._renew()
                except LockLost:
                    return
                except Exception:  # noqa: BLE001,S112 - transient: the next beat tries again
                    continue

    def check(self) -> None:
        """Before a commit point: make sure the lease is ours for at least ``ttl / 2`` more
        (renewing it now if half of it is gone); raise :class:`LockLost` otherwise."""
        with self._mutex:
            if self.lost:
                raise LockLost(f"lost the store's write lock ({self.lost}); not publishing")
            if time.monotonic() - self._sent_at >= self.ttl_s / 4:
                try:
                    self._renew()
                except LockLost:
                    raise
                except Exception as exc:  # noqa: BLE001
                    raise LockLost(f"cannot renew the store's write lock: {exc}") from exc
            if time.monotonic() - self._sent_at >= self.ttl_s / 2:
                raise LockLost("the store's write lease expired before it could be renewed")

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
            except FileNotFoundError:
                return
            except OSError as exc:
                if not precondition_failed(exc):
                    raise
                if self._adopt_if_ours(self._read()):  # a write of ours we did not hear of
                    self.fs.call_s3(
                        "delete_object", Bucket=self.bucket, Key=self.key, IfMatch=str(self.etag)
                    )


def holder_info(run_id: str) -> str:
    since = datetime.now(UTC).isoformat(timespec="seconds")
    return f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}, since {since}"
