"""The store versions a server answers from, and the watcher that follows each publish.

A :class:`ServedVersion` is one :class:`~inference.methods.RagEngine` on one published version
of the store (``coinrag.toml``'s ``[published]``: run id and LanceDB table versions), counted
by the requests that hold it. :class:`VersionHolder` hands the current one out
(:meth:`VersionHolder.acquire`) and swaps it atomically (:meth:`VersionHolder.swap`): requests
already holding the old version finish on it, new ones get the new one; the old engine's store
views (index tables, KV readers, chunk tokens) are closed when its last request releases it.
The server's reader lease (``storage.readers``) names every version held
(:meth:`VersionHolder.held`), so ``coinrag gc`` and a build's compaction keep them.

:class:`PublishWatcher` polls the store cheaply (the ``coinrag.toml`` object's size and mtime,
or its ETag on S3: one ``stat``/``HEAD`` per ``poll_interval``; the file is read only when that
changes), opens an engine for a new ``[published]`` record (:meth:`RagEngine.reopen`: the loaded
model and embedder are reused), warms it with one query on the model thread, and swaps. A
version the loaded model cannot serve (:class:`~inference.methods.engine.VersionRefused`: its
KV was built by another model or dtype, another embedder) is refused with one log line; the
old version keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from coinrag.inference.methods.engine import RagEngine, VersionRefused
from coinrag.schemas.leases import published_index_versions

log = logging.getLogger("coinrag.api")


def version_key(published: dict[str, Any] | None) -> tuple[Any, ...]:
    """What identifies a published version: run id, time and the index table versions."""
    p = published or {}
    versions = published_index_versions(p)
    return (p.get("run_id", ""), p.get("time", ""), tuple(sorted(versions.items())))


class ServedVersion:
    """One engine on one published version, with the count of requests holding it."""

    def __init__(self, engine: RagEngine) -> None:
        self.engine = engine
        self.published: dict[str, Any] = dict(engine.published or {})
        self.run_id: str = str(self.published.get("run_id", ""))
        self.key = version_key(engine.published)
        self.refs = 0
        self.retired = False
        self.closed = False


class VersionHolder:
    """The version new requests get; refcounts; closes a retired version's views when its last
    request releases it."""

    def __init__(
        self,
        first: ServedVersion,
        on_swap: Callable[[ServedVersion], None],
        on_held: Callable[[], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._current = first
        self._on_swap = on_swap
        self._on_held = on_held  # called when the versions held change (a swap, a close)
        self.retired_open: list[ServedVersion] = []  # retired, still held by requests
        on_swap(first)

    @property
    def current(self) -> ServedVersion:
        return self._current

    def held(self) -> list[dict[str, Any]]:
        """The ``[published]`` records of the versions held: the current one and the retired
        ones requests still read (what this server's reader lease names)."""
        with self._lock:
            return [v.published for v in [self._current, *self.retired_open] if v.published]

    def acquire(self) -> ServedVersion:
        with self._lock:
            version = self._current
            version.refs += 1
            return version

    def release(self, version: ServedVersion) -> None:
        with self._lock:
            version.refs -= 1
            close = version.retired and version.refs == 0 and not version.closed
            if close:
                version.closed = True
                self.retired_open.remove(version)
        if close:
            _close(version)
            if self._on_held is not None:
                self._on_held()

    def swap(self, new: ServedVersion) -> ServedVersion:
        """Make ``new`` current; the old one is closed now if no request holds it, else when its
        last request releases it. Returns the old one."""
        with self._lock:
            old, self._current = self._current, new
            old.retired = True
            close = old.refs == 0
            if close:
                old.closed = True
            else:
                self.retired_open.append(old)
        self._on_swap(new)
        log.info("serving published run %s (was %s)", new.run_id, old.run_id)
        if close:
            _close(old)
        if self._on_held is not None:
            self._on_held()
        return old


def _close(version: ServedVersion) -> None:
    version.engine.close()
    log.info("closed the store views of run %s", version.run_id)


class PublishWatcher(threading.Thread):
    """Polls the store's published version every ``interval`` seconds; on a change, opens and
    warms an engine for it (``prepare``: called with the new engine, runs the throwaway query on
    the model thread) and swaps it in. Never raises: a version that fails to open or warm is
    retried at the next polls, then refused (one log line) after ``attempts`` failures."""

    def __init__(
        self,
        holder: VersionHolder,
        interval: float,
        prepare: Callable[[RagEngine], None],
        on_refused: Callable[[str], None],
        before_open: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__(name="coinrag-publish-watcher", daemon=True)
        self.holder = holder
        self.interval = interval
        self.prepare = prepare
        self.on_refused = on_refused
        self.before_open = before_open  # called with the new [published] record before reading it
        self._stop = threading.Event()
        self._stamp: Any = self._read_stamp()
        self._refused: tuple[Any, ...] | None = None
        self._failures: dict[tuple[Any, ...], int] = {}  # version -> failed attempts to open
        self.attempts = 3  # a version that fails to open this often is refused
        self.checks = 0

    def _refuse(self, stamp: Any, key: tuple[Any, ...], why: str) -> None:
        """Never try this version again (until the file changes); the old one keeps serving."""
        self._stamp, self._refused = stamp, key
        current = self.holder.current.run_id
        message = f"refused published run {key[0]}: {why}; still serving run {current}"
        log.error(message)
        self.on_refused(message)

    def stop(self) -> None:
        self._stop.set()

    def _read_stamp(self) -> Any:
        """The settings file's size and mtime (local) or ETag (object store): what changes when
        a writer replaces it."""
        store = self.holder.current.engine.store
        fs, path = store.fs, store.uri(store.settings_path)
        try:
            fs.invalidate_cache(path)  # s3fs caches listings; a local file system has none
            info = fs.info(path)
        except FileNotFoundError:
            return None
        return tuple(info.get(k) for k in ("ETag", "etag", "size", "mtime", "ino"))

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # the watcher must outlive any one failure
                log.exception("checking the published version failed (retried)")

    def check(self) -> bool:
        """One poll: swap when the published version changed. Returns True on a swap."""
        self.checks += 1
        stamp = self._read_stamp()
        if stamp == self._stamp:
            return False
        current = self.holder.current
        toml = current.engine.store.read_toml()
        key = version_key(toml.get("published"))
        if key == current.key or key == self._refused:
            self._stamp = stamp
            return False
        started = time.perf_counter()
        engine = None
        try:
            if self.before_open is not None and toml.get("published"):
                self.before_open(toml["published"])
            engine = current.engine.reopen(toml)
            self.prepare(engine)
        except VersionRefused as exc:
            self._refuse(stamp, key, str(exc))
            return False
        except Exception as exc:  # e.g. a corrupt entry met by the warm-up: retried, then refused
            if engine is not None:
                engine.close()
            self._failures[key] = self._failures.get(key, 0) + 1
            if self._failures[key] >= self.attempts:
                self._refuse(stamp, key, f"{type(exc).__name__}: {exc}")
                return False
            raise
        self.holder.swap(ServedVersion(engine))
        self._stamp = stamp
        log.info("opened run %s in %.0f ms", key[0], (time.perf_counter() - started) * 1000)
        return True
