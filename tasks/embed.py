"""Embed + index stage: vectors for chunks, nuggets and documents, written to the LanceDB index.

Keys (see ../shared/DESIGN.md):

- the embedding cache (Parquet table ``embeddings``, :class:`schemas.tables.EmbeddingRow`) is keyed
  by ``(embedder_fp, text_hash)`` where ``text_hash`` is ``keys.text_hash`` of the exact string
  given to the embedder. A text is embedded at most once per embedder, whatever rows it belongs
  to, in this build or any later one (the same nugget text in two documents: one vector);
- an index row is keyed by its row identity (``chunk_id``, ``nugget_id``, ``doc_id``): a row that
  is already in the index for the same embedder (and, for documents, the same ``doc_version``)
  is not rewritten, so an unchanged rebuild writes nothing.

What is embedded:

- a chunk: its full text (the embedder truncates to its ``max_length``: 256 word pieces for
  MiniLM);
- a nugget: its source text, stripped of surrounding whitespace;
- a document: ``title + "\\n" + the start of its text``, truncated by the embedder to its
  ``max_length`` tokens (so the first ~250 tokens for MiniLM; the text is cut at
  ``8 * max_length`` characters before tokenising). The title is ``metadata["title"]`` if present,
  else the doc_id. Chosen over the mean of the chunk vectors because a document vector is used to
  pick a whole document (CAS cartridge selection), where the title and lead say what the
  document is about, while a mean of chunk vectors of a long document blurs towards the corpus
  mean; it costs one embedding per document version.

The inputs are the *complete* current view of the given documents: index rows of those documents
(``doc_id`` in ``documents``, ``chunks`` or ``nuggets``) that are not in the inputs (an old
version's chunks, nuggets no longer recovered) are deleted. Documents not given are left alone;
:meth:`storage.index.LanceIndex.delete_documents` removes a deleted document.

A new embedder (another fingerprint) resets the index: its tables are rebuilt from the cache of
the new embedder (which starts empty), while the old embedder's cached vectors stay in Parquet.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow.compute as pc

from coinrag.inference.embedders import Embedder
from coinrag.schemas.keys import CODE_VERSION, text_hash
from coinrag.schemas.tables import INDEX_TABLES, ChunkRow, EmbeddingRow, NuggetRow
from coinrag.storage.index import LanceIndex
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_table

CACHE_FLUSH_ROWS = 4096  # embedded vectors per Parquet file: a killed run loses at most these
DOC_CHARS_PER_TOKEN = 8  # document text is cut at max_length * this many characters

StageProgress = Callable[[int, int], None]  # (texts embedded so far, texts to embed)
# Parts of texts -> their vectors, ``(len(part), dim)`` float32 each, in order.
EmbedParts = Callable[[list[list[str]]], Iterable[np.ndarray]]


@dataclass
class EmbedCounts:
    texts: int = 0  # distinct texts whose vector was needed for a row to write
    embedded: int = 0  # of those, computed now
    cached: int = 0  # of those, read from the embedding cache (not embedded again)
    chunks_written: int = 0
    nuggets_written: int = 0
    documents_written: int = 0
    chunks_unchanged: int = 0  # already in the index: not rewritten
    nuggets_unchanged: int = 0
    documents_unchanged: int = 0
    chunks_deleted: int = 0  # stale rows of the given documents
    nuggets_deleted: int = 0
    index_reset: bool = False  # the index had another embedder and was rebuilt
    indexes_built: dict[str, list[str]] = field(default_factory=dict)
    embed_seconds: float = 0.0
    index_seconds: float = 0.0


def _doc_version(doc: Any) -> str:
    version = getattr(doc, "version", None)
    return version if isinstance(version, str) else doc.doc_version


def _doc_metadata(doc: Any) -> dict[str, Any]:
    metadata = getattr(doc, "metadata", None)
    if isinstance(metadata, dict):
        return metadata
    raw = getattr(doc, "metadata_json", None)
    return json.loads(raw) if raw else {}


def index_columns(
    table: str, rows: Sequence[Any], embedder_fp: str, run_id: str, **computed: list[Any]
) -> dict[str, list[Any]]:
    """The plain columns of index ``table`` (``schemas.tables.INDEX_TABLES``; all but the
    vector) for ``rows``: ``computed`` ones as given (one value per row), ``embedder_fp`` and
    ``run_id`` the same on every row, each other the rows' attribute of that name."""
    given = {"embedder_fp": [embedder_fp] * len(rows), "run_id": [run_id] * len(rows)}
    given.update(computed)
    return {
        f.name: given[f.name] if f.name in given else [getattr(r, f.name) for r in rows]
        for f in fields(INDEX_TABLES[table])
        if f.name != "vector"
    }


