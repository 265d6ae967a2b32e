"""How the index's vectors and words are searched: the ANN index types and their parameters
(measured), the full-text index configuration, and a reader's in-memory exact search of a small
table (:class:`FlatTable`)."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from coinrag.storage.index.tables import METRIC, InFilter

# Measured on 2 shared CPU cores (load average 4-6) with tests/benchmarks/bench_retrieval.py,
# dim 384, clustered vectors: a flat scan costs ~10 ms at 10^4 rows, ~15-20 ms at 2*10^4,
# ~50 ms at 10^5 and ~0.6-0.9 s at 10^6. IVF_SQ (cosine, rows/4096 partitions, 32 probes,
# refine 5) answers in ~5 ms at 2*10^4-10^5 and ~11 ms at 10^6 with recall@10 = 1.000 against
# exact search, and builds in 0.2 s / 1 s / 18 s. IVF_HNSW_SQ reached the same recall with
# refine 5 (5-8 ms) but took ~20 min to build at 10^6; IVF_PQ built in ~2 min and stayed at
# recall@10 0.89 (chunk-stage recall@5 0.52) even with refine 10. So: IVF_SQ from 2*10^4 rows.
VECTOR_INDEX_MIN_ROWS = int(os.environ.get("COINRAG_VECTOR_INDEX_MIN_ROWS", 20_000))
VECTOR_INDEX_TYPE = "IVF_SQ"
# A reader keeps a table in memory (FlatTable) when its vectors take at most this many bytes
# (float32 up to VECTOR_INDEX_MIN_ROWS rows; above, float16 and at most a bfloat16 copy to rank
# by: at most 4 bytes a component): exact search, faster than the ANN index where it fits
# (measured in FlatTable's docstring). Larger tables use the ANN index.
FLAT_MAX_BYTES = int(os.environ.get("COINRAG_FLAT_MAX_BYTES", 512 * 2**20))
_READERS = {"large_in_memory": True}


def keep_large_tables_in_memory(enabled: bool) -> None:
    """Whether this process's readers keep tables above ``VECTOR_INDEX_MIN_ROWS`` in memory
    too (the default, and a serving process's: ``coinrag api``, ``eval``), or search them by
    their ANN index (a one-shot ``coinrag query``: reading 142,565 nugget vectors into memory
    takes about 3 s, longer than the question it would speed up)."""
    _READERS["large_in_memory"] = bool(enabled)


def large_tables_in_memory() -> bool:
    """See :func:`keep_large_tables_in_memory`."""
    return _READERS["large_in_memory"]


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
# LanceDB's native full-text (BM25) index on the ``search_text`` column of chunks and nuggets
# (the heading path and the text): simple word tokens, lower case, ASCII folding, English
# stemming and stop words, no positions (no phrase queries: questions are matched as bags of
# words). An index written before ``search_text`` existed has it on ``text`` (read as it is
# until the next build rewrites the table: :func:`fts_column`).
FTS_COLUMN = "search_text"
LEGACY_FTS_COLUMN = "text"
FTS_CONFIG: dict[str, Any] = {
    "with_position": False,
    "base_tokenizer": "simple",
    "language": "English",
    "lower_case": True,
    "stem": True,
    "remove_stop_words": True,
    "ascii_folding": True,
}


def fts_column(schema: pa.Schema) -> str:
    """The column a table's words are searched in: :data:`FTS_COLUMN`, or the older
    :data:`LEGACY_FTS_COLUMN` in a table written before it existed."""
    return FTS_COLUMN if FTS_COLUMN in schema.names else LEGACY_FTS_COLUMN


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


# The half dtypes a large table can be ranked in (torch names); COINRAG_RANKING_DTYPE picks one,
# else the faster on this CPU (fastest_ranking_dtype).
RANKING_DTYPES = ("float16", "bfloat16")


_RANKING_LOCK = threading.Lock()


def ranking_product_seconds(
    rows: int = 65_536, dim: int = 384, repeats: int = 5
) -> dict[str, float]:
    """Dtype of :data:`RANKING_DTYPES` -> the fastest of ``repeats`` matrix-vector products
    over a ``(rows, dim)`` matrix in it (seconds, on this process's torch threads; the dtypes
    alternated, so that a burst of load falls on both)."""
    import torch

    pairs = {}
    for name in RANKING_DTYPES:
        mat = torch.full((rows, dim), 0.01, dtype=getattr(torch, name))  # values: no matter
        pairs[name] = (mat, mat[0].clone())
        mat @ pairs[name][1]  # warm
    best = dict.fromkeys(RANKING_DTYPES, float("inf"))
    for _ in range(repeats):
        for name, (mat, q) in pairs.items():
            t = time.perf_counter()
            mat @ q
            best[name] = min(best[name], time.perf_counter() - t)
    return best


@functools.cache
def _measured_ranking_dtype() -> str:
    seconds = ranking_product_seconds()
    return min(RANKING_DTYPES, key=seconds.__getitem__)


def fastest_ranking_dtype() -> str:
    """``COINRAG_RANKING_DTYPE`` if set, else the dtype of :data:`RANKING_DTYPES` whose
    matrix-vector product is faster on this CPU (:func:`ranking_product_seconds`), measured
    once a process (~0.15 s; under a lock, so threads opening tables at once share one
    measurement). Which one wins is the CPU's and torch's: stop 46's VM ranked 142,565 x 384 in
    11.2 ms in bfloat16 and 21.8 in float16; an AMD EPYC (Zen 4, AVX512_BF16, one thread, torch
    2.13) the other way round, 23.3 ms in bfloat16 and 8.4 in float16."""
    chosen = os.environ.get("COINRAG_RANKING_DTYPE")
    if chosen:
        if chosen not in RANKING_DTYPES:
            raise ValueError(f"COINRAG_RANKING_DTYPE={chosen!r}: use one of {RANKING_DTYPES}")
        return chosen
    with _RANKING_LOCK:
        return _measured_ranking_dtype()


class FlatTable:
    """A reader's in-memory copy of one table, read once at the reader's pinned version: its
    rows' hit columns and their L2-normalised ``(n, dim)`` vectors, searched exactly (a
    matrix-vector product: 0.3 ms for the 5,860 chunks of the Python docs, where LanceDB's flat
    scan took 13 ms), also under an :class:`~coinrag.storage.index.tables.InFilter` prefilter
    (``chunk_id IN (...)``: the rows of those ids only, through a per-column position map).

    ``half``: the vectors are held in float16 (a large table: 142,565 nuggets x 384 take 110 MB
    instead of 219). An unfiltered search ranks every row by a half-precision product (torch,
    one pass over the matrix) in ``ranking_dtype`` (None: :func:`fastest_ranking_dtype`):
    float16 ranks the float16 vectors themselves (no copy), bfloat16 a copy beside them
    (another 110 MB). On stop 46's VM bfloat16 took 11.2 ms for those nuggets on one core,
    float16 21.8, float32 17.5; on an AMD EPYC (Zen 4) float16 8.4, bfloat16 23.3, float32 30.1
    (the coarse ANN search took 11-20 ms). The best ``HALF_RESCORE * k`` candidates are
    rescored in float32 from the float16 vectors (widened, so a score differs from the float32
    vectors' by their rounding alone: at most 2**-11, held by
    ``tests/inference/test_reader_in_memory.py``). A candidate is missed only where the
    ranking's rounding (of the order of 2**-8 of a score in bfloat16, 2**-10 in float16: the
    vectors, the query and the product rounded) moves it below ``HALF_RESCORE * k`` others. A
    filtered search always scores in float32."""

    HALF_RESCORE = 4
    SCORE_BLOCK = 16_384  # rows of a half table widened to float32 at a time (25 MB at 384)

    def __init__(
        self,
        rows: pa.Table,
        vectors: np.ndarray,
        half: bool = False,
        ranking_dtype: str | None = None,
    ) -> None:
        self.rows = rows.combine_chunks()  # one chunk per column: ``take`` of a few rows is
        # microseconds (on the many chunks LanceDB returns it was 10 ms at 142,565 rows)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        unit = vectors / np.where(norms > 0, norms, 1.0)
        self.half = half
        self.vectors = unit.astype(np.float16 if half else np.float32)
        self._ranking = None  # half: the matrix (torch) every row is ranked by
        if half:
            import torch

            name = ranking_dtype or fastest_ranking_dtype()
            if name not in RANKING_DTYPES:
                raise ValueError(f"ranking dtype {name!r}: use one of {RANKING_DTYPES}")
            # float16: the vectors themselves (``to`` keeps the tensor); else a copy
            self._ranking = torch.from_numpy(self.vectors).to(getattr(torch, name))
        self._positions: dict[str, dict[str, np.ndarray]] = {}
        self._codes: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def nbytes(self) -> int:
        shared = self._ranking is None or self._ranking.data_ptr() == self.vectors.ctypes.data
        ranking = 0 if shared else self._ranking.numel() * self._ranking.element_size()
        return int(self.vectors.nbytes) + ranking

    @property
    def ranking_dtype(self) -> str | None:
        """The dtype every row is ranked in by an unfiltered search (None: float32 scores)."""
        return None if self._ranking is None else str(self._ranking.dtype).removeprefix("torch.")

    def _group_codes(self, column: str) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, codes)``: the column's distinct values (sorted) and each row's index among
        them, made on first use."""
        if column not in self._codes:
            values = self.rows.column(column).to_numpy(zero_copy_only=False)
            keys, codes = np.unique(values, return_inverse=True)
            self._codes[column] = (keys, codes.reshape(-1))
        return self._codes[column]

    def _groups(self, column: str) -> dict[str, np.ndarray]:
        """Value -> the positions of the rows holding it (ascending), per column, made on first
        use (0.2 s for the chunk ids of 142,565 nuggets)."""
        if column not in self._positions:
            keys, codes = self._group_codes(column)
            order = np.argsort(codes, kind="stable")
            starts = np.searchsorted(codes[order], np.arange(len(keys)))
            ends = [*starts[1:], len(order)][: len(keys)]  # none where there are no rows
            self._positions[column] = {
                str(key): order[a:b] for key, a, b in zip(keys, starts, ends, strict=True)
            }
        return self._positions[column]

    def positions(self, where: InFilter) -> np.ndarray | None:
        """The row positions the prefilter keeps (ascending), or None if this copy lacks its
        column (the caller asks LanceDB instead)."""
        if where.column not in self.rows.column_names:
            return None
        groups = self._groups(where.column)
        found = [groups[v] for v in where.values if v in groups]
        return np.sort(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)

    def rows_by_id(
        self, column: str, ids: Sequence[str], columns: Sequence[str]
    ) -> list[dict[str, Any]] | None:
        """The rows whose ``column`` (a unique id) is each of ``ids``, in that order (``columns``
        only); None if any id is not in this copy."""
        groups = self._groups(column)
        if any(i not in groups for i in ids):
            return None
        at = pa.array([int(groups[i][0]) for i in ids], pa.int64())
        return self.rows.select(list(columns)).take(at).to_pylist()

    def _scores(self, q: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
        """Float32 cosine scores ``(n,)`` of the rows at ``positions`` (all rows if None); a
        half table's rows are widened :data:`SCORE_BLOCK` at a time (not all at once: 4 bytes a
        component more)."""
        n = len(self.vectors) if positions is None else len(positions)
        if not self.half or n <= self.SCORE_BLOCK:
            mat = self.vectors if positions is None else self.vectors[positions]
            return mat.astype(np.float32, copy=False) @ q
        out = np.empty(n, np.float32)
        for a in range(0, n, self.SCORE_BLOCK):
            at = slice(a, a + self.SCORE_BLOCK)
            part = self.vectors[at] if positions is None else self.vectors[positions[at]]
            out[at] = part.astype(np.float32) @ q
        return out

    def _rough_scores(self, q: np.ndarray) -> Any:
        """Every row's score ``(n,)`` by the half-precision product (a float32 torch tensor)."""
        import torch

        return (self._ranking @ torch.from_numpy(q).to(self._ranking.dtype)).float()

    def _half_candidates(self, q: np.ndarray, k: int) -> np.ndarray:
        """The best ``HALF_RESCORE * k`` rows by a half-precision product over the whole matrix."""
        import torch

        wide = min(len(self.vectors), self.HALF_RESCORE * k)
        return torch.topk(self._rough_scores(q), wide).indices.numpy()

    def search(
        self, q: np.ndarray, k: int, columns: Sequence[str], where: InFilter | None = None
    ) -> list[dict[str, Any]]:
        """Top-``k`` rows by cosine similarity to ``q``, best first, with ``score``;
        ``where``: only the rows it keeps (see :meth:`positions`)."""
        q = np.asarray(q, dtype=np.float32) / (np.linalg.norm(q) or 1.0)
        if where is not None:
            positions = self.positions(where)
        elif self.half and len(self.vectors) > self.HALF_RESCORE * k:
            positions = self._half_candidates(q, k)
        else:
            positions = None
        scores = self._scores(q, positions)
        n = len(scores)
        if n == 0 or k <= 0:
            return []
        k = min(k, n)
        top = np.argpartition(-scores, k - 1)[:k]
        top = top[np.argsort(-scores[top], kind="stable")]
        rows_at = top if positions is None else positions[top]
        rows = self.rows.select(list(columns)).take(pa.array(rows_at)).to_pylist()
        for row, i in zip(rows, top, strict=True):
            row["score"] = float(scores[i])
        return rows

    def _group_best(
        self, column: str, positions: np.ndarray | None, scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(groups, best)``: the codes of the ``column`` values among the rows at
        ``positions`` (all rows if None) and each one's best of their ``scores`` (a NaN score
        ignored; a value whose scores are all NaN left out)."""
        keys, codes = self._group_codes(column)
        best = np.full(len(keys), -np.inf, np.float32)
        np.fmax.at(best, codes if positions is None else codes[positions], scores)
        groups = np.flatnonzero(best > -np.inf)
        return groups, best[groups]

    def _half_group_rows(self, q: np.ndarray, k: int, column: str) -> np.ndarray:
        """The rows (ascending) of the best ``HALF_RESCORE * k`` values of ``column`` (all of
        them if there are no more) by their rows' half-precision scores."""
        keys, codes = self._group_codes(column)
        groups, best = self._group_best(column, None, self._rough_scores(q).numpy())
        n = min(self.HALF_RESCORE * k, len(groups))
        if n == 0:
            return np.empty(0, dtype=np.int64)
        chosen = np.zeros(len(keys), dtype=bool)
        chosen[groups[np.argpartition(-best, n - 1)[:n]]] = True
        return np.flatnonzero(chosen[codes])

    def best_of_groups(
        self, q: np.ndarray, k: int, column: str, where: InFilter | None = None
    ) -> list[tuple[str, float]]:
        """The ``k`` values of ``column`` whose best row is closest to ``q`` (``(dim,)``), best
        first, each with that row's float32 cosine: one pass over the rows (the chunks of the
        best windows, where asking :meth:`search` for more windows until they hold ``k`` chunks
        scanned the table two or three times). ``where``: only the rows it keeps. A half table
        without ``where`` ranks the values by their rows' half-precision scores and rescores
        the rows of the best ``HALF_RESCORE * k`` in float32 from the float16 vectors (the
        caveat of :meth:`search`). Ties in no particular order."""
        if k <= 0:
            return []
        q = np.asarray(q, dtype=np.float32).reshape(-1)
        q = q / (np.linalg.norm(q) or 1.0)
        keys, _ = self._group_codes(column)
        if where is not None:
            positions = self.positions(where)
        elif self.half:
            positions = self._half_group_rows(q, k, column)
        else:
            positions = None
        scores = self._scores(q, positions)
        groups, best = self._group_best(column, positions, scores)
        k = min(k, len(groups))
        if k == 0:
            return []
        top = np.argpartition(-best, k - 1)[:k]
        top = top[np.argsort(-best[top], kind="stable")]
        return [(str(keys[groups[i]]), float(best[i])) for i in top]

    def rows_with_vectors(self, where: InFilter, columns: Sequence[str]) -> list[dict[str, Any]]:
        """The rows the prefilter keeps (``columns`` and ``vector``: the unit float32 vector,
        a list), in table order."""
        positions = self.positions(where)
        rows = self.rows.select(list(columns)).take(pa.array(positions)).to_pylist()
        for row, i in zip(rows, positions, strict=True):
            row["vector"] = self.vectors[i].astype(np.float32).tolist()
        return rows
