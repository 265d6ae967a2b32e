"""Questions written by the question generator about chunks of the store, as synthetic questions
for choosing the fusion weight (``coinrag train fusion --generated N``).

Why: the store's headings read like the FAQ questions (section titles), not like a user's
question, so a weight chosen on them favours BM25 (0.05 on the Python docs' HTML store, against
the 0.5-0.6 the natural questions want; tests/benchmarks/RESULTS.md). A generator asked about a
chunk's text writes questions in its own words ("How does the harmonic mean of a sequence
calculate its average?" for a chunk of ``library/statistics``), closer to what a user asks.

What is asked: ``n_chunks`` chunks (seeded sample) of the pages whose questions the fusion is
chosen or reported on (``tasks.retrieval.fusion.page_split``: ``fusion`` and ``report``, never the
``retriever`` pages an adapted embedder trains on; ``coinrag train retriever --generated N``
asks about ``retriever`` pages only, for training pairs), each of at least :data:`MIN_CHUNK_CHARS`
characters, one call a chunk with the ``question`` seed type and ``questions_per_chunk``
questions. The calls go through the self-study stage (``tasks/questions.py``): each is cached
in the store by (generator fingerprint, text hash, seed type, call index), written to the
ledger, and its items filtered by the same rules (a question, 3-80 words, a content word of the
chunk); a second run makes no call. Each question's gold page is its chunk's page, its
``passage`` the chunk's text.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyarrow.compute as pc

from coinrag.schemas.tables import ChunkRow
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.question_generators.base import QuestionGenerator
from coinrag.tasks.questions import CallPlan, SelfStudyCounts, call_key, selfstudy_stage
from coinrag.tasks.retrieval.fusion import GENERATED_KIND, SyntheticQuestion, page_split

MIN_CHUNK_CHARS = 400  # shorter chunks (a title, a link line) give no question worth asking
QUESTION_SEED = "question"  # the self-study seed type: factual recall and reasoning
ASKED_SPLITS = ("fusion", "report")
QUESTIONS_PER_CHUNK = 3  # asked of the generator per chunk (about a question a second locally)


@dataclass
class GeneratedQuestions:
    """The questions and what making them took (``counts``: the self-study stage's)."""

    questions: list[SyntheticQuestion]
    chunks: int  # chunks asked about
    counts: SelfStudyCounts
    generator_fp: str


def chunks_to_ask(
    index: LanceIndex, n_chunks: int, seed: int = 0, splits: Sequence[str] = ASKED_SPLITS
) -> list[dict[str, str]]:
    """``n_chunks`` chunk rows (``chunk_id``, ``doc_id``, ``doc_version``, ``text``) of the
    pages of ``splits`` (``tasks.retrieval.fusion.page_split``; default the fusion and report
    pages), at least :data:`MIN_CHUNK_CHARS` long: a sample seeded by ``seed`` from them in
    chunk id order, so the same chunks for the same index and seed."""
    rows = index.columns("chunks", ["chunk_id", "doc_id", "doc_version", "text"]).to_pylist()
    rows = [
        r
        for r in rows
        if page_split(r["doc_id"]) in splits and len(r["text"] or "") >= MIN_CHUNK_CHARS
    ]
    rows.sort(key=lambda r: r["chunk_id"])
    return random.Random(seed).sample(rows, min(n_chunks, len(rows)))


def generated_questions(
    store: Store,
    index: LanceIndex,
    generator: QuestionGenerator,
    n_chunks: int,
    run_id: str,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    splits: Sequence[str] = ASKED_SPLITS,
) -> GeneratedQuestions:
    """Ask ``generator`` about :func:`chunks_to_ask`'s chunks of the pages of ``splits``
    (cached calls are not made again; ``progress(questions written, questions to write)`` as
    they are written); every usable question, its gold page its chunk's page, its passage the
    chunk's text, kind :data:`GENERATED_KIND`."""
    picked = chunks_to_ask(index, n_chunks, seed, splits)
    ids = [r["chunk_id"] for r in picked]
    where = {
        r.chunk_id: (r.char_start, r.char_end)
        for r in read_rows(store, ChunkRow, filter=pc.field("chunk_id").isin(ids))
    }
    plan = [
        CallPlan(
            r["doc_id"],
            r["doc_version"],
            r["text"],
            *where.get(r["chunk_id"], (0, len(r["text"]))),
            QUESTION_SEED,
            0,
        )
        for r in picked
    ]
    made, counts = selfstudy_stage(
        store, [], generator, run_id=run_id, plan=plan, progress=progress
    )
    asked = {call_key(generator.fingerprint, p): p.text for p in plan}
    questions = [
        SyntheticQuestion(q.text, q.doc_id, GENERATED_KIND, asked[q.call_key]) for q in made
    ]
    return GeneratedQuestions(questions, len(picked), counts, generator.fingerprint)
