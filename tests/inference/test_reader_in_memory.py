"""A reader's in-memory copy of the index tables (``storage.index.ann.FlatTable``) and of their
text (``storage.index.bm25.Bm25Index``), held to LanceDB's own answers on real tables in a temp
dir: prefiltered searches, the float16 copy of a large table (ranked by a bfloat16 copy), text
searches from the BM25 copy (and from LanceDB where it cannot answer), lexical hits completed
from memory, and row lookups by id.

The writer's view (``LanceIndex.open_latest``) never uses a copy: its answers are LanceDB's, so
each test compares a reader pinned to the published versions with the writer."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from test_index_retrieval import HashEmbedder, cut

import coinrag.storage.index.ann as index_ann
import coinrag.storage.index.search as index_search
from coinrag.storage.index.bm25 import same_answers
from coinrag.storage.index.lance import ID_COLUMNS, LanceIndex
from coinrag.storage.index.tables import InFilter, in_filter
from coinrag.storage.store import Store
from coinrag.tasks.embed import embed_stage
from coinrag.tasks.ingest import SourceDocument

TEXTS = {
    "birds": "Penguins are flightless birds of the southern hemisphere. Emperor penguins "
    "breed in the Antarctic winter. The penguins of Antarctica eat krill and fish.",
    "rivers": "The Amazon river carries more water than any other river on Earth. The Nile is "
    "the longest river in Africa. Rivers carry sediment to the sea.",
    "volcanoes": "Mount Etna is an active stratovolcano on the east coast of Sicily. Its "
    "eruptions are frequent. Lava flows from Etna reach the villages below.",
    "stars": "A neutron star is the collapsed core of a massive supergiant star. Neutron stars "
    "spin fast. A pulsar is a neutron star that emits beams of radiation.",
}
QUERIES = ("penguins of Antarctica", "a river on Earth", "collapsed core", "lava of Etna")
# float16 rounds each component of a unit vector by at most 2**-11 of itself, so a cosine with
# a unit float32 query moves by at most 2**-11 (Cauchy-Schwarz): the stated tolerance.
HALF_TOLERANCE = 2.0**-11


@pytest.fixture()
def indexes(tmp_path, smollm2_tokenizer, monkeypatch):
    """(writer, reader, embedder) over the sample texts; readers of this process keep large
    tables in memory (a one-shot ``query`` run in-process by an earlier test turns it off)."""
    monkeypatch.setitem(index_ann._READERS, "large_in_memory", True)
    store = Store.at(tmp_path / "s").init()
    docs = [SourceDocument(k, v, {}, "test") for k, v in TEXTS.items()]
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    emb = HashEmbedder()
    embed_stage(store, chunks, nuggets, docs, emb, "r1")
    writer = LanceIndex.open_latest(store)
    reader = LanceIndex(store, writer.meta, writer.published_state()["versions"])
    return writer, reader, emb


def _ids(rows: list[dict], table: str) -> list[str]:
    return [r[ID_COLUMNS[table]] for r in rows]


def test_an_in_filter_is_its_sql_text():
    f = in_filter("chunk_id", ["a", "b'c", "a"])
    assert isinstance(f, InFilter) and isinstance(f, str)
    assert f == "chunk_id IN ('a', 'b''c')"
    assert (f.column, f.values) == ("chunk_id", ("a", "b'c"))


def test_prefiltered_searches_from_memory_equal_lancedb(indexes):
    writer, reader, emb = indexes
    chunk_ids = _ids(writer.rows_where("chunks", "doc_id IN ('birds', 'stars')", 50), "chunks")
    filters = {
        "nuggets": in_filter("chunk_id", chunk_ids[:3]),
        "chunks": in_filter("doc_id", ["rivers", "volcanoes"]),
    }
    for text in QUERIES:
        q = emb.embed_queries([text])[0]
        for table, where in filters.items():
            want = writer.search_vector(table, q, 4, embedder_fp=emb.fingerprint, where=where)
            got = reader.search_vector(table, q, 4, embedder_fp=emb.fingerprint, where=where)
            assert reader._flat(table) is not None and writer._flat(table) is None
            assert _ids(got, table) == _ids(want, table) and got
            assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], abs=1e-5)
            assert set(got[0]) == set(want[0])
    nowhere = in_filter("chunk_id", ["no-such-chunk"])
    q = emb.embed_queries([QUERIES[0]])[0]
    assert reader.search_vector("nuggets", q, 4, embedder_fp=emb.fingerprint, where=nowhere) == []


def test_a_large_table_is_held_in_float16_within_the_stated_tolerance(indexes, monkeypatch):
    """Above the ANN threshold the copy holds float16 vectors: each returned score is the
    row's float32 cosine within 2**-11, and the rows are the exact top k up to such ties."""
    writer, reader, emb = indexes
    monkeypatch.setattr(index_search, "VECTOR_INDEX_MIN_ROWS", 1)  # every table counts as large
    k = 2
    n = writer.count("nuggets")
    assert n > 4 * k  # the float16 candidate path, not a scan of every row in float32
    for text in QUERIES:
        q = emb.embed_queries([text])[0]
        exact = writer.search_vector("nuggets", q, n, embedder_fp=emb.fingerprint)
        exact_score = {r["nugget_id"]: r["score"] for r in exact}
        got = reader.search_vector("nuggets", q, k, embedder_fp=emb.fingerprint)
        assert reader._flat("nuggets").half
        assert len(got) == k
        for row in got:
            assert row["score"] == pytest.approx(exact_score[row["nugget_id"]], abs=HALF_TOLERANCE)
            assert exact_score[row["nugget_id"]] >= exact[k - 1]["score"] - 2 * HALF_TOLERANCE


