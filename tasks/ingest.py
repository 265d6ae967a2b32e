"""Ingest: read documents from a source into (doc_id, text, metadata) records, rejecting bad ones.

A source is a folder of documents (``tasks/ingest_files.py``: text, Markdown, reST, HTML, PDF, Word
files, each read by its format's reader in ``tasks/readers``, with its page and heading maps;
doc_id = the file's path relative to the folder, without extension, ``/``-separated), a JSONL
file (one ``{"id": ..., "text": ..., ...}`` object a line; other fields are kept as metadata),
or a Parquet file with ``id`` and ``text`` columns (other columns kept as metadata). Document ids
are data: they are hashed into store keys and never become paths.

One bad document never stops the others: it becomes a :class:`Reject` with a reason
(``empty_text``, ``invalid_utf8`` with file and byte offset, ``duplicate_id``, ``bad_record``,
e.g. an id holding a control character such as NUL, and a file reader's reasons: ``corrupt``,
``encrypted``, ``no_text_layer``, ``too_large``, ``outside_source``, ...).
Only an unusable SOURCE (missing, unreadable, unknown format) raises :class:`SourceError`.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coinrag.schemas.keys import CODE_VERSION, canonical_json, doc_version
from coinrag.schemas.tables import DocumentRow, FileOrigin
from coinrag.tasks.ingest_files import (
    FileRead,
    ReadOptions,
    Skipped,
    SourceFile,
    read_file,
    suffix_readers,
    walk_source,
    with_doc_ids,
)


class SourceError(ValueError):
    """The source as a whole cannot be read."""

    exit_code = 1


@dataclass(frozen=True)
class SourceDocument:
    """A document of the source. ``origin``: where a file's document came from and its maps
    (None for JSONL / Parquet records); ``parsed``: False when a rebuild reused the store's
    row of an unchanged file instead of reading it."""

    doc_id: str
    text: str
    metadata: dict[str, Any]
    source: str  # file (and line) it came from, for humans
    origin: FileOrigin | None = None
    parsed: bool = True

    @property
    def title(self) -> str | None:
        """The title its reader found (None for a record, or a file without one)."""
        return self.origin.title if self.origin is not None else None

    @property
    def version(self) -> str:
        """``keys.doc_version`` of the text and metadata (and, for a file, its reader's
        fingerprint: a new reader version makes new versions of its format's documents)."""
        if self.origin is None:
            return doc_version(self.text, self.metadata)
        return doc_version(self.text, {**self.metadata, "reader_fp": self.origin.reader_fp})

    @property
    def metadata_json(self) -> str:
        return canonical_json(self.metadata)


@dataclass(frozen=True)
class LeftOutFile:
    """A file a reader read that is not a document (a page of links): not built, not a reject;
    ``reason`` and ``detail`` as a reject's."""

    source: str
    reason: str
    detail: str


@dataclass(frozen=True)
class Reject:
    source: str
    doc_id: str | None
    reason: str
    detail: str


@dataclass
class IngestResult:
    documents: list[SourceDocument] = field(default_factory=list)
    rejects: list[Reject] = field(default_factory=list)
    skipped: int = 0  # files of a folder no reader takes, hidden or excluded
    left_out: list[LeftOutFile] = field(default_factory=list)  # read, but not documents

    @property
    def parsed(self) -> int:
        """Documents a reader read now (the others: reused rows of unchanged files)."""
        return sum(d.parsed for d in self.documents)


def _control_char(doc_id: str) -> str | None:
    """The first control character of an id (NUL, newline, ...) as ``U+0000``, or None: ids
    are shown, logged and passed on command lines, where such characters break or vanish."""
    for ch in doc_id:
        if unicodedata.category(ch) == "Cc":
            return f"U+{ord(ch):04X}"
    return None


def _iter_folder(
    root: Path, options: ReadOptions, known: Mapping[str, Any]
) -> Iterator[SourceDocument | Reject | Skipped | LeftOutFile]:
    files: list[SourceFile] = []
    for item in walk_source(root, options.exclude):
        if isinstance(item, SourceFile):
            files.append(item)
        elif item.reason is None:
            yield item
        else:
            yield Reject(item.rel, None, item.reason, item.detail)
    if not files:
        raise SourceError(f"{root} holds no files coinrag reads ({_suffix_list()})")
    for file in with_doc_ids(sorted(files, key=lambda f: f.rel)):
        bad = _control_char(file.doc_id)
        if bad is not None:
            yield Reject(file.rel, None, "bad_record", f"{file.rel}: name contains {bad}")
            continue
        yield _document(read_file(file, options, known.get(file.doc_id)))


def _document(read: FileRead) -> SourceDocument | Reject | LeftOutFile:
    file = read.file
    if read.left_out:
        return LeftOutFile(file.rel, read.reason or "", read.detail)
    if read.reason is not None:
        return Reject(file.rel, file.doc_id, read.reason, read.detail)
    return SourceDocument(
        file.doc_id, read.text, dict(read.metadata or {}), file.rel, read.origin, read.parsed
    )


def _suffix_list() -> str:
    return ", ".join(sorted(suffix_readers()))


def _iter_jsonl(path: Path) -> Iterator[SourceDocument | Reject]:
    offset = 0
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            start = offset
            offset += len(line)
            if not line.strip():
                continue
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield Reject(
                    where,
                    None,
                    "invalid_utf8",
                    f"{path}: invalid UTF-8 at byte offset {start + exc.start} (line {lineno})",
                )
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                yield Reject(where, None, "bad_record", f"{where}: not JSON ({exc.msg})")
                continue
            yield from _from_record(obj, where)


def _from_record(obj: Any, where: str) -> Iterator[SourceDocument | Reject]:
    if not isinstance(obj, dict):
        yield Reject(where, None, "bad_record", f"{where}: expected an object with id and text")
        return
    raw_id, text = obj.get("id"), obj.get("text")
    if raw_id is None or (isinstance(raw_id, str) and not raw_id.strip()):
        yield Reject(where, None, "bad_record", f"{where}: missing id")
        return
    if not isinstance(raw_id, str | int):
        yield Reject(where, None, "bad_record", f"{where}: id must be a string or an integer")
        return
    doc_id = str(raw_id)
    bad = _control_char(doc_id)
    if bad is not None:
        yield Reject(where, None, "bad_record", f"{where}: id contains the control character {bad}")
        return
    if not isinstance(text, str):
        yield Reject(where, doc_id, "bad_record", f"{where}: text must be a string")
        return
    metadata = {k: v for k, v in obj.items() if k not in ("id", "text")}
    yield SourceDocument(doc_id, text, metadata, where)


def _iter_parquet(path: Path) -> Iterator[SourceDocument | Reject]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise SourceError(f"{path} is not a readable Parquet file: {exc}") from exc
    missing = {"id", "text"} - set(table.column_names)
    if missing:
        raise SourceError(f"{path} lacks the column(s) {', '.join(sorted(missing))}")
    for i, obj in enumerate(table.to_pylist()):
        yield from _from_record(obj, f"{path}#row{i}")


def _kind(path: Path) -> str:
    """``folder``, ``jsonl`` or ``parquet``: what kind of source ``path`` is, or
    :class:`SourceError` naming what is accepted. Reads nothing but the path's type and name."""
    if not path.exists():
        raise SourceError(f"source {path} does not exist")
    if path.is_dir():
        return "folder"
    if path.suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix.lower() in suffix_readers():
        raise SourceError(f"{path} is a single file: pass the folder that holds it")
    raise SourceError(
        f"source {path}: unknown format {path.suffix or '(no extension)'}; give a folder of "
        f"documents ({_suffix_list()}), a .jsonl file, a .parquet file, or 'sample'"
    )


def check_source(source: str | Path, options: ReadOptions | None = None) -> None:
    """Raise :class:`SourceError` now if ``source`` cannot be a source (missing, unknown
    format, a folder without a file any reader takes): what the CLI checks before any work."""
    path = Path(source).expanduser()
    if _kind(path) == "folder":
        exclude = (options or ReadOptions()).exclude
        if not any(isinstance(f, SourceFile) for f in walk_source(path, exclude)):
            raise SourceError(f"{path} holds no files coinrag reads ({_suffix_list()})")


def iter_source(
    source: str | Path,
    options: ReadOptions | None = None,
    known: Mapping[str, Any] | None = None,
) -> Iterator[SourceDocument | Reject | Skipped]:
    """Documents and rejects of a source, in source order (no duplicate or emptiness checks),
    and for a folder the files it skips. ``options``: how files are read; ``known``: the
    store's live ``DocumentRow`` by doc_id (unchanged files are not read again)."""
    path = Path(source).expanduser()
    kind = _kind(path)
    if kind == "folder":
        return _iter_folder(path, options or ReadOptions(), known or {})
    return _iter_jsonl(path) if kind == "jsonl" else _iter_parquet(path)


def ingest(
    source: str | Path,
    options: ReadOptions | None = None,
    known: Mapping[str, Any] | None = None,
) -> IngestResult:
    """Read a whole source: valid documents in order, and rejects for the rest
    (``options``, ``known``: see :func:`iter_source`).

    Rejected: empty (or whitespace-only) text, invalid UTF-8, a repeated id (every occurrence
    after the first), malformed records, files a reader refuses.
    """
    result = IngestResult()
    seen: dict[str, str] = {}
    try:
        items = list(iter_source(source, options, known))
    except OSError as exc:
        raise SourceError(f"source {source} is unreadable: {exc}") from exc
    for item in items:
        if isinstance(item, Skipped):
            result.skipped += 1
            continue
        if isinstance(item, Reject):
            result.rejects.append(item)
            continue
        if isinstance(item, LeftOutFile):
            result.left_out.append(item)
            continue
        if not item.text.strip():
            result.rejects.append(Reject(item.source, item.doc_id, "empty_text", "no text"))
            continue
        if item.doc_id in seen:
            result.rejects.append(
                Reject(
                    item.source,
                    item.doc_id,
                    "duplicate_id",
                    f"id {item.doc_id!r} already used by {seen[item.doc_id]}",
                )
            )
            continue
        seen[item.doc_id] = item.source
        result.documents.append(item)
    return result


# ---------------------------------------------------------------------------- stage


def document_row(doc: SourceDocument, run_id: str) -> DocumentRow:
    """The ``documents`` row of a version of ``doc`` read by run ``run_id``."""
    return DocumentRow(
        doc_id=doc.doc_id,
        doc_version=doc.version,
        text=doc.text,
        metadata_json=doc.metadata_json,
        source=doc.source,
        n_chars=len(doc.text),
        run_id=run_id,
        code_version=CODE_VERSION,
        **(vars(doc.origin) if doc.origin is not None else {}),
    )


def ingest_stage(
    store: Any, source: str | Path, run_id: str, options: ReadOptions | None = None
) -> tuple[IngestResult, int]:
    """Read the source, record new document versions and rejects; return (result, n_new).

    A version row is written for every document whose live version (``storage.corpus``)
    differs: a new or edited document, or one that comes back after a deletion (its row
    supersedes the tombstone), even if that exact version was seen before. Files whose live
    rows say they are unchanged are not parsed again (``tasks/ingest_files.py``).
    """
    from coinrag.schemas.tables import RejectRow
    from coinrag.storage.corpus import live_documents
    from coinrag.storage.tables import append_rows

    known = live_documents(store)
    result = ingest(source, options, known)
    live = {doc_id: row.doc_version for doc_id, row in known.items()}
    new_rows = [
        document_row(d, run_id) for d in result.documents if live.get(d.doc_id) != d.version
    ]
    append_rows(store, new_rows, run_id, "ingest")
    append_rows(
        store,
        [RejectRow(run_id, r.source, r.doc_id, r.reason, r.detail) for r in result.rejects],
        run_id,
        "ingest",
    )
    return result, len(new_rows)
