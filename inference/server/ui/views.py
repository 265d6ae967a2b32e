"""What each explorer page shows, as plain dicts for its template: the store summary, the
documents list, one document cut into chunks and nuggets, a lineage walk, the Ask page's
settings. Everything is read through :class:`storage.explore.StoreExplorer` over the version
the server answers from now; the explorer is reopened when a build, delete or gc publishes
another version.

Example::

    state = UiState(server)
    state.store_page()["counts"]        # {"documents": 4, "chunks": 4, "nuggets": 24}
    state.document_page("marie-curie")["pieces"][0].runs[0].nugget["nugget_id"]
"""

from __future__ import annotations

import threading
from typing import Any

from coinrag.inference.methods.assets import StoredKv
from coinrag.inference.methods.base import METHODS
from coinrag.inference.retrieval.retriever import FUSION_NORMALISER, dense_weight
from coinrag.inference.server.ui.marks import cut_document
from coinrag.schemas.settings import DEFAULT_QUERY, RETRIEVAL_MODES
from coinrag.schemas.views import PRODUCERS
from coinrag.storage.explore import StoreExplorer
from coinrag.storage.runs import recorded_fingerprints

PAGE_SIZE = 25  # documents per page of the list
KV_PRODUCERS = ("model_fp", "embedder_fp")  # current producers the served engine knows


def raw_bf16_bytes_per_token(config: Any) -> int:
    """Bytes one token's K and V take over all layers in bfloat16, uncompressed:
    ``2 (K, V) * layers * kv_heads * head_dim * 2``; SmolLM2-135M: 2*30*3*64*2 = 23040."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * 2


def parse_cite(cite: str) -> tuple[str, int, int] | None:
    """``"ch-1a2b:27-41" -> ("ch-1a2b", 27, 41)``; None for anything else."""
    chunk_id, _, span = cite.rpartition(":")
    start, _, end = span.partition("-")
    if not chunk_id or not start.isdigit() or not end.isdigit():
        return None
    return chunk_id, int(start), int(end)


def reuses_kv(method: str) -> bool:
    """Whether ``method`` loads its context's KV from the store (coinrag, turborag) instead
    of computing it (standard)."""
    return any(issubclass(kind, StoredKv) for kind in METHODS[method].needs)


# The Ask page warns when no evidence's dense cosine similarity reaches this: nothing in the
# store is about the question. Measured with the default embedder (MiniLM) on the Python docs'
# HTML (the best chunk's cosine, dense search): 120 questions about the docs (60 FAQ, 60
# natural) at 0.361 or more (median 0.695 and 0.584), 20 questions about other things
# (capitals, recipes, spiders) at 0.171-0.381 (median 0.245), 19 of them under 0.35. Another
# embedder has other cosines: the warning is then only a hint.
WEAK_DENSE_COSINE = 0.35


class UiState:
    """The explorer of the served version (reopened on a swap) and the page builders."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self._lock = threading.Lock()
        self._explorer: StoreExplorer | None = None
        self._run_id: str | None = None
        self._current: dict[str, str] = {}  # the producers stale_assets compares with

    def explorer(self) -> StoreExplorer:
        """The explorer of the version served now (opened at the first page after a swap)."""
        version = self.server.holder.current
        with self._lock:
            if self._explorer is None or self._run_id != version.run_id:
                store = version.engine.store
                # the published build's producers, and what the served engine loaded itself
                fingerprints = {
                    **recorded_fingerprints(store, version.run_id),
                    **{p: v for p, v in version.engine.fingerprints().items() if p in KV_PRODUCERS},
                }
                current = {p: fingerprints[p] for p in PRODUCERS if p in fingerprints}
                # the previous explorer is not closed here: a page may still be reading it
                # (its connection goes with its last reference)
                self._explorer = StoreExplorer.open(store, current)
                self._run_id, self._current = version.run_id, current
            return self._explorer

    def close(self) -> None:
        with self._lock:
            if self._explorer is not None:
                self._explorer.close()
                self._explorer = None

    def store_page(self) -> dict[str, Any]:
        explorer = self.explorer()
        version = self.server.holder.current
        kv = explorer.kv_totals()
        per_token = raw_bf16_bytes_per_token(version.engine.model.config)
        n_stale, stale = explorer.stale()
        return {
            "store": str(explorer.store),
            "published": version.published,
            "fingerprints": version.engine.fingerprints(),
            "counts": explorer.counts(),
            "kv": kv,
            "raw_bf16_bytes": kv["tokens"] * per_token,
            "raw_bf16_per_token": per_token,
            "runs": explorer.runs(),
            "disk": explorer.disk_use(),
            "stale_total": n_stale,
            "stale": stale,
            "stale_producers": sorted(self._current),
        }

    def documents_page(self, query: str, page: int) -> dict[str, Any]:
        page = max(page, 1)
        total, rows = self.explorer().documents(query, (page - 1) * PAGE_SIZE, PAGE_SIZE)
        pages = max(1, -(-total // PAGE_SIZE))
        return {"query": query, "page": page, "pages": pages, "total": total, "rows": rows}

    def document_page(self, doc_id: str, cite: str = "") -> dict[str, Any] | None:
        """``cite``: ``"CHUNK_ID:START-END"``, a span of evidence (chunk-local tokens) to
        highlight: the nugget with exactly those offsets, or the whole chunk."""
        doc = self.explorer().document(doc_id)
        if doc is None:
            return None
        fingerprints = self.server.holder.current.engine.fingerprints()
        return {
            "doc": doc,
            "pieces": cut_document(doc["text"], doc["chunks"]),
            "cited": parse_cite(cite),
            "kv_codec": fingerprints.get("kv_codec", "-"),
            "kv_dtype": fingerprints.get("kv_dtype", "-"),
        }

    def lineage_page(self, ident: str) -> dict[str, Any]:
        """The walk through ``ident`` (``sections``), or ``kind`` None for an unknown id."""
        explorer = self.explorer()
        kind = explorer.kind_of(ident) if ident else None
        sections = explorer.walk(kind, ident) if kind else {}
        return {"ident": ident, "kind": kind, "sections": sections}

    def ask_page(self) -> dict[str, Any]:
        engine = self.server.holder.current.engine
        explorer = self.explorer()
        kv = explorer.kv_totals()
        return {
            "methods": self.server.methods,
            "reuses_kv": {m: reuses_kv(m) for m in self.server.methods},
            "defaults": DEFAULT_QUERY,
            "retrieval_modes": RETRIEVAL_MODES,
            "max_kc": self.server.settings.max_kc,
            "max_k": self.server.settings.max_k,
            "kv_bytes_per_token": kv["bytes"] // kv["tokens"] if kv["tokens"] else 0,
            "raw_bf16_per_token": raw_bf16_bytes_per_token(engine.model.config),
            "hybrid_dense_weight": dense_weight(engine.retriever.index),
            "fusion_normaliser": FUSION_NORMALISER.described,
            "weak_cosine": WEAK_DENSE_COSINE,
        }