@pytest.mark.parametrize(
    ("dtype", "nbytes"), [("bfloat16", 20_000 * 384 * 4), ("float16", 20_000 * 384 * 2)]
)
def test_a_half_table_ranks_in_half_precision_and_returns_the_exact_top_k(
    dtype: str, nbytes: int
) -> None:
    """A float16 table ranks every row by a half-precision product (bfloat16: a copy; float16:
    the vectors themselves) and rescores the best 4k in float32 from the float16 vectors: on
    20,000 random unit vectors of dimension 384 (scores close together, the hard case for a
    rough ranking) the top 10 of 50 queries are the float32 top 10 up to ties within twice the
    stated tolerance, each score within it."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((20_000, 384)).astype(np.float32)
    rows = pa.table({"row_id": np.arange(len(vectors))})
    flat = index_ann.FlatTable(rows, vectors, half=True, ranking_dtype=dtype)
    assert flat.half and flat.ranking_dtype == dtype
    assert flat.nbytes == nbytes
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    k = 10
    for q in rng.standard_normal((50, 384)).astype(np.float32):
        exact = unit @ (q / np.linalg.norm(q))
        got = flat.search(q, k, ["row_id"])
        kth = np.sort(exact)[-k]
        for row in got:
            assert row["score"] == pytest.approx(exact[row["row_id"]], abs=HALF_TOLERANCE)
            assert exact[row["row_id"]] >= kth - 2 * HALF_TOLERANCE


def test_the_ranking_dtype_is_the_faster_one_or_the_one_asked_for(monkeypatch) -> None:
    """Without a choice a half table ranks in the dtype whose product measured faster (both
    timed on this CPU; the choice follows the timings whichever way they go);
    ``COINRAG_RANKING_DTYPE`` picks it; an unknown name is an error naming both."""
    seconds = index_ann.ranking_product_seconds(rows=4096, dim=64, repeats=3)
    assert set(seconds) == set(index_ann.RANKING_DTYPES) and all(t > 0 for t in seconds.values())
    vectors = np.random.default_rng(1).standard_normal((300, 64)).astype(np.float32)
    rows = pa.table({"row_id": np.arange(300)})
    assert index_ann.FlatTable(rows, vectors).ranking_dtype is None  # float32 scores
    for fast, slow in (("float16", "bfloat16"), ("bfloat16", "float16")):
        timed = {fast: 0.001, slow: 0.003}
        monkeypatch.setattr(index_ann, "ranking_product_seconds", lambda t=timed: t)
        index_ann._measured_ranking_dtype.cache_clear()
        assert index_ann.fastest_ranking_dtype() == fast
        assert index_ann.FlatTable(rows, vectors, half=True).ranking_dtype == fast
    index_ann._measured_ranking_dtype.cache_clear()  # the next caller measures again
    for name in index_ann.RANKING_DTYPES:
        monkeypatch.setenv("COINRAG_RANKING_DTYPE", name)
        assert index_ann.fastest_ranking_dtype() == name
    monkeypatch.setenv("COINRAG_RANKING_DTYPE", "float8")
    with pytest.raises(ValueError, match="float16"):
        index_ann.fastest_ranking_dtype()
    with pytest.raises(ValueError, match="bfloat16"):
        index_ann.FlatTable(rows, vectors, half=True, ranking_dtype="int8")


def test_a_table_over_the_memory_budget_is_searched_by_lancedb(indexes):
    writer, reader, emb = indexes
    reader.flat_max_bytes = 0
    q = emb.embed_queries([QUERIES[1]])[0]
    got = reader.search_vector("chunks", q, 3, embedder_fp=emb.fingerprint)
    assert reader._flat("chunks") is None
    want = writer.search_vector("chunks", q, 3, embedder_fp=emb.fingerprint)
    assert _ids(got, "chunks") == _ids(want, "chunks")
    assert reader.search_text("chunks", "river", 3) == writer.search_text("chunks", "river", 3)


def test_lexical_hits_completed_from_memory_equal_lancedb(indexes):
    """Without its BM25 copy (as when it cannot answer), a reader asks LanceDB for ids and BM25
    scores only and takes the hit columns from its copy: the same rows, columns and scores as
    LanceDB's full answer."""
    writer, reader, _ = indexes
    reader._text_tables.update(chunks=None, nuggets=None)  # no BM25 copies
    where = in_filter("doc_id", ["birds", "rivers"])
    for table in ("chunks", "nuggets"):
        for text in ("penguins river", "neutron star pulsar", "Etna lava"):
            want = writer.search_text(table, text, 5)
            got = reader.search_text(table, text, 5)
            assert reader._flat(table) is not None
            assert got == want and got
            assert reader.search_text(table, text, 5, where=where) == writer.search_text(
                table, text, 5, where=where
            )


