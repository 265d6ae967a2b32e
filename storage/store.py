"""The store: a directory (or object-storage prefix) the user owns, its layout, the lock.

```
STORE/
  coinrag.toml            settings the store was last built with (never secrets)
  tables/<table>/         Parquet, one schema per table in schemas/tables.py
  staging/<table>/        rows written as they were computed, not yet moved into the table
  kv/<kv_fp>/             Zarr: per-chunk K/V of one generation model and prompt prefix
  index/                  LanceDB: chunks, nuggets, documents
  cartridges/<model_fp>/  Zarr: trained cartridges
  models/                 models written by training flows
  reports/                plots and evaluation results
  .prefect/               local working state of builds (the Batch API's submitted batches)
  .lock                   held by the one writing build
```

A store is a local folder (the default) or an object-storage URL, ``s3://bucket/prefix``
(``storage/location.py``: credentials from the environment only). For both, ``Store.fs`` is
an fsspec file system and the ``*_dir`` paths are paths on it: a ``pathlib.Path`` for a local
store, a ``PurePosixPath`` ``bucket/prefix/...`` for an object store (``Store.uri`` turns one
into the URL that LanceDB and DuckDB take). Local stores keep their fast paths (rename,
O_DIRECT, flock); object stores replace each rename by a single PUT or a copy, as the modules
that write say.

The builds' local working state (``.prefect/``: the Batch API's submitted batch ids): for an
object store it lives in ``$COINRAG_CACHE/stores/<hash of the URL>/.prefect`` on the machine that
runs the build (losing it costs at most a resubmitted batch: every stage finds its done work in
the tables).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from coinrag.storage.location import object_filesystem, split_store_url


class StoreLocked(RuntimeError):
    """Another process holds the store's write lock."""

    exit_code = 1


class LocalStoreRequired(ValueError):
    """An operation that needs a local store was asked of an object store."""

    exit_code = 1


_LOCKS: dict[str, Any] = {}  # url -> the ObjectLock this process holds on an object store


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def safe_component(name: str) -> str:
    """Check that ``name`` can be one path component inside the store (no ``/``, no ``..``).

    Ids chosen by users never become paths; only our own hashes and run ids do, and this guard
    makes that a checked rule rather than a habit.
    """
    if not _SAFE_NAME.match(name) or name in {".", ".."}:
        raise ValueError(f"{name!r} is not a safe store path component")
    return name


