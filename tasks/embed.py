"""Embed + index stage: vectors for chunks, their windows, nuggets and documents, written to the
LanceDB index.

Keys (see docs/design.md):

- the embedding cache (Parquet table ``embeddings``, :class:`schemas.tables.EmbeddingRow`) is keyed
  by ``(embedder_fp, text_hash)`` where ``text_hash`` is ``keys.text_hash`` of the exact string
  given to the embedder. A text is embedded at most once per embedder, whatever rows it belongs
  to, in this build or any later one (the same nugget text in two documents: one vector);
- an index row is keyed by its row identity (``chunk_id``, ``window_id``, ``nugget_id``,
  ``doc_id``): a row that is already in the index for the same embedder (and, for documents, the
  same ``doc_version``) is not rewritten, so an unchanged rebuild writes nothing. A chunk's
  windows are written with the chunk, and for every chunk the ``windows`` table lacks.

What is embedded (and searched by words: the ``search_text`` column of chunks and nuggets, while
``text`` stays the text shown as evidence and kept as KV):

- the heading prefix: a chunk's or nugget's heading path (``" > ".join(section)``, outermost
  first) and a newline, before its text; nothing for one without a section. A chunk's also
  holds the titles of the headings inside it (its document's heading map), one a line, after
  the path: a title is searched as a field of its own (``schemas.tables.SEARCH_TEXT_VERSION``);
- a chunk: its search text (the embedder truncates it to its ``max_length``: 256 word pieces for
  MiniLM, about a third of a 512-token chunk), in the ``chunks`` table;
- a chunk's windows (``inference.retrieval.windows``): its text cut into pieces of at most the
  embedder's ``max_length`` word pieces, a quarter of each overlapping the one before,
  together covering every token; each in the ``windows`` table after the heading path where
  it starts (a heading inside the chunk, from its document's heading map, else the chunk's
  own). A chunk that fits is one window, its search text (the chunk's own vector: the same
  text, embedded once);
- a nugget: the heading prefix and its source text, stripped of surrounding whitespace;
- a document: ``title + "\\n" + the start of its text``, truncated by the embedder to its
  ``max_length`` tokens (so the first ~250 tokens for MiniLM; the text is cut at
  ``8 * max_length`` characters before tokenising). The title is ``metadata["title"]`` if present,
  else the doc_id. Chosen over the mean of the chunk vectors because a document vector is used to
  pick a whole document (CAS cartridge selection), where the title and lead say what the
  document is about, while a mean of chunk vectors of a long document blurs towards the corpus
  mean; it costs one embedding per document version.

The inputs are the *complete* current view of the given documents: index rows of those documents
(``doc_id`` in ``documents``, ``chunks`` or ``nuggets``) that are not in the inputs (an old
version's chunks and their windows, nuggets no longer recovered) are deleted. Documents not
given are left alone; :meth:`storage.index.lance.LanceIndex.delete_documents` removes a deleted
document.

A new embedder (another fingerprint) resets the index: its tables are rebuilt from the cache of
the new embedder (which starts empty), while the old embedder's cached vectors stay in Parquet.
A table written by an older coinrag (without ``search_text``; no ``windows`` table) is emptied
and written again the same way (``LanceIndex.open_for_write``), embedding only the new texts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow.compute as pc

from coinrag.inference.retrieval.embedders import Embedder
from coinrag.inference.retrieval.windows import Window
from coinrag.schemas.keys import CODE_VERSION, text_hash, window_id
from coinrag.schemas.settings import BuildSettings
from coinrag.schemas.tables import INDEX_TABLES, ChunkRow, EmbeddingRow, NuggetRow, PlaceInDocument
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_table
from coinrag.tasks.place import DocumentMaps
from coinrag.tasks.readers.base import Heading, section_at

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
    windows_written: int = 0
    nuggets_written: int = 0
    documents_written: int = 0
    chunks_unchanged: int = 0  # already in the index: not rewritten
    nuggets_unchanged: int = 0
    documents_unchanged: int = 0
    chunks_deleted: int = 0  # stale rows of the given documents
    windows_deleted: int = 0
    nuggets_deleted: int = 0
    index_reset: bool = False  # the index had another embedder and was rebuilt
    tables_migrated: list[str] = field(default_factory=list)  # written by an older coinrag
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
    """The title a file's reader found, else ``metadata["title"]``, else the doc_id."""
    title = getattr(doc, "title", None) or _doc_metadata(doc).get("title")
    return str(title) if title else doc.doc_id


