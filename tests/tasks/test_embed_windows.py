"""The embed stage's windows and heading prefixes, on real LanceDB files: every chunk covered by
windows the embedder sees whole, a chunk found by the second half of its text without nuggets,
the heading path searched but never shown, incremental rebuilds, and an index written by an
older coinrag migrated (and read until then)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from coinrag.inference.model.loading import tokenizer_fingerprint
from coinrag.inference.retrieval.embedders import FlagEmbedder, load_embedder
from coinrag.inference.retrieval.retriever import Retriever
from coinrag.schemas.keys import text_hash
from coinrag.schemas.tables import ChunkRow, EmbeddingRow, FileOrigin
from coinrag.storage.index.lance import FTS_TABLES, LanceIndex
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.chunk import chunk_document
from coinrag.tasks.embed import chunk_windows, embed_stage, search_text
from coinrag.tasks.ingest import SourceDocument
from coinrag.tasks.place import DocumentMaps

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The answer to QUESTION sits at the end of the target document, past the first 256 word pieces
# that MiniLM keeps of a text; a decoy is about harbours (cosines to the question, measured:
# the target's own vector 0.06, its second window 0.38, the decoy 0.26).
QUESTION = "Who built the Zorvath lighthouse?"
ANSWER = (
    "The Zorvath lighthouse was built in 1822 by the engineer Ilsa Moren, who kept its lamp "
    "burning every night for forty years."
)
DECOY = (
    "Harbours are sheltered bodies of water where ships can dock. Many ports have a breakwater "
    "and a lighthouse."
)
SECTION = ["Quillon almanac", "Night tables"]


@pytest.fixture(scope="module")
def minilm() -> FlagEmbedder:
    return load_embedder(None, device="cpu")


@pytest.fixture(scope="module")
def sample(sample_corpus: Path) -> dict[str, str]:
    lines = sample_corpus.read_text(encoding="utf-8").splitlines()
    return {r["id"]: r["text"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def docs(sample: dict[str, str]) -> list[SourceDocument]:
    """The sample articles, a long one (two articles, then :data:`ANSWER`) and the decoy."""
    filler = " ".join(sample[k] for k in ("speed-of-light", "photosynthesis"))
    texts = {**sample, "target": f"{filler} {ANSWER}", "decoy": DECOY}
    return [SourceDocument(k, v, {}, "test") for k, v in texts.items()]


def cut(tokenizer, docs: list[SourceDocument], section=None) -> list[ChunkRow]:
    """512-token chunks of the generation model's tokenizer; ``section`` on every chunk."""
    fp = tokenizer_fingerprint(tokenizer)
    return [
        replace(c, section=section)
        for d in docs
        for c in chunk_document(tokenizer, d.doc_id, d.version, d.text, tokenizer_fp=fp, run_id="t")
    ]


def test_windows_cover_every_chunk_and_a_second_half_is_found(
    tmp_path, smollm2_tokenizer, minilm, docs
):
    store = Store.at(tmp_path / "s").init()
    chunks = cut(smollm2_tokenizer, docs)
    counts = embed_stage(store, chunks, [], docs, minilm, "r1")
    index = LanceIndex.open(store)
    windows = index.columns("windows", ["chunk_id", "char_start", "char_end"]).to_pylist()
    assert counts.windows_written == len(windows) == index.count("windows") > len(chunks)
    by_chunk: dict[str, list[tuple[int, int]]] = {}
    for w in windows:
        by_chunk.setdefault(w["chunk_id"], []).append((w["char_start"], w["char_end"]))
    assert set(by_chunk) == {c.chunk_id for c in chunks}
    for c in chunks:  # every character of a token is in a window the embedder sees whole
        covered = np.zeros(len(c.text), bool)
        for a, b in by_chunk[c.chunk_id]:
            covered[a:b] = True
            ids = minilm.tokenizer(c.text[a:b], verbose=False)["input_ids"]
            assert len(ids) <= minilm.max_length
        assert all(covered[i] or ch.isspace() for i, ch in enumerate(c.text))
    (target,) = [c for c in chunks if c.doc_id == "target"]
    assert len(by_chunk[target.chunk_id]) >= 2
    first_window_end = min(by_chunk[target.chunk_id])[1]
    assert target.text.index(ANSWER) > first_window_end  # the answer is past the first window

    # The chunk's own vector (its first 256 word pieces) ranks the decoy first...
    q = minilm.embed_queries([QUESTION])[0]
    own = index.search_chunks(q, 2, embedder_fp=minilm.fingerprint)
    assert own[0]["doc_id"] == "decoy"
    # ...its windows find it, in dense and hybrid search, without nuggets.
    retriever = Retriever(store, minilm)
    for mode in ("dense", "hybrid"):
        hits = retriever.chunks_only(QUESTION, kc=2, mode=mode).chunks
        assert hits[0].doc_id == "target", mode
        assert hits[0].text == target.text  # evidence: the whole chunk


