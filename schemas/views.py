"""The lineage views: every DuckDB view over the tables and the index, its columns defined once.

``storage/lineage.py`` creates each view with exactly the fields of its dataclass, in order
(``CREATE VIEW name (columns...) AS SELECT ...``; the columns are checked after creation), so a
view's column names are spelled here and nowhere else. Views that keep a table's own columns
(``latest_runs``, ``live_documents``, ``kv_entries``) reuse that table's dataclass.

Index tables (LanceDB, ``schemas.tables.INDEX_TABLES``) appear as ``index_<name>``
(``index_chunks``, ``index_windows``, ``index_nuggets``, ``index_documents``) with every column
but ``vector``.

"Current" producers are what the store's settings (``STORE/coinrag.toml``) make now:
:data:`PRODUCERS` names them; an asset is stale when a producer it was made with differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from coinrag.schemas.tables import DocumentRow, KvManifestRow, PlaceInDocument, RunRow

# The producers whose current value decides staleness (the names of ``current_producers`` rows).
# ``model_fp`` is the generation model as it computes the KV (at ``kv_dtype``);
# ``cartridge_model_fp`` the same model as cartridges are trained and served with (at its
# default dtype, ``inference.model.loading.default_dtype``): the two differ when the dtypes do.
PRODUCERS = (
    "tokenizer_fp",
    "chunker_fp",
    "extractor_fp",
    "tau",
    "model_fp",
    "cartridge_model_fp",
    "embedder_fp",
)

# Views that are a table's own columns, filtered to the current state.
SAME_AS_TABLE: dict[str, type] = {
    "latest_runs": RunRow,  # one row per run: its last state (the end row once written)
    "live_documents": DocumentRow,  # the live row per doc_id: storage.corpus.live_events
    # valid KV entries: latest manifest row per (kv_fp, content_key, kept ranges)
    "kv_entries": KvManifestRow,
}


@dataclass(frozen=True)
class ChunkLineage(PlaceInDocument):
    """``lineage_chunks``: one row per chunk and KV entry of its content (``kv_*`` NULL when the
    chunk has no KV; with ``kv_keep = "nuggets"`` one per entry of kept ranges, e.g. those of
    two extractors until gc), with its index row (``index_*`` NULL when it is not in the
    index)."""

    chunk_id: str
    doc_id: str
    doc_version: str
    ordinal: int
    n_tokens: int
    content_key: str
    text_hash: str
    tokenizer_fp: str
    chunker_fp: str
    run_id: str  # the run that cut the chunk
    live: bool  # its doc_version is the live version of its document
    kv_location: str | None  # "<kv_fp>/shard-NNNNNN#slot-S" under STORE/kv/
    kv_kept: list[int] | None  # token ranges the entry holds [s0, e0, ...]; NULL: whole chunk
    kv_model_fp: str | None
    kv_run_id: str | None  # the run that computed the KV entry (maybe an earlier one)
    index_embedder_fp: str | None
    index_run_id: str | None  # the run that upserted the LanceDB row
    embedding_run_id: str | None  # the run that computed the index row's vector


@dataclass(frozen=True)
class NuggetLineage(PlaceInDocument):
    """``lineage_nuggets``: one row per nugget and KV entry of its chunk's content that holds
    the nugget's span (every whole-chunk entry; with ``kv_keep = "nuggets"`` the entries whose
    kept ranges cover it), with the extraction that proposed it, the chunk and document version
    it lies in, its index row, and where it is (file, pages, section)."""

    nugget_id: str
    chunk_id: str
    doc_id: str
    doc_version: str
    content_key: str
    tok_start: int  # [tok_start, tok_end) inside the chunk: the KV slice of the nugget
    tok_end: int
    match_kind: str
    similarity: float
    tau: float
    run_id: str  # the run that recovered the nugget
    live: bool
    extractor_fp: str
    backend: str | None
    llm_model: str | None
    prompt_version: str | None
    extraction_status: str | None
    extraction_run_id: str | None  # the run whose extractor call answered the chunk text
    extraction_calls: int  # ledger rows of that answer (retries included)
    extraction_cost_usd: float
    tokenizer_fp: str | None
    chunker_fp: str | None
    kv_location: str | None
    kv_kept: list[int] | None  # token ranges the entry holds [s0, e0, ...]; NULL: whole chunk
    kv_model_fp: str | None
    kv_run_id: str | None
    index_embedder_fp: str | None
    index_run_id: str | None


@dataclass(frozen=True)
class AbandonedExtraction:
    """``abandoned_extractions``: one row per chunk whose text an extractor abandoned (its
    replies were malformed in ``abandon_after`` builds under that fingerprint, and no build got
    an ``ok`` answer since): the chunk has no LLM nuggets of that extractor, and no build asks
    again until the fingerprint changes or ``coinrag build --retry-abandoned``."""

    chunk_id: str
    doc_id: str
    doc_version: str
    text_hash: str
    extractor_fp: str
    backend: str
    llm_model: str
    prompt_version: str
    malformed_runs: int  # builds (distinct runs) whose replies for the text were malformed
    error: str | None  # "malformed in N builds: <the last reason>"
    run_id: str  # the build that abandoned it
    live: bool  # the chunk belongs to a live document version


@dataclass(frozen=True)
class CartridgeLineage:
    """``lineage_cartridges``: the latest stored version of each cartridge, with its run."""

    cartridge_id: str
    doc_id: str
    doc_version: str
    model_fp: str
    cartridge_fp: str
    kind: str
    step: int
    location: str
    run_id: str  # the training run that saved this version
    run_flow: str | None
    live: bool


@dataclass(frozen=True)
class RunFingerprint:
    """``run_fingerprints``: one row per (run, fingerprint it recorded), e.g. which training run
    produced a ``model_fp`` and which builds used it."""

    run_id: str
    flow: str
    status: str
    started_at: datetime
    name: str  # tokenizer_fp | chunker_fp | extractor_fp | model_fp | base_model_fp | ...
    fingerprint: str


@dataclass(frozen=True)
class RunCost:
    """``run_costs``: one row per run: recorded cost, the LLM ledger's sums, rows it wrote."""

    run_id: str
    flow: str
    status: str
    started_at: datetime
    ended_at: datetime | None
    code_version: str
    cost_usd: float  # as recorded by the run
    ledger_calls: int  # extraction_calls rows of the run (extraction and self-study)
    ledger_tokens_in: int
    ledger_tokens_out: int
    ledger_cost_usd: float
    documents: int  # rows each table got from the run
    chunks: int
    nuggets: int
    kv_entries: int
    embeddings: int
    cartridges: int


@dataclass(frozen=True)
class StaleAsset:
    """``stale_assets``: an asset whose producer differs from the current one (see PRODUCERS).

    ``asset``: chunk | nugget | kv_entry | index_chunk | index_nugget | index_document |
    cartridge; only chunks and nuggets of live document versions are listed.
    """

    asset: str
    asset_id: str  # chunk_id, nugget_id, KV location, doc_id (index_document) or cartridge_id
    doc_id: str | None
    producer: str  # one of PRODUCERS
    built_with: str
    current: str
    run_id: str  # the run that built it


@dataclass(frozen=True)
class CurrentProducer:
    """``current_producers``: one row per name of PRODUCERS, as the store's settings make it."""

    producer: str
    current: str


# Every view with its row type, in creation order (later views read earlier ones).
VIEWS: dict[str, type] = {
    **SAME_AS_TABLE,
    "lineage_chunks": ChunkLineage,
    "lineage_nuggets": NuggetLineage,
    "abandoned_extractions": AbandonedExtraction,
    "lineage_cartridges": CartridgeLineage,
    "run_fingerprints": RunFingerprint,
    "run_costs": RunCost,
    "current_producers": CurrentProducer,
    "stale_assets": StaleAsset,
}