def document_text(doc: Any, max_length: int) -> str:
    """The string embedded for a document's vector: its title and the start of its text."""
    return f"{document_title(doc)}\n{doc.text[: max_length * DOC_CHARS_PER_TOKEN]}"


def heading(section: Sequence[str] | None) -> str:
    """A heading path as searched: ``["FAQ", "Performance"]`` -> ``"FAQ > Performance"``
    (empty titles left out; "" for none)."""
    return PlaceInDocument(section=list(section or ())).section_text()


def search_text(text: str, section: Sequence[str] | None, titles: Sequence[str] = ()) -> str:
    r"""The text searched (embedded, and indexed by words) for a row of ``text`` under
    ``section``: the heading path, then ``titles`` (of the headings inside a chunk), one a
    line, then the text; the text alone without either.

    >>> search_text("Use a list.", ["Programming FAQ", "Performance"])
    'Programming FAQ > Performance\nUse a list.'
    >>> search_text("Use a list. Sorting ...", ["FAQ", "Lists"], ["How do I sort?"])
    'FAQ > Lists\nHow do I sort?\nUse a list. Sorting ...'
    """
    lines = [line for line in (heading(section), *(t.strip() for t in titles)) if line]
    return "\n".join([*lines, text]) if lines else text


def nugget_text(nugget: NuggetRow) -> str:
    """The string embedded for a nugget: its source text without surrounding whitespace, after
    its heading prefix (:func:`search_text`)."""
    return search_text(nugget.text.strip() or nugget.text, nugget.section)


@dataclass(frozen=True)
class PlannedWindow:
    """A window of a chunk to write (``inference.retrieval.windows.Window``), its ordinal in the
    chunk."""

    chunk: ChunkRow
    ordinal: int
    window: Window


def document_headings(documents: Iterable[Any]) -> dict[tuple[str, str], tuple[Heading, ...]]:
    """``(doc_id, doc_version)`` -> the document's headings (its ``FileOrigin`` heading map;
    ``tasks.ingest.SourceDocument`` or ``DocumentRow``), for the documents that have any."""
    out = {}
    for doc in documents:
        headings = DocumentMaps.of(doc.text, getattr(doc, "origin", doc)).headings
        if headings:
            out[(doc.doc_id, _doc_version(doc))] = headings
    return out


def inner_headings(chunk: ChunkRow, headings: Sequence[Heading]) -> list[Heading]:
    """The headings of ``chunk``'s document (``headings``) whose line starts inside the chunk,
    after its first character (the chunk's own ``section`` names the one it starts under)."""
    return [h for h in headings if chunk.char_start < h.char_start < chunk.char_end]


def inner_sections(chunk: ChunkRow, headings: tuple[Heading, ...]) -> list[tuple[int, str]]:
    """The heading paths that start inside ``chunk``, as ``(character of the chunk's text,
    heading path)``, from its document's ``headings``."""
    return [
        (h.char_start - chunk.char_start, heading(section_at(headings, h.char_start)))
        for h in inner_headings(chunk, headings)
    ]


def chunk_search_text(chunk: ChunkRow, headings: Sequence[Heading] = ()) -> str:
    """A chunk's search text: its heading path, the titles of the headings inside it (its
    document's ``headings``; a title counts as a field of its own, as search engines weigh a
    page's titles: a question worded like one of the sections a chunk holds finds it by
    words), then its text."""
    titles = [h.title for h in inner_headings(chunk, headings)]
    return search_text(chunk.text, chunk.section, titles)


