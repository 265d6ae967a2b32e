"""Every table coinrag writes, defined once.

Each table is a frozen dataclass (one instance = one row). The Arrow schema is derived from the
annotations by :func:`arrow_schema`, so a column name is spelled exactly once: here. Code builds
rows as instances and reads them back with ``Record(**row)``.

Every asset row carries ``run_id`` (the run that wrote it) plus its parents' ids and the
fingerprints of what produced it, so lineage is a join, never a separate log.

Type mapping: ``str`` -> string, ``int`` -> int64, ``float`` -> float64, ``bool`` -> bool,
``list[int]`` -> list<int32>, ``list[float]`` -> list<float32>, ``list[str]`` -> list<string>,
``datetime`` -> timestamp[us, UTC];
``X | None`` is nullable.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa

# ---------------------------------------------------------------------------- corpus


@dataclass(frozen=True, kw_only=True)
class FileOrigin:
    """Where a document read from a file came from, and its maps (``tasks/readers``): the
    columns every :class:`DocumentRow` has after its own (null for JSONL / Parquet records).

    ``page_starts[i]``: the character of ``text`` where page ``i + 1`` starts, its label
    ``page_labels[i]``; ``heading_starts[i]``: where heading ``i``'s line starts, its level
    (1 = top) and title. ``size`` and ``mtime_ns`` only let a rebuild skip hashing an unchanged
    file; ``sha256`` (of the file's bytes) and ``reader_fp`` decide the document's version."""

    path: str | None = None  # relative to SOURCE, "/"-separated
    format: str | None = None  # the reader's name: text | markdown | html | pdf | docx
    title: str | None = None
    reader_version: str | None = None
    reader_fp: str | None = None  # keys.fingerprint("reader", {name, version, options})
    sha256: str | None = None
    size: int | None = None  # bytes
    mtime_ns: int | None = None
    page_starts: list[int] | None = None
    page_labels: list[str] | None = None
    heading_starts: list[int] | None = None
    heading_levels: list[int] | None = None
    heading_titles: list[str] | None = None


@dataclass(frozen=True, kw_only=True)
class PlaceInDocument:
    """Where a span of a document is (a chunk, a nugget): its document's file, the pages it
    touches and the heading path where it starts; the columns after a :class:`ChunkRow`'s, a
    :class:`NuggetRow`'s and their index rows' own. Null for a document without pages /
    headings (``path`` null for one not read from a file).

    ``page_labels``: the labels of pages ``page_first..page_last`` (a PDF's own, ``"iv"``);
    ``section``: the heading titles, outermost first (``["Programming FAQ", "Performance"]``).
    """

    path: str | None = None  # the document's file, relative to SOURCE (as FileOrigin.path)
    page_first: int | None = None  # 1-based
    page_last: int | None = None
    page_labels: list[str] | None = None
    section: list[str] | None = None

    @classmethod
    def from_mapping(cls, row: Any) -> PlaceInDocument:
        """The place columns of a row as a mapping (a search hit, a dict)."""
        return cls(**{f.name: row.get(f.name) for f in dataclasses.fields(cls)})

    def pages_text(self) -> str:
        """``"p. 12"``, ``"pp. iv-2"`` (the file's own page labels where it has them), ``""``
        without pages."""
        if self.page_first is None:
            return ""
        labels = self.page_labels or []
        first = labels[0] if labels else str(self.page_first)
        last = labels[-1] if labels else str(self.page_last)
        return f"p. {first}" if first == last else f"pp. {first}-{last}"

    def section_text(self) -> str:
        """The heading path as one line: ``"Programming FAQ > Performance"``."""
        return " > ".join(t.strip() for t in self.section or () if t and t.strip())

    def citation(self, doc_id: str) -> str:
        """Where a span is, for a person: ``"faq/programming.pdf p. 12 | Programming FAQ >
        Performance"`` (the file, else ``doc_id``; pages and section where known)."""
        where = " ".join(filter(None, [self.path or doc_id, self.pages_text()]))
        return " | ".join(filter(None, [where, self.section_text()]))


def with_place(row: Any, place: PlaceInDocument) -> Any:
    """``row`` (a chunk, a nugget or an index row) with the columns of ``place``."""
    names = (f.name for f in dataclasses.fields(PlaceInDocument))
    return dataclasses.replace(row, **{n: getattr(place, n) for n in names})


def place_of(row: Any) -> PlaceInDocument:
    """The :class:`PlaceInDocument` columns of ``row``."""
    names = (f.name for f in dataclasses.fields(PlaceInDocument))
    return PlaceInDocument(**{n: getattr(row, n) for n in names})


@dataclass(frozen=True)
class DocumentRow(FileOrigin):
    """One version of one source document."""

    doc_id: str  # the user's id (data, never a path)
    doc_version: str  # keys.doc_version(text, metadata)
    text: str
    metadata_json: str  # every source field but id and text, canonical JSON
    source: str  # where it was read from (file name or source path), for humans
    n_chars: int
    run_id: str
    code_version: str


@dataclass(frozen=True)
class ChunkRow(PlaceInDocument):
    """A chunk of at most ``chunk_size`` tokens of one document version.

    ``text == document.text[char_start:char_end] == tokenizer.decode(token_ids)``;
    ``token_spans`` are the (start, end) char offsets of each token inside ``text``, flattened
    as ``[s0, e0, s1, e1, ...]``.
    """

    chunk_id: str  # keys.chunk_id(doc_version, ordinal, tokenizer_fp, chunker_fp)
    doc_id: str
    doc_version: str
    ordinal: int  # 0-based position of the chunk in the document
    text: str
    n_tokens: int
    char_start: int  # [char_start, char_end) in the document text
    char_end: int
    tok_start: int  # [tok_start, tok_end) in the document's token ids
    tok_end: int
    token_ids: list[int]
    token_spans: list[int]
    content_key: str  # keys.content_key(tokenizer_fp, token_ids)
    text_hash: str  # keys.text_hash(text): the key of the LLM's input
    tokenizer_fp: str
    chunker_fp: str
    run_id: str
    code_version: str


@dataclass(frozen=True)
class DeletionRow:
    """A tombstone: from this run on, ``doc_id`` is no longer part of the corpus.

    A later version row of the same document (a build that reads it again) supersedes it; see
    ``storage/corpus.py`` for the live view that both define.
    """

    doc_id: str
    doc_version: str  # the last live version when it was deleted
    reason: str  # pruned (absent from SOURCE in a `build --prune`) | deleted (`coinrag delete`)
    run_id: str
    time: datetime
    code_version: str


# ---------------------------------------------------------------------------- extraction


# The statuses of an ``extractions`` row (tasks/extract.py says what each one leads to).
EXTRACTION_OK = "ok"  # candidates parsed (or salvaged from a malformed reply)
EXTRACTION_FAILED = "failed"  # transient: no answer (transport, timeout, 429, 5xx)
EXTRACTION_MALFORMED = "malformed"  # content: every reply of the run was unreadable
EXTRACTION_ABANDONED = "abandoned"  # settled: malformed in abandon_after runs, not asked again
# The ledger status of a malformed reply whose complete items were kept as candidates.
CALL_SALVAGED = "salvaged"


@dataclass(frozen=True)
class ExtractionRow:
    """The LLM's answer for one chunk text: the response cache, keyed by (text_hash, extractor_fp).

    ``status`` is ``ok`` (candidates parsed), ``failed`` (no answer, retries exhausted),
    ``malformed`` (answers, none readable) or ``abandoned`` (malformed in ``abandon_after``
    builds: the run that settled it, ``error`` says so); ``error`` says why, a failure is never
    silently empty. A later build asks failed and malformed texts again, abandoned ones only
    under another fingerprint or with ``retry_abandoned``.
    """

    text_hash: str
    extractor_fp: str  # keys.fingerprint("extractor", {backend, model, prompt_version, ...})
    backend: str  # openai | openai-batch | local | rules | none
    llm_model: str
    prompt_version: str
    candidates: list[str]
    status: str
    error: str | None
    run_id: str
    code_version: str


@dataclass(frozen=True)
class ExtractionCallRow:
    """The ledger: one row per request sent to an LLM endpoint (or local generation)."""

    call_id: str
    run_id: str
    backend: str
    llm_model: str
    text_hash: str  # the chunk text this call was for
    custom_id: str | None  # Batch API request id
    batch_id: str | None
    attempt: int  # 1-based
    # ok | salvaged | malformed | rate_limited | server_error | timeout | error | expired
    status: str
    tokens_in: int
    tokens_out: int
    cost_usd: float
    latency_ms: float
    error: str | None
    started_at: datetime


@dataclass(frozen=True)
class NuggetRow(PlaceInDocument):
    """A recovered nugget: a token span ``[tok_start, tok_end)`` of one chunk.

    ``text == chunk.text[char_start:char_end] == decode(chunk.token_ids[tok_start:tok_end])``:
    the source text (it may carry the first token's leading space), never the candidate.
    """

    nugget_id: str  # keys.nugget_id(chunk_id, tok_start, tok_end)
    chunk_id: str
    doc_id: str
    doc_version: str
    content_key: str
    ordinal: int  # order of the nugget inside its chunk (document order)
    text: str
    candidate: str
    match_kind: str  # exact | fuzzy
    similarity: float
    char_start: int
    char_end: int
    tok_start: int
    tok_end: int
    occurrences: int  # > 1: the candidate matched in several places (ambiguous)
    extractor_fp: str
    tau: float
    run_id: str
    code_version: str


@dataclass(frozen=True)
class AbandonedRow:
    """A candidate that could not be recovered to a verbatim span."""

    chunk_id: str
    doc_id: str
    candidate: str
    best_similarity: float
    reason: str
    extractor_fp: str
    tau: float
    run_id: str
    code_version: str


# ---------------------------------------------------------------------------- KV


@dataclass(frozen=True)
class KvManifestRow:
    """A stored, verified KV entry. An entry is valid only once this row exists."""

    chunk_id: str
    content_key: str
    model_fp: str
    location: str  # "<kv_fp>/shard-NNNNNN#slot-S": the entry inside STORE/kv/<kv_fp>/
    tokens: int  # tokens of the chunk
    bytes: int  # bytes of the stored tokens (tokens, or those of the kept ranges)
    checksum: str
    run_id: str
    code_version: str
    # The [start, end) token ranges of the chunk the entry holds, flat [s0, e0, s1, e1, ...]
    # (kv_keep = "nuggets": those its nuggets cover); NULL: the whole chunk (storage/kv/kept.py).
    kept: list[int] | None = None


# ---------------------------------------------------------------------------- embeddings, indexes


@dataclass(frozen=True)
class EmbeddingRow:
    """The embedding cache: one vector per (text_hash, embedder_fp); text is never re-embedded."""

    text_hash: str
    embedder_fp: str
    vector: list[float]  # float32, normalised as the embedder's identity says
    run_id: str
    code_version: str


@dataclass(frozen=True)
class ChunkIndexRow(PlaceInDocument):
    """A row of the LanceDB ``chunks`` table (upserted by chunk_id).

    ``text`` is the chunk as shown (evidence); ``search_text`` what is searched: the heading
    path (``" > ".join(section)``), the titles of the headings inside the chunk, one a line,
    then the text; the text itself for a chunk without headings (``tasks.embed.search_text``).
    ``vector`` is ``search_text``'s embedding as the embedder truncates it; the ``windows``
    table covers the rest."""

    chunk_id: str
    doc_id: str
    doc_version: str
    content_key: str
    text: str
    search_text: str
    n_tokens: int
    vector: list[float]
    embedder_fp: str
    run_id: str


@dataclass(frozen=True)
class NuggetIndexRow(PlaceInDocument):
    """A row of the LanceDB ``nuggets`` table (upserted by nugget_id); ``search_text`` as in
    :class:`ChunkIndexRow` (the nugget's own section)."""

    nugget_id: str
    chunk_id: str
    doc_id: str
    doc_version: str
    content_key: str
    text: str
    search_text: str
    tok_start: int
    tok_end: int
    vector: list[float]
    embedder_fp: str
    run_id: str


@dataclass(frozen=True)
class WindowIndexRow:
    """A row of the LanceDB ``windows`` table (upserted by window_id): one piece of a chunk
    that the embedder sees whole, ``[char_start, char_end)`` of the chunk's ``text``;
    ``search_text`` is the string embedded: the heading path where the window starts (of a
    heading inside the chunk, else the chunk's own) and a newline before those characters
    (``inference.retrieval.windows``). A chunk's windows cover every one of its tokens,
    consecutive ones overlapping; a chunk that fits the embedder is one window (its
    ``search_text``, the vector of its ``chunks`` row)."""

    window_id: str  # keys.window_id(chunk_id, char_start, char_end)
    chunk_id: str
    doc_id: str
    doc_version: str
    ordinal: int  # 0-based, in chunk order
    char_start: int
    char_end: int
    search_text: str
    vector: list[float]
    embedder_fp: str
    run_id: str


@dataclass(frozen=True)
class DocumentIndexRow:
    """A row of the LanceDB ``documents`` table: one vector per document (upserted by doc_id)."""

    doc_id: str
    doc_version: str
    title: str
    vector: list[float]
    embedder_fp: str
    run_id: str


# ---------------------------------------------------------------------------- bookkeeping


@dataclass(frozen=True)
class RejectRow:
    """A source document (or line, or file) that was not ingested, and why."""

    run_id: str
    source: str
    doc_id: str | None
    reason: str  # empty_text | invalid_utf8 | duplicate_id | bad_record | unreadable
    detail: str


@dataclass(frozen=True)
class RunRow:
    """One run of a flow. Written at start (status ``running``) and again at the end."""

    run_id: str
    flow: str
    status: str  # running | completed | failed
    started_at: datetime
    ended_at: datetime | None
    parameters_json: str  # settings and arguments, never secrets
    code_version: str
    fingerprints_json: str  # tokenizer_fp, chunker_fp, extractor_fp, model_fp, ...
    counts_json: str
    cost_usd: float
    error: str | None


# ---------------------------------------------------------------------------- cartridges


@dataclass(frozen=True)
class SelfStudyCallRow:
    """One question-generation call of self-study: the cache, keyed by ``call_key`` =
    hash(generator_fp, text_hash, seed_type, call_index). ``status``: ok | malformed (answer
    was not a JSON array of strings: dropped and counted, not retried) | failed (transport
    errors exhausted: retried by the next run)."""

    call_key: str
    generator_fp: str
    backend: str  # openai | local
    doc_id: str
    doc_version: str
    text_hash: str  # keys.text_hash of the text the generator saw (the document or a slice)
    char_start: int  # [char_start, char_end) of that text in the document
    char_end: int
    seed_type: str  # structuring | summarization | question | use_case | creative
    call_index: int
    status: str
    n_raw: int  # items in the answer
    n_questions: int  # usable questions kept
    error: str | None
    run_id: str
    code_version: str


@dataclass(frozen=True)
class SelfStudyQuestionRow:
    """One usable self-study question (a row per question of an ``ok`` call)."""

    question_id: str  # hash(call_key, ordinal)
    call_key: str
    doc_id: str
    doc_version: str
    seed_type: str
    ordinal: int
    question: str
    generator_fp: str
    run_id: str
    code_version: str


@dataclass(frozen=True)
class TeacherAnswerRow:
    """The teacher's greedy answer to one question with the document in context, and its top-k
    log-probabilities per answer position, flattened row-major: ``topk_ids[i * top_k + j]``."""

    answer_id: str  # hash(teacher_fp, context_hash, question_id)
    question_id: str
    doc_id: str
    doc_version: str
    context_hash: str  # hash of the document token ids the teacher saw
    teacher_fp: str
    model_fp: str
    answer_ids: list[int]  # ends with the EOS id when the answer stopped there
    answer_text: str
    top_k: int
    topk_ids: list[int]  # len(answer_ids) * top_k
    topk_logprobs: list[float]  # same layout; log-softmax over the full vocabulary
    run_id: str
    code_version: str


@dataclass(frozen=True)
class CartridgeManifestRow:
    """A stored, verified cartridge version. Valid only once this row exists."""

    cartridge_id: str  # hash(doc_id, doc_version, cartridge_fp)
    doc_id: str
    doc_version: str
    model_fp: str
    cartridge_fp: str  # everything the cartridge depends on but the document
    prefix_sha: str  # the RAG prompt prefix it stands after (inference/model/prompt.py)
    p: int  # tokens
    init: str  # first_tokens | random_text
    step: int  # optimizer steps of the training run when saved
    kind: str  # init | rotation | checkpoint | final
    location: str  # "<model_fp>/<cartridge_id>/<version>" inside STORE/cartridges/
    dtype: str
    bytes: int
    checksum: str  # sha256 of the stored bytes
    run_id: str
    code_version: str


# ---------------------------------------------------------------------------- registry

TABLES: dict[str, type] = {
    "documents": DocumentRow,
    "deletions": DeletionRow,
    "chunks": ChunkRow,
    "extractions": ExtractionRow,
    "extraction_calls": ExtractionCallRow,
    "nuggets": NuggetRow,
    "abandoned": AbandonedRow,
    "kv_manifest": KvManifestRow,
    "embeddings": EmbeddingRow,
    "rejects": RejectRow,
    "runs": RunRow,
    "selfstudy_calls": SelfStudyCallRow,
    "selfstudy_questions": SelfStudyQuestionRow,
    "teacher_answers": TeacherAnswerRow,
    "cartridge_manifest": CartridgeManifestRow,
}

# How the ``search_text`` of an index row is composed (``tasks.embed``): a table whose rows were
# composed by another version is written again (``storage.index.lance.LanceIndex._migrate``).
# 1: the heading path and the text; 2: a chunk's also the titles of the headings inside it, and
# each window after the heading path where it starts.
SEARCH_TEXT_VERSION = "2"

# LanceDB tables (under STORE/index/), not Parquet: same one-definition rule.
INDEX_TABLES: dict[str, type] = {
    "chunks": ChunkIndexRow,
    "windows": WindowIndexRow,
    "nuggets": NuggetIndexRow,
    "documents": DocumentIndexRow,
}

_SCALARS: dict[Any, pa.DataType] = {
    str: pa.string(),
    int: pa.int64(),
    float: pa.float64(),
    bool: pa.bool_(),
    datetime: pa.timestamp("us", tz="UTC"),
}


def _arrow_type(annotation: Any) -> tuple[pa.DataType, bool]:
    """(arrow type, nullable) of one annotation."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        (inner,) = args
        return _arrow_type(inner)[0], True
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if item is float:
            return pa.list_(pa.float32()), False
        return pa.list_(pa.int32() if item is int else _SCALARS[item]), False
    return _SCALARS[annotation], False


def _fields_in_order(record: type) -> list[dataclasses.Field]:
    """A row dataclass's fields: its own in order, then those of keyword-only bases
    (:class:`FileOrigin`, :class:`PlaceInDocument`), so a table's own columns lead."""
    fields = dataclasses.fields(record)
    return [f for f in fields if not f.kw_only] + [f for f in fields if f.kw_only]


def arrow_schema(record: type) -> pa.Schema:
    """The Arrow schema of a row dataclass, in column order (:func:`_fields_in_order`)."""
    hints = typing.get_type_hints(record)
    fields = []
    for f in _fields_in_order(record):
        typ, nullable = _arrow_type(hints[f.name])
        fields.append(pa.field(f.name, typ, nullable=nullable))
    return pa.schema(fields)


def column_names(record: type) -> list[str]:
    """The column names of a row dataclass, in order."""
    return [f.name for f in _fields_in_order(record)]


def table_name(record: type) -> str:
    """The table a row dataclass is stored in."""
    for name, rec in TABLES.items():
        if rec is record:
            return name
    raise KeyError(f"{record.__name__} is not a registered table")
