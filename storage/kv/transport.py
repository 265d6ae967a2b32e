"""Where the KV store's bytes live: local disk or an object store, behind one interface.

:class:`KvStore` never asks where its files are; it asks its :class:`KvTransport`
(:func:`transport_for` picks one per store) to

- create the group (``zarr.json`` of ``STORE/kv/<kv_fp>/``) atomically;
- stage a shard: the shard is always encoded and verified in a *local* folder (on disk: the
  staging folder itself; for an object store: a temporary folder, then uploaded to
  ``.tmp-<uuid>/``, data file first and ``zarr.json`` last, and read back: crc32c of the whole
  data file against the local one);
- publish a staged shard as the next free ``shard-NNNNNN`` (on disk: an atomic rename; for an
  object store: the number claimed with a conditional create of ``shard-NNNNNN/.claim``, so two
  writers never copy into one folder, then server-side copies, data first, ``zarr.json`` last,
  and the staged objects removed). A crash between the copies leaves an orphan prefix that
  ``gc`` removes, as a crash before a rename does on disk: no manifest row points to it yet;
- install a new folder whole (the prefix ``C_p``), set a damaged one aside;
- read byte ranges of files (the checks, and the slice reads that decode blocks themselves),
  give file sizes, open a Zarr store on a folder (whole entries and the prefix are read through
  Zarr: ``LocalStore`` or ``FsspecStore`` over s3fs).

Listing, reading metadata and removing trees go through :class:`storage.store.Store`, which
already speaks both. The local file helpers (page-aligned buffers, ``O_DIRECT`` writes, fsync)
live here too: both transports encode shards on local disk first.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, ClassVar

import google_crc32c  # zarr's crc32c codec uses it (a dependency of zarr)
import numpy as np
import zarr
from zarr.codecs import Crc32cCodec
from zarr.storage import FsspecStore, LocalStore

from coinrag.storage.kv.errors import CorruptKvEntry, KvError, MissingKvEntry, read_problem
from coinrag.storage.kv.layout import ATTR, KvLayout
from coinrag.storage.location import zarr_storage_options
from coinrag.storage.object_lock import precondition_failed
from coinrag.storage.store import Store

_ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and sizes (a page)
_CLAIM = ".claim"  # object stores: created (conditionally) before a shard is copied into place


class KvTransport(ABC):
    """The file operations of one store's KV folder that differ between local disk and an
    object store. Paths are the store's (``Store.kv_dir(...) / ...``)."""

    # Object stores pay a round trip per request, so they remember a shard whose files checked
    # out (objects are written once) and fetch all ranges of a check at once. Both transports
    # read entries and slices as byte ranges decoded here (``ranged_slice_reads``) instead of
    # through Zarr's reader, which reads the shard index and then each block on every read.
    remember_file_checks: ClassVar[bool]
    verify_ranges_at_once: ClassVar[bool]
    ranged_slice_reads: ClassVar[bool]

    def __init__(self, store: Store) -> None:
        self.store = store

    @abstractmethod
    def zarr_store(self, path: PurePath, read_only: bool = False) -> Any:
        """The Zarr store of a folder."""

    @abstractmethod
    def create_group(self, root: PurePath, attributes: dict[str, Any], fsync: bool) -> None:
        """Create the Zarr group ``root`` with ``attributes`` atomically (no-op if another
        writer created it meanwhile)."""

    @abstractmethod
    def size(self, path: PurePath) -> int:
        """Bytes of a file (FileNotFoundError when it is missing)."""

    @abstractmethod
    def free_bytes(self, path: PurePath) -> int | None:
        """Bytes free where ``path`` is (or would be); None when there is no such limit."""

    @abstractmethod
    def read_ranges(
        self, path: PurePath, ranges: Sequence[tuple[int, int]], scratch: ScratchBuffers
    ) -> list[Any]:
        """Byte ranges ``[start, end)`` of one file (OSError when one cannot be read whole).
        May read into ``scratch``: a range is valid until the next call."""

    @abstractmethod
    def fetch_ranges(
        self,
        paths: list[str],
        starts: list[int],
        ends: list[int],
        scratch: ScratchBuffers | None = None,
    ) -> list[Any]:
        """Byte ranges of files, fetched concurrently where the transport can; an exception in
        place of a range that failed. ``scratch``: the ranges may be read into it (each valid
        until the caller's next fetch through the same buffers)."""

    @abstractmethod
    def staging(self, root: PurePath, name: str, fsync: bool) -> Any:
        """Context manager: a local folder to write the shard ``name`` in; when the block ends
        without error the folder is at ``root / name``, complete (and, object stores: read
        back); on error nothing is left."""

    @abstractmethod
    def new_folder(self, root: PurePath, name: str, fsync: bool) -> Any:
        """Context manager: a local folder to write; when the block ends without error it
        becomes ``root / name`` whole (an existing ``root / name`` is kept)."""

    @abstractmethod
    def publish(self, tmp: PurePath, root: PurePath, number: int, fsync: bool) -> str:
        """Move the staged folder ``tmp`` to the first free ``root / shard-NNNNNN`` from
        ``number`` on; return that name."""

    @abstractmethod
    def set_aside(self, path: PurePath) -> None:
        """Take a damaged folder out of the way (``gc`` removes what is left)."""


