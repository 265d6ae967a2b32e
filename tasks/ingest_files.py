"""A folder SOURCE: every file a reader takes (``tasks/readers``), read into documents or
rejected with a reason; nothing outside the folder is ever read.

What is read: every file under SOURCE whose suffix a reader declares (``.txt``, ``.md``,
``.html``, ``.pdf``, ``.docx``, any case), in path order. Hidden files and folders (a name
starting with ``.``) and paths matching an ``exclude`` glob (relative to SOURCE, ``*`` crosses
folders: ``_sources/*``) are left out; files of other formats (images, CSS) are skipped, not
rejected.

Document ids: a file's path relative to SOURCE, ``/``-separated, without its extension
(``faq/general.html`` -> ``faq/general``); where two files share that stem, both keep their
extension (``faq/general.html``, ``faq/general.pdf``).

Versions: a document's version hashes its text, its path and its reader's fingerprint (format,
version, options), so a new reader version re-reads exactly its format. ``known`` (the store's
live rows) lets a rebuild skip work: a file whose path, size and modification time match its
live row is not read at all, and one whose bytes hash (sha256) to the live row's is read but not
parsed.

Rejects (one each, the rest read): ``outside_source`` (a symlink leading out of SOURCE: never
followed), ``too_large`` (over ``max_file_bytes``), ``empty_file`` (0 bytes), ``unreadable``,
and each reader's own (``corrupt``, ``encrypted``, ``no_text_layer``, ``undecodable``,
``invalid_utf8``, ...). A reader that fails in an unforeseen way gives ``corrupt`` with the
error's message, never a traceback.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from coinrag.schemas.settings import READERS
from coinrag.schemas.tables import FileOrigin
from coinrag.tasks.readers.base import LeftOut, ReadDocument, Reader, ReadError


@dataclass(frozen=True)
class ReadOptions:
    """How a folder is read: ``html_mode`` (the html reader's), ``max_file_bytes`` (larger
    files are rejected unread), ``exclude`` (globs of relative paths to leave out)."""

    html_mode: str = "main"
    max_file_bytes: int = 200 * 2**20
    exclude: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, settings: Any) -> ReadOptions:
        """The read options of ``BuildSettings``."""
        globs = tuple(g.strip() for g in settings.exclude.split(",") if g.strip())
        return cls(settings.html_mode, settings.max_file_bytes, globs)

    def reader(self, name: str) -> Reader:
        """The reader ``name`` with the options it declares (``Reader.option_names``)."""
        cls = Reader.registry[name]
        return cls(**{o: getattr(self, o) for o in cls.option_names})


@dataclass(frozen=True)
class SourceFile:
    """A file of a folder SOURCE: its path, its path relative to SOURCE (``rel``, posix), its
    reader's name and its document id."""

    path: Path
    rel: str
    reader: str
    doc_id: str = ""


@dataclass(frozen=True)
class Skipped:
    """A path left out or refused before reading: ``reason`` None for a file no reader takes
    or an excluded path (not a reject), else a reject reason with ``detail``."""

    rel: str
    reason: str | None = None
    detail: str = ""


def suffix_readers() -> dict[str, str]:
    """``".pdf" -> "pdf"``, ...: the suffix each reader declares."""
    return {s: name for name in READERS for s in Reader.registry[name].suffixes}


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def walk_source(root: Path, exclude: tuple[str, ...] = ()) -> Iterator[SourceFile | Skipped]:
    """Every file under ``root`` (a folder's files before its subfolders'), as a
    :class:`SourceFile` (with its reader) or :class:`Skipped`; symlinks are followed only where
    they stay inside ``root``, and folder symlinks never (their files are reached through their
    real place, or refused)."""
    real_root = root.resolve()
    by_suffix = suffix_readers()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for d in list(dirnames):
            if (here / d).is_symlink():
                dirnames.remove(d)
                rel = (here / d).relative_to(root).as_posix()
                if not _inside(here / d, real_root):
                    yield Skipped(rel, "outside_source", f"{rel}: a link to outside SOURCE")
        for name in sorted(filenames):
            path = here / name
            rel = path.relative_to(root).as_posix()
            reader = by_suffix.get(path.suffix.lower())
            if name.startswith(".") or reader is None or _excluded(rel, exclude):
                yield Skipped(rel)
            elif path.is_symlink() and not _inside(path, real_root):
                yield Skipped(rel, "outside_source", f"{rel}: a link to outside SOURCE")
            else:
                yield SourceFile(path, rel, reader)


def _excluded(rel: str, exclude: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(rel, g) for g in exclude)