@dataclass(frozen=True)
class Store:
    """Paths of one store. Creating the object touches nothing; :meth:`init` makes the folders.

    ``root``: the store's folder (an absolute ``Path``) or, for an object store, its
    ``bucket/prefix`` (a ``PurePosixPath``) on the file system of ``scheme`` (``"s3"``).
    """

    root: PurePath
    scheme: str = ""

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> Store:
        """The store at a local path or an object-storage URL (``s3://bucket/prefix``)."""
        scheme, rest = split_store_url(os.fspath(path))
        if scheme:
            return cls(PurePosixPath(rest), scheme)
        return cls(Path(rest).expanduser().resolve())

    def __str__(self) -> str:
        return self.url

    @property
    def is_local(self) -> bool:
        return not self.scheme

    @property
    def url(self) -> str:
        """The store as the user names it: a local path or ``s3://bucket/prefix``."""
        return self.uri(self.root)

    def uri(self, path: PurePath) -> str:
        """A path of this store as a URL (what LanceDB and DuckDB take)."""
        return str(path) if self.is_local else f"{self.scheme}://{path}"

    @property
    def fs(self) -> Any:
        """The fsspec file system the store's paths live on."""
        if self.is_local:
            from fsspec.implementations.local import LocalFileSystem

            return LocalFileSystem()
        return object_filesystem(self.scheme)

    def require_local(self, what: str) -> Path:
        """The local folder, or :class:`LocalStoreRequired` naming ``what`` needs one."""
        if not self.is_local:
            raise LocalStoreRequired(
                f"{what} needs a local store; {self.url} is in object storage (there, coinrag "
                "supports build, delete, gc, lineage, query, eval, serve and watch)"
            )
        return Path(self.root)

    def init(self) -> Store:
        if self.is_local:
            for sub in ("tables", "kv", "index", "cartridges", "models", "reports"):
                (Path(self.root) / sub).mkdir(parents=True, exist_ok=True)
        # Object stores have no folders: a prefix exists once an object is written under it.
        return self

    def exists(self) -> bool:
        if self.is_local:
            return (Path(self.root) / "tables").is_dir()
        return bool(self.list_names(self.root / "tables")) or self.is_file(self.settings_path)

    # -------------------------------------------------------------- file operations (both)

    def is_file(self, path: PurePath) -> bool:
        if self.is_local:
            return Path(path).is_file()
        return bool(self.fs.isfile(str(path)))

    def list_names(self, folder: PurePath) -> list[str]:
        """Names of the entries directly under ``folder`` (files and folders), sorted; empty if
        it does not exist."""
        if self.is_local:
            folder = Path(folder)
            return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        try:
            found = self.fs.ls(str(folder), detail=False)
        except FileNotFoundError:
            return []
        return sorted(PurePosixPath(p).name for p in found if p.rstrip("/") != str(folder))

    def read_bytes(self, path: PurePath) -> bytes:
        return Path(path).read_bytes() if self.is_local else bytes(self.fs.cat_file(str(path)))

    def write_bytes_atomic(self, path: PurePath, data: bytes) -> None:
        """Replace ``path`` with ``data`` in one step: a reader sees the old object or the new
        one. Local: a temporary file renamed into place; object store: one PUT (atomic per
        object)."""
        if self.is_local:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(str(path), data)

    def remove(self, path: PurePath) -> None:
        """Remove a file or a folder with everything under it (nothing if it is missing)."""
        if self.is_local:
            import shutil

            path = Path(path)
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            return
        try:
            self.fs.rm(str(path), recursive=True)
        except FileNotFoundError:
            pass

    def tree_bytes(self, path: PurePath) -> int:
        """Bytes of the files under ``path`` (or of the file itself); 0 if missing."""
        if self.is_local:
            path = Path(path)
            if not path.exists():
                return 0
            if path.is_file():
                return path.stat().st_size
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        try:
            return int(self.fs.du(str(path), total=True))
        except FileNotFoundError:
            return 0

    # -------------------------------------------------------------- layout

    def table_dir(self, table: str) -> PurePath:
        return self.root / "tables" / safe_component(table)

    def staging_dir(self, table: str) -> PurePath:
        """Rows computed (by a worker, maybe) but not yet in the table: ``STORE/staging/<table>``
        (``storage.tables.stage_rows``); the store's writer moves them in."""
        return self.root / "staging" / safe_component(table)

    def kv_dir(self, kv_fp: str) -> PurePath:
        return self.root / "kv" / safe_component(kv_fp)

    @property
    def index_dir(self) -> PurePath:
        return self.root / "index"

    def cartridges_dir(self, model_fp: str) -> Path:
        return self.require_local("training cartridges") / "cartridges" / safe_component(model_fp)

    @property
    def reports_dir(self) -> Path:
        return self.require_local("writing reports into the store") / "reports"

    @property
    def models_dir(self) -> Path:
        return self.require_local("training models") / "models"

    @property
    def prefect_dir(self) -> Path:
        """Local working state of this store's builds (always a local folder, see above)."""
        if self.is_local:
            return Path(self.root) / ".prefect"
        cache = Path(os.environ.get("COINRAG_CACHE", Path.home() / ".cache" / "coinrag"))
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        return cache / "stores" / digest / ".prefect"

    @property
    def settings_path(self) -> PurePath:
        return self.root / "coinrag.toml"

    def write_settings(
        self, settings: dict[str, Any] | None, published: dict[str, Any] | None = None
    ) -> None:
        """Record the settings of the last build (``[build]``) and, with ``published``, the
        state it published (``[published]``: run id and index table versions) as TOML.

        One atomic write (temporary file, then rename): this is the commit point of a build or
        a deletion. Readers see the old file or the new one, never a mix. ``settings=None``
        keeps the recorded ``[build]`` table; ``published=None`` keeps ``[published]``. Values
        are str/int/float/bool or nested tables of them.
        """
        current = self.read_toml()
        tables = {
            "build": current.get("build", {}) if settings is None else settings,
            "published": current.get("published") if published is None else published,
        }
        lines = ["# settings of the last build of this store and what it published (coinrag)"]
        for name, table in tables.items():
            if table is not None:
                lines += _toml_table(name, table)
        self.check_write_lock()
        self.write_bytes_atomic(self.settings_path, ("\n".join(lines) + "\n").encode("utf-8"))

    def read_toml(self) -> dict[str, Any]:
        """``STORE/coinrag.toml`` as a dict (empty if it does not exist yet)."""
        import tomllib

        try:
            data = self.read_bytes(self.settings_path)
        except FileNotFoundError:
            return {}
        try:
            return tomllib.loads(data.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.uri(self.settings_path)} is not valid TOML: {exc}") from exc

    def published(self) -> dict[str, Any] | None:
        """What the last completed build (or deletion) published, or None if nothing has been
        published yet (a store written by stages alone, or by an older coinrag)."""
        return self.read_toml().get("published")

    def check_write_lock(self) -> None:
        """Before a commit point on an object store whose lease this process holds: renew the
        lease if half of it is gone, and raise ``storage.object_lock.LockLost`` if it was lost
        (taken over by another writer): never publish after losing it. Nothing to do for local
        stores (flock is held until the process ends) or when this process holds no lease."""
        held = _LOCKS.get(self.url)
        if held is not None:
            held.check()

    @contextmanager
    def write_lock(self, run_id: str) -> Iterator[None]:
        """Hold ``STORE/.lock`` for the duration; a second writer gets :class:`StoreLocked`.

        Local: an OS-level lock (flock), released when the holder dies, so a killed build never
        leaves the store locked. Object store: a lease object (``storage/object_lock.py``):
        created conditionally, kept by a heartbeat, taken over once its holder is silent.
        """
        if not self.is_local:
            with self._object_lock(run_id):
                yield
            return
        Path(self.root).mkdir(parents=True, exist_ok=True)
        path = Path(self.root) / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._locked(path) from None
            os.ftruncate(fd, 0)
            info = f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}, since "
            os.write(fd, (info + datetime.now(UTC).isoformat()).encode())
            yield
        finally:
            os.close(fd)

    def _locked(self, path: Path) -> StoreLocked:
        holder = path.read_text(encoding="utf-8", errors="replace").strip()
        return StoreLocked(
            f"store {self.url} is being written by another build ({holder or 'unknown'}); "
            "wait for it to finish, or stop it"
        )

    def check_unlocked(self) -> None:
        """Raise :class:`StoreLocked` now if another process holds the write lock of this
        local store (a probe: the lock is taken and dropped at once; the writer takes it for
        real later). What the CLI checks before any work; an object store's lease is checked
        when it is taken."""
        if not self.is_local:
            return
        path = Path(self.root) / ".lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._locked(path) from None
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @contextmanager
    def _object_lock(self, run_id: str) -> Iterator[None]:
        from coinrag.storage.object_lock import LockContention, ObjectLock, holder_info

        lock = ObjectLock(self.fs, str(self.root / ".lock"), holder_info(run_id))
        try:
            lock.acquire()
        except LockContention as exc:
            raise StoreLocked(
                f"store {self.url} is being written by another build ({exc.holder}); "
                "wait for it to finish, or stop it"
            ) from None
        _LOCKS[self.url] = lock
        try:
            yield
        finally:
            _LOCKS.pop(self.url, None)
            lock.release()


def _toml_table(name: str, table: dict[str, Any]) -> list[str]:
    """TOML lines of one table: scalars first, then its sub-tables (``[name.sub]``)."""
    lines = [f"[{name}]"]
    subs = []
    for key, value in table.items():
        if value is None:
            continue
        if isinstance(value, dict):
            subs.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {json.dumps(value)}")
    for key, value in subs:
        lines += _toml_table(f"{name}.{_toml_key(key)}", value)
    return lines


def _toml_key(key: Any) -> str:
    """A bare TOML key where allowed (letters, digits, ``_``, ``-``), else a quoted one."""
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else json.dumps(text)
