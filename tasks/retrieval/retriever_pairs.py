"""Training pairs for the corpus-adapted retriever (``coinrag train retriever``), made from the
store alone.

A pair is ``(query, positive, negative)``: a text a user might search with, the passage that
answers it, and a hard negative (the best BM25 chunk of another page). Made of:

- **headings**: a heading (the last part of a chunk's ``section`` where readers filled it, as in
  HTML; else a reST / Markdown title in the chunk's text,
  ``tasks.retrieval.fusion.text_headings``) and the section text under it: the chunk's text
  without its heading lines, so the pair cannot be matched by copying the heading;
- **nuggets**: a nugget's text (``nuggets`` table) and the text of its chunk, where the store
  has nuggets;
- **generated questions** (``coinrag train retriever --generated N``): the configured question
  generator's questions about N chunks of the ``retriever`` pages
  (``tasks/generated_questions.py``, cached in the store) and the chunk each was asked about.
  They are few (on this machine's CPU the local generator writes about one question a second;
  the headings give thousands for free), so they come first, before the others are sampled
  (``max_pairs`` counts them too).

Only pages of the ``retriever`` split (``tasks.retrieval.fusion.page_split``: 70 % of pages by id
hash) give pairs, so the fusion weight, chosen and reported on the other 30 %, is never chosen on
questions the embedder was trained on; and a pair whose query equals (normalised) a question of
any evaluation file given is dropped and counted (:func:`training_pairs` returns the count).

Example: a text chunk of ``howto/sorting`` holding ``"Sorting Basics\\n==============\\nA simple
ascending sort..."`` gives ``("Sorting Basics", "A simple ascending sort...", <the best BM25 chunk
for "Sorting Basics" that is not on howto/sorting>)``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from coinrag.inference.retrieval.fusion import normalise
from coinrag.storage.index.lance import LanceIndex
from coinrag.tasks.retrieval.fusion import (
    GENERATED_KIND,
    MIN_HEADING_WORDS,
    SyntheticQuestion,
    clean_heading,
    page_split,
    text_headings,
)

NEGATIVE_DEPTH = 10  # BM25 chunks looked at for a query's hard negative
PASSAGE_CHARS = 2000  # a positive or negative passage's characters (the encoder cuts it anyway)


@dataclass(frozen=True)
class TrainingPair:
    """One example: ``query`` should be nearer to ``positive`` than to ``negative`` (and than
    to the other examples' passages of its batch)."""

    query: str
    positive: str
    negative: str
    doc_id: str
    kind: str  # heading | nugget | generated question (tasks.retrieval.fusion.GENERATED_KIND)


def without_headings(text: str, heads: Iterable[str]) -> str:
    """``text`` with each line that is one of ``heads`` (cleaned) or an underline removed."""
    banned = {normalise(h) for h in heads}
    kept = [
        line
        for line in text.splitlines()
        if normalise(clean_heading(line)) not in banned
        and not re.fullmatch(r"\s*([=\-~^*#\"'+])\1{2,}\s*", line)
    ]
    return "\n".join(kept).strip()


def heading_candidates(rows: Iterable[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """``(heading, section text, doc_id)`` of chunk rows (``doc_id``, ``section``, ``text``)
    of ``retriever`` pages: each heading with the text of the chunk it heads."""
    out = []
    for row in rows:
        if page_split(row["doc_id"]) != "retriever":
            continue
        section = row.get("section") or []
        heads = [clean_heading(section[-1])] if section else text_headings(row["text"] or "")
        body = without_headings(row["text"] or "", heads)
        for head in heads:
            if len(head.split()) >= MIN_HEADING_WORDS and len(body) > 80:
                out.append((head, body[:PASSAGE_CHARS], row["doc_id"]))
    return out


def nugget_candidates(index: LanceIndex, chunk_text: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(nugget text, its chunk's text, doc_id)`` of the nuggets of ``retriever`` pages."""
    if not index.count("nuggets"):
        return []
    rows = index.columns("nuggets", ["chunk_id", "doc_id", "text"]).to_pylist()
    return [
        (r["text"].strip(), chunk_text[r["chunk_id"]][:PASSAGE_CHARS], r["doc_id"])
        for r in rows
        if page_split(r["doc_id"]) == "retriever" and r["chunk_id"] in chunk_text
    ]


def hard_negative(index: LanceIndex, query: str, doc_id: str) -> str | None:
    """The text of the best BM25 chunk for ``query`` that is not on page ``doc_id``."""
    for row in index.search_text("chunks", query, NEGATIVE_DEPTH):
        if row["doc_id"] != doc_id:
            return row["text"][:PASSAGE_CHARS]
    return None


def training_pairs(
    index: LanceIndex,
    evaluation: Iterable[str],
    max_pairs: int,
    seed: int = 0,
    kinds: Sequence[str] = ("heading", "nugget"),
    generated: Sequence[SyntheticQuestion] = (),
) -> tuple[list[TrainingPair], dict[str, int]]:
    """At most ``max_pairs`` pairs, none whose query is an evaluation question: every
    ``generated`` question of a ``retriever`` page with its ``passage`` first, in order, then
    a seeded sample of the headings' and nuggets' pairs; and counts: ``candidates``,
    ``excluded_as_evaluation``, ``pairs``, ``generated_pairs``, ``no_negative`` (queries whose
    BM25 top 10 were all of their own page: dropped)."""
    rows = index.columns("chunks", ["chunk_id", "doc_id", "section", "text"]).to_pylist()
    found: list[tuple[str, str, str, str]] = []
    if "heading" in kinds:
        found += [(*c, "heading") for c in heading_candidates(rows)]
    if "nugget" in kinds:
        texts = {r["chunk_id"]: r["text"] for r in rows}
        found += [(*c, "nugget") for c in nugget_candidates(index, texts)]
    asked = [
        (q.text, q.passage[:PASSAGE_CHARS], q.doc_id, q.kind)
        for q in generated
        if page_split(q.doc_id) == "retriever" and q.passage
    ]
    banned = {normalise(q) for q in evaluation}
    kept = [c for c in found if normalise(c[0]) not in banned]
    kept_asked = [c for c in asked if normalise(c[0]) not in banned]
    counts = {
        "candidates": len(found) + len(asked),
        "excluded_as_evaluation": len(found) - len(kept) + len(asked) - len(kept_asked),
    }
    rng = random.Random(seed)
    rng.shuffle(kept)
    kept = kept_asked + kept
    pairs: list[TrainingPair] = []
    for query, positive, doc_id, kind in kept:
        if len(pairs) >= max_pairs:
            break
        negative = hard_negative(index, query, doc_id)
        if negative is None:
            counts["no_negative"] = counts.get("no_negative", 0) + 1
            continue
        pairs.append(TrainingPair(query, positive, negative, doc_id, kind))
    counts["pairs"] = len(pairs)
    counts["generated_pairs"] = sum(p.kind == GENERATED_KIND for p in pairs)
    return pairs, counts