def test_heading_prefix_is_searched_never_shown(tmp_path, smollm2_tokenizer, minilm, docs):
    """A heading word found by full-text and dense search; the rows shown (evidence), and the
    chunk rows the KV is computed from, carry the text alone."""
    store = Store.at(tmp_path / "s").init()
    chunks = cut(smollm2_tokenizer, docs, section=None)
    chunks = [replace(c, section=SECTION) if c.doc_id == "moon" else c for c in chunks]
    before = [replace(c) for c in chunks]
    embed_stage(store, chunks, [], docs, minilm, "r1")
    assert chunks == before  # the stage never changes a chunk row (its tokens make the KV)
    index = LanceIndex.open(store)
    rows = index.columns("chunks", ["doc_id", "text", "search_text"]).to_pylist()
    moon = next(r for r in rows if r["doc_id"] == "moon")
    (chunk,) = [c for c in chunks if c.doc_id == "moon"]
    assert moon["text"] == chunk.text
    assert moon["search_text"] == "Quillon almanac > Night tables\n" + chunk.text
    assert all(r["search_text"] == r["text"] for r in rows if r["doc_id"] != "moon")
    # The vector embeds the heading too (the cache is keyed by the embedded string).
    cache = {r.text_hash for r in read_rows(store, EmbeddingRow)}
    assert text_hash(search_text(chunk.text, SECTION)) in cache
    assert text_hash(chunk.text) not in cache
    retriever = Retriever(store, minilm)
    for mode in ("lexical", "hybrid"):  # "Quillon almanac" is in no text, only in the heading
        hit = retriever.chunks_only("the Quillon almanac", kc=1, mode=mode).evidence[0]
        assert hit.doc_id == "moon" and hit.text == chunk.text and "Quillon" not in hit.text


def test_unchanged_rebuild_embeds_nothing_and_stale_windows_go(
    tmp_path, smollm2_tokenizer, minilm, docs
):
    store = Store.at(tmp_path / "s").init()
    chunks = cut(smollm2_tokenizer, docs)
    embed_stage(store, chunks, [], docs, minilm, "r1")
    again = embed_stage(store, chunks, [], docs, minilm, "r2")
    assert again.texts == again.embedded == again.windows_written == again.chunks_written == 0
    assert again.tables_migrated == [] and not again.indexes_built
    # An edited document: its old chunk's windows are deleted with it, the new ones written.
    edited = [replace(d, text=d.text + " Revised.") if d.doc_id == "target" else d for d in docs]
    new_chunks = cut(smollm2_tokenizer, edited)
    counts = embed_stage(store, new_chunks, [], edited, minilm, "r3")
    index = LanceIndex.open_latest(store)
    have = set(index.columns("windows", ["chunk_id"]).column(0).to_pylist())
    assert have == {c.chunk_id for c in new_chunks}
    assert counts.windows_deleted > 0 and counts.windows_written > 0
    # A deleted document leaves no window.
    assert index.delete_documents(["target"])["windows"] == counts.windows_written
    assert "target" not in set(index.columns("windows", ["doc_id"]).column(0).to_pylist())


def _as_older_coinrag(store: Store) -> None:
    """Rewrite the index as coinrag wrote it before windows, search text and places: no
    ``windows`` table, no ``search_text`` nor place columns, the full-text index on ``text``."""
    from lancedb.index import FTS

    from coinrag.storage.index.ann import FTS_CONFIG
    from coinrag.storage.index.tables import PLACE_COLUMNS

    index = LanceIndex.open_latest(store)
    index.db.drop_table("windows")
    for name in [n for n in FTS_TABLES if index.table(n) is not None]:
        data = index.table(name).to_arrow().drop_columns(["search_text", *PLACE_COLUMNS])
        tbl = index.db.create_table(name, data, mode="overwrite")
        tbl.create_index("text", config=FTS(**FTS_CONFIG), replace=True)


