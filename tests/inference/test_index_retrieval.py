"""Embedders, the embed+index stage, the LanceDB index and the retriever, on real files.

The real MiniLM embedder (module fixture) embeds the sample Wikipedia corpus cut into small
chunks by the SmolLM2 tokenizer; nuggets are hand-made token windows of those chunks.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from coinrag.inference.model.loading import tokenizer_fingerprint  # noqa: E402
from coinrag.inference.retrieval.embedders import FlagEmbedder, load_embedder  # noqa: E402
from coinrag.inference.retrieval.retriever import NUGGET_FANOUT, Retriever, order_nuggets  # noqa: E402
from coinrag.inference.retrieval.windows import text_windows  # noqa: E402
from coinrag.schemas.keys import CODE_VERSION, fingerprint, nugget_id, text_hash  # noqa: E402
from coinrag.schemas.tables import ChunkRow, EmbeddingRow, NuggetRow  # noqa: E402
from coinrag.storage.index.lance import EmbedderMismatch, LanceIndex  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402
from coinrag.storage.tables import read_rows  # noqa: E402
from coinrag.tasks.chunk import chunk_document, token_spans_pairs  # noqa: E402
from coinrag.tasks.embed import embed_stage  # noqa: E402
from coinrag.tasks.ingest import SourceDocument  # noqa: E402

QUESTIONS = [
    "Who directed 2001: A Space Odyssey?",
    "Which supercomputer travels to Jupiter?",
    "When was the film released?",
    "What is the capital city?",
]


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread for this module: on a shared 2-core machine, two OpenMP threads wait on
    each other (a MiniLM query took ~1 s with 2 threads and ~20 ms with 1 under load 4.5)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def minilm() -> FlagEmbedder:
    return load_embedder(None, device="cpu")


@pytest.fixture(scope="module")
def corpus(sample_corpus: Path) -> list[SourceDocument]:
    docs = []
    for line in sample_corpus.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        meta = {k: v for k, v in rec.items() if k not in ("id", "text")}
        docs.append(SourceDocument(rec["id"], rec["text"], meta, str(sample_corpus)))
    return docs


def make_nuggets(chunk: ChunkRow, width: int = 9, step: int = 11) -> list[NuggetRow]:
    """Hand-made nuggets: token windows ``[s, s+width)`` every ``step`` tokens."""
    spans = token_spans_pairs(chunk.token_spans)
    out = []
    for i, s in enumerate(range(0, chunk.n_tokens - 2, step)):
        e = min(s + width, chunk.n_tokens)
        cs, ce = spans[s][0], spans[e - 1][1]
        out.append(
            NuggetRow(
                nugget_id=nugget_id(chunk.chunk_id, s, e),
                chunk_id=chunk.chunk_id,
                doc_id=chunk.doc_id,
                doc_version=chunk.doc_version,
                content_key=chunk.content_key,
                ordinal=i,
                text=chunk.text[cs:ce],
                candidate=chunk.text[cs:ce].strip(),
                match_kind="exact",
                similarity=1.0,
                char_start=cs,
                char_end=ce,
                tok_start=s,
                tok_end=e,
                occurrences=1,
                extractor_fp="extractor-test",
                tau=0.7,
                run_id="test",
                code_version=CODE_VERSION,
            )
        )
    return out


def cut(tokenizer, docs: list[SourceDocument]) -> tuple[list[ChunkRow], list[NuggetRow]]:
    tok_fp = tokenizer_fingerprint(tokenizer)
    chunks = []
    for d in docs:
        chunks += chunk_document(
            tokenizer, d.doc_id, d.version, d.text, tokenizer_fp=tok_fp, chunk_size=48, run_id="t"
        )
    nuggets = [n for c in chunks for n in make_nuggets(c)]
    return chunks, nuggets


@pytest.fixture(scope="module")
def rows(smollm2_tokenizer, corpus):
    return cut(smollm2_tokenizer, corpus)


@pytest.fixture(scope="module")
def built(tmp_path_factory, minilm, corpus, rows):
    """A store built once with the real embedder: (store, first counts)."""
    store = Store.at(tmp_path_factory.mktemp("store")).init()
    chunks, nuggets = rows
    counts = embed_stage(store, chunks, nuggets, corpus, minilm, "run-1")
    return store, counts


def words(text: str) -> tuple[list[tuple[int, int]], list[int]]:
    """A whitespace tokenizer for windows: each word one token
    (``inference.retrieval.windows.Tokenize``)."""
    import re

    offsets = [m.span() for m in re.finditer(r"\S+", text)]
    return offsets, list(range(len(offsets)))


class HashEmbedder:
    """A cheap deterministic stand-in embedder (vectors from text hashes, windows of words):
    another identity."""

    def __init__(self, dim: int = 16, salt: str = "a") -> None:
        self.name = f"hash-{salt}"
        self.dim = dim
        self.max_length = 64
        self.fingerprint = fingerprint("embedder", {"name": self.name, "dim": dim})
        self.calls = 0

    def _vec(self, text: str) -> np.ndarray:
        seed = int(text_hash(self.name + text)[3:19], 16)
        v = np.random.default_rng(seed).standard_normal(self.dim).astype(np.float32)
        return v / np.linalg.norm(v)

    def embed_documents(self, texts, progress=None):
        self.calls += len(texts)
        out = np.stack([self._vec(t) for t in texts]) if texts else np.zeros((0, self.dim))
        if progress:
            progress(len(texts), len(texts))
        return out.astype(np.float32)

    def embed_queries(self, texts):
        return self.embed_documents(texts)

    def windows(self, text, prefix="", sections=()):
        return text_windows(text, prefix, words, self.max_length - 2, sections=sections)


def ids_of(index: LanceIndex, table: str, column: str) -> list[str]:
    return index.columns(table, [column]).column(column).to_pylist()


# ---------------------------------------------------------------------------- embedders


def test_minilm_matches_sentence_transformers(minilm, corpus):
    from sentence_transformers import SentenceTransformer

    long_text = " ".join(d.text for d in corpus)  # > 256 word pieces: truncation must agree
    texts = [d.text for d in corpus] + [
        "a",
        "Grace O’Malley (Irish: Gráinne Ní Mháille)",
        long_text,
    ]
    ours = minilm.embed_documents(texts)
    st = SentenceTransformer(str(minilm.model_dir), device="cpu")
    ref = st.encode(texts, batch_size=4, normalize_embeddings=True, convert_to_numpy=True)
    assert ours.shape == (len(texts), 384) and ours.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cos = (ours * ref).sum(axis=1)
    assert cos.min() > 0.9999, cos
    assert minilm.max_length == st.max_seq_length == 256
    # Batching (padding and length sorting) does not change a vector.
    alone = minilm.embed_documents([texts[0]])
    assert float((alone[0] * ours[0]).sum()) > 0.99999


def test_minilm_identity(minilm):
    assert minilm.dim == 384 and minilm.pooling == "mean"
    assert minilm.fingerprint.startswith("embedder-")
    shorter = load_embedder(None, device="cpu", max_length=128)
    assert shorter.fingerprint != minilm.fingerprint  # truncation is part of the identity
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_embedder("BAAI/bge-m3")


def _save_tiny(tmp: Path, minilm: FlagEmbedder, model_type: str) -> Path:
    """A random-weight encoder of ``model_type`` with the MiniLM (BERT) tokenizer, saved."""
    import torch
    from transformers import AutoConfig, AutoModel

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(minilm.tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=130,
        pad_token_id=minilm.tokenizer.pad_token_id,
    )
    model = AutoModel.from_config(config)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    minilm.tokenizer.save_pretrained(tmp)
    return tmp


def test_bge_m3_loading_on_tiny_xlm_roberta(tmp_path, minilm):
    """BGE-M3 weights are not installable: the loading path runs on a tiny random XLM-R."""
    import torch
    from FlagEmbedding import BGEM3FlagModel
    from transformers import AutoModel

    path = _save_tiny(tmp_path / "tiny-xlmr", minilm, "xlm-roberta")
    emb = load_embedder(path, device="cpu")
    assert emb.kind == "bge-m3" and emb.pooling == "cls" and emb.dim == 32
    assert emb.max_length == 128  # max_position_embeddings - 2 (XLM-R positions)
    texts = ["first text", "a second, longer text about something else entirely", "x"]
    ours = emb.embed_documents(texts)
    # Reference 1: CLS hidden state, normalised, computed by hand.
    model = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        for i, t in enumerate(texts):
            enc = emb.tokenizer(t, return_tensors="pt")
            cls = model(**enc).last_hidden_state[0, 0]
            ref = torch.nn.functional.normalize(cls, dim=-1).numpy()
            assert float(ref @ ours[i]) > 0.9999
    # Reference 2: FlagEmbedding's public API.
    flag = BGEM3FlagModel(str(path), use_fp16=False, devices=["cpu"])
    dense = flag.encode(texts, batch_size=2, max_length=128)["dense_vecs"]
    assert (dense * ours).sum(axis=1).min() > 0.9999
    # Identity: a BGE-M3 folder named so, with a BERT config, also loads as BGE-M3.
    renamed = tmp_path / "my-bge-m3-copy"
    shutil.copytree(_save_tiny(tmp_path / "b", minilm, "bert"), renamed)
    assert load_embedder(renamed, device="cpu").kind == "bge-m3"


def test_generic_folder_is_mean_pooled(tmp_path, minilm):
    import torch
    from transformers import AutoModel

    path = _save_tiny(tmp_path / "tiny-bert", minilm, "bert")
    emb = load_embedder(path, device="cpu")
    assert emb.pooling == "mean" and emb.kind == "mean"
    texts = ["one two three", "four"]
    ours = emb.embed_documents(texts)
    model = AutoModel.from_pretrained(path).eval()
    enc = emb.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()
    assert (ref * ours).sum(axis=1).min() > 0.9999


# ---------------------------------------------------------------------------- stage + index


def test_stage_writes_all_tables(built, corpus, rows):
    store, counts = built
    chunks, nuggets = rows
    index = LanceIndex.open(store)
    assert index.count("chunks") == len(chunks)
    assert index.count("nuggets") == len(nuggets)
    assert index.count("documents") == len(corpus)
    assert counts.embedded == counts.texts > 0 and counts.cached == 0
    assert counts.chunks_written == len(chunks) and counts.nuggets_written == len(nuggets)
    # The embedding cache holds exactly one vector per distinct embedded text.
    cache = read_rows(store, EmbeddingRow)
    assert len(cache) == counts.embedded == len({r.text_hash for r in cache})
    # Scalar indexes on the id columns.
    tbl = index.table("nuggets")
    assert {"nugget_id", "chunk_id", "doc_id"} <= {c for i in tbl.list_indices() for c in i.columns}


def test_rebuild_is_idempotent_and_cached(built, corpus, rows, minilm):
    store, first = built
    chunks, nuggets = rows
    again = embed_stage(store, chunks, nuggets, corpus, minilm, "run-2")
    assert again.embedded == 0 and again.texts == 0  # nothing to write, nothing to embed
    assert again.chunks_unchanged == len(chunks) and again.nuggets_unchanged == len(nuggets)
    assert again.documents_unchanged == len(corpus)
    index = LanceIndex.open(store)
    for table, column, n in (
        ("chunks", "chunk_id", len(chunks)),
        ("nuggets", "nugget_id", len(nuggets)),
        ("documents", "doc_id", len(corpus)),
    ):
        ids = ids_of(index, table, column)
        assert len(ids) == len(set(ids)) == n
    # Upserting the same rows again through merge_insert does not duplicate them either.
    data = index.columns("chunks", [f.name for f in index.table("chunks").schema])
    assert index.upsert("chunks", data) == len(chunks)
    assert index.count("chunks") == len(chunks)


def test_cache_survives_a_lost_index(tmp_path, minilm, corpus, rows):
    chunks, nuggets = rows
    store = Store.at(tmp_path / "s").init()
    docs, sub_chunks = corpus[:3], [c for c in chunks if c.doc_id in {d.doc_id for d in corpus[:3]}]
    sub_nuggets = [n for n in nuggets if n.chunk_id in {c.chunk_id for c in sub_chunks}]
    first = embed_stage(store, sub_chunks, sub_nuggets, docs, minilm, "r1")
    shutil.rmtree(store.index_dir)
    second = embed_stage(store, sub_chunks, sub_nuggets, docs, minilm, "r2")
    assert second.embedded == 0 and second.cached == second.texts == first.texts
    assert second.chunks_written == len(sub_chunks)
    # The same text in another row (a duplicated nugget text) is embedded once.
    assert first.texts <= len(sub_chunks) + len(sub_nuggets) + len(docs)


def test_edit_reembeds_only_changed_text(tmp_path, smollm2_tokenizer, corpus):
    emb = HashEmbedder()
    store = Store.at(tmp_path / "s").init()
    docs = corpus[:4]
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    embed_stage(store, chunks, nuggets, docs, emb, "r1")
    # Edit the end of one document: its first chunks keep their text (cached vectors).
    edited = replace(docs[0], text=docs[0].text + " An added closing sentence.")
    new_docs = [edited, *docs[1:]]
    chunks2, nuggets2 = cut(smollm2_tokenizer, new_docs)
    emb.calls = 0
    counts = embed_stage(store, chunks2, nuggets2, new_docs, emb, "r2")
    old_texts = {c.text for c in chunks} | {n.text.strip() for n in nuggets}
    new_texts = {c.text for c in chunks2 if c.doc_id == edited.doc_id}
    new_texts |= {n.text.strip() for n in nuggets2 if n.doc_id == edited.doc_id}
    expected = len(new_texts - old_texts) + 1  # + the document vector of the new version
    assert counts.embedded == emb.calls == expected
    assert counts.cached > 0
    index = LanceIndex.open(store)
    # The old version's rows are gone, the new version's are there, nothing else moved.
    assert sorted(ids_of(index, "chunks", "chunk_id")) == sorted(c.chunk_id for c in chunks2)
    assert sorted(ids_of(index, "nuggets", "nugget_id")) == sorted(n.nugget_id for n in nuggets2)
    versions = index.columns("documents", ["doc_id", "doc_version"]).to_pydict()
    assert (
        dict(zip(versions["doc_id"], versions["doc_version"], strict=True))[edited.doc_id]
        == edited.version
    )


def test_delete_documents(tmp_path, smollm2_tokenizer, corpus):
    emb = HashEmbedder()
    store = Store.at(tmp_path / "s").init()
    docs = corpus[:4]
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    embed_stage(store, chunks, nuggets, docs, emb, "r1")
    index = LanceIndex.open(store)
    gone = docs[1].doc_id
    deleted = index.delete_documents([gone])
    assert deleted["chunks"] == sum(c.doc_id == gone for c in chunks) > 0
    assert deleted["nuggets"] == sum(n.doc_id == gone for n in nuggets) > 0
    assert deleted["documents"] == 1
    for table in ("chunks", "nuggets", "documents"):
        assert gone not in ids_of(index, table, "doc_id")
        assert index.table(table).count_rows(f"doc_id = '{gone}'") == 0
    assert index.count("chunks") == sum(c.doc_id != gone for c in chunks)
    # A search never returns the deleted document.
    q = emb.embed_queries([docs[1].text])[0]
    hits = index.search_chunks(q, 50, embedder_fp=emb.fingerprint)
    assert hits and all(h["doc_id"] != gone for h in hits)
    # Document ids are user data: quotes in them are escaped, never interpreted.
    odd = "it's \"odd\" ' OR '1'='1"
    row = {"doc_id": [odd], "doc_version": ["v"], "title": ["t"]}
    row |= {"embedder_fp": [emb.fingerprint], "run_id": ["r"]}
    index.upsert("documents", index.build_table("documents", row, emb.embed_documents(["t"])))
    before = index.count("documents")
    assert index.delete_documents([odd])["documents"] == 1
    assert index.count("documents") == before - 1


def test_embedder_mismatch(built, minilm):
    store, _ = built
    other = HashEmbedder(dim=384, salt="other")
    with pytest.raises(EmbedderMismatch) as err:
        Retriever(store, other)
    assert minilm.fingerprint in str(err.value) and other.fingerprint in str(err.value)
    index = LanceIndex.open(store)
    q = other.embed_queries(["anything"])[0]
    with pytest.raises(EmbedderMismatch, match=other.fingerprint):
        index.search_nuggets(q, 5, embedder_fp=other.fingerprint)
    with pytest.raises(EmbedderMismatch):
        index.search_nuggets(q, 5, ["some-chunk"], embedder_fp=other.fingerprint)
    with pytest.raises(EmbedderMismatch):
        LanceIndex.open_for_write(store, other.fingerprint, 384, reset_on_mismatch=False)


def test_new_embedder_resets_index(tmp_path, smollm2_tokenizer, corpus):
    store = Store.at(tmp_path / "s").init()
    docs = corpus[:2]
    chunks, nuggets = cut(smollm2_tokenizer, docs)
    a, b = HashEmbedder(16, "a"), HashEmbedder(24, "b")
    embed_stage(store, chunks, nuggets, docs, a, "r1")
    counts = embed_stage(store, chunks, nuggets, docs, b, "r2")
    assert counts.index_reset and counts.cached == 0 and counts.nuggets_written == len(nuggets)
    index = LanceIndex.open(store)
    assert index.embedder_fp == b.fingerprint and index.dim == 24
    assert index.count("nuggets") == len(nuggets)
    assert set(index.columns("nuggets", ["embedder_fp"]).column(0).to_pylist()) == {b.fingerprint}


# ---------------------------------------------------------------------------- retrieval


def test_two_stage_stays_inside_chosen_chunks(built, minilm, rows):
    store, _ = built
    _, nuggets = rows
    per_chunk: dict[str, int] = {}
    for n in nuggets:
        per_chunk[n.chunk_id] = per_chunk.get(n.chunk_id, 0) + 1
    retriever = Retriever(store, minilm)
    for question in QUESTIONS:
        for kc, k in ((1, 3), (2, 10), (5, 10), (3, 100)):
            result = retriever.two_stage(question, kc=kc, k=k)
            chosen = {h.chunk_id for h in result.chunks}
            assert len(result.chunks) == kc
            assert {e.chunk_id for e in result.evidence} <= chosen
            # The prefilter still fills k from inside those chunks.
            assert len(result.evidence) == min(k, sum(per_chunk.get(c, 0) for c in chosen))
            assert result.embed_ms > 0 and result.search_ms > 0


def test_two_stage_finds_the_right_passage(built, minilm):
    store, _ = built
    result = Retriever(store, minilm).two_stage("Who directed 2001: A Space Odyssey?", 3, 5)
    assert result.chunks[0].doc_id == "2001:-a-space-odyssey"
    assert any("Kubrick" in e.text for e in result.evidence)
    docs = Retriever(store, minilm).documents("a science fiction film by Stanley Kubrick", 1)
    assert docs[0]["doc_id"] == "2001:-a-space-odyssey"


def _assert_grouped_in_document_order(evidence, group_rank):
    seen: list[str] = []
    for e in evidence:
        if not seen or seen[-1] != e.chunk_id:
            assert e.chunk_id not in seen, "a chunk's nuggets must be contiguous"
            seen.append(e.chunk_id)
    assert [group_rank[c] for c in seen] == sorted(group_rank[c] for c in seen)
    for c in seen:
        spans = [(e.tok_start, e.tok_end) for e in evidence if e.chunk_id == c]
        assert spans == sorted(spans)


@pytest.mark.parametrize("mode", ["dense", "hybrid"])
def test_ordering_rules(built, minilm, mode):
    store, _ = built
    retriever = Retriever(store, minilm, mode=mode)
    for question in QUESTIONS:
        two = retriever.two_stage(question, kc=4, k=10)
        rank = {h.chunk_id: h.rank for h in two.chunks}
        assert [h.score for h in two.chunks] == sorted((h.score for h in two.chunks), reverse=True)
        _assert_grouped_in_document_order(two.evidence, rank)

        one = retriever.one_stage(question, k=10)
        assert len(one.evidence) == 10 and not one.chunks
        best: dict[str, float] = {}
        for e in one.evidence:
            best[e.chunk_id] = max(best.get(e.chunk_id, -9.0), e.score)
        order = sorted(best, key=lambda c: -best[c])
        _assert_grouped_in_document_order(one.evidence, {c: i for i, c in enumerate(order)})
        # One-stage selects the global top-k: no selected nugget scores below an unselected one.
        if mode == "dense":
            flat = retriever.index.search_nuggets(
                minilm.embed_queries([question])[0], 11, embedder_fp=minilm.fingerprint
            )
            assert min(e.score for e in one.evidence) >= flat[-1]["score"] - 1e-6

        only = retriever.chunks_only(question, kc=3)
        assert [e.chunk_id for e in only.evidence] == [h.chunk_id for h in only.chunks]
        assert all(
            e.tok_start == 0 and e.tok_end == h.n_tokens
            for e, h in zip(only.evidence, only.chunks, strict=True)
        )


def test_order_nuggets_unit():
    def n(cid, s, score):
        return dict(chunk_id=cid, doc_id="d", content_key="k", tok_start=s, tok_end=s + 3,
                    text="t", score=score)  # fmt: skip

    got = order_nuggets([n("B", 9, 0.9), n("A", 5, 0.5), n("B", 1, 0.4), n("A", 2, 0.8)],
                        {"A": 0, "B": 1})  # fmt: skip
    assert [(e.chunk_id, e.tok_start) for e in got] == [("A", 2), ("A", 5), ("B", 1), ("B", 9)]
    got = order_nuggets([n("B", 9, 0.9), n("A", 5, 0.5), n("B", 1, 0.4), n("A", 2, 0.8)], {})
    assert [(e.chunk_id, e.tok_start) for e in got] == [("B", 1), ("B", 9), ("A", 2), ("A", 5)]


def test_ann_index_with_prefilter(tmp_path):
    """Past the threshold an ANN index is built; the prefiltered search stays exact and full."""
    store = Store.at(tmp_path / "s").init()
    dim, n_chunks, per = 16, 300, 4
    index, _ = LanceIndex.open_for_write(store, "embedder-synthetic", dim)
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((n_chunks * per, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    cids = [f"ch-{i // per:04d}" for i in range(n_chunks * per)]
    cols = {
        "nugget_id": [f"ng-{i:05d}" for i in range(n_chunks * per)],
        "chunk_id": cids,
        "doc_id": [f"d{i // (per * 10)}" for i in range(n_chunks * per)],
        "doc_version": ["v"] * len(cids),
        "content_key": ["ck"] * len(cids),
        "text": ["t"] * len(cids),
        "search_text": ["t"] * len(cids),
        "tok_start": [i % per * 5 for i in range(len(cids))],
        "tok_end": [i % per * 5 + 4 for i in range(len(cids))],
        "embedder_fp": ["embedder-synthetic"] * len(cids),
        "run_id": ["r"] * len(cids),
    }
    index.upsert("nuggets", index.build_table("nuggets", cols, vecs))
    made = index.ensure_indexes(min_rows=1000)
    assert any(m.endswith(":vector") for m in made["nuggets"]) and index.has_vector_index("nuggets")
    assert index.read_meta(store).vector_indexes["nuggets"]["rows"] == len(cids)
    q = vecs[7]
    exact = np.argsort(-(vecs @ q))[:10]
    ann = index.search_nuggets(q, 10, embedder_fp="embedder-synthetic")
    assert ann[0]["nugget_id"] == "ng-00007" and len(ann) == 10
    assert len({r["nugget_id"] for r in ann} & {cols["nugget_id"][i] for i in exact}) >= 8
    chosen = ["ch-0100", "ch-0200", "ch-0003"]
    got = index.search_nuggets(q, 10, chosen, embedder_fp="embedder-synthetic")
    assert len(got) == 10 and {r["chunk_id"] for r in got} <= set(chosen)
    inside = [i for i, c in enumerate(cids) if c in chosen]
    want = sorted(inside, key=lambda i: -float(vecs[i] @ q))[:10]
    assert [r["nugget_id"] for r in got] == [cols["nugget_id"][i] for i in want]


def test_dense_chunk_score_is_the_mean_of_its_windows_and_its_best_nugget(built, minilm):
    """A chunk's dense score is (its own cosine + its best nugget's cosine) / 2, its own the
    best of its windows': recomputed by hand over every window and nugget vector, the top-kc
    chunks are the same, and so are their scores (a chunk none of whose nuggets is among the
    nuggets searched scores its own)."""
    store, _ = built
    retriever = Retriever(store, minilm, mode="dense")
    index = retriever.index

    def vectors(table: str) -> tuple[list[str], np.ndarray]:
        data = index.columns(table, ["chunk_id", "vector"])
        vec = data.column("vector").combine_chunks()
        mat = vec.flatten().to_numpy().reshape(len(vec), -1).astype(np.float32)
        return data.column("chunk_id").to_pylist(), mat

    window_chunks, window_vec = vectors("windows")
    nugget_chunks, nugget_vec = vectors("nuggets")
    assert set(window_chunks) == set(vectors("chunks")[0])  # every chunk has its windows
    helped = 0
    for question in QUESTIONS:
        q = minilm.embed_queries([question])[0]
        own: dict[str, float] = {}
        for cid, s in zip(window_chunks, (window_vec @ q).tolist(), strict=True):
            own[cid] = max(own.get(cid, -2.0), s)
        best: dict[str, float] = {}
        for cid, s in zip(nugget_chunks, (nugget_vec @ q).tolist(), strict=True):
            best[cid] = max(best.get(cid, -2.0), s)
        best = {c: best.get(c, own[c]) for c in own}  # a chunk without nuggets: its own
        score = {c: (own[c] + best[c]) / 2 for c in own}
        want = sorted(score, key=lambda c: -score[c])[:4]
        got = retriever.chunks_only(question, kc=4).chunks
        assert [h.chunk_id for h in got] == want
        # a chunk's best nugget counts when it is among the top NUGGET_FANOUT * kc nuggets (else
        # its own cosine stands in): the score is then exactly the by-hand mean
        cut = sorted((nugget_vec @ q).tolist(), reverse=True)[NUGGET_FANOUT * 4 - 1]
        expect = [score[c] if best[c] >= cut else own[c] for c in want]
        assert [h.score for h in got] == pytest.approx(expect, abs=1e-5)
        helped += sum(best[c] >= cut and score[c] > own[c] for c in want)
    assert helped > 0  # nuggets lifted some chunks above their own vector's score
