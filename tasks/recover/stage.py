"""Recovery stage: turn each chunk's candidates into nugget rows (exact token spans) and
abandoned rows, with :func:`tasks.recover.match.recover_candidates`.

Recovery is pure and fast, so it is keyed by ``(chunk_id, extractor_fp, tau)``: a chunk already
recovered with this extractor and threshold is skipped; anything else is recomputed.
Two candidates that land on the same token span make one nugget (the first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow.compute as pc

from coinrag.schemas.keys import CODE_VERSION, nugget_id
from coinrag.schemas.tables import (
    AbandonedRow,
    ChunkRow,
    DocumentRow,
    ExtractionRow,
    NuggetRow,
    place_of,
    with_place,
)
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_table
from coinrag.tasks.chunk import token_spans_pairs
from coinrag.tasks.place import DocumentMaps
from coinrag.tasks.recover.match import recover_candidates


@dataclass
class RecoverCounts:
    chunks: int = 0
    exact: int = 0
    fuzzy: int = 0
    abandoned: int = 0
    duplicates: int = 0  # candidates that landed on an existing nugget's span
    skipped: int = 0  # chunks recovered by an earlier run


def recover_chunk(
    chunk: ChunkRow, extraction: ExtractionRow, tau: float, run_id: str
) -> tuple[list[NuggetRow], list[AbandonedRow], int]:
    """Nugget and abandoned rows of one chunk, nuggets in document order; and duplicates.
    A nugget row is its chunk's ids and a ``RecoveredSpan``'s fields, an abandoned row its
    chunk's ids and an ``AbandonedCandidate``'s (``recover/match.py``)."""
    spans, abandoned = recover_candidates(
        chunk.text, token_spans_pairs(chunk.token_spans), extraction.candidates, tau=tau
    )
    by_span = {}
    duplicates = 0
    for s in spans:
        if (s.tok_start, s.tok_end) in by_span:
            duplicates += 1
            continue
        by_span[(s.tok_start, s.tok_end)] = s
    ordered = sorted(by_span.values(), key=lambda s: (s.tok_start, s.tok_end))
    # what made both kinds of row (the recovery key and the run)
    made_by = {
        "extractor_fp": extraction.extractor_fp,
        "tau": tau,
        "run_id": run_id,
        "code_version": CODE_VERSION,
    }
    nuggets = [
        NuggetRow(
            nugget_id=nugget_id(chunk.chunk_id, s.tok_start, s.tok_end),
            chunk_id=chunk.chunk_id,
            doc_id=chunk.doc_id,
            doc_version=chunk.doc_version,
            content_key=chunk.content_key,
            ordinal=i,
            **vars(s),
            **made_by,
        )
        for i, s in enumerate(ordered)
    ]
    dropped = [
        AbandonedRow(chunk_id=chunk.chunk_id, doc_id=chunk.doc_id, **vars(a), **made_by)
        for a in abandoned
    ]
    return nuggets, dropped, duplicates


def recovered_chunk_ids(store: Store, extractor_fp: str, tau: float) -> set[str]:
    """Chunks that already have nugget or abandoned rows for this extractor and tau."""
    done: set[str] = set()
    for record in (NuggetRow, AbandonedRow):
        table = read_table(
            store,
            record,
            columns=["chunk_id"],
            filter=(pc.field("extractor_fp") == extractor_fp) & (pc.field("tau") == tau),
        )
        done.update(table.column("chunk_id").to_pylist())
    return done


def recover_stage(
    store: Store,
    chunks: Sequence[ChunkRow],
    extractions: dict[str, ExtractionRow],
    extractor_fp: str,
    tau: float,
    run_id: str,
) -> RecoverCounts:
    """Recover every chunk with an ok extraction and no nuggets yet for (extractor_fp, tau)."""
    counts = RecoverCounts()
    done = recovered_chunk_ids(store, extractor_fp, tau)
    nuggets: list[NuggetRow] = []
    abandoned: list[AbandonedRow] = []
    for chunk in chunks:
        extraction = extractions.get(chunk.text_hash)
        if extraction is None:
            continue
        if chunk.chunk_id in done:
            counts.skipped += 1
            continue
        n, a, dup = recover_chunk(chunk, extraction, tau, run_id)
        nuggets += n
        abandoned += a
        counts.chunks += 1
        counts.duplicates += dup
        counts.exact += sum(x.match_kind == "exact" for x in n)
        counts.fuzzy += sum(x.match_kind == "fuzzy" for x in n)
        counts.abandoned += len(a)
    nuggets = place_nuggets(store, chunks, nuggets)
    append_rows(store, nuggets, run_id, "recover")
    append_rows(store, abandoned, run_id, "recover")
    return counts


def place_nuggets(
    store: Store, chunks: Sequence[ChunkRow], nuggets: Sequence[NuggetRow]
) -> list[NuggetRow]:
    """``nuggets`` with their place in their document (``tasks/place.py``): the pages and
    heading path of their own span, from the maps of their chunk's document version (read
    only for chunks that have pages or a section; the others' nuggets take their chunk's)."""
    from coinrag.storage.tables import read_rows

    mapped = sorted({c.doc_version for c in chunks if c.page_first or c.section})
    docs = read_rows(store, DocumentRow, pc.field("doc_version").isin(mapped)) if mapped else []
    maps = {d.doc_version: DocumentMaps.of(d.text, d) for d in docs}
    by_id = {c.chunk_id: c for c in chunks}
    out = []
    for n in nuggets:
        chunk = by_id[n.chunk_id]
        doc = maps.get(chunk.doc_version)
        start = chunk.char_start + n.char_start
        place = doc.place(start, chunk.char_start + n.char_end) if doc else place_of(chunk)
        out.append(with_place(n, place))
    return out


def current_nuggets(
    store: Store, chunk_ids: Sequence[str], extractor_fp: str, tau: float
) -> list[NuggetRow]:
    """The nuggets of these chunks made by this extractor and tau (any run), in chunk order."""
    from coinrag.storage.tables import read_rows

    rows = read_rows(
        store,
        NuggetRow,
        filter=(pc.field("extractor_fp") == extractor_fp)
        & (pc.field("tau") == tau)
        & pc.field("chunk_id").isin(list(chunk_ids)),
    )
    order = {cid: i for i, cid in enumerate(chunk_ids)}
    unique = {r.nugget_id: r for r in rows}
    return sorted(unique.values(), key=lambda r: (order[r.chunk_id], r.tok_start, r.tok_end))