def test_rows_by_id_from_memory_equal_lancedb(indexes):
    writer, reader, _ = indexes
    ids = _ids(writer.rows_where("chunks", "doc_id = 'volcanoes'", 50), "chunks")
    where = in_filter("chunk_id", ids)
    want = {r["chunk_id"]: r for r in writer.rows_where("chunks", where, 50, extra=("vector",))}
    got = {r["chunk_id"]: r for r in reader.rows_where("chunks", where, 50, extra=("vector",))}
    assert got.keys() == want.keys() and got
    for cid, row in got.items():
        assert {k: v for k, v in row.items() if k != "vector"} == {
            k: v for k, v in want[cid].items() if k != "vector"
        }
        assert np.allclose(row["vector"], want[cid]["vector"], atol=1e-6)
    plain = reader.rows_where("chunks", where, 50)
    assert all("vector" not in r for r in plain) and len(plain) == len(ids)


def test_a_one_shot_reader_searches_large_tables_by_their_index(indexes, monkeypatch):
    """``coinrag query`` (not serving) keeps only the tables under the ANN threshold in memory:
    a large one is searched by LanceDB, with the writer's answers; words are searched by
    LanceDB."""
    from coinrag.storage.index.ann import keep_large_tables_in_memory, large_tables_in_memory

    writer, reader, emb = indexes
    monkeypatch.setattr(index_search, "VECTOR_INDEX_MIN_ROWS", writer.count("chunks"))
    assert large_tables_in_memory()
    keep_large_tables_in_memory(False)
    try:
        q = emb.embed_queries([QUERIES[2]])[0]
        got = reader.search_vector("nuggets", q, 3, embedder_fp=emb.fingerprint)
        assert reader._flat("nuggets") is None and reader._flat("chunks") is not None
        want = writer.search_vector("nuggets", q, 3, embedder_fp=emb.fingerprint)
        assert _ids(got, "nuggets") == _ids(want, "nuggets")
        # nor does it make BM25 copies (they cost more than the searches they would save)
        words = reader.search_text("chunks", QUERIES[2], 3)
        assert reader._lexical("chunks") is None
        assert _ids(words, "chunks") == _ids(writer.search_text("chunks", QUERIES[2], 3), "chunks")
    finally:
        keep_large_tables_in_memory(True)


