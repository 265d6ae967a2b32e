"""The best row per group in one pass (``FlatTable.best_of_groups``: a chunk's best window), held
to a brute-force maximum per group on random vectors (float32, and float16 tables ranked in
either half dtype), under a prefilter, and through the index: a reader's one pass gives the same
chunks and cosines as the writer, which asks LanceDB for windows until they hold ``k`` chunks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from test_index_retrieval import HashEmbedder, cut
from test_reader_in_memory import HALF_TOLERANCE, QUERIES, TEXTS

import coinrag.storage.index.ann as index_ann
from coinrag.inference.retrieval.retriever import DenseSearch, Query
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.index.tables import in_filter
from coinrag.storage.store import Store
from coinrag.tasks.embed import embed_stage
from coinrag.tasks.ingest import SourceDocument


def _grouped(n: int, groups: int, dim: int, seed: int) -> tuple[np.ndarray, pa.Table]:
    """``n`` random vectors in ``groups`` groups of uneven size (``g00017``, ...), shuffled."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    owner = np.concatenate([np.arange(groups), rng.integers(0, groups, n - groups)])
    rng.shuffle(owner)
    rows = pa.table({"row_id": np.arange(n), "chunk_id": [f"g{g:05d}" for g in owner]})
    return vectors, rows


def _brute(vectors: np.ndarray, rows: pa.Table, q: np.ndarray, keep=None) -> dict[str, float]:
    """Group -> its best row's float32 cosine to ``q`` (only the rows ``keep`` says)."""
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    scores = unit @ (q / np.linalg.norm(q))
    best: dict[str, float] = {}
    for gid, score in zip(rows.column("chunk_id").to_pylist(), scores, strict=True):
        if keep is None or gid in keep:
            best[gid] = max(best.get(gid, -2.0), float(score))
    return best


def test_float32_groups_are_the_exact_best_per_group():
    vectors, rows = _grouped(3_000, 700, 32, seed=0)
    flat = index_ann.FlatTable(rows, vectors)
    for q in np.random.default_rng(1).standard_normal((20, 32)).astype(np.float32):
        want = sorted(_brute(vectors, rows, q).items(), key=lambda kv: -kv[1])[:25]
        got = flat.best_of_groups(q, 25, "chunk_id")
        assert [g for g, _ in got] == [g for g, _ in want]
        assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-6)
    assert len(flat.best_of_groups(q, 5_000, "chunk_id")) == 700  # k past the groups: all
    assert flat.best_of_groups(q, 0, "chunk_id") == []


def test_a_prefilter_keeps_only_its_groups_rows():
    vectors, rows = _grouped(3_000, 700, 32, seed=2)
    keep = {f"g{g:05d}" for g in range(0, 700, 7)}
    for half in (False, True):
        flat = index_ann.FlatTable(rows, vectors, half=half)
        q = np.random.default_rng(3).standard_normal(32).astype(np.float32)
        got = flat.best_of_groups(q, 10, "chunk_id", in_filter("chunk_id", sorted(keep)))
        want = sorted(_brute(vectors, rows, q, keep).items(), key=lambda kv: -kv[1])[:10]
        assert [g for g, _ in got] == [g for g, _ in want]
        tolerance = HALF_TOLERANCE if half else 1e-6
        assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=tolerance)


@pytest.mark.parametrize("dtype", index_ann.RANKING_DTYPES)
def test_a_half_table_ranks_groups_roughly_and_rescores_them(dtype: str):
    """20,000 rows of dimension 384 in 6,000 groups (about a chunk's windows each): the top
    40 groups are the float32 top 40 up to ties within twice the stated tolerance, each score
    the best row's float32 cosine within it."""
    vectors, rows = _grouped(20_000, 6_000, 384, seed=4)
    flat = index_ann.FlatTable(rows, vectors, half=True, ranking_dtype=dtype)
    for q in np.random.default_rng(5).standard_normal((20, 384)).astype(np.float32):
        exact = _brute(vectors, rows, q)
        kth = sorted(exact.values())[-40]
        got = flat.best_of_groups(q, 40, "chunk_id")
        assert len(got) == 40 and len({g for g, _ in got}) == 40
        for gid, score in got:
            assert score == pytest.approx(exact[gid], abs=HALF_TOLERANCE)
            assert exact[gid] >= kth - 2 * HALF_TOLERANCE


