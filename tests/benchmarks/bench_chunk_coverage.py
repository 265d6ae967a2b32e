"""Whole-chunk coverage of dense chunk search: which chunk vector finds the evidence best.

The default embedder (all-MiniLM-L6-v2) keeps 256 word pieces, about half of a 512-token chunk
of the generation model, so a chunk's one vector says nothing about its second half. This
benchmark compares, on a built store's chunks and one or more question files with gold
``doc_ids`` (hit@kc: a chunk of a gold document among the top ``kc``):

- ``first``: one vector of the chunk's text as the embedder truncates it (the index's vector,
  read from the store's embedding cache);
- ``mean``: the chunk cut into windows of the embedder's length, one vector each, their
  normalised mean as the chunk's vector;
- ``max``: the same windows, a chunk scored by its best window;
- ``lexical``: BM25 over the whole chunk text (LanceDB's full-text index, the index's settings);
- ``hybrid-<dense>``: reciprocal rank fusion of that dense variant and lexical.

Vectors are computed once and cached in ``--cache`` (an ``.npz``), so reruns cost only the
searches. Runnable alone::

    python tests/benchmarks/bench_chunk_coverage.py --store STORE \\
        --questions faq/questions.jsonl infra/python_natural_questions.jsonl --cache cov.npz
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from coinrag.inference.embedders import load_embedder, text_windows  # noqa: E402
from coinrag.inference.retrieve import rrf_fuse  # noqa: E402
from coinrag.schemas.qa import load_questions  # noqa: E402
from coinrag.schemas.tables import ChunkRow  # noqa: E402
from coinrag.storage.corpus import live_versions  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402
from coinrag.storage.tables import read_table  # noqa: E402


def live_chunks(store: Store) -> tuple[list[str], list[str], list[str]]:
    """(chunk_ids, doc_ids, texts) of the live documents' chunks (all chunks of a store whose
    first build has not finished yet)."""
    live = live_versions(store)
    table = read_table(store, ChunkRow, columns=["chunk_id", "doc_id", "doc_version", "text"])
    seen: dict[str, tuple[str, str]] = {}
    columns = [table.column(c).to_pylist() for c in table.column_names]
    for cid, did, ver, text in zip(*columns, strict=True):
        if not live or live.get(did) == ver:
            seen[cid] = (did, text)
    ids = sorted(seen)
    return ids, [seen[c][0] for c in ids], [seen[c][1] for c in ids]


def vectors(store: Store, embedder, texts: list[str], cache: Path | None) -> dict[str, np.ndarray]:
    """``first`` (n, dim): each chunk's vector as the index holds it (read from the store's
    embedding cache where the build left it, else embedded); ``windows`` (m, dim) with
    ``owner`` (m,): every window of every chunk (window 0 of a chunk is its ``first`` vector:
    the same tokens as the truncated text)."""
    from coinrag.schemas.keys import text_hash
    from coinrag.tasks.embed import cached_vectors

    if cache is not None and cache.exists():
        data = np.load(cache)
        if int(data["n"]) == len(texts):
            return {k: data[k] for k in data.files}
    hashes = [text_hash(t) for t in texts]
    have = cached_vectors(store, embedder.fingerprint, hashes, embedder.dim)
    missing = [t for t, h in zip(texts, hashes, strict=True) if h not in have]
    print(f"  {len(texts) - len(missing)} chunk vectors from the store's cache", file=sys.stderr)
    fresh = iter(embedder.embed_documents(missing, progress=_progress("chunks")))
    first = np.stack([have[h] if h in have else next(fresh) for h in hashes])
    windows = [text_windows(embedder.tokenizer, t, embedder.max_length) for t in texts]
    rest = [w for ws in windows for w in ws[1:]]
    rest_vec = iter(embedder.embed_documents(rest, progress=_progress("windows")))
    wvec, owner = [], []
    for i, ws in enumerate(windows):
        wvec.append(first[i])
        owner.append(i)
        for _ in ws[1:]:
            wvec.append(next(rest_vec))
            owner.append(i)
    out = {
        "first": first,
        "windows": np.stack(wvec),
        "owner": np.array(owner, dtype=np.int64),
        "n": np.array(len(texts)),
    }
    if cache is not None:
        np.savez(cache, **out)
    return out


def _progress(what: str):
    def report(done: int, total: int) -> None:
        if done == total or done % 512 < 32:
            print(f"  embed {what}: {done}/{total}", file=sys.stderr, flush=True)

    return report


def mean_vectors(wvec: np.ndarray, owner: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((n, wvec.shape[1]), dtype=np.float32)
    np.add.at(out, owner, wvec)
    return out / np.linalg.norm(out, axis=1, keepdims=True)


def dense_rank(scores: np.ndarray, depth: int) -> list[int]:
    top = np.argpartition(-scores, min(depth, len(scores) - 1))[:depth]
    return [int(i) for i in top[np.argsort(-scores[top])]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--questions", nargs="+", required=True)
    ap.add_argument("--kc", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--depth", type=int, default=50, help="candidates per list before fusion")
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import lancedb
    import pyarrow as pa
    from lancedb.index import FTS

    from coinrag.storage.index import FTS_CONFIG

    store = Store.at(args.store)
    ids, docs, texts = live_chunks(store)
    embedder = load_embedder(None)
    vec = vectors(store, embedder, texts, args.cache)
    n = len(ids)
    first, wvec, owner = vec["first"], vec["windows"], vec["owner"]
    mean = mean_vectors(wvec, owner, n)
    print(f"{n} chunks, {len(wvec)} windows ({len(wvec) / n:.2f} per chunk)")

    tmp = Path(tempfile.mkdtemp(prefix="bench-cov-"))
    db = lancedb.connect(str(tmp))
    tbl = db.create_table("c", pa.table({"row": list(range(n)), "text": texts}))
    tbl.create_index("text", config=FTS(**FTS_CONFIG))

    def lexical(q: str, depth: int) -> list[int]:
        rows = (
            tbl.search(q, query_type="fts", fts_columns="text")
            .select(["row", "_score"])
            .limit(depth)
            .to_arrow()
        )
        return rows.column("row").to_pylist()

    results = {}
    for qpath in args.questions:
        questions = [q for q in load_questions(qpath) if q.doc_ids]
        qv = embedder.embed_queries([q.question for q in questions])
        hits: dict[str, dict[int, list[float]]] = {}
        for qi, q in enumerate(questions):
            gold = set(q.doc_ids)
            wscore = wvec @ qv[qi]
            best = np.full(n, -2.0, dtype=np.float32)
            np.maximum.at(best, owner, wscore)
            ranks = {
                "first": dense_rank(first @ qv[qi], args.depth),
                "mean": dense_rank(mean @ qv[qi], args.depth),
                "max": dense_rank(best, args.depth),
                "lexical": lexical(q.question, args.depth),
            }
            for dense in ("first", "mean", "max"):
                ranks[f"hybrid-{dense}"] = rrf_fuse([ranks[dense], ranks["lexical"]])
            for name, order in ranks.items():
                for kc in args.kc:
                    hit = any(docs[i] in gold for i in order[:kc])
                    hits.setdefault(name, {}).setdefault(kc, []).append(float(hit))
        print(f"\n{qpath} ({len(questions)} questions): hit@kc %")
        print(f"{'variant':<14}" + "".join(f"{'@' + str(k):>8}" for k in args.kc))
        table = {}
        for name, per in hits.items():
            table[name] = {k: 100 * float(np.mean(v)) for k, v in per.items()}
            print(f"{name:<14}" + "".join(f"{table[name][k]:>8.1f}" for k in args.kc))
        results[qpath] = table
    shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
