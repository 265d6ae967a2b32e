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
(``storage/location.py``: credentials from the environment only): the subclasses
:class:`LocalStore` and :class:`ObjectStore` of :class:`Store`, which ``Store.at`` picks from the
path; code outside this module asks the store (``write_parquet``, ``download``,
``connect_lance``, ...) instead of testing where it lives. For both, ``Store.fs`` is
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
import io
import os
import re
import shutil
import socket
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePath, PurePosixPath
from typing import TYPE_CHECKING, Any, ClassVar

from coinrag.storage.location import lance_storage_options, object_filesystem, split_store_url
from coinrag.storage.toml_lines import toml_table

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa
    import pyarrow.dataset as ds

    from coinrag.schemas.settings import BuildSettings


class StoreLocked(RuntimeError):
    """Another process holds the store's write lock."""

    exit_code = 1


class LocalStoreRequired(ValueError):
    """An operation that needs a local store was asked of an object store."""

    exit_code = 1


class StoreLocationError(ValueError):
    """A local store path that cannot hold a store: a file, under a file, or not writable."""

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
class Store(ABC):
    """Paths of one store. Creating the object touches nothing; :meth:`init` makes the folders.

    ``root``: the store's folder (an absolute ``Path``) or, for an object store, its
    ``bucket/prefix`` (a ``PurePosixPath``) on the file system of ``scheme`` (``"s3"``).

    What differs between the two locations is chosen by subclass: :class:`LocalStore` (a
    folder: renames, flock, hard links) and :class:`ObjectStore` (``s3://``: one PUT per file,
    a lease object for the lock). :meth:`at` picks one from the path the user gives.
    """

    root: PurePath
    scheme: str = ""
    is_local: ClassVar[bool]

    @staticmethod
    def at(path: str | os.PathLike[str]) -> Store:
        """The store at a local path or an object-storage URL (``s3://bucket/prefix``)."""
        scheme, rest = split_store_url(os.fspath(path))
        if scheme:
            return ObjectStore(PurePosixPath(rest), scheme)
        return LocalStore(Path(rest).expanduser().resolve())

    def __str__(self) -> str:
        return self.url

    @property
    def url(self) -> str:
        """The store as the user names it: a local path or ``s3://bucket/prefix``."""
        return self.uri(self.root)

    @abstractmethod
    def uri(self, path: PurePath) -> str:
        """A path of this store as a URL (what LanceDB and DuckDB take)."""

    @abstractmethod
    def absolute_uri(self, path: PurePath) -> str:
        """The name DuckDB reads a store file by: an absolute local path, or an ``s3://`` URL."""

    @property
    @abstractmethod
    def fs(self) -> Any:
        """The fsspec file system the store's paths live on."""

    @abstractmethod
    def parquet_dataset(self, files: Sequence[PurePath], schema: pa.Schema) -> ds.Dataset:
        """Parquet ``files`` as one Arrow dataset of ``schema`` (a column an older file lacks
        reads as nulls), for scans with columns and filters."""

    @abstractmethod
    def require_local(self, what: str) -> Path:
        """The local folder, or :class:`LocalStoreRequired` naming ``what`` needs one."""

    @abstractmethod
    def local_path(self, path: PurePath) -> Path | None:
        """``path`` as a local file a local tool can open, or None for an object store."""

    @abstractmethod
    def check_creatable(self, named: str) -> None:
        """Raise :class:`StoreLocationError` (its message starts with ``named``, how the user
        named the store) unless a build can create or update a store here. Local: a folder
        (or a folder to create), never a file, with a writable nearest existing folder above
        it. Object store: always (a prefix is made by writing under it)."""

    @abstractmethod
    def check_not_a_file(self, named: str) -> None:
        """Raise :class:`StoreLocationError` if the local store path is a file (an object
        store's prefix never is)."""

    @abstractmethod
    def removed_if_left_empty(self) -> AbstractContextManager[None]:
        """A block (a build) that, when it fails, removes the store folder it created if
        nothing but empty folders (and the lock file) is in it, so a failed first build leaves
        no empty store. Nothing to remove in object storage (no folders)."""

    @abstractmethod
    def init(self) -> Store:
        """Make the store's folders (nothing to make in object storage); returns ``self``."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether a store has been written here."""

    # -------------------------------------------------------------- file operations

    @abstractmethod
    def is_file(self, path: PurePath) -> bool: ...

    @abstractmethod
    def list_names(self, folder: PurePath) -> list[str]:
        """Names of the entries directly under ``folder`` (files and folders), sorted; empty if
        it does not exist."""

    @abstractmethod
    def read_bytes(self, path: PurePath) -> bytes: ...

    @abstractmethod
    def write_bytes_atomic(self, path: PurePath, data: bytes) -> None:
        """Replace ``path`` with ``data`` in one step: a reader sees the old object or the new
        one. Local: a temporary file renamed into place; object store: one PUT (atomic per
        object)."""

    @abstractmethod
    def write_parquet(self, path: PurePath, table: pa.Table) -> None:
        """Write ``table`` as the new Parquet file ``path`` (zstd) in one step. Local: written
        to ``.<name>.tmp`` beside it, then renamed; object store: one PUT."""

    @abstractmethod
    def remove(self, path: PurePath) -> None:
        """Remove a file or a folder with everything under it (nothing if it is missing)."""

    @abstractmethod
    def remove_empty_folder(self, folder: PurePath) -> None:
        """Remove ``folder`` if nothing is left in it (a folder that holds something stays);
        object stores have no folders, so nothing to do there."""

    @abstractmethod
    def tree_bytes(self, path: PurePath) -> int:
        """Bytes of the files under ``path`` (or of the file itself); 0 if missing."""

    @abstractmethod
    def temp_files(self, patterns: Iterable[str]) -> list[PurePath]:
        """Files and folders matching the glob ``patterns`` (relative to the root) that killed
        local writes left. An object store writes no temporary files (each file is one PUT):
        always empty there."""

    @abstractmethod
    def download(self, folder: PurePath, dest: Path, link_under: Iterable[str] = ()) -> None:
        """Copy the files under ``folder`` into the local folder ``dest``. Local: files inside
        a sub-folder named in ``link_under`` (files written once, never rewritten) are hard
        links, the rest copies; object store: everything downloaded."""

    @property
    @abstractmethod
    def scratch_base(self) -> Path:
        """A local folder for scratch copies: the store's own folder (so hard links work), or
        the system's temporary folder for an object store."""

    @abstractmethod
    def connect_lance(self, folder: PurePath) -> Any:
        """A LanceDB connection to the database at ``folder`` (made if missing)."""

    @abstractmethod
    def register_with_duckdb(self, con: duckdb.DuckDBPyConnection) -> None:
        """Let ``con`` read this store's files (before its configuration is locked)."""

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
    @abstractmethod
    def prefect_dir(self) -> Path:
        """Local working state of this store's builds (always a local folder, see above)."""

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
                lines += toml_table(name, table)
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

    # -------------------------------------------------------------- the write lock

    def check_write_lock(self) -> None:
        """Before a commit point on an object store whose lease this process holds: renew the
        lease if half of it is gone, and raise ``storage.object_lock.LockLost`` if it was lost
        (taken over by another writer): never publish after losing it. Nothing to do for local
        stores (flock is held until the process ends) or when this process holds no lease."""
        held = _LOCKS.get(self.url)
        if held is not None:
            held.check()

    @abstractmethod
    def write_lock(self, run_id: str) -> AbstractContextManager[None]:
        """Hold ``STORE/.lock`` for the duration; a second writer gets :class:`StoreLocked`.

        Local: an OS-level lock (flock), released when the holder dies, so a killed build never
        leaves the store locked. Object store: a lease object (``storage/object_lock.py``):
        created conditionally, kept by a heartbeat, taken over once its holder is silent.
        """

    @abstractmethod
    def check_unlocked(self) -> None:
        """Raise :class:`StoreLocked` now if another process holds the write lock of this
        local store (a probe: the lock is taken and dropped at once; the writer takes it for
        real later). What the CLI checks before any work; an object store's lease is checked
        when it is taken."""

    def _locked(self, holder: str) -> StoreLocked:
        return StoreLocked(
            f"store {self.url} is being written by another build ({holder or 'unknown'}); "
            "wait for it to finish, or stop it"
        )


