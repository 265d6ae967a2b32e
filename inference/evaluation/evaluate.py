"""Evaluation: token-level F1 / exact match, retrieval recall, TTFT and active prefix tokens.

The paper's measures, on a JSONL of questions, for every method x ``(kc, k)`` of a sweep:

- **F1 / EM**: SQuAD / LongBench answer normalisation (lowercase, drop punctuation, drop the
  articles a/an/the, collapse whitespace), token-level F1 and exact match, each the **max over the
  gold answers** of a question; the means are reported as fractions in ``[0, 1]`` (the printed
  table and the plots show percent, like the paper's tables).
- **recall**: per question, the fraction of its gold ``doc_ids`` found among the documents of the
  evidence the method actually used (CoinRAG: the documents of the selected nuggets; TurboRAG and
  standard: the documents of the top-``kc`` chunks). With one gold document this is hit@kc. Null
  for questions without gold ids; the mean is over questions that have them (null if none).
- **TTFT**: ``Answer.timings['ttft']`` (retrieval + KV load + assembly + query prefill, ms); mean
  and P99 (numpy's linear-interpolation percentile).
- **active tokens**: context tokens after the cached prompt prefix (KV-memory proxy), mean.

A method runs once per distinct value of what its retrieval uses (``Retrieval.used``: its
``uses_kc``, ``uses_k``) and records ``0`` for the other ("not applicable"): CoinRAG per
(kc, k), TurboRAG and standard RAG once per kc with ``k = 0``, cartridge RAG once per k with
``kc = 0``. Retrieval is computed once per question and retrieval key
(``RagMethod.retrieval_key``): once per (question, kc) for the chunk methods (``chunks_only``,
shared by turborag and standard), once per (question, kc, k) for CoinRAG (``two_stage``); each
method's TTFT includes the retrieval time of the result it used. Before measuring, every method
answers the first question once, untimed, so lazy loading (weights, index, KV files) is not in
the first measurement.

Models: ``models`` (``coinrag eval --model LABEL=REF``, repeatable) opens one engine per label;
a method entry ``METHOD@LABEL`` runs on that model (a bare name on the first): the
no-fine-tuning ablation is ``coinrag@base`` next to ``coinrag`` on a fine-tuned model. Every row
carries ``dataset`` (the question file's stem) and ``model`` (the label).

Outputs under ``out_dir`` (columns: ``schemas/evaluation.py``; rendering:
``inference/evaluation/report.py``): ``results.parquet`` (one row per dataset, model, method and
(kc, k)), ``per_question.parquet``, ``table3.parquet`` and ``table3.md`` (the paper's Table 3 form:
per method the best F1 among sweep points whose P99 TTFT <= budget, with EM, TTFT, active tokens
and the (kc, k) that achieved it; ``best_under_budget.parquet`` holds the same rows under its
former name), and the plots ``f1_vs_p99_ttft.png`` (log TTFT axis), ``f1_vs_active_tokens.png``,
``f1_vs_budget.png`` (the paper's Figures 2 and 3) and ``ablation_f1.png`` (Figure 4: full
CoinRAG next to each ``coinrag-*`` ablation and ``coinrag`` on the other models; written when
the run holds them).
"""

from __future__ import annotations

import itertools
import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from coinrag.inference.evaluation.report import (
    aggregate,
    best_under_budget,
    budget_text,
    plot_ablation,
    plot_budget_curve,
    plot_pareto,
    results_text,
    table3_markdown,
)
from coinrag.inference.retrieval.retriever import search_mode
from coinrag.schemas.evaluation import PER_QUESTION_SCHEMA
from coinrag.schemas.qa import load_questions
from coinrag.schemas.settings import DEFAULT_QUERY, DEFAULT_RAG_METHODS
from coinrag.storage.store import Store

if TYPE_CHECKING:
    from coinrag.inference.methods import RagMethod

DEFAULT_SWEEP = ((DEFAULT_QUERY.kc, DEFAULT_QUERY.k),)
DEFAULT_BUDGETS_MS = (100.0, 200.0, 500.0, 1000.0, 2000.0, math.inf)


