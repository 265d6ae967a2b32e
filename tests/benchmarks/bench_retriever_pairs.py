"""Train the default embedder on one kind of training pair made from a store, to compare kinds.

``coinrag train retriever`` trains on the store's headings and nuggets (and, with
``--generated N``, the question generator's questions). This benchmark writes one embedder
folder per run from one kind of pair, the same trainer and settings
(``training.retriever.finetune_embedder``, ``RetrieverTrainSettings`` defaults: 6-minute budget,
32 pairs a step, BM25 hard negatives), so that ``bench_chunk_coverage.py --embedder OUT`` can
score each against the packaged MiniLM on the same store and questions:

- ``store``: the flow's own pairs (headings and nuggets, ``training_pairs``' defaults);
- ``generated``: only the question generator's questions about ``--chunks`` chunks of the
  ``retriever`` pages (cached in the store's self-study calls: a second run asks nothing);
- ``roundtrip``: those questions kept only where the store's hybrid search finds their page in
  its top ``--depth`` chunks (round-trip consistency, Alberti et al. 2019: a question the
  retriever cannot trace back to its page is likely one the chunk does not answer);
- ``cloze``: inverse-cloze pairs (Lee et al. 2019): a sentence of a ``retriever`` page's chunk
  (6-40 words, no markup) as the query, the chunk without it (with it one time in ten) as the
  positive; no generator.

Pairs whose query is a question of ``--exclude-questions`` are dropped, as in the flow. Runnable
alone (the store is written to only by ``generated`` / ``roundtrip``: the generator's calls)::

    python tests/benchmarks/bench_retriever_pairs.py --store S --kind roundtrip --chunks 400 \\
        --out EMB --exclude-questions FAQ.jsonl infra/python_natural_questions.jsonl
    python tests/benchmarks/bench_chunk_coverage.py --store S --embedder EMB --questions ...
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from prefect import flow  # noqa: E402

from coinrag.inference.retrieval.embedders import (  # noqa: E402
    locate_embedder,
    root_embedder,
    store_embedder_of,
)
from coinrag.inference.retrieval.fusion import normalise  # noqa: E402
from coinrag.inference.retrieval.retriever import Retriever  # noqa: E402
from coinrag.schemas.qa import load_questions  # noqa: E402
from coinrag.schemas.settings import settings_from_toml  # noqa: E402
from coinrag.schemas.training_settings import RetrieverTrainSettings  # noqa: E402
from coinrag.storage.index.lance import LanceIndex  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402
from coinrag.tasks.retrieval.fusion import SyntheticQuestion, page_split  # noqa: E402
from coinrag.tasks.retrieval.retriever_pairs import (  # noqa: E402
    PASSAGE_CHARS,
    TrainingPair,
    hard_negative,
    training_pairs,
)
from coinrag.training.retriever import finetune_embedder  # noqa: E402

SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z])")
MARKUP = re.compile(r"[=`>{}]{2}|::")
KEEP_SENTENCE = 0.1  # share of cloze positives that keep their sentence (Lee et al.)


def generated(st: Store, index: LanceIndex, n_chunks: int, seed: int) -> list[SyntheticQuestion]:
    """The local generator's questions about ``n_chunks`` chunks of the retriever pages."""
    from coinrag.flows.retriever import _generated

    settings = settings_from_toml(st.read_toml(), st.uri(st.settings_path))

    @flow(name="bench-retriever-pairs")
    def ask() -> list[SyntheticQuestion]:
        with st.write_lock("bench-retriever-pairs"):
            made = _generated(st, index, settings, n_chunks, "bench", seed, "local", ("retriever",))
        return made.questions

    return ask()


def round_trip(st: Store, questions: list[SyntheticQuestion], depth: int) -> list[int | None]:
    """Per question, the rank of its page's first chunk in the store's hybrid top ``depth``."""
    settings = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    retriever = Retriever(st, store_embedder_of(settings))
    ranks: list[int | None] = []
    for q in questions:
        docs = [e.doc_id for e in retriever.chunks_only(q.text, depth, mode="hybrid").evidence]
        ranks.append(docs.index(q.doc_id) + 1 if q.doc_id in docs else None)
    return ranks


def cloze_pairs(index: LanceIndex, n: int, seed: int) -> list[TrainingPair]:
    """``n`` inverse-cloze pairs from chunks of the retriever pages (module docstring)."""
    rows = [
        r
        for r in index.columns("chunks", ["chunk_id", "doc_id", "text"]).to_pylist()
        if page_split(r["doc_id"]) == "retriever" and len(r["text"] or "") > 400
    ]
    rows.sort(key=lambda r: r["chunk_id"])
    rng = random.Random(seed)
    rng.shuffle(rows)
    pairs: list[TrainingPair] = []
    for row in rows:
        if len(pairs) >= n:
            break
        text = " ".join(row["text"].split())
        sentences = [
            s
            for s in SENTENCE_END.split(text)
            if 6 <= len(s.split()) <= 40 and not MARKUP.search(s)
        ]
        if len(sentences) < 2:
            continue
        sentence = rng.choice(sentences)
        positive = text if rng.random() < KEEP_SENTENCE else text.replace(sentence, " ")
        negative = hard_negative(index, sentence, row["doc_id"])
        if negative is not None:
            pairs.append(
                TrainingPair(sentence, positive[:PASSAGE_CHARS], negative, row["doc_id"], "cloze")
            )
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--kind", choices=("store", "generated", "roundtrip", "cloze"), required=True)
    ap.add_argument("--out", type=Path, required=True, help="embedder folder written")
    ap.add_argument("--chunks", type=int, default=400, help="chunks asked about (generated)")
    ap.add_argument("--depth", type=int, default=10, help="round trip: chunks searched")
    ap.add_argument("--exclude-questions", nargs="*", default=[])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    st = Store.at(args.store)
    index = LanceIndex.open(st)
    cfg = RetrieverTrainSettings(seed=args.seed).validate()
    evaluation = [q.question for path in args.exclude_questions for q in load_questions(path)]
    counts: dict[str, object] = {"kind": args.kind}
    if args.kind == "cloze":
        pairs = cloze_pairs(index, cfg.max_pairs, args.seed)
        banned = {normalise(q) for q in evaluation}
        pairs = [p for p in pairs if normalise(p.query) not in banned]
    elif args.kind == "store":
        pairs, made = training_pairs(index, evaluation, cfg.max_pairs, args.seed)
        counts |= made
    else:
        questions = generated(st, index, args.chunks, args.seed)
        counts["generated"] = len(questions)
        if args.kind == "roundtrip":
            ranks = round_trip(st, questions, args.depth)
            questions = [q for q, r in zip(questions, ranks, strict=True) if r is not None]
            counts |= {"kept": len(questions), "first": sum(r == 1 for r in ranks)}
        pairs, made = training_pairs(
            index, evaluation, cfg.max_pairs, args.seed, kinds=(), generated=questions
        )
        counts |= made
    print(json.dumps(counts), flush=True)
    settings = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    base_ref = root_embedder(settings.embedder)
    base = store_embedder_of(settings, base_ref)
    summary = finetune_embedder(
        locate_embedder(base_ref), base.max_length, pairs, args.out, cfg, {"bench": counts}
    )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