def chunk_windows(
    embedder: Embedder,
    chunks: Sequence[ChunkRow],
    headings: Mapping[tuple[str, str], tuple[Heading, ...]] | None = None,
) -> list[PlannedWindow]:
    """Every window of these chunks: ``Embedder.windows`` of the text after its heading path,
    a window that starts under a heading inside the chunk after that heading's path
    (``headings``: :func:`document_headings` of their documents; a chunk whose document is
    not there: its own path only)."""
    headings = headings or {}
    return [
        PlannedWindow(c, i, w)
        for c in chunks
        for i, w in enumerate(
            embedder.windows(
                c.text,
                heading(c.section),
                inner_sections(c, headings.get((c.doc_id, c.doc_version), ())),
            )
        )
    ]


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


@dataclass(frozen=True)
class EmbedOptions:
    """How the stage embeds: texts per part (``part_size``: one embeddings-cache file each, the
    build's ``embed_batch_size``), where each part's vectors are computed (``parts``: e.g. one
    task per part on a runner's workers, ``flows/scaleout.py``; None: by the stage's embedder,
    here, one part after another), and ``vector_index_min_rows`` (rows from which LanceDB
    builds vector indexes: ``storage.index.lance.LanceIndex.ensure_indexes``; None: its default)."""

    part_size: int = BuildSettings.embed_batch_size
    parts: EmbedParts | None = None
    vector_index_min_rows: int | None = None

    @classmethod
    def from_settings(
        cls, settings: BuildSettings, parts: EmbedParts | None = None
    ) -> EmbedOptions:
        return cls(part_size=settings.embed_batch_size, parts=parts)


def embed_here(embedder: Embedder, total: int, progress: StageProgress | None) -> EmbedParts:
    """:data:`EmbedParts` by ``embedder`` in this process, one part after another, reporting
    ``progress(done, total)`` within each part."""

    def parts(batches: list[list[str]]) -> Iterator[np.ndarray]:
        done = 0
        for batch in batches:

            def report(n: int, _total: int, base: int = done) -> None:
                if progress is not None:
                    progress(base + n, total)

            yield embedder.embed_documents(batch, progress=report)
            done += len(batch)

    return parts


def embed_texts(
    store: Store,
    embedder: Embedder,
    texts: dict[str, str],
    run_id: str,
    counts: EmbedCounts,
    options: EmbedOptions | None = None,
    progress: StageProgress | None = None,
) -> dict[str, np.ndarray]:
    """Vectors for ``{text_hash: text}``: from the cache, else embedded now and cached.

    The texts to embed are cut into parts of ``options.part_size`` (in ``texts`` order); each
    part's vectors are appended to the cache as one file as soon as they arrive (computed by
    ``options.parts``, in order, else by :func:`embed_here`).
    """
    options = options or EmbedOptions()
    hashes = list(texts)
    vectors = cached_vectors(store, embedder.fingerprint, hashes, embedder.dim)
    missing = [h for h in hashes if h not in vectors]
    counts.texts += len(hashes)
    counts.cached += len(hashes) - len(missing)
    started = time.perf_counter()
    size = options.part_size
    parts = [missing[i : i + size] for i in range(0, len(missing), size)]
    embed_parts = options.parts or embed_here(embedder, len(missing), progress)
    matrices = embed_parts([[texts[h] for h in part] for part in parts])
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


@dataclass
class IndexPlan:
    """What the index lacks of the given rows (new, or a new version of a document); the stale
    rows of the given documents are deleted while planning (:func:`plan_index`)."""

    chunks: list[ChunkRow]
    nuggets: list[NuggetRow]
    documents: list[Any]
    windowed: list[ChunkRow]  # chunks whose windows the index lacks
    windows: list[PlannedWindow] = field(default_factory=list)  # theirs (:func:`chunk_windows`)
    # (doc_id, doc_version) -> its headings (:func:`document_headings`)
    headings: Mapping[tuple[str, str], tuple[Heading, ...]] = field(default_factory=dict)

    def chunk_texts(self) -> list[str]:
        """The search texts of the new chunks (:func:`chunk_search_text`), in row order."""
        return [
            chunk_search_text(c, self.headings.get((c.doc_id, c.doc_version), ()))
            for c in self.chunks
        ]

    def texts(self, max_length: int) -> dict[str, list[str]]:
        """table -> the strings embedded for its new rows, in row order."""
        return {
            "chunks": self.chunk_texts(),
            "windows": [w.window.text for w in self.windows],
            "nuggets": [nugget_text(n) for n in self.nuggets],
            "documents": [document_text(d, max_length) for d in self.documents],
        }