# ---------------------------------------------------------------------------- answer metrics

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD / LongBench normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _as_list(gold: str | Sequence[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else list(gold)


def _f1_one(prediction: str, gold: str) -> float:
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(gold).split()
    if not pred or not ref:  # SQuAD v2 convention: 1 only when both are empty
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred)
    recall = common / len(ref)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """Token-level F1 after normalisation; the max over several gold answers (0 if none)."""
    return max((_f1_one(prediction, g) for g in _as_list(gold)), default=0.0)


def exact_match(prediction: str, gold: str | Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return max((float(pred == normalize_answer(g)) for g in _as_list(gold)), default=0.0)


def doc_recall(evidence_doc_ids: Iterable[str], gold_doc_ids: Sequence[str] | None) -> float | None:
    """Fraction of the gold documents among the evidence documents; None without gold ids."""
    if not gold_doc_ids:
        return None
    found = set(evidence_doc_ids)
    gold = list(dict.fromkeys(gold_doc_ids))
    return sum(g in found for g in gold) / len(gold)


# ---------------------------------------------------------------------------- the run


DEFAULT_MODEL_LABEL = "default"  # the store's own model


@dataclass(frozen=True)
class EvalModel:
    """A model of the run: ``label`` (in tables and ``METHOD@LABEL``) and ``ref`` (a model
    folder, a GGUF file, a KVLink adapter folder; None: the store's model)."""

    label: str
    ref: str | None = None

    @classmethod
    def parse(cls, text: str) -> EvalModel:
        """``LABEL=REF``, or ``REF`` (labelled by its folder's name), or ``default`` (the
        store's model)."""
        label, sep, ref = text.partition("=")
        if not sep:
            ref = text
            label = DEFAULT_MODEL_LABEL if text == DEFAULT_MODEL_LABEL else Path(text).name
        if not label or not ref:
            raise ValueError(f"--model {text!r}: give LABEL=REF, REF or default")
        return cls(label, None if ref == DEFAULT_MODEL_LABEL else ref)


def split_method(entry: str, models: Sequence[EvalModel]) -> tuple[str, str]:
    """``METHOD@LABEL`` -> ``(method, label)``; a bare ``METHOD`` runs on the first model."""
    method, sep, label = entry.partition("@")
    if not sep:
        return method, models[0].label
    if label not in {m.label for m in models}:
        raise ValueError(
            f"method {entry!r}: no model labelled {label!r} (--model {label}=REF); "
            f"models: {', '.join(m.label for m in models)}"
        )
    return method, label


def _configs(
    methods: Sequence[tuple[str, RagMethod]], sweep: Sequence[tuple[int, int]]
) -> list[tuple[str, str, int, int]]:
    """(model label, method, kc, k) to run, for opened methods (``RagMethod``): each once per
    distinct value of what it uses, 0 for what it does not (coinrag per (kc, k); the chunk
    methods once per kc with k = 0; cartridge and coinrag-onestage once per k with kc = 0)."""
    out: list[tuple[str, str, int, int]] = []
    for label, method in methods:
        seen: set[tuple[int, int]] = set()
        for kc, k in sweep:
            key = method.retrieval.used(kc, k)
            if key not in seen:
                seen.add(key)
                out.append((label, method.name, *key))
    return out


EVAL_RUN_FILE = "eval_run.json"


def write_eval_run(out: Path, store: Store, questions: Sequence[str | Path], **fields: Any) -> Path:
    """``OUT/eval_run.json``: where an evaluation's numbers came from (the lineage of the run):
    the store and the index versions it read (its ``[published]`` record), the hybrid fusion
    searched with (``fusion``: the code's method and the dense weight used, which is the
    published record's only where that record names the same method), each question file with
    its sha256, the code version, and ``fields`` (methods, sweep, search modes, ...)."""
    import json
    from datetime import UTC, datetime

    from coinrag.inference.model.loading import file_sha256
    from coinrag.inference.retrieval.retriever import FUSION_METHOD, dense_weight
    from coinrag.schemas.keys import CODE_VERSION
    from coinrag.storage.index.lance import LanceIndex
    from coinrag.storage.index.tables import IndexNotBuilt

    try:
        fusion = {"method": FUSION_METHOD, "dense_weight": dense_weight(LanceIndex.open(store))}
    except IndexNotBuilt:
        fusion = None
    record = {
        "store": store.url,
        "published": store.published(),
        "fusion": fusion,
        "questions": [{"path": str(p), "sha256": file_sha256(Path(p))} for p in questions],
        "code_version": CODE_VERSION,
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **fields,
    }
    path = out / EVAL_RUN_FILE
    path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def evaluate(
    store_path: str | Path,
    questions_path: str | Path,
    out_dir: str | Path,
    methods: Sequence[str] | None = None,
    sweep: Sequence[tuple[int, int]] = DEFAULT_SWEEP,
    max_new_tokens: int = DEFAULT_QUERY.max_new_tokens,
    budgets_ms: Sequence[float] = DEFAULT_BUDGETS_MS,
    *,
    model: str | None = None,
    models: Sequence[EvalModel] | None = None,
    limit: int | None = None,
    limit_for: dict[str, int] | None = None,
    engine: Any = None,
    quiet: bool = False,
    retrievals: Sequence[str] | None = None,
    rerank: str | None = None,
) -> pa.Table:
    """Run every method x model x (kc, k) on the questions; write the outputs; return
    ``results``.

    ``methods``: names, or ``METHOD@LABEL`` to run on the model labelled ``LABEL`` of
    ``models`` (default: one model, the store's or ``model``, labelled ``default``); a bare
    name runs on the first model. ``None``: the default methods the store's assets can run
    (``methods_for``: a store keeping only nugget spans has no turborag; a note names each
    one left out). ``limit``: only the first ``limit`` questions;
    ``limit_for``: ``{METHOD or METHOD@LABEL: N}``, that method on the first N questions only
    (slow methods on a subset; ``n`` says so in every table). ``engine``: an already opened
    :class:`~inference.methods.RagEngine` for the first model (then ``store_path``, its model
    and ``max_new_tokens`` are taken from it). ``quiet``: no progress bar and no printed
    tables. ``retrievals``: the search modes to compare (``schemas.settings.RETRIEVAL_MODES``;
    every method and (kc, k) runs in each; default: the store's ``retrieval`` setting); each row
    records its mode (column ``retrieval``). ``rerank``: how the top chunks are reordered
    (``schemas.settings.RERANKERS``; default: the store's ``rerank`` setting; an ``engine``
    given keeps its own). The tables go to stdout, progress and log lines to stderr.
    """
    from rich.console import Console

    from coinrag.inference.methods import methods_for, unavailable_methods

    console = Console(stderr=True, quiet=quiet)
    if methods is None:
        store = engine.store if engine is not None else Store.at(store_path)
        methods = methods_for(store, DEFAULT_RAG_METHODS)
        for left_out, why in unavailable_methods(store, DEFAULT_RAG_METHODS).items():
            console.log(f"note: {left_out} left out: {why}")
    models = list(models or [EvalModel(DEFAULT_MODEL_LABEL, model)])
    plan = _EvalPlan.check(methods, models, sweep, max_new_tokens, limit_for, retrievals)
    questions = load_questions(questions_path)
    if limit is not None:
        questions = questions[:limit]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    opening = (str(store_path), max_new_tokens, rerank)
    engines = _open_engines(plan, models, engine, opening, console)
    rows = _answer_all(plan, engines, questions, Path(questions_path).stem, console)
    results = aggregate(rows)
    table3 = best_under_budget(results, budgets_ms)
    first = engines[plan.entries[0][1]]
    write_eval_run(
        out,
        first.store,
        [questions_path],
        kind="eval",
        methods=[f"{name}@{label}" for name, label in plan.entries],
        models={label: e.loaded.model_fp for label, e in engines.items()},
        sweep=plan.sweep,
        retrievals=sorted({r["retrieval"] for r in rows}),
        max_new_tokens=max_new_tokens,
        n_questions=len(questions),
        rerank=first.rerank,
    )
    _write_report(out, rows, results, table3, console)
    return results


@dataclass
class _EvalPlan:
    """What an evaluation runs, checked before any model loads: ``entries`` (method, model
    label), per-entry question ``limits``, the (kc, k) ``sweep``, the search ``modes``."""

    entries: list[tuple[str, str]]
    limits: dict[tuple[str, str], int]
    sweep: list[tuple[int, int]]
    modes: list[str | None]

    @classmethod
    def check(
        cls,
        methods: Sequence[str],
        models: Sequence[EvalModel],
        sweep: Sequence[tuple[int, int]],
        max_new_tokens: int,
        limit_for: dict[str, int] | None,
        retrievals: Sequence[str] | None,
    ) -> _EvalPlan:
        """The plan, or a ValueError naming the bad value."""
        from coinrag.inference.methods import METHODS

        if len({m.label for m in models}) != len(models):
            raise ValueError(f"two models share a label: {', '.join(m.label for m in models)}")
        entries = list(dict.fromkeys(split_method(m, models) for m in methods))
        bad = [m for m, _ in entries if m not in METHODS]
        if bad or not entries:
            raise ValueError(f"methods must be among {', '.join(METHODS)}; got {list(methods)}")
        limits = {split_method(m, models): int(n) for m, n in (limit_for or {}).items()}
        if any(n < 1 for n in limits.values()):
            raise ValueError("a --limit-for count must be >= 1")
        unknown = [f"{m}@{label}" for m, label in limits if (m, label) not in entries]
        if unknown:
            raise ValueError(f"--limit-for {', '.join(unknown)}: not among the methods run")
        pairs = [(int(kc), int(k)) for kc, k in sweep]
        if not pairs or any(kc < 1 or k < 1 for kc, k in pairs):
            raise ValueError(f"sweep must be non-empty (kc, k) pairs with kc, k >= 1; got {pairs}")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        modes: list[str | None] = list(dict.fromkeys(retrievals)) if retrievals else [None]
        for mode in modes:
            if mode is not None:
                search_mode(mode)  # an unknown mode is refused before any model loads
        return cls(entries, limits, pairs, modes)

    def runs(self, qi: int, label: str, method: str) -> bool:
        """Whether question ``qi`` is asked of ``method`` on model ``label`` (--limit-for)."""
        return qi < self.limits.get((method, label), qi + 1)


def _open_engines(
    plan: _EvalPlan,
    models: Sequence[EvalModel],
    engine: Any,
    opening: tuple[str, int, str | None],
    console: Any,
) -> dict[str, Any]:
    """One engine per model label that runs a method (``engine``: the first model's, already
    open), each opened on ``opening``: the store's path, ``max_new_tokens`` and the reranker's
    name (None: the store's)."""
    from coinrag.inference.methods import RagEngine

    store_path, max_new_tokens, rerank = opening
    engines: dict[str, Any] = {}
    for m in models:
        wanted = [name for name, label in plan.entries if label == m.label]
        if not wanted:
            continue
        if engine is not None and m is models[0]:
            engines[m.label] = engine
            continue
        console.log(
            f"loading model {m.label} ({m.ref or 'the store' + chr(39) + 's'}) and {store_path}"
        )
        engines[m.label] = RagEngine.open(
            store_path, model=m.ref, max_new_tokens=max_new_tokens, methods=wanted, rerank=rerank
        )
    return engines


def _answer_all(
    plan: _EvalPlan, engines: dict[str, Any], questions: Sequence[Any], dataset: str, console: Any
) -> list[dict[str, Any]]:
    """Every question x config x search mode: one per-question row each (after one untimed
    warm-up answer per method and model, on the first question)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    opened = [(label, engines[label].method(name)) for name, label in plan.entries]
    configs = _configs(opened, plan.sweep)
    kc0, k0 = plan.sweep[0]
    for name, label in plan.entries:
        for mode in plan.modes:
            engines[label].answer(questions[0].question, method=name, kc=kc0, k=k0, retrieval=mode)
    rows: list[dict[str, Any]] = []
    n = len(questions)
    total = len(plan.modes) * sum(plan.runs(qi, c[0], c[1]) for qi in range(n) for c in configs)
    columns = (BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    description = "[progress.description]{task.description}"
    # no refresh thread: it takes the GIL ten times a second, and the timed reads and kernels
    # wait for it (int2mix's fetch 2.1 ms median with it, 0.6 without); redrawn per answer
    with Progress(
        description, *columns, console=console, disable=console.quiet, auto_refresh=False
    ) as bar:
        task = bar.add_task("evaluating", total=total)
        for qi, q in enumerate(questions):
            cache: dict[Any, Any] = {}  # retrieval key -> result, shared between methods
            for (label, method, kc, k), mode in itertools.product(configs, plan.modes):
                if not plan.runs(qi, label, method):
                    continue
                rag = engines[label].method(method)
                key = rag.retrieval_key(kc, k, mode)
                if key not in cache:
                    cache[key] = rag.retrieve(q.question, kc, k, mode=mode)
                ans = rag.run(q.question, cache[key], kc, k)
                rows.append(_row(qi, q, dataset, label, method, kc, k, ans))
                bar.update(task, advance=1, refresh=True)
            if not console.is_terminal and ((qi + 1) % 5 == 0 or qi + 1 == n):
                console.log(f"{qi + 1}/{n} questions done")  # log lines off a tty
    return rows


def _row(
    qi: int, q: Any, dataset: str, label: str, method: str, kc: int, k: int, ans: Any
) -> dict[str, Any]:
    """One per-question row (``schemas.evaluation.PER_QUESTION_SCHEMA``)."""
    ev_docs = list(dict.fromkeys(e["doc_id"] for e in ans.evidence))
    return {
        "qid": qi,
        "line": q.line,
        "dataset": dataset,
        "model": label,
        "method": method,
        "retrieval": ans.retrieval,
        "kc": kc,
        "k": k,
        "question": q.question,
        "answer": ans.answer,
        "gold": q.answers,
        "gold_doc_ids": q.doc_ids,
        "f1": token_f1(ans.answer, q.answers),
        "em": exact_match(ans.answer, q.answers),
        "recall": doc_recall(ev_docs, q.doc_ids),
        "ttft_ms": float(ans.timings["ttft"]),
        "timings": [(n, float(v)) for n, v in ans.timings.items()],
        "active_tokens": int(ans.active_tokens),
        "evidence_doc_ids": ev_docs,
        "evidence_citations": [e.get("citation") or e["doc_id"] for e in ans.evidence],
    }


def _write_report(
    out: Path, rows: list[dict[str, Any]], results: pa.Table, table3: pa.Table, console: Any
) -> None:
    """The tables and plots under ``out``; the report on stdout, the file list on stderr."""
    from rich.console import Console

    pq.write_table(
        pa.Table.from_pylist(rows, schema=PER_QUESTION_SCHEMA), out / "per_question.parquet"
    )
    pq.write_table(results, out / "results.parquet")
    pq.write_table(table3, out / "table3.parquet")
    pq.write_table(table3, out / "best_under_budget.parquet")  # its former name, same rows
    (out / "table3.md").write_text(table3_markdown(table3), encoding="utf-8")
    figures = [*plot_pareto(results, out), plot_budget_curve(results, out)]
    ablation = plot_ablation(table3, out)
    figures += [ablation] if ablation else []
    report = Console(quiet=console.quiet)  # the report on stdout (as `coinrag query` prints)
    report.print(results_text(results), highlight=False, soft_wrap=True, markup=False)
    report.print(budget_text(table3), highlight=False, soft_wrap=True, markup=False)
    console.log(
        f"wrote {out}/results.parquet, per_question.parquet, table3.parquet, table3.md, "
        f"{EVAL_RUN_FILE}, " + ", ".join(p.name for p in figures)
    )