def document_title(doc: Any) -> str:
    title = _doc_metadata(doc).get("title")
    return str(title) if title else doc.doc_id


def document_text(doc: Any, max_length: int) -> str:
    """The string embedded for a document's vector: its title and the start of its text."""
    return f"{document_title(doc)}\n{doc.text[: max_length * DOC_CHARS_PER_TOKEN]}"


def nugget_text(nugget: NuggetRow) -> str:
    """The string embedded for a nugget (its source text without surrounding whitespace)."""
    return nugget.text.strip() or nugget.text


def cached_vectors(
    store: Store, embedder_fp: str, hashes: Sequence[str], dim: int
) -> dict[str, np.ndarray]:
    """Vectors of the embedding cache for these text hashes (those present)."""
    if not hashes:
        return {}
    table = read_table(
        store,
        EmbeddingRow,
        columns=["text_hash", "vector"],
        filter=(pc.field("embedder_fp") == embedder_fp) & pc.field("text_hash").isin(list(hashes)),
    )
    if table.num_rows == 0:
        return {}
    keys = table.column("text_hash").to_pylist()
    vec = table.column("vector").combine_chunks()
    lengths = pc.list_value_length(vec).to_numpy(zero_copy_only=False)
    flat = vec.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    out: dict[str, np.ndarray] = {}
    offset = 0
    for key, n in zip(keys, lengths, strict=True):
        if n == dim and key not in out:
            out[key] = flat[offset : offset + n]
        offset += int(n)
    return out


def embed_texts(
    store: Store,
    embedder: Embedder,
    texts: dict[str, str],
    run_id: str,
    counts: EmbedCounts,
    progress: StageProgress | None = None,
    part_size: int = CACHE_FLUSH_ROWS,
    embed_parts: EmbedParts | None = None,
) -> dict[str, np.ndarray]:
    """Vectors for ``{text_hash: text}``: from the cache, else embedded now and cached.

    The texts to embed are cut into parts of ``part_size`` (in ``texts`` order); each part's
    vectors are appended to the cache as one file as soon as they arrive. ``embed_parts`` maps
    the list of parts to their ``(len(part), dim)`` float32 matrices, in order (e.g. one task
    per part on a distributed runner); by default ``embedder`` embeds them here, one by one.
    """
    hashes = list(texts)
    vectors = cached_vectors(store, embedder.fingerprint, hashes, embedder.dim)
    missing = [h for h in hashes if h not in vectors]
    counts.texts += len(hashes)
    counts.cached += len(hashes) - len(missing)
    started = time.perf_counter()
    parts = [missing[i : i + part_size] for i in range(0, len(missing), part_size)]

    def embed_here(batches: list[list[str]]) -> Iterator[np.ndarray]:
        done = 0
        for batch in batches:

            def report(n: int, _total: int, base: int = done) -> None:
                if progress is not None:
                    progress(base + n, len(missing))

            yield embedder.embed_documents(batch, progress=report)
            done += len(batch)

    matrices = (embed_parts or embed_here)([[texts[h] for h in part] for part in parts])
    for part, mat in zip(parts, matrices, strict=True):
        rows = [
            EmbeddingRow(
                text_hash=h,
                embedder_fp=embedder.fingerprint,
                vector=mat[i],  # float32 numpy row: written as list<float32>
                run_id=run_id,
                code_version=CODE_VERSION,
            )
            for i, h in enumerate(part)
        ]
        append_rows(store, rows, run_id, "embed")
        for i, h in enumerate(part):
            vectors[h] = mat[i]
        counts.embedded += len(part)
        if progress is not None:
            progress(counts.embedded, len(missing))
    counts.embed_seconds += time.perf_counter() - started
    return vectors