@dataclass(frozen=True)
class LocalStore(Store):
    """A store in a local folder (``root``: an absolute ``Path``)."""

    is_local: ClassVar[bool] = True

    def uri(self, path: PurePath) -> str:
        return str(path)

    def absolute_uri(self, path: PurePath) -> str:
        return os.path.abspath(path)

    @property
    def fs(self) -> Any:
        from fsspec.implementations.local import LocalFileSystem

        return LocalFileSystem()

    def parquet_dataset(self, files: Sequence[PurePath], schema: pa.Schema) -> ds.Dataset:
        import pyarrow.dataset as ds

        return ds.dataset([str(f) for f in files], schema=schema, format="parquet")

    def require_local(self, what: str) -> Path:
        return Path(self.root)

    def local_path(self, path: PurePath) -> Path | None:
        return Path(path)

    def check_creatable(self, named: str) -> None:
        root = Path(self.root)
        if root.exists() and not root.is_dir():
            raise StoreLocationError(
                f"{named} is a file, not a folder: give a folder (created if absent)"
            )
        existing = root
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise StoreLocationError(
                f"{named}: {existing} is a file, so no folder can be made there"
            )
        if not os.access(existing, os.W_OK | os.X_OK):
            raise StoreLocationError(f"{named}: {existing} is not writable by this user")

    def check_not_a_file(self, named: str) -> None:
        if Path(self.root).is_file():
            raise StoreLocationError(f"{named} is a file, not a coinrag store (a folder)")

    @contextmanager
    def removed_if_left_empty(self) -> Iterator[None]:
        root = Path(self.root)
        existed = root.exists()
        try:
            yield
        except BaseException:
            if not existed and root.is_dir():
                inside = list(root.rglob("*"))
                if all(p.is_dir() or p.name == ".lock" for p in inside):  # only the skeleton
                    for folder in sorted((p for p in inside if p.is_dir()), reverse=True):
                        folder.rmdir()
                    (root / ".lock").unlink(missing_ok=True)
                    root.rmdir()
            raise

    def init(self) -> Store:
        for sub in ("tables", "kv", "index", "cartridges", "models", "reports"):
            (Path(self.root) / sub).mkdir(parents=True, exist_ok=True)
        return self

    def exists(self) -> bool:
        return (Path(self.root) / "tables").is_dir()

    def is_file(self, path: PurePath) -> bool:
        return Path(path).is_file()

    def list_names(self, folder: PurePath) -> list[str]:
        folder = Path(folder)
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    def read_bytes(self, path: PurePath) -> bytes:
        return Path(path).read_bytes()

    def write_bytes_atomic(self, path: PurePath, data: bytes) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def write_parquet(self, path: PurePath, table: pa.Table) -> None:
        import pyarrow.parquet as pq

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)

    def remove(self, path: PurePath) -> None:
        path = Path(path)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    def remove_empty_folder(self, folder: PurePath) -> None:
        if not self.list_names(folder):
            Path(folder).rmdir()

    def tree_bytes(self, path: PurePath) -> int:
        path = Path(path)
        if not path.exists():
            return 0
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    def temp_files(self, patterns: Iterable[str]) -> list[PurePath]:
        root = Path(self.root)
        return sorted({found for pattern in patterns for found in root.glob(pattern)})

    def download(self, folder: PurePath, dest: Path, link_under: Iterable[str] = ()) -> None:
        src, links = Path(folder), set(link_under)
        for path in src.rglob("*"):
            if not path.is_file():
                continue
            rel = path.relative_to(src)
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if links.intersection(rel.parts[:-1]):
                os.link(path, target)
            else:
                shutil.copy2(path, target)

    @property
    def scratch_base(self) -> Path:
        return Path(self.root)

    def connect_lance(self, folder: PurePath) -> Any:
        import lancedb

        Path(folder).mkdir(parents=True, exist_ok=True)
        return lancedb.connect(str(folder))

    def register_with_duckdb(self, con: duckdb.DuckDBPyConnection) -> None:
        pass  # DuckDB reads local files itself

    @property
    def prefect_dir(self) -> Path:
        return Path(self.root) / ".prefect"

    @contextmanager
    def write_lock(self, run_id: str) -> Iterator[None]:
        Path(self.root).mkdir(parents=True, exist_ok=True)
        path = Path(self.root) / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._locked_by(path) from None
            os.ftruncate(fd, 0)
            info = f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}, since "
            os.write(fd, (info + datetime.now(UTC).isoformat()).encode())
            yield
        finally:
            os.close(fd)

    def _locked_by(self, path: Path) -> StoreLocked:
        return self._locked(path.read_text(encoding="utf-8", errors="replace").strip())

    def check_unlocked(self) -> None:
        path = Path(self.root) / ".lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise self._locked_by(path) from None
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class ObjectStore(Store):
    """A store under an object-storage prefix (``root``: ``bucket/prefix``, a
    ``PurePosixPath``, on the file system of ``scheme``)."""

    is_local: ClassVar[bool] = False

    def uri(self, path: PurePath) -> str:
        return f"{self.scheme}://{path}"

    def absolute_uri(self, path: PurePath) -> str:
        return self.uri(path)

    @property
    def fs(self) -> Any:
        return object_filesystem(self.scheme)

    def parquet_dataset(self, files: Sequence[PurePath], schema: pa.Schema) -> ds.Dataset:
        """The files' bytes fetched here, all at once (fsspec's own I/O), and scanned from
        memory. Arrow never reads through fsspec: its I/O threads would call into Python, and a
        process that exits while a scan runs in another thread (a server's store watcher) then
        aborts in finalization ("PyGILState_Release: thread state ... must be current",
        exit 134; ``tests/storage/test_object_store_exit.py``). Whole files are fetched, also
        for a scan of a few columns: a store's table files are small (one per run and stage).
        Each copied into Arrow's memory: a fragment over Python ``bytes`` takes the GIL when
        Arrow's own worker frees it, which aborts a process that finalizes meanwhile."""
        import pyarrow as pa
        import pyarrow.dataset as ds

        from coinrag.storage.exit_gate import arrow_owned

        blobs = self.fs.cat_ranges([str(f) for f in files], None, None, on_error="raise")
        parquet = ds.ParquetFileFormat()
        fragments = [parquet.make_fragment(pa.BufferReader(arrow_owned(b))) for b in blobs]
        return ds.FileSystemDataset(fragments, schema=schema, format=parquet)

    def require_local(self, what: str) -> Path:
        raise LocalStoreRequired(
            f"{what} needs a local store; {self.url} is in object storage (there, coinrag "
            "supports build, delete, gc, lineage, query, eval, serve and watch)"
        )

    def local_path(self, path: PurePath) -> Path | None:
        return None

    def check_creatable(self, named: str) -> None:
        pass  # a prefix is made by writing under it

    def check_not_a_file(self, named: str) -> None:
        pass  # a prefix is never a file

    def removed_if_left_empty(self) -> AbstractContextManager[None]:
        return nullcontext()  # no folders to remove

    def init(self) -> Store:
        return self  # no folders: a prefix exists once an object is written under it

    def exists(self) -> bool:
        return bool(self.list_names(self.root / "tables")) or self.is_file(self.settings_path)

    def is_file(self, path: PurePath) -> bool:
        return bool(self.fs.isfile(str(path)))

    def list_names(self, folder: PurePath) -> list[str]:
        try:
            found = self.fs.ls(str(folder), detail=False)
        except FileNotFoundError:
            return []
        return sorted(PurePosixPath(p).name for p in found if p.rstrip("/") != str(folder))

    def read_bytes(self, path: PurePath) -> bytes:
        return bytes(self.fs.cat_file(str(path)))

    def write_bytes_atomic(self, path: PurePath, data: bytes) -> None:
        self.fs.pipe_file(str(path), data)

    def write_parquet(self, path: PurePath, table: pa.Table) -> None:
        import pyarrow.parquet as pq

        buffer = io.BytesIO()
        pq.write_table(table, buffer, compression="zstd")
        self.fs.pipe_file(str(path), buffer.getvalue())

    def remove(self, path: PurePath) -> None:
        try:
            self.fs.rm(str(path), recursive=True)
        except FileNotFoundError:
            pass

    def remove_empty_folder(self, folder: PurePath) -> None:
        pass  # no folders in object storage

    def tree_bytes(self, path: PurePath) -> int:
        try:
            return int(self.fs.du(str(path), total=True))
        except FileNotFoundError:
            return 0

    def temp_files(self, patterns: Iterable[str]) -> list[PurePath]:
        return []

    def download(self, folder: PurePath, dest: Path, link_under: Iterable[str] = ()) -> None:
        self.fs.get(str(folder) + "/", str(dest) + "/", recursive=True)

    @property
    def scratch_base(self) -> Path:
        return Path(tempfile.gettempdir())

    def connect_lance(self, folder: PurePath) -> Any:
        import lancedb

        return lancedb.connect(self.uri(folder), storage_options=lance_storage_options(self.scheme))

    def register_with_duckdb(self, con: duckdb.DuckDBPyConnection) -> None:
        # DuckDB reads s3:// paths through s3fs, calling into Python: a thread that queries an
        # object store must end (or be joined) before the interpreter exits, or the exit aborts
        # ("PyGILState_Release ...", exit 134): the server joins its explorer's warm-up
        con.register_filesystem(self.fs)

    @property
    def prefect_dir(self) -> Path:
        cache = Path(os.environ.get("COINRAG_CACHE", Path.home() / ".cache" / "coinrag"))
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        return cache / "stores" / digest / ".prefect"

    @contextmanager
    def write_lock(self, run_id: str) -> Iterator[None]:
        from coinrag.storage.object_lock import LockContention, ObjectLock, holder_info

        lock = ObjectLock(self.fs, str(self.root / ".lock"), holder_info(run_id))
        try:
            lock.acquire()
        except LockContention as exc:
            raise self._locked(exc.holder) from None
        _LOCKS[self.url] = lock
        try:
            yield
        finally:
            _LOCKS.pop(self.url, None)
            lock.release()

    def check_unlocked(self) -> None:
        pass  # the lease is checked when it is taken


def store_settings(store: Store) -> BuildSettings:
    """The settings ``store`` was built with (``STORE/coinrag.toml``; the defaults for what it
    does not record, e.g. ``kv_keep = "chunks"`` for a store built before the setting)."""
    from coinrag.schemas.settings import settings_from_toml

    return settings_from_toml(store.read_toml(), store.uri(store.settings_path))
