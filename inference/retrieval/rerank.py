"""A second stage over the top chunks of a search: :class:`Reranker`, its registry, and how its
scores are combined with the search's.

A reranker scores each of the search's top :attr:`Reranker.depth` chunks for the question
(:meth:`Reranker.scores`: higher is better, any scale); :meth:`Reranker.rerank` orders them by
the convex combination of the two min-max normalised scores (:func:`combined`)::

    score = (1 - weight) * search_norm + weight * rerank_norm

and ``Retriever`` keeps the first ``kc``. So every ``kc <= depth`` sees a prefix of one order
(the same order at kc 1 and kc 8), and both stages of two-stage retrieval start from it.

The plug-ins (``schemas.settings.RERANKERS``, the ``rerank`` setting): ``none`` (the search's
order; what a store without the setting does), ``pages`` (:class:`OnePerPage`: each page's best
chunk before any page's second, so ``kc`` chunks cover as many pages as the search's top rows
hold), ``support`` (:class:`PageSupport`: the same rounds, the pages in each ordered by their
best chunk plus a share of their second best) and ``upr``, the generation model's query
likelihood (``inference/context/rerank.py``: it reads the chunks' KV, so it lives where the
context is built; imported on first look-up).

Worked example (weight 0.5): search scores ``[0.9, 0.6, 0.3]`` (normalised ``[1, 0.5, 0]``)
and reranker scores ``[-3.0, -2.0, -2.5]`` (normalised ``[0, 1, 0.5]``) combine to
``[0.5, 0.75, 0.25]``: the second chunk comes first.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from coinrag.inference.retrieval.normalise import MinMax
from coinrag.schemas.registry import Registered, Registry
from coinrag.schemas.settings import RERANKERS

if TYPE_CHECKING:
    from coinrag.inference.retrieval.retriever import ChunkHit
    from coinrag.storage.index.lance import LanceIndex

RERANK_MODULES = {"upr": "coinrag.inference.context.rerank"}


def normalised(values: Sequence[float]) -> list[float]:
    """Min-max normalised to [0, 1] (all 1 when equal): ``[3, 1, 2]`` -> ``[1, 0, 0.5]``."""
    return MinMax().normalise(values)


def combined(search: Sequence[float], rerank: Sequence[float], weight: float) -> list[float]:
    """``(1 - weight) * normalised(search) + weight * normalised(rerank)``, item by item."""
    return [
        (1.0 - weight) * s + weight * r
        for s, r in zip(normalised(search), normalised(rerank), strict=True)
    ]


class Reranker(Registered, ABC):
    """Reorders a search's top chunks for a question: one subclass per ``rerank`` setting
    (``schemas.settings.RERANKERS``), registered by name (``Reranker.registry``).

    ``depth``: how many of the search's top chunks it reorders (a search for ``kc`` chunks
    fetches ``max(kc, depth)``); ``weight``: its scores' share of the combined score."""

    registry: ClassVar[Registry[Reranker]] = Registry("reranker", RERANKERS, RERANK_MODULES)
    depth: ClassVar[int] = 0
    weight: ClassVar[float] = 0.0

    @classmethod
    def open(cls, context_of: Callable[[], Any]) -> Reranker:
        """This reranker; ``context_of()`` gives the chunks' KV (an
        ``inference.context.builders.ContextBuilder``), called only by one that reads it."""
        return cls()

    @abstractmethod
    def scores(self, question: str, hits: Sequence[ChunkHit]) -> list[float]:
        """One score per hit (higher: more likely to answer ``question``), in order."""

    def rerank(self, question: str, hits: Sequence[ChunkHit]) -> list[ChunkHit]:
        """``hits`` (the search's, best first) in :func:`combined` order, best first: each
        with its new ``rank`` (0 = best) and its search ``score`` kept; ties keep the
        search's order."""
        if len(hits) < 2 or self.depth == 0:
            return list(hits)
        mixed = combined([h.score for h in hits], self.scores(question, hits), self.weight)
        order = sorted(range(len(hits)), key=lambda i: (-mixed[i], i))
        return [dataclasses.replace(hits[i], rank=r) for r, i in enumerate(order)]

    def for_index(self, index: LanceIndex) -> Reranker:
        """This reranker as it reorders ``index``'s searches: itself, or, for one with a
        parameter chosen per index (:class:`PageSupport`), one with the index's recorded value
        (``Retriever`` asks once, for the index it opens)."""
        return self

    def record(self) -> dict[str, Any]:
        """What an evaluation run records of it: its name, depth and weight."""
        return {"name": self.name, "depth": self.depth, "weight": self.weight}


class NoRerank(Reranker, name="none"):
    """The search's own order (reorders nothing)."""

    def scores(self, question: str, hits: Sequence[ChunkHit]) -> list[float]:
        return [h.score for h in hits]


