"""How hybrid search puts a dense and a lexical ranking's scores on one scale before it adds them.

Cosine similarities (dense) and BM25 scores (lexical) live on unrelated scales, so each ranking's
top rows are mapped to a common one first; the fused score is then ``w * dense + (1 - w) *
lexical`` (``retriever.relative_scores``). One subclass per rule, registered by ``name`` in
:data:`SCORE_NORMALISERS`:

- ``minmax``: ``(s - min) / (max - min)``: the best row of every ranking scores 1, however
  little it stands out, and the worst 0.
- ``dbsf`` (distribution-based score fusion, after Qdrant's DBSF and Mazzeschi 2023):
  ``max(0, (s - (mu - 3 sigma)) / (6 sigma))``, ``mu`` and ``sigma`` the mean and population
  standard deviation of the ranking's scores (Qdrant's client takes the sample deviation: 1.7 %
  wider at 30 rows). A row is scored by how far it stands out of its own ranking: a BM25 top
  row far above the rest (the question's rare words are in it) scores near or above 1, the top
  row of a flat ranking (no row is much better than the others) only about 0.8. Not clipped
  above: a row more than 3 sigma above the mean scores above 1, which is the point (the
  standout wins the fusion); clipped at 0 below, so that being ranked never scores less than
  not being ranked. A ranking without spread (one row, or equal scores) gives each row 0.5: it
  sits at its ranking's mean and nothing says it stands out.

Worked example: the scores ``[12, 4, 2]`` (mu 6, sigma 4.32) normalise to ``[0.731, 0.423,
0.346]`` by ``dbsf`` and to ``[1, 0.2, 0]`` by ``minmax``; ``[5]`` to ``[0.5]`` by ``dbsf`` and
``[1]`` by ``minmax``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from coinrag.schemas.registry import Registered, Registry

SCORE_NORMALISERS = ("dbsf", "minmax")


class ScoreNormaliser(Registered, ABC):
    """Maps one ranking's scores (any scale, best first or not) to a common scale."""

    registry: ClassVar[Registry[ScoreNormaliser]] = Registry("score normaliser", SCORE_NORMALISERS)
    described: ClassVar[str]  # what it does to a ranking, in words (the UI's score formula)

    @abstractmethod
    def normalise(self, values: Sequence[float]) -> list[float]:
        """``values`` mapped item by item (empty in, empty out)."""


class MinMax(ScoreNormaliser, name="minmax"):
    """``(s - min) / (max - min)``, in [0, 1]: ``[3, 1, 2]`` -> ``[1, 0, 0.5]``; all equal:
    all 1."""

    described: ClassVar[str] = "min-max normalised over its top rows"

    def normalise(self, values: Sequence[float]) -> list[float]:
        if not values:
            return []
        low, span = min(values), max(values) - min(values)
        return [(v - low) / span if span > 0 else 1.0 for v in values]


class DistributionBased(ScoreNormaliser, name="dbsf"):
    """``max(0, (s - (mu - 3 sigma)) / (6 sigma))`` over the ranking's own scores:
    ``[12, 4, 2]`` -> ``[0.731, 0.423, 0.346]`` (rounded); no spread: all 0.5."""

    described: ClassVar[str] = (
        "scaled over its top rows so that their mean - 3 sd is 0 and mean + 3 sd is 1 "
        "(distribution-based)"
    )
    spread: ClassVar[float] = 3.0  # standard deviations either side of the mean mapped to 0 and 1

    def normalise(self, values: Sequence[float]) -> list[float]:
        if not values:
            return []
        mean = sum(values) / len(values)
        sigma = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if sigma <= 0.0:
            return [0.5] * len(values)
        low = mean - self.spread * sigma
        return [max(0.0, (v - low) / (2.0 * self.spread * sigma)) for v in values]


def score_normaliser(name: str) -> ScoreNormaliser:
    """The registered normaliser ``name`` (``UnknownPlugin`` lists the known ones)."""
    return ScoreNormaliser.registry[name]()