@pytest.mark.parametrize("half", [False, True])
def test_edge_cases_of_a_grouped_search(half: bool):
    """k of 0 or less finds nothing; a half table with no more groups than ``4 k`` rescores
    them all (its rows widened in blocks: more rows than one block here); a NaN row is
    ignored by its group; a prefilter that keeps nothing finds nothing."""
    vectors, rows = _grouped(20_000, 30, 16, seed=6)
    vectors[7] = np.nan
    flat = index_ann.FlatTable(rows, vectors, half=half)
    assert len(vectors) > flat.SCORE_BLOCK
    q = np.random.default_rng(7).standard_normal(16).astype(np.float32)
    assert flat.best_of_groups(q, 0, "chunk_id") == [] == flat.best_of_groups(q, -3, "chunk_id")
    kept = np.delete(np.arange(len(vectors)), 7)  # every group has other rows (~667 each)
    want = _brute(vectors[kept], rows.take(kept), q)
    got = flat.best_of_groups(q, 30, "chunk_id")
    ranked = sorted(want.items(), key=lambda kv: -kv[1])
    assert [g for g, _ in got] == [g for g, _ in ranked]
    tolerance = HALF_TOLERANCE if half else 1e-6
    assert [s for _, s in got] == pytest.approx([s for _, s in ranked], abs=tolerance)
    assert flat.best_of_groups(q, 3, "chunk_id", in_filter("chunk_id", ["nothing"])) == []


@pytest.fixture()
def long_indexes(tmp_path, smollm2_tokenizer, monkeypatch):
    """(writer, reader, embedder) over the sample texts, each said three times (numbered),
    windows of 10 words: a chunk of 48 tokens spans several."""
    monkeypatch.setitem(index_ann._READERS, "large_in_memory", True)
    store = Store.at(tmp_path / "s").init()
    texts = {k: " ".join(f"({i}) {v}" for i in range(3)) for k, v in TEXTS.items()}
    docs = [SourceDocument(k, v, {}, "test") for k, v in texts.items()]
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    emb = HashEmbedder()
    emb.max_length = 12
    embed_stage(store, chunks, nuggets, docs, emb, "r1")
    writer = LanceIndex.open_latest(store)
    reader = LanceIndex(store, writer.meta, writer.published_state()["versions"])
    return writer, reader, emb


def test_a_reader_finds_a_chunks_best_window_in_one_pass_as_the_writer_does(long_indexes):
    writer, reader, emb = long_indexes
    assert writer.count("windows") >= 2 * writer.count("chunks")  # chunks of several windows
    dense = DenseSearch()
    chunk_ids = [r["chunk_id"] for r in writer.rows_where("chunks", "doc_id IN ('birds')", 50)]
    for text in QUERIES:
        q = emb.embed_queries([text])[0]
        fp = emb.fingerprint
        assert writer.best_of_groups("windows", "chunk_id", q, 3, embedder_fp=fp) is None
        one_pass = reader.best_of_groups("windows", "chunk_id", q, 3, embedder_fp=fp)
        assert one_pass is not None and len(one_pass) == 3  # the reader's path is this one
        row_vector = reader.best_of_groups("windows", "chunk_id", q[None, :], 3, embedder_fp=fp)
        assert row_vector == one_pass  # a (1, dim) vector, as search_vector takes it
        for k, where in ((1, None), (3, None), (50, None), (2, in_filter("chunk_id", chunk_ids))):
            want = dense._own(writer, Query(text, emb), k, where)
            got = dense._own(reader, Query(text, emb), k, where)
            assert list(got) == list(want) and len(got) == min(k, len(want))
            assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