def embed_stage(
    store: Store,
    chunks: Sequence[ChunkRow],
    nuggets: Sequence[NuggetRow],
    documents: Sequence[Any],
    embedder: Embedder,
    run_id: str,
    progress: StageProgress | None = None,
    vector_index_min_rows: int | None = None,
    part_size: int = CACHE_FLUSH_ROWS,
    embed_parts: EmbedParts | None = None,
) -> EmbedCounts:
    """Bring the index up to date for these documents, chunks and nuggets; return counts.

    ``documents`` are ``tasks.ingest.SourceDocument`` (or ``DocumentRow``) objects.
    ``part_size`` and ``embed_parts``: see :func:`embed_texts`.
    """
    counts = EmbedCounts()
    index, counts.index_reset = LanceIndex.open_for_write(
        store, embedder.fingerprint, embedder.dim, getattr(embedder, "name", "")
    )
    t0 = time.perf_counter()
    chunks = list({c.chunk_id: c for c in chunks}.values())
    nuggets = list({n.nugget_id: n for n in nuggets}.values())
    documents = list({d.doc_id: d for d in documents}.values())
    scope = {d.doc_id for d in documents} | {c.doc_id for c in chunks} | {n.doc_id for n in nuggets}

    # What the index already holds, and what of it is stale.
    have_chunks = index.columns("chunks", ["chunk_id", "doc_id"]).to_pydict()
    have_nuggets = index.columns("nuggets", ["nugget_id", "doc_id"]).to_pydict()
    have_docs = index.columns("documents", ["doc_id", "doc_version"]).to_pydict()
    chunk_ids = {c.chunk_id for c in chunks}
    nugget_ids = {n.nugget_id for n in nuggets}
    stale_chunks = [
        cid
        for cid, did in zip(have_chunks["chunk_id"], have_chunks["doc_id"], strict=True)
        if did in scope and cid not in chunk_ids
    ]
    stale_nuggets = [
        nid
        for nid, did in zip(have_nuggets["nugget_id"], have_nuggets["doc_id"], strict=True)
        if did in scope and nid not in nugget_ids
    ]
    counts.chunks_deleted = index.delete_where("chunks", "chunk_id", stale_chunks)
    counts.nuggets_deleted = index.delete_where("nuggets", "nugget_id", stale_nuggets)

    existing_chunks = set(have_chunks["chunk_id"])
    existing_nuggets = set(have_nuggets["nugget_id"])
    existing_docs = dict(zip(have_docs["doc_id"], have_docs["doc_version"], strict=True))
    new_chunks = [c for c in chunks if c.chunk_id not in existing_chunks]
    new_nuggets = [n for n in nuggets if n.nugget_id not in existing_nuggets]
    new_docs = [d for d in documents if existing_docs.get(d.doc_id) != _doc_version(d)]
    counts.chunks_unchanged = len(chunks) - len(new_chunks)
    counts.nuggets_unchanged = len(nuggets) - len(new_nuggets)
    counts.documents_unchanged = len(documents) - len(new_docs)
    counts.index_seconds += time.perf_counter() - t0

    # Vectors: the cache first, then the embedder for what it lacks.
    chunk_texts = [c.text for c in new_chunks]
    nugget_texts = [nugget_text(n) for n in new_nuggets]
    doc_texts = [document_text(d, embedder.max_length) for d in new_docs]
    wanted: dict[str, str] = {}
    keys: dict[str, list[str]] = {}
    for kind, texts in (("chunks", chunk_texts), ("nuggets", nugget_texts), ("docs", doc_texts)):
        keys[kind] = [text_hash(t) for t in texts]
        for h, t in zip(keys[kind], texts, strict=True):
            wanted.setdefault(h, t)
    vectors = embed_texts(store, embedder, wanted, run_id, counts, progress, part_size, embed_parts)

    def matrix(hashes: list[str]) -> np.ndarray:
        if not hashes:
            return np.zeros((0, embedder.dim), dtype=np.float32)
        return np.stack([vectors[h] for h in hashes]).astype(np.float32, copy=False)

    t1 = time.perf_counter()
    fp = embedder.fingerprint
    if new_chunks:
        data = index.build_table(
            "chunks",
            index_columns("chunks", new_chunks, fp, run_id),
            matrix(keys["chunks"]),
        )
        counts.chunks_written = index.upsert("chunks", data)
    if new_nuggets:
        data = index.build_table(
            "nuggets",
            index_columns("nuggets", new_nuggets, fp, run_id),
            matrix(keys["nuggets"]),
        )
        counts.nuggets_written = index.upsert("nuggets", data)
    if new_docs:
        data = index.build_table(
            "documents",
            index_columns(
                "documents",
                new_docs,
                fp,
                run_id,
                doc_version=[_doc_version(d) for d in new_docs],
                title=[document_title(d) for d in new_docs],
            ),
            matrix(keys["docs"]),
        )
        counts.documents_written = index.upsert("documents", data)
    changed = (
        counts.chunks_written
        + counts.nuggets_written
        + counts.documents_written
        + counts.chunks_deleted
        + counts.nuggets_deleted
    )
    if changed or counts.index_reset or index.lacks_text_index():
        counts.indexes_built = index.ensure_indexes(min_rows=vector_index_min_rows)
    counts.index_seconds += time.perf_counter() - t1
    return counts