class OnePerPage(Reranker, name="pages"):
    """Page-diverse order: the search's top :attr:`depth` chunks round by round, each round
    holding the next-best chunk of every page that has one left, in the search's order (a
    page's second chunk comes after every page's first). The search's order is kept within a
    round, so ``kc`` 1 keeps the search's best chunk and a question whose top chunks come from
    as many pages is not reordered at all.

    Why: a page with several chunks near a question (a long reference page, a FAQ page whose
    sections share words) otherwise fills the ``kc`` chunks, and the page that answers comes
    after them. Measured on the 497 pages of the Python docs with ``rules`` nuggets
    (docs/retrieval.md, "One chunk a page first"): hybrid hit@kc at kc 2-8 up or equal on
    all three question sets, kc 1 unchanged."""

    depth: ClassVar[int] = 30  # the search's top chunks it reorders (a hybrid search's depth)
    weight: ClassVar[float] = 1.0  # the order is its own: rounds, then the search's order

    def scores(self, question: str, hits: Sequence[ChunkHit]) -> list[float]:
        """``-(round * len(hits) + position)``: the hit's round (how many chunks of its page
        come before it in the search's order), then its place in that order."""
        taken: dict[str, int] = {}
        out = []
        for position, hit in enumerate(hits):
            rounds = taken.get(hit.doc_id, 0)
            taken[hit.doc_id] = rounds + 1
            out.append(-float(rounds * len(hits) + position))
        return out


class PageSupport(OnePerPage, name="support"):
    """Pages ranked by their support: a page's best chunk's score plus :attr:`support` times its
    second best's (the search's scores of its top :attr:`depth` chunks, min-max normalised to
    [0, 1]: any search mode's scale), then :class:`OnePerPage`'s rounds with the pages of each
    round in that order (ties: the search's order). A page with one chunk scores its chunk.

    Why: the unit a question is answered by is a page, and a page that two of the top chunks
    come from is more likely the one than a page that one chunk a little higher comes from. On
    the 497 pages of the Python documentation (all-mpnet-base-v2, windows of 256, no nuggets;
    docs/retrieval.md, "Pages ranked by their support") hybrid hit@1 rises on both natural
    question sets (74.6 -> 84.1 and 65.2 -> 71.2 %) and falls on the FAQ titles (93.2 -> 89.2:
    a title matches one chunk alone). :attr:`support`: 0.5 by default, chosen on that store's
    own headings and generated questions, not on those sets; ``coinrag train fusion`` chooses
    one per index the same way, and :meth:`for_index` reads it.

    Worked example (support 0.5): normalised scores ``a 1.0, b 0.9, b 0.8, c 0.1`` give pages
    ``a 1.0``, ``b 0.9 + 0.4 = 1.3``, ``c 0.1``: the order is ``b``'s first chunk, ``a``,
    ``c``, then ``b``'s second."""

    support: float = 0.5  # the second-best chunk's share of its page's score (the default)
    method: ClassVar[str] = "minmax-best-second-v1"  # what a share recorded per index is for

    def __init__(self, support: float | None = None) -> None:
        if support is not None:
            if not 0.0 <= support <= 1.0:
                raise ValueError(f"page support {support} is outside [0, 1]")
            self.support = float(support)

    def for_index(self, index: LanceIndex) -> PageSupport:
        """One with the share ``coinrag train fusion`` chose for ``index`` (recorded with its
        version, :func:`recorded_support`), else this one."""
        share = recorded_support(index)
        return self if share is None else type(self)(share)

    def scores(self, question: str, hits: Sequence[ChunkHit]) -> list[float]:
        """``-(place)``: each hit's place in (round, page support descending, search order)."""
        chunks_of: dict[str, list[float]] = {}
        for hit, score in zip(hits, normalised([h.score for h in hits]), strict=True):
            chunks_of.setdefault(hit.doc_id, []).append(score)
        page_score = {}
        for page, scores in chunks_of.items():
            best, *rest = sorted(scores, reverse=True)
            page_score[page] = best + self.support * (rest[0] if rest else 0.0)
        taken: dict[str, int] = {}
        keys = []
        for position, hit in enumerate(hits):
            rounds = taken.get(hit.doc_id, 0)
            taken[hit.doc_id] = rounds + 1
            keys.append((rounds, -page_score[hit.doc_id], position))
        places = sorted(range(len(hits)), key=keys.__getitem__)
        out = [0.0] * len(hits)
        for place, i in enumerate(places):
            out[i] = -float(place)
        return out

    def record(self) -> dict[str, Any]:
        """:meth:`Reranker.record` with the second best chunk's share, ``support``."""
        return {**super().record(), "support": self.support}


def recorded_support(index: LanceIndex) -> float | None:
    """The page support share recorded with ``index``'s version (``IndexMeta.fusion``:
    ``tasks/retrieval/fusion.py`` chooses it with the fusion weight on the store's questions)
    when it was chosen for this code's fusion and :attr:`PageSupport.method`, else None."""
    from coinrag.inference.retrieval.retriever import FUSION_METHOD

    fusion = index.meta.fusion or {}
    if fusion.get("method") != FUSION_METHOD:
        return None
    if fusion.get("page_support_method") != PageSupport.method or "page_support" not in fusion:
        return None
    return float(fusion["page_support"])


def open_reranker(name: str, context_of: Callable[[], Any]) -> Reranker | None:
    """The reranker ``name`` (``schemas.settings.RERANKERS``) opened with ``context_of``
    (:meth:`Reranker.open`), or None for one that reorders nothing (``none``)."""
    cls = Reranker.registry[name]
    return None if cls.depth == 0 else cls.open(context_of)