def plan_index(
    index: LanceIndex,
    chunks: Sequence[ChunkRow],
    nuggets: Sequence[NuggetRow],
    documents: Sequence[Any],
    counts: EmbedCounts,
) -> IndexPlan:
    """Delete the rows of the given documents that are not in the inputs (an old version's
    chunks, nuggets no longer recovered), count the unchanged ones; return the new ones. The
    inputs are deduplicated by row identity (first wins)."""
    chunks = list({c.chunk_id: c for c in chunks}.values())
    nuggets = list({n.nugget_id: n for n in nuggets}.values())
    documents = list({d.doc_id: d for d in documents}.values())
    scope = {d.doc_id for d in documents} | {c.doc_id for c in chunks} | {n.doc_id for n in nuggets}
    have_chunks = index.columns("chunks", ["chunk_id", "doc_id"]).to_pydict()
    have_windows = index.columns("windows", ["chunk_id", "doc_id"]).to_pydict()
    have_nuggets = index.columns("nuggets", ["nugget_id", "doc_id"]).to_pydict()
    have_docs = index.columns("documents", ["doc_id", "doc_version"]).to_pydict()
    counts.chunks_deleted = _delete_stale(index, "chunks", "chunk_id", have_chunks, chunks, scope)
    counts.windows_deleted = _delete_stale(
        index, "windows", "chunk_id", have_windows, chunks, scope
    )
    counts.nuggets_deleted = _delete_stale(
        index, "nuggets", "nugget_id", have_nuggets, nuggets, scope
    )
    existing_chunks = set(have_chunks["chunk_id"])
    existing_nuggets = set(have_nuggets["nugget_id"])
    existing_docs = dict(zip(have_docs["doc_id"], have_docs["doc_version"], strict=True))
    windowed = set(have_windows["chunk_id"])
    plan = IndexPlan(
        chunks=[c for c in chunks if c.chunk_id not in existing_chunks],
        nuggets=[n for n in nuggets if n.nugget_id not in existing_nuggets],
        documents=[d for d in documents if existing_docs.get(d.doc_id) != _doc_version(d)],
        windowed=[c for c in chunks if c.chunk_id not in windowed],
    )
    counts.chunks_unchanged = len(chunks) - len(plan.chunks)
    counts.nuggets_unchanged = len(nuggets) - len(plan.nuggets)
    counts.documents_unchanged = len(documents) - len(plan.documents)
    return plan


def _delete_stale(
    index: LanceIndex,
    table: str,
    key: str,
    have: dict[str, list[Any]],
    rows: Sequence[Any],
    scope: set[str],
) -> int:
    """Delete the rows of ``table`` (``have``: its ``key`` and ``doc_id`` columns) whose
    document is in ``scope`` but which are not among ``rows``; return how many."""
    keep = {getattr(r, key) for r in rows}
    stale = [
        k
        for k, did in zip(have[key], have["doc_id"], strict=True)
        if did in scope and k not in keep
    ]
    return index.delete_where(table, key, stale)