def with_doc_ids(files: list[SourceFile]) -> list[SourceFile]:
    """``files`` with their document ids: the relative path without extension, or with it
    where two files share the stem (see the module doc)."""
    stems: dict[str, int] = {}
    for f in files:
        stem = _stem(f.rel)
        stems[stem] = stems.get(stem, 0) + 1
    return [replace(f, doc_id=f.rel if stems[_stem(f.rel)] > 1 else _stem(f.rel)) for f in files]


def _stem(rel: str) -> str:
    head, _, name = rel.rpartition("/")
    stem = name.rsplit(".", 1)[0] if "." in name.lstrip(".") else name
    return f"{head}/{stem}" if head else stem


def origin_of(
    doc: ReadDocument, file: SourceFile, reader: Reader, data: bytes, stat: os.stat_result
) -> FileOrigin:
    """The ``FileOrigin`` columns of a document read from ``file`` (``data``: its bytes,
    ``stat``: the file's status when it was read)."""
    for i, page in enumerate(doc.pages):
        if page.number != i + 1:
            raise ValueError(f"{file.rel}: page {i} is numbered {page.number}, not {i + 1}")
    return FileOrigin(
        path=file.rel,
        format=reader.name,
        title=doc.title,
        reader_version=reader.version,
        reader_fp=reader.fingerprint,
        sha256=hashlib.sha256(data).hexdigest(),
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        page_starts=[p.char_start for p in doc.pages] or None,
        page_labels=[p.label for p in doc.pages] or None,
        heading_starts=[h.char_start for h in doc.headings] or None,
        heading_levels=[h.level for h in doc.headings] or None,
        heading_titles=[h.title for h in doc.headings] or None,
    )


def origin_from_row(row: Any, **changes: Any) -> FileOrigin:
    """The ``FileOrigin`` columns of a stored ``DocumentRow`` (``changes`` applied)."""
    names = FileOrigin.__dataclass_fields__
    return FileOrigin(**{**{n: getattr(row, n) for n in names}, **changes})


@dataclass(frozen=True)
class FileRead:
    """What reading one file gave: the document (``text``, ``metadata``, ``origin``), or the
    reject (``reason``, ``detail``); ``parsed``: whether a reader ran (False when the store's
    live row was reused)."""

    file: SourceFile
    text: str = ""
    metadata: Mapping[str, Any] | None = None
    origin: FileOrigin | None = None
    reason: str | None = None
    detail: str = ""
    parsed: bool = False
    left_out: bool = False  # reason and detail say why: a file that is not a document


def read_file(file: SourceFile, options: ReadOptions, known: Any | None = None) -> FileRead:
    """Read one file (see the module doc); ``known``: the store's live ``DocumentRow`` of the
    same document id, or None."""
    rel = file.rel
    try:
        stat = file.path.stat()
    except OSError as exc:
        return FileRead(file, reason="unreadable", detail=f"{rel}: {exc.strerror}")
    if stat.st_size > options.max_file_bytes:
        return FileRead(
            file,
            reason="too_large",
            detail=f"{rel}: {stat.st_size} bytes, over max_file_bytes = {options.max_file_bytes} "
            "(raise it in the config file's [build] table to read it)",
        )
    if stat.st_size == 0:
        return FileRead(file, reason="empty_file", detail=f"{rel}: the file is empty")
    reader = options.reader(file.reader)
    same_reader = known is not None and known.reader_fp == reader.fingerprint
    if same_reader and (known.path, known.size, known.mtime_ns) == (
        rel,
        stat.st_size,
        stat.st_mtime_ns,
    ):
        return _reuse(file, known)
    try:
        data = file.path.read_bytes()
    except OSError as exc:
        return FileRead(file, reason="unreadable", detail=f"{rel}: {exc.strerror}")
    if same_reader and known.path == rel and known.sha256 == hashlib.sha256(data).hexdigest():
        return _reuse(file, known, size=stat.st_size, mtime_ns=stat.st_mtime_ns)
    try:
        doc = reader.read(data, rel)
    except ReadError as exc:
        left_out = isinstance(exc, LeftOut)
        return FileRead(file, reason=exc.reason, detail=exc.detail, left_out=left_out)
    except Exception as exc:  # a library's failure on a malformed file: a reject, not a crash
        return FileRead(file, reason="corrupt", detail=f"{rel}: {type(exc).__name__}: {exc}")
    origin = origin_of(doc, file, reader, data, stat)
    return FileRead(file, doc.text, {"path": rel}, origin, parsed=True)


def _reuse(file: SourceFile, known: Any, **changes: Any) -> FileRead:
    metadata = json.loads(known.metadata_json)
    return FileRead(file, known.text, metadata, origin_from_row(known, **changes))