def transport_for(store: Store) -> KvTransport:
    """The transport of ``store``: :class:`LocalTransport` or :class:`ObjectTransport`."""
    return LocalTransport(store) if store.is_local else ObjectTransport(store)


def kv_free_bytes(store: Store) -> int | None:
    """Bytes free on the file system that holds ``STORE/kv/`` (the nearest existing folder on
    the way there); None for an object store, which has no such limit to check."""
    return transport_for(store).free_bytes(store.root / "kv")


@dataclass(eq=False)
class KvFolder:
    """One KV store's folder as its parts (the shard catalog, the prefix folder) reach it:
    ``store`` and ``layout``, the folder ``root`` (``STORE/kv/<kv_fp>``), the ``transport``
    that writes there and ``reader``, the KV store's (counting) Zarr reader."""

    store: Store
    layout: KvLayout
    root: PurePath
    transport: KvTransport
    reader: Any


@dataclass(eq=False)
class OneArrayFolder(KvFolder, ABC):
    """A folder of one small Zarr array written once beside the shards (``root / folder``: the
    prompt prefix's ``C_p``, a key basis): one inner chunk with its crc32c, what it records in
    its attributes under ``layout.ATTR`` (a sha256 of what it holds among them); read back and
    compared as it is written. A subclass names the folder and says what the array holds
    (``read``: the checked content, raising :class:`MissingKvEntry` / :class:`CorruptKvEntry`)."""

    fsync: bool = False
    folder: ClassVar[str]

    def exists(self) -> bool:
        return self.store.is_file(self.root / self.folder / "zarr.json")

    def write_array(self, stored: np.ndarray, axes: Sequence[str], attrs: dict[str, Any]) -> None:
        """Write ``stored`` (dimension names ``axes``) with ``attrs`` into a new folder, published
        once it reads back as written (:class:`KvError` otherwise)."""
        with self.transport.new_folder(self.root, self.folder, self.fsync) as folder:
            array = zarr.create_array(
                store=LocalStore(folder),
                shape=stored.shape,
                chunks=stored.shape,
                dtype=stored.dtype,
                compressors=[Crc32cCodec()],
                fill_value=0,
                dimension_names=tuple(axes),
                attributes={ATTR: attrs},
                zarr_format=3,
            )
            array[...] = stored
            back = zarr.open_array(store=LocalStore(folder, read_only=True), mode="r")[...]
            if not np.array_equal(back, stored):
                raise KvError(f"{self.folder} of {self.layout.kv_fp} does not read back as written")

    def read_array(self, missing: str) -> tuple[np.ndarray, dict[str, Any]]:
        """The stored array and its attributes, the crc32c checked: :class:`MissingKvEntry`
        (``missing``) where none is stored, :class:`CorruptKvEntry` where it fails a read."""
        try:
            array = zarr.open_array(store=self.reader, path=self.folder, mode="r")
            attrs = dict(array.attrs.get(ATTR) or {})
            return np.ascontiguousarray(array[...]), attrs
        except FileNotFoundError as exc:
            raise MissingKvEntry(missing) from exc
        except Exception as exc:
            raise CorruptKvEntry(self.folder, self.location, read_problem(exc)) from exc

    @property
    def location(self) -> str:
        return f"{self.layout.kv_fp}/{self.folder}"

    @abstractmethod
    def read(self) -> Any:
        """What the folder holds, checked (:class:`MissingKvEntry`, :class:`CorruptKvEntry`)."""

    def recorded(self) -> dict[str, Any]:
        """The attributes the stored metadata records ({} where it cannot be read), without
        reading the array: what a damaged copy said it held."""
        try:
            meta = json.loads(self.store.read_bytes(self.root / self.folder / "zarr.json"))
            return dict(meta["attributes"][ATTR])
        except Exception:
            return {}

    def problem(self) -> str | None:
        """Why the stored array fails its check (unreadable, a crc32c or its sha256), or None
        when it checks out or none is stored."""
        if not self.exists():
            return None
        try:
            self.read()
        except MissingKvEntry:
            return None
        except CorruptKvEntry as exc:
            return exc.reason
        return None


