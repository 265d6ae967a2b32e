"""The corpus as it stands: which documents are live, at which version. Defined once, here.

Two tables record what happened to a document, both append-only:

- ``documents`` (:class:`schemas.tables.DocumentRow`): a build read version V of document D;
- ``deletions`` (:class:`schemas.tables.DeletionRow`): D was pruned or deleted (a tombstone).

A document is **live** when its latest event is a version row; its live version is that row's
``doc_version``. A tombstone hides every earlier version row; a version row written after it (the
document is read again by a later build) brings the document back.

Only events of **committed** runs count. A run is committed once its ``completed`` row is in
``runs``, or when it is the run the store last published (``[published].run_id`` of
``STORE/coinrag.toml``: the commit point of a build or deletion, written just before its
``completed`` row). Rows of a run that started but never completed (killed, failed) are
invisible, so a crashed build leaves the previous corpus in place; rows with no ``runs`` row at
all (stages called on their own, stores written by older code) count, before every recorded run.

Order: runs are serialised by the store's write lock, so a run's start time (its first ``runs``
row) orders its events; one run never writes a version row and a tombstone for the same document.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow.compute as pc

from coinrag.schemas.keys import CODE_VERSION
from coinrag.schemas.tables import DeletionRow, DocumentRow, RunRow
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_rows, read_table

_BEFORE_ALL = datetime.min.replace(tzinfo=UTC)

RunOrder = tuple[datetime, str]


def run_states(store: Store) -> tuple[dict[str, RunOrder], set[str]]:
    """``(committed run -> order key, runs that started but are not committed)``."""
    table = read_table(store, RunRow, columns=["run_id", "status", "started_at"])
    started: dict[str, datetime] = {}
    completed: set[str] = set()
    for run_id, status, at in zip(
        table.column("run_id").to_pylist(),
        table.column("status").to_pylist(),
        table.column("started_at").to_pylist(),
        strict=True,
    ):
        started[run_id] = min(started.get(run_id, at), at)
        if status == "completed":
            completed.add(run_id)
    published = (store.published() or {}).get("run_id")
    if published:
        completed.add(published)
    committed = {r: (started.get(r, _BEFORE_ALL), r) for r in completed}
    return committed, set(started) - completed


def _order(run_id: str, committed: dict[str, RunOrder], uncommitted: set[str]) -> RunOrder | None:
    """The order key of a row's run, or None if the run is not committed."""
    if run_id in committed:
        return committed[run_id]
    if run_id in uncommitted:
        return None
    return (_BEFORE_ALL, run_id)  # no runs row: a stage run on its own, or an older store


def live_events(store: Store) -> dict[str, tuple[str, str]]:
    """``doc_id -> (doc_version, run_id)`` of every live document: its live version and the
    run whose version row made it live (the latest committed event; reads three narrow columns
    of ``documents`` and two of ``deletions``). Every reader of "live" derives from this."""
    committed, uncommitted = run_states(store)
    latest: dict[str, tuple[RunOrder, str | None, str]] = {}

    def see(doc_id: str, version: str | None, run_id: str) -> None:
        order = _order(run_id, committed, uncommitted)
        if order is None:
            return
        cur = latest.get(doc_id)
        if cur is None or cur[0] <= order:
            latest[doc_id] = (order, version, run_id)

    docs = read_table(store, DocumentRow, columns=["doc_id", "doc_version", "run_id"])
    for doc_id, version, run_id in zip(*docs.to_pydict().values(), strict=True):
        see(doc_id, version, run_id)
    dels = read_table(store, DeletionRow, columns=["doc_id", "run_id"])
    for doc_id, run_id in zip(*dels.to_pydict().values(), strict=True):
        see(doc_id, None, run_id)
    return {d: (v, r) for d, (_, v, r) in sorted(latest.items()) if v is not None}


def live_versions(store: Store) -> dict[str, str]:
    """``doc_id -> doc_version`` of every live document (sorted by id)."""
    return {d: v for d, (v, _) in live_events(store).items()}


def live_documents(store: Store, doc_ids: Iterable[str] | None = None) -> dict[str, DocumentRow]:
    """``doc_id -> DocumentRow`` of the live version of each live document (sorted by id);
    with ``doc_ids``, only those (ids that are not live are simply absent)."""
    events = live_events(store)
    if doc_ids is not None:
        wanted = set(doc_ids)
        events = {d: e for d, e in events.items() if d in wanted}
    if not events:
        return {}
    wanted_versions = pc.field("doc_version").isin(sorted({v for v, _ in events.values()}))
    rows = read_rows(store, DocumentRow, filter=wanted_versions)
    out: dict[str, DocumentRow] = {}
    for row in rows:  # the row of the live event (one version may have rows of several runs)
        if events.get(row.doc_id) == (row.doc_version, row.run_id):
            out.setdefault(row.doc_id, row)
    return dict(sorted(out.items()))


def live_documents_in(store: Store, doc_ids: Sequence[str] | None = None) -> list[DocumentRow]:
    """The live version of each of ``doc_ids`` (all live documents when None, by doc_id; the
    ids in the given order, each once).

    Raises KeyError naming the ids that are not live documents of the store.
    """
    latest = live_documents(store)
    if doc_ids is None:
        return [latest[d] for d in sorted(latest)]
    missing = [d for d in doc_ids if d not in latest]
    if missing:
        raise KeyError(f"documents not in the store {store}: {', '.join(missing[:10])}")
    return [latest[d] for d in dict.fromkeys(doc_ids)]


def tombstones(
    doc_versions: dict[str, str], reason: str, run_id: str, when: datetime | None = None
) -> list[DeletionRow]:
    """Tombstone rows for ``{doc_id: last live version}`` (``reason``: pruned | deleted)."""
    if reason not in ("pruned", "deleted"):
        raise ValueError(f"tombstone reason {reason!r} is not pruned or deleted")
    at = when or datetime.now(UTC)
    return [
        DeletionRow(
            doc_id=d,
            doc_version=v,
            reason=reason,
            run_id=run_id,
            time=at,
            code_version=CODE_VERSION,
        )
        for d, v in sorted(doc_versions.items())
    ]


def record_tombstones(
    store: Store, doc_versions: dict[str, str], reason: str, run_id: str
) -> list[DeletionRow]:
    """Append tombstones (they count once ``run_id`` commits); return them."""
    rows = tombstones(doc_versions, reason, run_id)
    append_rows(store, rows, run_id, reason)
    return rows


def absent_from(live: dict[str, str], present: Sequence[Any]) -> dict[str, str]:
    """The live documents (``{doc_id: version}``) whose id is not among ``present`` (objects
    with a ``doc_id``): what ``build --prune`` tombstones."""
    ids = {d.doc_id for d in present}
    return {d: v for d, v in live.items() if d not in ids}