def test_an_empty_table_in_memory_finds_nothing():
    import pyarrow as pa

    from coinrag.storage.index.ann import FlatTable

    flat = FlatTable(pa.table({"chunk_id": pa.array([], pa.string())}), np.zeros((0, 4)))
    where = in_filter("chunk_id", ["a"])
    assert flat.positions(where).size == 0
    assert flat.search(np.ones(4, np.float32), 3, ["chunk_id"], where) == []
    assert flat.search(np.ones(4, np.float32), 3, ["chunk_id"]) == []
    assert flat.rows_by_id("chunk_id", ["a"], ["chunk_id"]) is None


def _same_text_hits(got: list[dict], want: list[dict], table: str) -> bool:
    """LanceDB's answer within float32 rounding (``same_answers``), each row's columns equal."""
    key = ID_COLUMNS[table]
    pairs = [[(r[key], r["score"]) for r in rows] for rows in (want, got)]
    by_id = {r[key]: r for r in want}
    return same_answers(*pairs) and all(
        {c: v for c, v in r.items() if c != "score"}
        == {c: v for c, v in by_id[r[key]].items() if c != "score"}
        for r in got
        if r[key] in by_id
    )


def test_a_reader_searches_words_in_its_bm25_copy_as_lancedb_does(indexes, monkeypatch):
    """A reader answers text searches from its in-memory BM25 copy, unfiltered and under an
    ``IN`` prefilter, without asking LanceDB: LanceDB's rows and scores (float32 rounding)."""
    writer, reader, _ = indexes
    where = {
        "chunks": in_filter("doc_id", ["birds", "rivers"]),
        "nuggets": in_filter(
            "chunk_id", _ids(writer.rows_where("chunks", "doc_id = 'stars'", 50), "chunks")
        ),
    }
    cases = ("penguins river", "neutron stars pulsar", "Etna lava Etna", "the of and", "rivers")
    wanted = {
        (table, text, k, f): writer.search_text(table, text, k, where=where[table] if f else None)
        for table in ("chunks", "nuggets")
        for text in cases
        for k in (1, 3, 10)
        for f in (False, True)
    }
    for table in ("chunks", "nuggets"):
        assert reader._lexical(table) is not None and writer._lexical(table) is None

    def no_lancedb(*args, **kwargs):
        raise AssertionError("the reader asked LanceDB")

    monkeypatch.setattr(index_search.IndexSearch, "_fts_query", staticmethod(no_lancedb))
    for (table, text, k, f), want in wanted.items():
        got = reader.search_text(table, text, k, where=where[table] if f else None)
        assert _same_text_hits(got, want, table), (table, text, k, f)
        assert got or text == "the of and" or f  # only stop words find nothing