# ---------------------------------------------------------------------------- local disk


class LocalTransport(KvTransport):
    """A folder on a local (or mounted) file system: renames are atomic."""

    remember_file_checks = False
    verify_ranges_at_once = False
    ranged_slice_reads = True  # one pread per read, no index reads (see reads.gather_ranges)

    def zarr_store(self, path: PurePath, read_only: bool = False) -> Any:
        return LocalStore(path, read_only=read_only)

    def create_group(self, root: PurePath, attributes: dict[str, Any], fsync: bool) -> None:
        root = Path(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = root.parent / f".tmp-{root.name}-{uuid.uuid4().hex[:8]}"
        zarr.create_group(store=LocalStore(tmp), attributes=attributes)
        if fsync:
            fsync_tree(tmp)
        try:
            os.rename(tmp, root)
        except OSError as exc:  # created meanwhile by someone else
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise

    def size(self, path: PurePath) -> int:
        return os.stat(path).st_size

    def free_bytes(self, path: PurePath) -> int | None:
        path = Path(path)
        while not path.exists() and path != path.parent:
            path = path.parent
        return shutil.disk_usage(path).free

    def read_ranges(
        self, path: PurePath, ranges: Sequence[tuple[int, int]], scratch: ScratchBuffers
    ) -> list[Any]:
        buf = scratch.get("check", sum(b - a for a, b in ranges))
        out = []
        at = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            for start, end in ranges:
                view = buf[at : at + end - start]
                n = os.preadv(fd, [memoryview(view)], start)
                if n != end - start:
                    raise OSError(f"{path}: read {n} of {end - start} bytes at {start}")
                out.append(view)
                at += end - start
        finally:
            os.close(fd)
        return out

    def fetch_ranges(
        self,
        paths: list[str],
        starts: list[int],
        ends: list[int],
        scratch: ScratchBuffers | None = None,
    ) -> list[Any]:
        """Each range one ``pread``; into ``scratch`` where given and the ranges come to at most
        :data:`SLICE_SCRATCH_MAX` bytes: fresh memory costs a page fault per 4 KiB page on first
        touch (14 ranges of 211 kB, a coinrag request on ``int2mix``: 1.6 ms into new bytes,
        0.4 ms into reused memory, page cache warm)."""
        total = sum(end - start for start, end in zip(starts, ends, strict=True))
        buf = scratch.get("slices", total) if scratch and total <= SLICE_SCRATCH_MAX else None
        out: list[Any] = []
        at = 0
        for path, start, end in zip(paths, starts, ends, strict=True):
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    if buf is None:
                        data = os.pread(fd, end - start, start)
                        n = len(data)
                    else:
                        data = buf[at : at + end - start]
                        n = os.preadv(fd, [memoryview(data)], start)
                        at += end - start
                finally:
                    os.close(fd)
                if n != end - start:
                    raise OSError(f"{path}: read {n} of {end - start} bytes at {start}")
                out.append(data)
            except OSError as exc:
                out.append(exc)
        return out

    @contextmanager
    def staging(self, root: PurePath, name: str, fsync: bool) -> Iterator[Path]:
        tmp = Path(root) / name
        try:
            yield tmp
            if fsync:
                fsync_tree(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @contextmanager
    def new_folder(self, root: PurePath, name: str, fsync: bool) -> Iterator[Path]:
        tmp = Path(root) / f".tmp-{uuid.uuid4().hex}"
        try:
            yield tmp
            if fsync:
                fsync_tree(tmp)
            try:
                os.rename(tmp, Path(root) / name)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def publish(self, tmp: PurePath, root: PurePath, number: int, fsync: bool) -> str:
        while True:
            name = f"shard-{number:06d}"
            try:
                os.rename(tmp, Path(root) / name)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    number += 1
                    continue
                raise
            if fsync:
                fsync_dir(Path(root))
            return name

    def set_aside(self, path: PurePath) -> None:
        aside = Path(path).parent / f".tmp-corrupt-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------- object stores


class ObjectTransport(KvTransport):
    """An S3-compatible object store (``s3://``, through s3fs): one object per file; no rename,
    so publishing is a claimed server-side copy."""

    remember_file_checks = True
    verify_ranges_at_once = True
    ranged_slice_reads = True

    def zarr_store(self, path: PurePath, read_only: bool = False) -> Any:
        return FsspecStore.from_url(
            self.store.uri(path),
            storage_options=zarr_storage_options(self.store.scheme),
            read_only=read_only,
        )

    def create_group(self, root: PurePath, attributes: dict[str, Any], fsync: bool) -> None:
        zarr.create_group(store=self.zarr_store(root), attributes=attributes)  # one PUT: atomic

    def size(self, path: PurePath) -> int:
        return int(self.store.fs.size(str(path)))

    def free_bytes(self, path: PurePath) -> int | None:
        return None

    def read_ranges(
        self, path: PurePath, ranges: Sequence[tuple[int, int]], scratch: ScratchBuffers
    ) -> list[Any]:
        paths = [str(path)] * len(ranges)
        got = self.fetch_ranges(paths, [a for a, _ in ranges], [b for _, b in ranges])
        for raw in got:
            if isinstance(raw, BaseException):
                raise OSError(f"{self.store.uri(path)}: {raw}")
        return got

    def fetch_ranges(
        self,
        paths: list[str],
        starts: list[int],
        ends: list[int],
        scratch: ScratchBuffers | None = None,
    ) -> list[Any]:
        """Concurrently, through fsspec (which returns new bytes: ``scratch`` is not used)."""
        return self.store.fs.cat_ranges(paths, starts, ends, on_error="return")

    @contextmanager
    def staging(self, root: PurePath, name: str, fsync: bool) -> Iterator[Path]:
        scratch = Path(tempfile.mkdtemp(prefix="coinrag-shard-"))
        tmp = scratch / name
        try:
            yield tmp
            try:
                _upload_folder(self.store, tmp, root / name)
            except BaseException:
                self.store.remove(root / name)
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    @contextmanager
    def new_folder(self, root: PurePath, name: str, fsync: bool) -> Iterator[Path]:
        scratch = Path(tempfile.mkdtemp(prefix=f"coinrag-{name}-"))
        try:
            yield scratch / name
            _upload_folder(self.store, scratch / name, root / name)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def publish(self, tmp: PurePath, root: PurePath, number: int, fsync: bool) -> str:
        self.store.check_write_lock()
        while not _claim(self.store, root / f"shard-{number:06d}" / _CLAIM):
            number += 1
        name = f"shard-{number:06d}"
        _copy_folder(self.store, tmp, root / name)
        self.store.remove(tmp)
        return name

    def set_aside(self, path: PurePath) -> None:
        self.store.remove(path)


def _upload_order(files: Iterable[PurePath]) -> list[PurePath]:
    """Data files before metadata: a folder's ``zarr.json`` lands last, so a folder whose
    metadata can be read has all its data."""
    return sorted(files, key=lambda p: (p.name == "zarr.json", str(p)))


def _upload_folder(store: Store, local: Path, remote: PurePath) -> None:
    """Upload every file under ``local`` to ``remote`` (data first, ``zarr.json`` last) and
    read each data file back: its crc32c must be the local file's."""
    fs = store.fs
    for path in _upload_order(p for p in local.rglob("*") if p.is_file()):
        rel = path.relative_to(local).as_posix()
        data = path.read_bytes()
        fs.pipe_file(str(remote / rel), data)
        if path.name != "zarr.json":
            back = fs.cat_file(str(remote / rel))
            if google_crc32c.value(bytes(back)) != google_crc32c.value(data):
                raise KvError(f"{store.uri(remote / rel)} does not read back as uploaded")


def _claim(store: Store, path: PurePath) -> bool:
    """Create ``path`` only if it does not exist (``If-None-Match: *``): True if we created it.
    A shard number is claimed this way, so two writers (one of them fenced off too late) never
    copy into one shard folder."""
    bucket, _, key = str(path).partition("/")
    try:
        store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"", IfNoneMatch="*")
    except OSError as exc:
        if precondition_failed(exc):
            return False
        raise
    return True


def _copy_folder(store: Store, src: PurePath, dst: PurePath) -> None:
    """Server-side copy of every object under ``src`` to ``dst`` (data first, ``zarr.json``
    last)."""
    fs = store.fs
    files = [PurePath(p) for p in fs.find(str(src))]
    for path in _upload_order(files):
        fs.copy(str(path), str(dst / path.relative_to(src)))


# ---------------------------------------------------------------------------- local files


def round_up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on an ``_ALIGN`` boundary."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + nbytes]


SLICE_SCRATCH_MAX = 64 << 20  # bytes: a slice read of more gets fresh memory (kept per thread)


class ScratchBuffers:
    """Reusable, page-aligned uint8 buffers by name: fresh memory costs a page fault per page
    on first touch, so the write path encodes, writes and reads back through these, and each
    thread's slice reads read into its own (:class:`ThreadScratch`)."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (grown by 25% when short)."""
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = aligned_empty(round_up(int(nbytes * 1.25)))
            self._buffers[name] = buf
        return buf

    def clear(self) -> None:
        self._buffers.clear()


class ThreadScratch:
    """One :class:`ScratchBuffers` per thread: a reader serving requests on several threads
    gives each thread's reads their own memory (at most about :data:`SLICE_SCRATCH_MAX` x 1.25
    bytes per thread, freed with the thread)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self) -> ScratchBuffers:
        """The calling thread's buffers."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = ScratchBuffers()
        return buffers


class LocalFiles:
    """Whole local files written and read back with ``O_DIRECT`` where the file system takes
    it (``direct``; turned off for good at the first refusal, e.g. on tmpfs).

    O_DIRECT sends the pages straight to the device: no page-cache copy (on this kind of VM,
    allocating page cache for a new file costs more CPU than encoding the shard), and the
    read-back then really reads the device.
    """

    def __init__(self, direct: bool = True) -> None:
        self.direct = direct

    def write(self, path: Path, padded: np.ndarray, size: int) -> bool:
        """Write ``padded[:size]`` to a new file; True if written with O_DIRECT. The write is
        page-aligned and page-sized (``padded``), then the file is truncated to ``size``.
        Without O_DIRECT support the file is written through the page cache."""
        if self.direct and hasattr(os, "O_DIRECT"):
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT
            try:
                fd = os.open(path, flags, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False  # e.g. tmpfs
            else:
                try:
                    view = memoryview(padded)
                    done = 0
                    while done < len(view):
                        done += os.write(fd, view[done:])
                    os.ftruncate(fd, size)
                    return True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self.direct = False
                    os.unlink(path)
                finally:
                    os.close(fd)
        with open(path, "wb") as f:
            f.write(memoryview(padded[:size]))
        return False

    @staticmethod
    def read(path: Path, buf: np.ndarray, direct: bool) -> int:
        """Read a whole file into ``buf`` (page-aligned and page-sized when ``direct``, and at
        least as large as the file); return the bytes read. ``direct`` reads with O_DIRECT
        (from the device, not the page cache)."""
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags)
        try:
            view = memoryview(buf)
            total = 0
            while total < len(view):
                n = os.readv(fd, [view[total:]])
                if not n:
                    break
                total += n
            return total
        finally:
            os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (durability against power loss)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))