def write_index(
    index: LanceIndex,
    embedder: Embedder,
    plan: IndexPlan,
    vectors: dict[str, np.ndarray],
    hashes: dict[str, list[str]],
    run_id: str,
    counts: EmbedCounts,
) -> None:
    """Upsert the planned rows with ``embedder``'s vectors (``hashes``: table -> each new row's
    text hash, keys of ``vectors``); counts the rows written."""
    fp, dim = embedder.fingerprint, embedder.dim

    def matrix(table: str) -> np.ndarray:
        if not hashes[table]:
            return np.zeros((0, dim), dtype=np.float32)
        return np.stack([vectors[h] for h in hashes[table]]).astype(np.float32, copy=False)

    docs, windows = plan.documents, plan.windows
    computed: dict[str, dict[str, list[Any]]] = {
        "chunks": {"search_text": plan.chunk_texts()},
        "windows": {
            "window_id": [
                window_id(w.chunk.chunk_id, w.window.char_start, w.window.char_end) for w in windows
            ],
            **{
                name: [getattr(w.chunk, name) for w in windows]
                for name in ("chunk_id", "doc_id", "doc_version")
            },
            "ordinal": [w.ordinal for w in windows],
            "search_text": [w.window.text for w in windows],
            "char_start": [w.window.char_start for w in windows],
            "char_end": [w.window.char_end for w in windows],
        },
        "nuggets": {"search_text": [search_text(n.text, n.section) for n in plan.nuggets]},
        "documents": {
            "doc_version": [_doc_version(d) for d in docs],
            "title": [document_title(d) for d in docs],
        },
    }
    rows_of = {"chunks": plan.chunks, "windows": windows, "nuggets": plan.nuggets}
    written = {}
    for table, rows in (*rows_of.items(), ("documents", docs)):
        written[table] = 0
        if rows:
            columns = index_columns(table, rows, fp, run_id, **computed[table])
            written[table] = index.upsert(table, index.build_table(table, columns, matrix(table)))
    counts.chunks_written = written["chunks"]
    counts.windows_written = written["windows"]
    counts.nuggets_written = written["nuggets"]
    counts.documents_written = written["documents"]


def embed_stage(
    store: Store,
    chunks: Sequence[ChunkRow],
    nuggets: Sequence[NuggetRow],
    documents: Sequence[Any],
    embedder: Embedder,
    run_id: str,
    options: EmbedOptions | None = None,
    progress: StageProgress | None = None,
) -> EmbedCounts:
    """Bring the index up to date for these documents, chunks and nuggets; return counts.

    ``documents`` are ``tasks.ingest.SourceDocument`` (or ``DocumentRow``) objects; the
    vectors are computed as ``options`` says (:class:`EmbedOptions`: in this process, or by a
    runner's workers), ``progress(done, total)`` counting the texts embedded.
    """
    counts = EmbedCounts()
    index, counts.index_reset = LanceIndex.open_for_write(
        store, embedder.fingerprint, embedder.dim, getattr(embedder, "name", "")
    )
    counts.tables_migrated = list(index.migrated)
    t0 = time.perf_counter()
    plan = plan_index(index, chunks, nuggets, documents, counts)
    plan.headings = document_headings(documents)
    plan.windows = chunk_windows(embedder, plan.windowed, plan.headings)
    counts.index_seconds += time.perf_counter() - t0

    # Vectors: the cache first, then the embedder for what it lacks.
    wanted: dict[str, str] = {}
    hashes: dict[str, list[str]] = {}
    for table, texts in plan.texts(embedder.max_length).items():
        hashes[table] = [text_hash(t) for t in texts]
        for h, t in zip(hashes[table], texts, strict=True):
            wanted.setdefault(h, t)
    vectors = embed_texts(store, embedder, wanted, run_id, counts, options, progress)

    t1 = time.perf_counter()
    write_index(index, embedder, plan, vectors, hashes, run_id, counts)
    changed = (
        counts.chunks_written
        + counts.windows_written
        + counts.windows_deleted
        + counts.nuggets_written
        + counts.documents_written
        + counts.chunks_deleted
        + counts.nuggets_deleted
    )
    if changed or counts.index_reset or counts.tables_migrated or index.lacks_text_index():
        min_rows = (options or EmbedOptions()).vector_index_min_rows
        counts.indexes_built = index.ensure_indexes(min_rows=min_rows)
    counts.index_seconds += time.perf_counter() - t1
    return counts
