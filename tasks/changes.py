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

from coinrag.tasks.ingest import SourceDocument, ingest


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


def source_delta(source: str | Path, store_path: str | Path) -> tuple[list[str], list[str]]:
    """``(changed, removed)`` ids of SOURCE against the store at ``store_path`` (see the
    module doc); reads the source once. Raises :class:`tasks.ingest.SourceError` when SOURCE
    cannot be read."""
    from coinrag.storage.corpus import live_versions
    from coinrag.storage.store import Store

    store = Store.at(store_path)
    read = ingest(source)
    if not store.exists():
        return changed_doc_ids(read.documents, {}), []
    live = live_versions(store)
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


def source_changes(source: str | Path, store_path: str | Path) -> list[str]:
    """Ids of SOURCE's documents a build would (re)build into the store at ``store_path``.

    Every valid document is changed when the store does not exist yet. Raises
    :class:`tasks.ingest.SourceError` when SOURCE cannot be read.
    """
    from coinrag.storage.corpus import live_versions
    from coinrag.storage.store import Store

    store = Store.at(store_path)
    live = live_versions(store) if store.exists() else {}
    return changed_doc_ids(ingest(source).documents, live)
