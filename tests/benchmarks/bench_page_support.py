"""Page support (``rerank = support``, ``inference/retrieval/rerank.py`` :class:`PageSupport`):
which share of a page's second-best chunk ranks the pages best, chosen on the store's own
questions, and what it gives on question files.

Per question, each search mode's top ``HYBRID_DEPTH`` chunks are taken once (hybrid: the two
rankings ``train fusion`` scores, fused at the index's dense weight,
``inference.retrieval.fusion``) and reordered by ``PageSupport`` at every ``--supports`` value
(0: the pages in the order of their best chunk, as ``rerank = pages``). Scored: hit@1, 2, 4, 8
of the pages of the reordered top chunks and MRR within 8, and their mean (the ``objective``
``train fusion`` chooses a weight by).

Question sets:

- ``headings``: the store's headings of the fusion and report pages (``tasks.retrieval.fusion``:
  those equal to a question of ``--exclude-questions`` removed), asked without the chunks that
  quote them word for word, as ``train fusion`` asks them;
- ``titles``: the same headings asked as they are (their own section in the index): questions
  that name a section's title, like the FAQ set's;
- ``generated``: the question generator's questions cached in ``--generated-store``'s
  ``selfstudy_questions`` table (``coinrag train fusion --generated N`` on that store or a copy
  of it writes them), gold the page they were asked about, asked the same way;
- each ``--questions`` file (evaluation sets: gold ``doc_ids``, asked as they are).

The share to use is chosen on the store's sets only (the mean of their hybrid objectives); the
evaluation files are reported. Runnable
alone::

    python tests/benchmarks/bench_page_support.py --store S --generated-store S \\
        --exclude-questions FAQ.jsonl NAT.jsonl NAT2.jsonl \\
        --questions FAQ.jsonl NAT.jsonl NAT2.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from coinrag.inference.evaluation.retrieval_only import first_gold_rank  # noqa: E402
from coinrag.inference.retrieval.embedders import store_embedder_of  # noqa: E402
from coinrag.inference.retrieval.fusion import (  # noqa: E402
    FUSION_KCS,
    SUPPORT_GRID,
    as_hits,
    choose_weight,
    objective,
    question_lists,
    rank_scores,
)
from coinrag.inference.retrieval.rerank import PageSupport  # noqa: E402
from coinrag.inference.retrieval.retriever import (  # noqa: E402
    HYBRID_DEPTH,
    ChunkHit,
    Query,
    dense_weight,
    fuse_rankings,
)
from coinrag.schemas.qa import load_questions  # noqa: E402
from coinrag.schemas.settings import settings_from_toml  # noqa: E402
from coinrag.schemas.tables import SelfStudyQuestionRow  # noqa: E402
from coinrag.storage.index.lance import LanceIndex  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402
from coinrag.storage.tables import read_rows  # noqa: E402
from coinrag.tasks.retrieval.fusion import (  # noqa: E402
    GENERATED_KIND,
    MAX_QUESTIONS,
    SyntheticQuestion,
    excluding,
    page_split,
    sample_by_kind,
    store_headings,
)


def mode_hits(
    index: LanceIndex, embedder, text: str, gold: Sequence[str], mask: bool, weight: float
) -> dict[str, list[ChunkHit]]:
    """Each search mode's top chunks for ``text``, best first; ``mask``: without the chunks
    that quote it."""
    lists = question_lists(index, Query(text, embedder), gold, mask_verbatim=mask).lists
    return {
        "hybrid": as_hits(fuse_rankings(lists, "chunk_id", HYBRID_DEPTH, weight)),
        "dense": as_hits(list(lists[0])[:HYBRID_DEPTH]),
        "lexical": as_hits(list(lists[1])[:HYBRID_DEPTH]),
    }


def scored(ranks: list[int | None]) -> dict[str, float]:
    """hit@kc and MRR (%) of first-gold ranks (``rank_scores``), and their mean, ``objective``."""
    out = {key: 100 * value for key, value in rank_scores(ranks).items()}
    return out | {"objective": objective(out)}


def score_set(index, embedder, questions, mask: bool, supports) -> dict[str, dict]:
    """``{mode/support: scored(...)}`` over ``questions`` ((text, gold pages) pairs)."""
    weight = dense_weight(index)
    rerankers = {s: PageSupport(s) for s in supports}
    ranks: dict[str, list[int | None]] = {}
    for text, gold in questions:
        for mode, hits in mode_hits(index, embedder, text, sorted(gold), mask, weight).items():
            for s, reranker in rerankers.items():
                ranked = reranker.rerank(text, hits)[: max(FUSION_KCS)]
                rank = first_gold_rank([h.doc_id for h in ranked], sorted(gold))
                ranks.setdefault(f"{mode}/{s}", []).append(rank)
    return {key: scored(r) for key, r in ranks.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--generated-store", default=None, help="a store with cached questions")
    ap.add_argument("--exclude-questions", nargs="*", default=[])
    ap.add_argument("--questions", nargs="*", default=[])
    ap.add_argument("--supports", nargs="+", type=float, default=list(SUPPORT_GRID))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    store = Store.at(args.store)
    index = LanceIndex.open(store)
    embedder = store_embedder_of(
        settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    )
    evaluation = [q.question for p in args.exclude_questions for q in load_questions(p)]
    rows = index.columns("chunks", ["doc_id", "section", "text"]).to_pylist()
    headings, excluded = excluding(store_headings(rows), evaluation)
    headings = [h for h in headings if page_split(h.doc_id) != "retriever"]
    sets = {
        "headings": (
            [(h.text, {h.doc_id}) for h in sample_by_kind(headings, MAX_QUESTIONS, 0)],
            True,
        )
    }
    sets["titles"] = (sets["headings"][0], False)
    if args.generated_store:
        made = read_rows(Store.at(args.generated_store), SelfStudyQuestionRow)
        asked = [SyntheticQuestion(r.question, r.doc_id, GENERATED_KIND) for r in made]
        kept, dropped = excluding(asked, evaluation)
        sets["generated"] = ([(q.text, {q.doc_id}) for q in kept], True)
        excluded += dropped
    for path in args.questions:
        asked = [(q.question, set(q.doc_ids)) for q in load_questions(path) if q.doc_ids]
        sets[Path(path).stem] = (asked, False)
    print(f"{excluded} store questions excluded as evaluation questions")
    results = {}
    for name, (questions, mask) in sets.items():
        results[name] = score_set(index, embedder, questions, mask, args.supports)
        print(f"\n{name} ({len(questions)} questions): hit@1 / 2 / 4 / 8, MRR, objective (%)")
        for key, row in results[name].items():
            print(f"{key:<16}" + "".join(f"{v:>8.1f}" for v in row.values()))
    chosen_on = [n for n in ("headings", "titles", "generated") if n in results]
    mean = {
        s: sum(results[n][f"hybrid/{s}"]["objective"] for n in chosen_on) / len(chosen_on)
        for s in args.supports
    }
    best = choose_weight({s: {"objective": v} for s, v in mean.items()}, PageSupport.support)
    print(
        f"\nhybrid objective, mean over {' and '.join(chosen_on)}: "
        + ", ".join(f"{s}: {v:.2f}" for s, v in mean.items())
        + f"; best {best}"
    )
    if args.json:
        args.json.write_text(json.dumps({"results": results, "mean": mean, "best": best}, indent=1))


if __name__ == "__main__":
    main()
