"""How a source differs from its store: documents a build would (re)build, and documents removed.

A document is *changed* when its current version (``keys.doc_version`` of its text and
metadata) is not the live version of its id in the store (``storage.corpus``): new, edited, or
deleted from the store (tombstoned) while SOURCE still holds it; exactly the documents for
which ``tasks.ingest.ingest_stage`` writes a version row, so a build brings a deleted one back.
A document is *removed* when it is live in the store but its id is no longer in the source; a
build with ``--prune`` (``prune = true``) tombstones it. Rejected records are neither.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from coinrag.schemas.settings import BuildSettings
from coinrag.tasks.ingest import IngestResult, SourceDocument, ingest
from coinrag.tasks.ingest_files import ReadOptions


def changed_doc_ids(documents: Iterable[SourceDocument], live: dict[str, str]) -> list[str]:
    """Ids of ``documents`` whose version is not the live one of their id (``live``: doc_id ->
    live version), in source order.

    Example: versions {a: v1, b: v2, c: v3} against live {a: v1, b: v1} -> ``["b", "c"]``.
    """
    return [d.doc_id for d in documents if live.get(d.doc_id) != d.version]


def removed_doc_ids(
    documents: Iterable[SourceDocument],
    live_ids: Iterable[str],
    rejected_ids: Iterable[str | None] = (),
) -> list[str]:
    """Ids in ``live_ids`` that no document of the source has, sorted. A record of the source
    that was rejected this time (``rejected_ids``) still names its document: not removed (a
    ``--prune`` build keeps it too).

    Example: source {a, b} against live {a, c} -> ``["c"]``.
    """
    present = {d.doc_id for d in documents} | {i for i in rejected_ids if i is not None}
    return sorted(set(live_ids) - present)


def _read_against(
    source: str | Path, store_path: str | Path, options: ReadOptions | None
) -> tuple[IngestResult, dict[str, str] | None]:
    """SOURCE read against the store (files unchanged since its live rows are not parsed
    again), and the store's live versions (None: no store yet)."""
    from coinrag.storage.corpus import live_documents
    from coinrag.storage.store import Store

    store = Store.at(store_path)
    known = live_documents(store) if store.exists() else None
    if options is None and known is not None:  # as the store's last build read its files
        recorded = store.read_toml().get("build", {})
        names = BuildSettings.__dataclass_fields__
        built = BuildSettings(**{k: v for k, v in recorded.items() if k in names})
        options = ReadOptions.from_settings(built)
    read = ingest(source, options, known)
    return read, None if known is None else {d: r.doc_version for d, r in known.items()}


def source_delta(
    source: str | Path, store_path: str | Path, options: ReadOptions | None = None
) -> tuple[list[str], list[str]]:
    """``(changed, removed)`` ids of SOURCE against the store at ``store_path`` (see the
    module doc; ``options``: how SOURCE's files are read); reads the source once. Raises
    :class:`tasks.ingest.SourceError` when SOURCE cannot be read."""
    read, live = _read_against(source, store_path, options)
    if live is None:
        return changed_doc_ids(read.documents, {}), []
    rejected = [r.doc_id for r in read.rejects]
    return changed_doc_ids(read.documents, live), removed_doc_ids(read.documents, live, rejected)


def deleted_doc_ids(store_path: str | Path, doc_ids: Iterable[str]) -> list[str]:
    """Those of ``doc_ids`` that the store holds deleted (tombstoned, not live again), in the
    given order: among the changed ids, the ones a build brings back."""
    from coinrag.schemas.tables import DeletionRow
    from coinrag.storage.corpus import live_versions
    from coinrag.storage.store import Store
    from coinrag.storage.tables import column_values

    store = Store.at(store_path)
    if not store.exists():
        return []
    tombstoned = column_values(store, DeletionRow, "doc_id") - set(live_versions(store))
    return [d for d in doc_ids if d in tombstoned]


def source_changes(
    source: str | Path, store_path: str | Path, options: ReadOptions | None = None
) -> list[str]:
    """Ids of SOURCE's documents a build would (re)build into the store at ``store_path``.

    Every valid document is changed when the store does not exist yet. Raises
    :class:`tasks.ingest.SourceError` when SOURCE cannot be read.
    """
    read, live = _read_against(source, store_path, options)
    return changed_doc_ids(read.documents, live or {})
