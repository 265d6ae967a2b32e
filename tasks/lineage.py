"""Lineage queries of a store with its current producers: SQL over the lineage views, the chain
through one asset, the stale assets.

The views are ``storage/lineage.py``; the current producers (the fingerprints the store's
settings make now) ``tasks/fingerprints.py``. Read-only: nothing here takes the store's write
lock, so it runs beside a build. Printing is ``flows/render.py``.
"""

from __future__ import annotations

import pyarrow as pa

from coinrag.storage.lineage import open_lineage, run_query, walk
from coinrag.storage.store import Store

# Queries that name one of these need the current producers (computed from the settings).
_NEEDS_CURRENT = ("stale_assets", "current_producers")


def _current(store: Store) -> dict[str, str]:
    from coinrag.tasks.fingerprints import current_producers, store_settings

    return current_producers(store_settings(store))


def lineage_sql(store: Store, sql: str) -> pa.Table:
    """The rows of one read-only query over the views (``storage.lineage.LineageError`` if bad).

    The current producers are computed only when the query names ``stale_assets`` or
    ``current_producers`` (it costs loading the tokenizer and the embedder).
    """
    needs = any(name in sql.lower() for name in _NEEDS_CURRENT)
    con = open_lineage(store, _current(store) if needs else None)
    return run_query(con, sql)


def lineage_stale(store: Store) -> pa.Table:
    """Every stale asset against the settings in ``STORE/coinrag.toml``."""
    con = open_lineage(store, _current(store))
    return run_query(con, "SELECT * FROM stale_assets ORDER BY asset, producer, asset_id")


def lineage_walk(store: Store, kind: str, ident: str) -> dict[str, pa.Table]:
    """The chain up and down through one ``kind`` (nugget | chunk | doc) id."""
    return walk(open_lineage(store), kind, ident)
