"""Score normalisation for hybrid fusion (``inference/retrieval/normalise.py``): the rules by
hand, their invariants as properties, and the case that made distribution-based the default (a
page only BM25 finds, far ahead of BM25's other rows)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coinrag.inference.retrieval.normalise import (
    DistributionBased,
    MinMax,
    ScoreNormaliser,
    score_normaliser,
)
from coinrag.inference.retrieval.retriever import (
    FUSION_METHOD,
    FUSION_NORMALISER,
    HYBRID_DENSE_WEIGHT,
    relative_scores,
)
from coinrag.schemas.registry import UnknownPlugin

SCORES = st.lists(
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False), min_size=2, max_size=40
).filter(lambda v: max(v) - min(v) > 1e-6)


def test_rules_by_hand():
    assert MinMax().normalise([3.0, 1.0, 2.0]) == [1.0, 0.0, 0.5]
    # [12, 4, 2]: mean 6, sigma sqrt(56 / 3) = 4.3205; 0 at mean - 3 sigma, 1 at mean + 3 sigma
    sigma = math.sqrt(56 / 3)
    want = [(v - (6 - 3 * sigma)) / (6 * sigma) for v in (12.0, 4.0, 2.0)]
    got = DistributionBased().normalise([12.0, 4.0, 2.0])
    assert got == pytest.approx(want, abs=1e-12)
    assert got == pytest.approx([0.7315, 0.4229, 0.3457], abs=1e-4)
    for rule in (MinMax(), DistributionBased()):
        assert rule.normalise([]) == []
    # nothing to tell them apart: min-max calls each the best, dbsf each average
    assert MinMax().normalise([5.0, 5.0]) == [1.0, 1.0]
    assert DistributionBased().normalise([5.0, 5.0]) == [0.5, 0.5]
    assert DistributionBased().normalise([7.0]) == [0.5]
    # a row far below the rest is clipped to 0: ranked never scores below unranked
    low = DistributionBased().normalise([10.0] * 39 + [-1000.0])
    assert low[-1] == 0.0 and low[0] > 0.5


def test_registry_and_default():
    assert isinstance(score_normaliser("dbsf"), DistributionBased)
    assert isinstance(score_normaliser("minmax"), MinMax)
    assert ScoreNormaliser.registry.known() == ["dbsf", "minmax"]
    with pytest.raises(UnknownPlugin, match="unknown score normaliser 'rank'"):
        score_normaliser("rank")
    assert FUSION_NORMALISER.name == "dbsf" and FUSION_METHOD == "dbsf-convex-v1"
    assert HYBRID_DENSE_WEIGHT == 0.5


@given(SCORES, st.floats(min_value=0.01, max_value=100), st.floats(min_value=-50, max_value=50))
def test_affine_invariant_and_order_preserving(values, scale, shift):
    """Only the scores' spread matters, not their scale or offset (cosine vs BM25); the order of
    a ranking is kept; distribution-based scores stay in [0, 0.5 + sqrt(n - 1) / 6] and, where
    none is clipped, average 0.5 (the mean maps to the middle)."""
    moved = [scale * v + shift for v in values]
    for rule in (MinMax(), DistributionBased()):
        out = rule.normalise(values)
        assert rule.normalise(moved) == pytest.approx(out, abs=1e-6)
        by_score = [x for _, x in sorted(zip(values, out, strict=True))]
        assert all(a <= b + 1e-12 for a, b in itertools.pairwise(by_score))
    dbsf = DistributionBased().normalise(values)
    # within 0 (clipped) and the most a row can stand out: sqrt(n - 1) sd above the mean
    reach = 0.5 + math.sqrt(len(values) - 1) / 6
    assert all(0.0 <= v <= reach + 1e-9 for v in dbsf)
    if min(dbsf) > 0.0:  # nothing clipped: the mean maps to the middle
        assert sum(dbsf) / len(dbsf) == pytest.approx(0.5, abs=1e-9)


def _ranking(prefix: str, scores: list[float]) -> list[tuple[str, float]]:
    return [(f"{prefix}{i}", s) for i, s in enumerate(scores)]


def test_a_standout_of_either_ranking_wins():
    """30 rows each, as hybrid search fetches. Dense is flat (no chunk stands out); BM25 has one
    page far ahead of its other rows that dense did not rank. Min-max at dense 0.75 (the rule
    before) gives that page at most 0.25, below dense's top rows; distribution-based at equal
    weights puts it first. And where dense has the standout and BM25 is flat, dense's wins."""
    flat_dense = _ranking("d", [0.62 - 0.002 * i for i in range(30)])
    peaked_bm25 = [("gold", 31.0)] + _ranking("w", [9.0 - 0.1 * i for i in range(29)])
    before = relative_scores([flat_dense, peaked_bm25], [0.75, 0.25], MinMax())
    assert max(before, key=before.get) == "d0" and before["gold"] == pytest.approx(0.25)
    now = relative_scores([flat_dense, peaked_bm25], [HYBRID_DENSE_WEIGHT] * 2)
    assert max(now, key=now.get) == "gold"
    peaked_dense = [("gold", 0.81)] + _ranking("d", [0.45 - 0.002 * i for i in range(29)])
    flat_bm25 = _ranking("w", [12.0 - 0.05 * i for i in range(30)])
    now = relative_scores([peaked_dense, flat_bm25], [HYBRID_DENSE_WEIGHT] * 2)
    assert max(now, key=now.get) == "gold"
