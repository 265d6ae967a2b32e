"""How a source differs from its store: documents not built yet, and documents removed.

A document is *changed* when its current version (``keys.doc_version`` of its text and
metadata) is not among the versions in the store's ``documents`` table. A document is
*removed* when it is live in the store (``storage.corpus``) but its id is no longer in the
source; a build with ``--prune`` (``prune = true``) tombstones it. Rejected records are neither.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tasks.ingest import SourceDocument, ingest


def changed_doc_ids(documents: Iterable[SourceDocument], known_versions: set[str]) -> list[str]:
    """Ids of ``documents`` whose version is not in ``known_versions``, in source order.

    Example: versions {a: v1, b: v2} against known {v1} -> ``["b"]``.
    """
    return [d.doc_id for d in documents if d.version not in known_versions]


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
    from schemas.tables import DocumentRow
    from storage.corpus import live_versions
    from storage.store import Store
    from storage.tables import column_values

    store = Store.at(store_path)
    read = ingest(source)
    if not store.exists():
        return changed_doc_ids(read.documents, set()), []
    known = column_values(store, DocumentRow, "doc_version")
    rejected = [r.doc_id for r in read.rejects]
    removed = removed_doc_ids(read.documents, live_versions(store), rejected)
    return changed_doc_ids(read.documents, known), removed


def source_changes(source: str | Path, store_path: str | Path) -> list[str]:
    """Ids of SOURCE's documents not yet built into the store at ``store_path``.

    Every valid document is changed when the store does not exist yet. Raises
    :class:`tasks.ingest.SourceError` when SOURCE cannot be read.
    """
    from schemas.tables import DocumentRow
    from storage.store import Store
    from storage.tables import column_values

    store = Store.at(store_path)
    known = column_values(store, DocumentRow, "doc_version") if store.exists() else set()
    return changed_doc_ids(ingest(source).documents, known)
