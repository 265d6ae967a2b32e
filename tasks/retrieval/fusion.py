"""Synthetic questions of a store, and the hybrid fusion weight chosen on them for its index.

No evaluation file is ever looked at to choose the weight: the questions are the store's own
**headings** (and, where there are nuggets, nugget texts: up to the same total, headings first),
each asked for the page it heads (a heading path's last part where readers filled
``section``, as in HTML; else the reST / Markdown titles found in the chunk text: a line
underlined by ``=``, ``-``, ``~``, ``^``, ``*``, ``#``, ``"``, ``'`` or ``+`` at least as long, or
``#`` / ``##`` ... lines), kept when they have at least 3 words and head one page only (``See
also`` heads many). A heading whose normalised words equal a question of any evaluation file
given (``evaluation``: the FAQ questions are their answers' section titles, word for word) is
dropped and counted. The pages are split by a hash of their id (:func:`page_split`): 70 % are
``retriever`` pages (what ``train retriever`` may train on), 15 % ``fusion`` pages (the weight is
chosen on their questions, ``inference/retrieval/fusion.py``) and 15 % ``report`` pages (the
chosen weight is reported on them beside the index's default, ``default_dense_weight``, dense
alone and lexical alone); so an adapted embedder never saw the questions its fusion is chosen or
reported on. Each question is asked of the page's chunks that do not hold it word for word
(``fusion.question_lists``: a user's question does not copy the answer's heading).

Example: the reST text ``"Sorting HOW TO\\n**************\\n..."`` of page ``howto/sorting``
gives the question ``"Sorting HOW TO"`` with gold page ``howto/sorting``.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from coinrag.inference.retrieval.embedders import Embedder
from coinrag.inference.retrieval.fusion import (
    WEIGHT_GRID,
    QuestionLists,
    choose_weight,
    confirmed_weight,
    normalise,
    question_lists,
    score_supports,
    score_weights,
)
from coinrag.inference.retrieval.rerank import PageSupport
from coinrag.inference.retrieval.retriever import FUSION_METHOD, Query, default_dense_weight
from coinrag.storage.index.lance import LanceIndex

SPLITS = (("fusion", 15), ("report", 30), ("retriever", 100))  # (split, upper percent bound)
MIN_HEADING_WORDS = 3
GENERATED_KIND = "generated question"  # a SyntheticQuestion from the question generator
# which synthetic questions are asked first
KIND_ORDER = ("heading", GENERATED_KIND, "nugget")
MAX_QUESTIONS = 800  # questions asked (a seeded sample of the fusion and report pages' headings)

_UNDERLINE = re.compile(r"^([^\n]*\S[^\n]*)\n([=\-~^*#\"'+])\2{2,}[ \t]*$", re.MULTILINE)
_ATX = re.compile(r"^#{1,6}[ \t]+(\S[^\n]*)$", re.MULTILINE)
_ROLE = re.compile(r":[\w.:-]+:`([^`]*)`")
_MARKUP = re.compile(r"[`*_|]+")


@dataclass(frozen=True)
class SyntheticQuestion:
    """A question made from the store and the page that answers it."""

    text: str
    doc_id: str
    kind: str = "heading"
    passage: str = ""  # the text it was asked about (a generated question's chunk), else ""


def clean_heading(line: str) -> str:
    """A title line without reST roles and inline markup: ``":mod:`re` --- Regular
    expressions"`` -> ``"re --- Regular expressions"``."""
    return " ".join(_MARKUP.sub("", _ROLE.sub(r"\1", line)).split())


def text_headings(text: str) -> list[str]:
    """The reST (underlined) and Markdown (``#``) titles in ``text``, cleaned, in order."""
    found = [(m.start(), m.group(1), m.group(2)) for m in _UNDERLINE.finditer(text)]
    titles = [
        (start, title)
        for start, title, mark in found
        if len(title.strip()) <= len(text[start:].split("\n", 2)[1].strip())
        and not re.fullmatch(rf"\s*\{mark}+\s*", title)
    ]
    titles += [(m.start(), m.group(1)) for m in _ATX.finditer(text)]
    return [clean_heading(t) for _, t in sorted(titles) if clean_heading(t)]


