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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from coinrag.schemas.settings import BuildSettings, settings_from_toml  # noqa: E402
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


def generated(
    st: Store, index: LanceIndex, settings: BuildSettings, n_chunks: int, seed: int
) -> list[SyntheticQuestion]:
    """The local generator's questions about ``n_chunks`` chunks of the retriever pages."""
    from coinrag.flows.retriever import _generated

    @flow(name="bench-retriever-pairs")
    def ask() -> list[SyntheticQuestion]:
        with st.write_lock("bench-retriever-pairs"):
            made = _generated(st, index, settings, n_chunks, "bench", seed, "local", ("retriever",))
        return made.questions

    return ask()


def round_trip(
    retriever: Retriever, questions: list[SyntheticQuestion], depth: int
) -> list[int | None]:
    """Per question, the rank of its page's first chunk in the store's hybrid top ``depth``."""
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


@dataclass
class PairSource:
    """What every kind of pair is made from: the store, its index, settings and embedder, the
    trainer's settings, the evaluation questions to leave out, and the command line."""

    st: Store
    index: LanceIndex
    settings: BuildSettings
    embedder: Any  # the store's (``store_embedder_of``): the round trip searches with it
    cfg: RetrieverTrainSettings
    evaluation: list[str]
    args: argparse.Namespace

    def pairs_of(self, questions: list[SyntheticQuestion]) -> tuple[list[TrainingPair], dict]:
        return training_pairs(
            self.index,
            self.evaluation,
            self.cfg.max_pairs,
            self.args.seed,
            generated=questions,
            kinds=(),
        )


def store_kind(src: PairSource) -> tuple[list[TrainingPair], dict]:
    return training_pairs(src.index, src.evaluation, src.cfg.max_pairs, src.args.seed)


def generated_kind(src: PairSource) -> tuple[list[TrainingPair], dict]:
    questions = generated(src.st, src.index, src.settings, src.args.chunks, src.args.seed)
    pairs, counts = src.pairs_of(questions)
    return pairs, {"generated": len(questions), **counts}


def roundtrip_kind(src: PairSource) -> tuple[list[TrainingPair], dict]:
    questions = generated(src.st, src.index, src.settings, src.args.chunks, src.args.seed)
    retriever = Retriever(src.st, src.embedder, index=src.index)
    ranks = round_trip(retriever, questions, src.args.depth)
    kept = [q for q, r in zip(questions, ranks, strict=True) if r is not None]
    pairs, counts = src.pairs_of(kept)
    found = {"generated": len(questions), "kept": len(kept), "first": ranks.count(1)}
    return pairs, {**found, **counts}


def cloze_kind(src: PairSource) -> tuple[list[TrainingPair], dict]:
    banned = {normalise(q) for q in src.evaluation}
    made = cloze_pairs(src.index, src.cfg.max_pairs, src.args.seed)
    pairs = [p for p in made if normalise(p.query) not in banned]
    return pairs, {"pairs": len(pairs), "excluded_as_evaluation": len(made) - len(pairs)}


KINDS: dict[str, Callable[[PairSource], tuple[list[TrainingPair], dict]]] = {
    "store": store_kind,
    "generated": generated_kind,
    "roundtrip": roundtrip_kind,
    "cloze": cloze_kind,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--kind", choices=tuple(KINDS), required=True)
    ap.add_argument("--out", type=Path, required=True, help="embedder folder written")
    ap.add_argument("--chunks", type=int, default=400, help="chunks asked about (generated)")
    ap.add_argument("--depth", type=int, default=10, help="round trip: chunks searched")
    ap.add_argument("--exclude-questions", nargs="*", default=[])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    st = Store.at(args.store)
    settings = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    cfg = RetrieverTrainSettings(seed=args.seed).validate()
    evaluation = [q.question for path in args.exclude_questions for q in load_questions(path)]
    embedder = store_embedder_of(settings)
    src = PairSource(st, LanceIndex.open(st), settings, embedder, cfg, evaluation, args)
    pairs, counts = KINDS[args.kind](src)
    print(json.dumps({"kind": args.kind, **counts}), flush=True)
    base_ref = root_embedder(settings.embedder)
    base = embedder if base_ref == settings.embedder else store_embedder_of(settings, base_ref)
    summary = finetune_embedder(
        locate_embedder(base_ref), base.max_length, pairs, args.out, cfg, {"bench": counts}
    )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
