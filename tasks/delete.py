"""Deletion stage: tombstone documents and take them out of the index.

``build --prune`` tombstones the live documents absent from SOURCE (reason ``pruned``);
``coinrag delete ID ...`` tombstones named ones (reason ``deleted``). Either way the document's
rows leave the LanceDB index (at its latest versions: readers see it once the run publishes),
and its KV entries become garbage for ``coinrag gc``. Tombstones count once the run commits
(``storage.corpus``); a later build that reads the document again brings it back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from coinrag.storage.corpus import absent_from, live_versions, record_tombstones
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store


class UnknownDocuments(KeyError):
    """Ids given to ``delete`` that are not live documents of the store."""

    exit_code = 1

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def unindex_documents(store: Store, doc_ids: Iterable[str]) -> dict[str, int]:
    """Delete these documents' rows from every index table; rows deleted per table."""
    ids = sorted(set(doc_ids))
    index = LanceIndex.open_latest(store)
    if index is None or not ids:
        return {}
    return index.delete_documents(ids)


def prune_stage(
    store: Store, documents: Sequence[Any], rejected_ids: Iterable[str | None], run_id: str
) -> dict[str, str]:
    """Tombstone (``pruned``) and unindex the live documents whose id is neither among
    ``documents`` (read from SOURCE) nor among ``rejected_ids`` (in SOURCE but unreadable this
    time: kept at their last good version). Returns ``{doc_id: last live version}``."""
    keep = {i for i in rejected_ids if i is not None}
    absent = absent_from(live_versions(store), documents)
    pruned = {d: v for d, v in absent.items() if d not in keep}
    record_tombstones(store, pruned, "pruned", run_id)
    unindex_documents(store, pruned)
    return pruned


def delete_stage(store: Store, doc_ids: Sequence[str], run_id: str) -> dict[str, str]:
    """Tombstone (``deleted``) and unindex these live documents; return ``{doc_id: version}``.

    Every id is checked first: one that is not a live document raises
    :class:`UnknownDocuments` naming it, and nothing is written.
    """
    live = live_versions(store)
    wanted = list(dict.fromkeys(doc_ids))
    unknown = [d for d in wanted if d not in live]
    if unknown:
        shown = ", ".join(repr(d) for d in unknown[:10])
        more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
        raise UnknownDocuments(
            f"not a live document of {store}: {shown}{more}; nothing was deleted"
        )
    chosen = {d: live[d] for d in wanted}
    record_tombstones(store, chosen, "deleted", run_id)
    unindex_documents(store, chosen)
    return chosen
