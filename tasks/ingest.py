"""Ingest: read documents from a source into (doc_id, text, metadata) records, rejecting bad ones.

A source is a folder of ``.txt``/``.md`` files (doc_id = the file's path relative to the folder,
without extension, ``/``-separated), a JSONL file (one ``{"id": ..., "text": ..., ...}`` object a
line; other fields are kept as metadata), or a Parquet file with ``id`` and ``text`` columns
(other columns kept as metadata). Document ids are data: they are hashed into store keys and
never become paths.

One bad document never stops the others: it becomes a :class:`Reject` with a reason
(``empty_text``, ``invalid_utf8`` with file and byte offset, ``duplicate_id``, ``bad_record``,
e.g. an id holding a control character such as NUL).
Only an unusable SOURCE (missing, unreadable, unknown format) raises :class:`SourceError`.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coinrag.schemas.keys import canonical_json, doc_version

TEXT_SUFFIXES = (".txt", ".md")


class SourceError(ValueError):
    """The source as a whole cannot be read."""

    exit_code = 1


@dataclass(frozen=True)
class SourceDocument:
    doc_id: str
    text: str
    metadata: dict[str, Any]
    source: str  # file (and line) it came from, for humans

    @property
    def version(self) -> str:
        return doc_version(self.text, self.metadata)

    @property
    def metadata_json(self) -> str:
        return canonical_json(self.metadata)


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


def _control_char(doc_id: str) -> str | None:
    """The first control character of an id (NUL, newline, ...) as ``U+0000``, or None: ids
    are shown, logged and passed on command lines, where such characters break or vanish."""
    for ch in doc_id:
        if unicodedata.category(ch) == "Cc":
            return f"U+{ord(ch):04X}"
    return None


def _utf8_error(data: bytes, source: str, doc_id: str | None) -> Reject | None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Reject(
            source,
            doc_id,
            "invalid_utf8",
            f"{source}: invalid UTF-8 at byte offset {exc.start} ({exc.reason})",
        )
    return None


def _text_files(root: Path) -> Iterator[Path]:
    return (p for p in root.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())


def _iter_folder(root: Path) -> Iterator[SourceDocument | Reject]:
    files = sorted(_text_files(root))
    if not files:
        raise SourceError(f"{root} holds no .txt or .md files")
    for path in files:
        rel = path.relative_to(root)
        doc_id = rel.with_suffix("").as_posix()
        bad = _control_char(doc_id)
        if bad is not None:
            yield Reject(str(path), None, "bad_record", f"{path}: name contains {bad}")
            continue
        try:
            data = path.read_bytes()
        except OSError as exc:
            yield Reject(str(path), doc_id, "unreadable", f"{path}: {exc.strerror}")
            continue
        bad = _utf8_error(data, str(path), doc_id)
        if bad:
            yield bad
            continue
        text = data.decode("utf-8").removeprefix("\ufeff")
        yield SourceDocument(doc_id, text, {"path": rel.as_posix()}, str(rel))


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


def _reader(path: Path) -> Callable[[Path], Iterator[SourceDocument | Reject]]:
    """The reader of a source path by its kind, or :class:`SourceError` naming what is
    accepted. Reads nothing but the path's type and name."""
    if not path.exists():
        raise SourceError(f"source {path} does not exist")
    if path.is_dir():
        return _iter_folder
    if path.suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl
    if path.suffix == ".parquet":
        return _iter_parquet
    if path.suffix in TEXT_SUFFIXES:
        raise SourceError(f"{path} is a single file: pass the folder that holds it")
    raise SourceError(
        f"source {path}: unknown format {path.suffix or '(no extension)'}; give a folder of "
        ".txt/.md files, a .jsonl file, a .parquet file, or 'sample'"
    )


def check_source(source: str | Path) -> None:
    """Raise :class:`SourceError` now if ``source`` cannot be a source (missing, unknown
    format, a folder without .txt/.md files): what the CLI checks before any work."""
    path = Path(source).expanduser()
    if _reader(path) is _iter_folder and not any(_text_files(path)):
        raise SourceError(f"{path} holds no .txt or .md files")


def iter_source(source: str | Path) -> Iterator[SourceDocument | Reject]:
    """Documents and rejects of a source, in source order (no duplicate or emptiness checks)."""
    path = Path(source).expanduser()
    return _reader(path)(path)


def ingest(source: str | Path) -> IngestResult:
    """Read a whole source: valid documents in order, and rejects for the rest.

    Rejected: empty (or whitespace-only) text, invalid UTF-8, a repeated id (every occurrence
    after the first), malformed records.
    """
    result = IngestResult()
    seen: dict[str, str] = {}
    try:
        items = list(iter_source(source))
    except OSError as exc:
        raise SourceError(f"source {source} is unreadable: {exc}") from exc
    for item in items:
        if isinstance(item, Reject):
            result.rejects.append(item)
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


def ingest_stage(store: Any, source: str | Path, run_id: str) -> tuple[IngestResult, int]:
    """Read the source, record new document versions and rejects; return (result, n_new).

    A version row is written for every document whose live version (``storage.corpus``)
    differs: a new or edited document, or one that comes back after a deletion (its row
    supersedes the tombstone), even if that exact version was seen before.
    """
    from coinrag.schemas.keys import CODE_VERSION
    from coinrag.schemas.tables import DocumentRow, RejectRow
    from coinrag.storage.corpus import live_versions
    from coinrag.storage.tables import append_rows

    result = ingest(source)
    live = live_versions(store)
    new_rows = [
        DocumentRow(
            doc_id=d.doc_id,
            doc_version=d.version,
            text=d.text,
            metadata_json=d.metadata_json,
            source=d.source,
            n_chars=len(d.text),
            run_id=run_id,
            code_version=CODE_VERSION,
        )
        for d in result.documents
        if live.get(d.doc_id) != d.version
    ]
    append_rows(store, new_rows, run_id, "ingest")
    append_rows(
        store,
        [RejectRow(run_id, r.source, r.doc_id, r.reason, r.detail) for r in result.rejects],
        run_id,
        "ingest",
    )
    return result, len(new_rows)