def store_headings(rows: Iterable[dict[str, Any]]) -> list[SyntheticQuestion]:
    """One question per distinct heading that heads one page only (chunk rows with ``doc_id``,
    ``section`` and ``text``), in first-seen order."""
    pages: dict[str, set[str]] = {}
    for row in rows:
        section = row.get("section") or []
        heads = [clean_heading(section[-1])] if section else text_headings(row["text"] or "")
        for head in heads:
            if len(head.split()) >= MIN_HEADING_WORDS:
                pages.setdefault(head, set()).add(row["doc_id"])
    return [SyntheticQuestion(h, next(iter(d))) for h, d in pages.items() if len(d) == 1]


def page_split(doc_id: str) -> str:
    """Which use a page's synthetic questions have, stable by the page id's hash: ``fusion``
    (15 %: the fusion weight is chosen on them), ``report`` (15 %: it is reported on them) or
    ``retriever`` (70 %: ``train retriever`` trains on them)."""
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:4], "big") % 100
    return next(name for name, bound in SPLITS if bucket < bound)


def store_nuggets(rows: Iterable[dict[str, Any]]) -> list[SyntheticQuestion]:
    """One question per distinct nugget text of at least ``MIN_HEADING_WORDS`` words (nugget
    rows with ``doc_id`` and ``text``) that occurs on one page only."""
    pages: dict[str, set[str]] = {}
    for row in rows:
        text = " ".join((row["text"] or "").split())
        if len(text.split()) >= MIN_HEADING_WORDS:
            pages.setdefault(text, set()).add(row["doc_id"])
    return [SyntheticQuestion(t, next(iter(d)), "nugget") for t, d in pages.items() if len(d) == 1]


def excluding(
    questions: Sequence[SyntheticQuestion], evaluation: Iterable[str]
) -> tuple[list[SyntheticQuestion], int]:
    """``questions`` without those equal (normalised) to an evaluation question; how many went."""
    banned = {normalise(q) for q in evaluation}
    kept = [q for q in questions if normalise(q.text) not in banned]
    return kept, len(questions) - len(kept)


@dataclass
class SupportChoice:
    """``rerank = support``'s page support share chosen at the fusion's weight, and what it was
    chosen on (``record()``: the ``page_support`` keys of the index's fusion record)."""

    share: float
    train: dict[float, dict[str, float]]  # share -> scores on the training questions
    held_out: dict[float, dict[str, float]]  # share -> scores on the held-out questions
    best_on_train: float

    def record(self) -> dict[str, Any]:
        best = self.best_on_train
        shown = {"chosen": best, "default": PageSupport.support}
        return {
            "page_support": self.share,
            "page_support_method": PageSupport.method,
            "page_support_best_on_train": best,
            "page_support_confirmed_on_held_out": best == self.share,
            "page_support_train": _rounded(self.train[best]),
            "page_support_held_out": {
                name: _rounded(self.held_out[v]) for name, v in shown.items()
            },
        }


def choose_support(
    train: Sequence[QuestionLists], held: Sequence[QuestionLists], weight: float
) -> SupportChoice:
    """The share of ``fusion.SUPPORT_GRID`` best on ``train`` at ``weight``, kept only where it
    beats the default (``PageSupport.support``) on ``held`` (as the weight is)."""
    default = PageSupport.support
    scored = score_supports(train, weight)
    best = choose_weight(scored, default)
    held_scores = score_supports(held, weight, sorted({best, default}))
    return SupportChoice(
        confirmed_weight(best, default, held_scores, len(held)), scored, held_scores, best
    )