def test_an_older_index_is_read_then_migrated(tmp_path, smollm2_tokenizer, minilm, docs):
    store = Store.at(tmp_path / "s").init()
    chunks = cut(smollm2_tokenizer, docs)
    first = embed_stage(store, chunks, [], docs, minilm, "r1")
    _as_older_coinrag(store)
    writer = LanceIndex.open_latest(store)
    old = LanceIndex(store, writer.meta, writer.published_state()["versions"])
    assert old.table("windows") is None and old.fts_column("chunks") == "text"
    # A reader of the older version searches it as it is: words in ``text``, chunk vectors.
    retriever = Retriever(store, minilm, old)
    for mode in ("dense", "lexical", "hybrid"):
        assert retriever.chunks_only("Who built the Zorvath lighthouse?", 2, mode=mode).chunks
    assert retriever.chunks_only("Zorvath", 1, mode="lexical").chunks[0].doc_id == "target"
    # The next build migrates: the tables are written again from the embedding cache.
    counts = embed_stage(store, chunks, [], docs, minilm, "r2")
    assert counts.tables_migrated == ["chunks"] and counts.embedded == 0
    assert counts.cached == first.texts - len(docs)  # no document vector written again
    assert counts.windows_written == first.windows_written
    index = LanceIndex.open_latest(store)
    assert index.fts_column("chunks") == "search_text" and index.has_text_index("chunks")
    assert index.count("chunks") == len(chunks)
    again = embed_stage(store, chunks, [], docs, minilm, "r3")
    assert again.tables_migrated == [] and again.texts == again.chunks_written == 0


def test_a_window_under_a_heading_inside_its_chunk_is_embedded_after_that_heading(
    tmp_path, smollm2_tokenizer, minilm, sample
):
    """A chunk of a file with headings: each window is embedded after the heading path where
    its first visible character is (from the document's heading map), not the chunk's first
    path; a chunk whose document is not given keeps its own path on every window."""
    head, body = "Quillon almanac\n\n", sample["amazon-river"]
    inner = "\n\nNight tables\n\n"
    text = f"{head}{body}{inner}{ANSWER} {sample['photosynthesis']} {sample['penicillin']}"
    at = len(head) + len(body) + 2  # where the "Night tables" line starts
    origin = FileOrigin(
        path="almanac.md",
        format="markdown",
        heading_starts=[0, at],
        heading_levels=[1, 2],
        heading_titles=SECTION,
    )
    doc = SourceDocument("almanac", text, {}, "test", origin=origin)
    (chunk,) = cut(smollm2_tokenizer, [doc], section=SECTION[:1])
    maps = DocumentMaps.of(text, origin)
    store = Store.at(tmp_path / "s").init()
    embed_stage(store, [chunk], [], [doc], minilm, "r1")
    rows = LanceIndex.open(store).columns("windows", ["char_start", "char_end", "search_text"])
    rows = sorted(rows.to_pylist(), key=lambda r: r["char_start"])
    assert len(rows) >= 2
    prefixes = []
    for r in rows:
        piece = chunk.text[r["char_start"] : r["char_end"]]
        visible = chunk.char_start + r["char_start"] + len(piece) - len(piece.lstrip())
        path = " > ".join(maps.place(visible, visible + 1).section or [])
        assert r["search_text"] == f"{path}\n{piece}"
        prefixes.append(path)
    assert prefixes[0] == "Quillon almanac" and prefixes[-1] == "Quillon almanac > Night tables"
    # Without its document (no heading map): every window after the chunk's own path.
    alone = chunk_windows(minilm, [chunk])
    assert {w.window.text.split("\n", 1)[0] for w in alone} == {"Quillon almanac"}


def test_search_texts_composed_by_an_older_rule_are_written_again(
    tmp_path, smollm2_tokenizer, minilm, docs
):
    """A table whose search texts an older coinrag composed (its schema records another
    ``SEARCH_TEXT_VERSION``) is emptied and written again, from the embedding cache."""
    from coinrag.schemas.tables import SEARCH_TEXT_VERSION
    from coinrag.storage.index.tables import SEARCH_TEXT_KEY

    store = Store.at(tmp_path / "s").init()
    chunks = cut(smollm2_tokenizer, docs)
    embed_stage(store, chunks, [], docs, minilm, "r1")
    index = LanceIndex.open_latest(store)
    for name in ("chunks", "windows"):
        data = index.table(name).to_arrow()
        older = {**data.schema.metadata, SEARCH_TEXT_KEY.encode(): b"1"}
        index.db.create_table(name, data.replace_schema_metadata(older), mode="overwrite")
        assert index.db.open_table(name).schema.metadata[SEARCH_TEXT_KEY.encode()] == b"1"
    counts = embed_stage(store, chunks, [], docs, minilm, "r2")
    assert counts.tables_migrated == ["chunks", "windows"] and counts.embedded == 0
    index = LanceIndex.open_latest(store)
    assert index.count("chunks") == len(chunks)
    for name in ("chunks", "windows"):
        version = index.db.open_table(name).schema.metadata[SEARCH_TEXT_KEY.encode()]
        assert version == SEARCH_TEXT_VERSION.encode()
    again = embed_stage(store, chunks, [], docs, minilm, "r3")
    assert again.tables_migrated == [] and again.chunks_written == 0
