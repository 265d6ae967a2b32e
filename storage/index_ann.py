"""How the index's vectors and words are searched: the ANN index types and their parameters
(measured), the full-text index configuration, and a reader's in-memory exact search of a small
table (:class:`FlatTable`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from coinrag.storage.index_tables import METRIC

# Measured on 2 shared CPU cores (load average 4-6) with tests/benchmarks/bench_retrieval.py,
# dim 384, clustered vectors: a flat scan costs ~10 ms at 10^4 rows, ~15-20 ms at 2*10^4,
# ~50 ms at 10^5 and ~0.6-0.9 s at 10^6. IVF_SQ (cosine, rows/4096 partitions, 32 probes,
# refine 5) answers in ~5 ms at 2*10^4-10^5 and ~11 ms at 10^6 with recall@10 = 1.000 against
# exact search, and builds in 0.2 s / 1 s / 18 s. IVF_HNSW_SQ reached the same recall with
# refine 5 (5-8 ms) but took ~20 min to build at 10^6; IVF_PQ built in ~2 min and stayed at
# recall@10 0.89 (chunk-stage recall@5 0.52) even with refine 10. So: IVF_SQ from 2*10^4 rows.
VECTOR_INDEX_MIN_ROWS = int(os.environ.get("COINRAG_VECTOR_INDEX_MIN_ROWS", 20_000))
VECTOR_INDEX_TYPE = "IVF_SQ"
IVF_TARGET_PARTITION_ROWS = 4096  # IVF partitions: rows / this (about sqrt(rows) near 10^7)
HNSW_PARTITION_ROWS = 262_144  # IVF_HNSW_SQ partitions: one HNSW graph per 256Ki rows
HNSW_EF_CONSTRUCTION = 300  # LanceDB's default
SEARCH_NPROBES = 32  # IVF partitions probed per query
SEARCH_REFINE_FACTOR = 5  # re-rank 5*k candidates with the exact float32 vectors
SEARCH_EF = 100  # HNSW candidate list (IVF_HNSW_* indexes only)
# A coarse ANN search (the nugget votes of dense chunk scoring: approximate by design): on 142,565
# nuggets of the Python docs, top-100 recall 0.956 against exact in 11.5 ms, vs 1.000 in 18.6 ms
# with the fine parameters above (one thread).
COARSE_NPROBES = 16
COARSE_REFINE_FACTOR = 2
RETRAIN_GROWTH = 2.0  # retrain the ANN index when the table has grown this much since training
# LanceDB's native full-text (BM25) index on the ``text`` column of chunks and nuggets: simple
# word tokens, lower case, ASCII folding, English stemming and stop words, no positions (no
# phrase queries: questions are matched as bags of words).
FTS_COLUMN = "text"
FTS_CONFIG: dict[str, Any] = {
    "with_position": False,
    "base_tokenizer": "simple",
    "language": "English",
    "lower_case": True,
    "stem": True,
    "remove_stop_words": True,
    "ascii_folding": True,
}


def create_vector_index(tbl: Any, rows: int, dim: int, index_type: str = VECTOR_INDEX_TYPE) -> None:
    """Train an ANN index on ``tbl.vector`` (cosine), sized for ``rows`` rows."""
    from lancedb.index import HnswSq, IvfPq, IvfSq

    partitions = max(1, rows // IVF_TARGET_PARTITION_ROWS)
    if index_type == "IVF_PQ":
        sub = dim // 16 if dim % 16 == 0 else (dim // 8 if dim % 8 == 0 else 1)
        config: Any = IvfPq(distance_type=METRIC, num_partitions=partitions, num_sub_vectors=sub)
    elif index_type == "IVF_SQ":
        config = IvfSq(distance_type=METRIC, num_partitions=partitions)
    elif index_type == "IVF_HNSW_SQ":
        config = HnswSq(
            distance_type=METRIC,
            num_partitions=max(1, rows // HNSW_PARTITION_ROWS),
            ef_construction=HNSW_EF_CONSTRUCTION,
        )
    else:
        raise ValueError(f"unsupported vector index type {index_type!r}")
    tbl.create_index("vector", config=config, replace=True)


def tune_ann_query(query: Any, coarse: bool = False) -> Any:
    """Search parameters for the ANN index (chosen with the benchmark's recall@10); ``coarse``:
    fewer partitions and less refining (:data:`COARSE_NPROBES`)."""
    if coarse:
        return query.nprobes(COARSE_NPROBES).ef(SEARCH_EF).refine_factor(COARSE_REFINE_FACTOR)
    query = query.nprobes(SEARCH_NPROBES).ef(SEARCH_EF)
    return query.refine_factor(SEARCH_REFINE_FACTOR) if SEARCH_REFINE_FACTOR else query


class FlatTable:
    """A reader's in-memory copy of a small table (no ANN index: LanceDB would scan it whole
    anyway): its rows' hit columns and their L2-normalised ``(n, dim)`` float32 vectors, read
    once at the reader's pinned version. An exact cosine search over it is one matrix-vector
    product (0.3 ms for the 5,860 chunks of the Python docs, where LanceDB's flat scan took
    13 ms)."""

    def __init__(self, rows: pa.Table, vectors: np.ndarray) -> None:
        self.rows = rows
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        self.vectors = vectors / np.where(norms > 0, norms, 1.0)

    def search(self, q: np.ndarray, k: int, columns: Sequence[str]) -> list[dict[str, Any]]:
        """Top-``k`` rows by cosine similarity to ``q``, best first, with ``score``."""
        n = len(self.vectors)
        if n == 0:
            return []
        scores = self.vectors @ (q / (np.linalg.norm(q) or 1.0))
        k = min(k, n)
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        rows = self.rows.select(list(columns)).take(pa.array(top)).to_pylist()
        for row, i in zip(rows, top, strict=True):
            row["score"] = float(scores[i])
        return rows
