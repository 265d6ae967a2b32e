"""Reader leases in the store (``STORE/readers/<reader>.json``, record: ``schemas.leases``).

A long-lived reader (the ``coinrag api`` server) holds a lease naming the published versions it
reads; ``gc`` (``storage.gc``) keeps what fresh leases name: their LanceDB table versions and
the KV entries their index rows point to. :class:`ReaderLeaseHolder` writes and renews one
lease from a daemon thread; :func:`fresh_leases` and :func:`stale_lease_paths` are what gc
reads. Files go through :class:`~storage.store.Store` (local folders and ``s3://`` alike; each
write is one atomic replace or PUT).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

from coinrag.schemas.leases import READER_LEASE_TTL_S, ReaderLease
from coinrag.storage.store import Store

log = logging.getLogger("coinrag.readers")

READERS_DIR = "readers"
_SUFFIX = ".json"


def readers_dir(store: Store) -> PurePath:
    return store.root / READERS_DIR


def lease_path(store: Store, reader: str) -> PurePath:
    return readers_dir(store) / f"{reader}{_SUFFIX}"


def _leases(store: Store) -> list[tuple[PurePath, ReaderLease | None]]:
    """Every lease file with its record (None: unreadable, e.g. cut short)."""
    out: list[tuple[PurePath, ReaderLease | None]] = []
    for name in store.list_names(readers_dir(store)):
        if not name.endswith(_SUFFIX) or name.startswith("."):
            continue
        path = readers_dir(store) / name
        try:
            out.append((path, ReaderLease.from_json(store.read_bytes(path))))
        except FileNotFoundError:
            continue  # released between the listing and the read
        except (ValueError, KeyError, TypeError):
            out.append((path, None))
    return out


def fresh_leases(store: Store, now_unix: float | None = None) -> list[ReaderLease]:
    """The leases not yet expired at ``now_unix`` (default: now)."""
    now = time.time() if now_unix is None else now_unix
    return [lease for _, lease in _leases(store) if lease is not None and lease.fresh(now)]


def stale_lease_paths(store: Store, now_unix: float | None = None) -> list[PurePath]:
    """Lease files of readers that stopped renewing (expired) or that cannot be read."""
    now = time.time() if now_unix is None else now_unix
    return [path for path, lease in _leases(store) if lease is None or not lease.fresh(now)]


class ReaderLeaseHolder:
    """One reader's lease: written by :meth:`hold` (now and then every ``ttl_s / 3`` seconds
    from a daemon thread, with what ``versions()`` returns then) and removed by
    :meth:`release`. A failed renewal is logged and retried at the next beat (the lease stays
    fresh for ``ttl_s`` after the last good one)."""

    def __init__(
        self,
        store: Store,
        versions: Callable[[], list[dict[str, Any]]],
        ttl_s: float = READER_LEASE_TTL_S,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a reader lease needs ttl_s > 0; got {ttl_s}")
        self.store = store
        self.versions = versions
        self.ttl_s = float(ttl_s)
        self.reader = uuid.uuid4().hex
        self.path = lease_path(store, self.reader)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()

    def renew(self, extra: list[dict[str, Any]] | None = None) -> ReaderLease:
        """Write the lease now: the held versions, plus ``extra`` (a version about to be
        opened: leased before it is read)."""
        held = list(self.versions()) + list(extra or [])
        unique = list({repr(sorted(v.items())): v for v in held}.values())
        lease = ReaderLease(
            reader=self.reader,
            host=socket.gethostname(),
            pid=os.getpid(),
            expires_unix=time.time() + self.ttl_s,
            versions=unique,
        )
        with self._write_lock:
            if not self._stop.is_set():
                self.store.write_bytes_atomic(self.path, lease.to_json())
        return lease

    def hold(self) -> None:
        """Write the lease and start renewing it. A store this reader cannot write (read-only
        credentials) logs one warning and is retried at each beat: reading goes on."""
        try:
            self.renew()
        except Exception as exc:
            log.warning(
                "cannot write the reader lease %s (%s): gc may prune versions this reader holds",
                self.store.uri(self.path),
                exc,
            )
        self._thread = threading.Thread(target=self._beat, name="coinrag-reader-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except Exception:  # an unreachable store: retried at the next beat
                log.exception("renewing the reader lease %s failed (retried)", self.path)

    def release(self) -> None:
        """Stop renewing and remove the lease file."""
        with self._write_lock:
            self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.store.remove(self.path)
            self.store.remove_empty_folder(readers_dir(self.store))  # the last reader leaves none
        except OSError:
            pass  # another reader's lease appeared meanwhile: the folder stays
        except Exception:
            log.exception("removing the reader lease %s failed (it expires by itself)", self.path)