def test_hybrid_search_runs_the_copys_words_on_its_own_thread(indexes, monkeypatch):
    """Hybrid search asks a second thread for the lexical half only where LanceDB answers it
    (the writer); a reader with BM25 copies searches words on its own thread; both rank the
    same rows."""
    from coinrag.inference.retrieval import retriever as retrieve

    writer, reader, emb = indexes
    assert reader.searches_text_in_memory("chunks") and not writer.searches_text_in_memory("chunks")
    submitted = []
    pool = retrieve._lexical_pool()

    class Counting:
        def submit(self, *args, **kwargs):
            submitted.append(args[0])
            return pool.submit(*args, **kwargs)

    monkeypatch.setattr(retrieve, "_lexical_pool", lambda: Counting())
    by = {}
    for name, index in (("reader", reader), ("writer", writer)):
        found = retrieve.Retriever(index.store, emb, index, mode="hybrid").two_stage(
            QUERIES[0], 2, 3
        )
        by[name] = [(e.chunk_id, e.tok_start, e.tok_end) for e in found.evidence]
        assert bool(submitted) == (name == "writer")
    assert by["reader"] == by["writer"] and by["reader"]


def test_text_the_copy_cannot_answer_goes_to_lancedb(indexes):
    """A query with a character this Python's Unicode database lacks, and a prefilter that is
    not an ``IN`` list, are answered by LanceDB (the writer's answers)."""
    writer, reader, _ = indexes
    odd = "penguins " + chr(0x1FAE9)
    assert reader.search_text("nuggets", odd, 3) == writer.search_text("nuggets", odd, 3)
    sql = "doc_id = 'birds'"
    assert reader.search_text("chunks", "penguins", 3, where=sql) == writer.search_text(
        "chunks", "penguins", 3, where=sql
    )
    assert reader._lexical("nuggets") is not None


def test_unindexed_rows_leave_text_search_to_lancedb(indexes):
    """Rows added after the full-text index was built are scored by lance with other
    statistics: a reader pinned to such a version keeps no BM25 copy and asks LanceDB."""
    writer, _, _ = indexes
    tbl = writer.table("chunks")
    row = tbl.search().limit(1).to_arrow()
    extra = row.set_column(
        row.schema.get_field_index("chunk_id"), "chunk_id", pa.array(["extra-chunk"])
    )
    tbl.add(extra)
    versions = {**writer.published_state()["versions"], "chunks": tbl.version}
    reader = LanceIndex(writer.store, writer.meta, versions)
    assert reader._flat("chunks") is not None and reader._lexical("chunks") is None
    for text in ("penguins river", "neutron star"):
        assert reader.search_text("chunks", text, 5) == writer.search_text("chunks", text, 5)


def test_an_index_still_counting_deleted_rows_leaves_text_search_to_lancedb(indexes):
    """Deleted rows stay in lance's BM25 statistics until the index is rebuilt (compaction):
    the copy's probe sees other scores, so the reader asks LanceDB."""
    writer, _, _ = indexes
    tbl = writer.table("nuggets")
    tbl.delete("doc_id = 'birds'")
    versions = {**writer.published_state()["versions"], "nuggets": tbl.version}
    reader = LanceIndex(writer.store, writer.meta, versions)
    assert reader._flat("nuggets") is not None and reader._lexical("nuggets") is None
    for text in ("neutron star", "river Nile"):
        assert reader.search_text("nuggets", text, 5) == writer.search_text("nuggets", text, 5)


def test_another_full_text_configuration_leaves_text_search_to_lancedb(indexes, monkeypatch):
    writer, reader, _ = indexes
    other = {**index_search.FTS_CONFIG, "stem": False}
    monkeypatch.setattr(index_search, "FTS_CONFIG", other)
    assert reader._flat("chunks") is not None and reader._lexical("chunks") is None
    assert reader.search_text("chunks", "rivers", 3) == writer.search_text("chunks", "rivers", 3)
