"""Which documents of a source the store has not built yet (new ids or changed text/metadata).

A document is *changed* when its current version (``keys.doc_version`` of its text and
metadata) is not among the versions in the store's ``documents`` table. Rejected records and
documents removed from the source are not reported here (deletion is its own stage).
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