@dataclass
class FusionChoice:
    """The chosen weight and what it was chosen on (``record()``: what the index keeps)."""

    dense_weight: float
    train: dict[float, dict[str, float]]  # weight -> scores on the training questions
    held_out: dict[float, dict[str, float]]  # weight -> scores on the held-out questions
    n_train: int
    n_held_out: int
    excluded: int  # questions dropped for equalling an evaluation question
    embedder_fp: str
    support: SupportChoice  # rerank = support's share, chosen at dense_weight the same way
    default_weight: float  # the index's weight where none is chosen (default_dense_weight)
    chosen_on: str = "headings"  # the kinds of synthetic question, e.g. "headings+nuggets"
    best_on_train: float | None = None  # the training questions' best (None: dense_weight)

    def record(self) -> dict[str, Any]:
        """The index's ``fusion`` record (TOML-able: numbers and tables of them)."""
        w = self.dense_weight
        best = w if self.best_on_train is None else self.best_on_train
        shown = {"chosen": best, "default": self.default_weight, "dense": 1.0, "lexical": 0.0}
        return {
            "dense_weight": w,
            "best_on_train": best,
            "default_weight": self.default_weight,
            "confirmed_on_held_out": best == w,
            "method": FUSION_METHOD,
            "chosen_on": self.chosen_on,
            "embedder_fp": self.embedder_fp,
            "questions": self.n_train,
            "held_out_questions": self.n_held_out,
            "excluded_as_evaluation": self.excluded,
            "train": _rounded(self.train[best]),
            "held_out": {name: _rounded(self.held_out[v]) for name, v in shown.items()},
        } | self.support.record()


def _rounded(scores: dict[str, float]) -> dict[str, float]:
    return {k.replace("@", "_at_"): round(v, 4) for k, v in scores.items()}


def sample_by_kind(
    questions: Sequence[SyntheticQuestion], limit: int, seed: int
) -> list[SyntheticQuestion]:
    """At most ``limit`` of ``questions``: a sample seeded by ``seed``, taken kind by kind in
    :data:`KIND_ORDER` (headings and generated questions read like a searcher's words; nuggets
    fill the rest)."""
    rng, out = random.Random(seed), []
    for kind in KIND_ORDER:
        of_kind = [q for q in questions if q.kind == kind]
        out += rng.sample(of_kind, min(len(of_kind), limit - len(out)))
    return out


def choose_fusion(
    index: LanceIndex,
    embedder: Embedder,
    evaluation: Iterable[str],
    max_questions: int = MAX_QUESTIONS,
    seed: int = 0,
    generated: Sequence[SyntheticQuestion] | None = None,
) -> FusionChoice:
    """Choose ``index``'s dense weight on its store's headings (never on ``evaluation``'s
    questions, see the module docstring), or on ``generated`` questions where given (the
    question generator's, ``tasks/generated_questions.py``: the headings are then not used),
    then ``rerank = support``'s page support share at that weight on the same questions (kept,
    like the weight, only where it beats the default on the held-out ones); nothing is written."""
    if generated is not None:
        found = list(generated)
    else:
        rows = index.columns("chunks", ["doc_id", "section", "text"]).to_pylist()
        found = store_headings(rows)
        if index.count("nuggets"):
            found += store_nuggets(index.columns("nuggets", ["doc_id", "text"]).to_pylist())
    questions, excluded = excluding(found, evaluation)
    questions = [q for q in questions if page_split(q.doc_id) != "retriever"]
    questions = sample_by_kind(questions, max_questions, seed)
    train, held = [], []
    for q in questions:
        lists = question_lists(index, Query(q.text, embedder), [q.doc_id])
        (train if page_split(q.doc_id) == "fusion" else held).append(lists)
    if not train:
        raise ValueError(
            f"{index.store.uri(index.store.index_dir)}: no heading, nugget or generated "
            f"question of {MIN_HEADING_WORDS}+ words on a fusion page to choose a fusion weight "
            "on; the default weight stays"
        )
    default = default_dense_weight(index)
    scored = score_weights(train, WEIGHT_GRID)
    best = choose_weight(scored, default)
    held_scores = score_weights(held, sorted({best, default, 0.0, 1.0}))
    weight = confirmed_weight(best, default, held_scores, len(held))
    return FusionChoice(
        weight,
        scored,
        held_scores,
        len(train),
        len(held),
        excluded,
        embedder.fingerprint,
        choose_support(train, held, weight),
        default,
        "+".join(sorted({f"{q.kind}s" for q in questions})),
        best,
    )
