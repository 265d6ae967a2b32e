"""``coinrag query`` and ``coinrag eval``: their options are generated from
``schemas.settings.QueryOptions`` / ``EvalOptions`` (the server's requests from the same
``QueryOptions``), and the runtime settings from ``RuntimeSettings``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from coinrag.flows.cli import common
from coinrag.flows.cli.common import BuiltStore, ModelOption, console, fail
from coinrag.flows.settings_options import with_options, with_settings_options
from coinrag.schemas.settings import EvalOptions, QueryOptions, RuntimeSettings

RUNTIME_PANEL = "Runtime settings"


@with_options(QueryOptions)
@with_settings_options(RuntimeSettings, panel=RUNTIME_PANEL)
def query(
    question: Annotated[str, typer.Argument(help="The question.")],
    store: BuiltStore,
    options: QueryOptions,
    model: ModelOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    *,
    overrides: dict[str, Any],
) -> None:
    """Answer QUESTION from STORE: retrieval, KV assembly, query prefill, greedy decoding.

    ``--method cartridge`` retrieves --k documents and answers from their trained cartridges.
    """
    from coinrag.flows import preflight
    from coinrag.schemas.qa import require_question
    from coinrag.schemas.settings import LOCAL_STORE_METHODS

    method = options.method
    require_question(question)
    if method in LOCAL_STORE_METHODS:
        common.require_local(store, f"query --method {method}")
    st = preflight.built_store(store)
    preflight.store_methods(st, [method])
    if model is not None:
        preflight.model(model)

    from coinrag.inference.model.threads import apply_runtime

    apply_runtime(preflight.runtime_settings(common.given(overrides)), serving=False)
    from coinrag.inference.methods import RagEngine

    with common.exit_on(1, LookupError, ValueError, FileNotFoundError):
        engine = RagEngine.open(
            str(store), model=model, max_new_tokens=options.max_new_tokens, methods=[method]
        )
        result = engine.ask(question, options)
    if json_out:
        print(result.to_json_text())
        return
    from coinrag.flows import render

    render.print_answer(Console(), result)


Questions = Annotated[
    Path,
    typer.Argument(
        help="JSONL: question, answers (list), optional doc_ids (gold); the train nuggets "
        "format (answer, gold_doc_ids or documents) is read too."
    ),
]


@with_options(EvalOptions)
@with_settings_options(RuntimeSettings, panel=RUNTIME_PANEL)
def eval_cmd(
    questions: Questions,
    store: BuiltStore,
    out: Annotated[Path, typer.Option("--out", help="Folder for results, plots.")],
    options: EvalOptions,
    *,
    overrides: dict[str, Any],
) -> None:
    """Answer QUESTIONS with each method, model and (kc, k); write results.parquet,
    per-question rows, Table 3 (table3.md / table3.parquet: best F1 under P99 TTFT budgets) and
    plots (F1 vs P99 TTFT on a log axis, F1 vs active tokens, F1 vs budget, the ablations).
    With --retrieval-only: write retrieval.parquet (recall, MRR, search latency) instead.
    The report is printed on stdout, progress on stderr."""
    from coinrag.flows import preflight
    from coinrag.schemas.qa import load_questions

    models, limits = _eval_inputs(store, options)
    load_questions(questions)  # every line checked before any model loads
    preflight.output_folder(out, "--out")
    st = preflight.built_store(store)

    from coinrag.inference.model.threads import apply_runtime

    apply_runtime(preflight.runtime_settings(common.given(overrides)), serving=True)
    if options.retrieval_only:
        _eval_retrieval(store, questions, out, options)
        return
    from coinrag.inference.evaluation.evaluate import evaluate
    from coinrag.inference.methods import methods_for, unavailable_methods
    from coinrag.schemas.settings import DEFAULT_RAG_METHODS

    methods = options.methods
    if methods:  # METHOD or METHOD@LABEL: the store must serve each method
        preflight.store_methods(st, list(dict.fromkeys(m.partition("@")[0] for m in methods)))
    else:  # the default methods the store's assets can run
        methods = methods_for(st, DEFAULT_RAG_METHODS)
        for left_out, why in unavailable_methods(st, DEFAULT_RAG_METHODS).items():
            console.print(f"note: {left_out} left out: {escape(why)}", soft_wrap=True)
    with common.exit_on(2, ValueError, FileNotFoundError):
        evaluate(
            str(store),
            str(questions),
            str(out),
            methods=tuple(methods),
            sweep=options.sweep,
            max_new_tokens=options.max_new_tokens,
            limit=options.limit,
            models=models,
            limit_for=limits,
            retrievals=options.retrieval,
            rerank=options.rerank,
        )


def _eval_inputs(store: str, options: EvalOptions) -> tuple[list[Any] | None, dict[str, int]]:
    """The models (``--model LABEL=REF``) and ``--limit-for`` counts, checked with the methods
    before anything loads (exit 2 for a bad value)."""
    from coinrag.flows import preflight
    from coinrag.inference.evaluation.evaluate import EvalModel, split_method
    from coinrag.schemas.settings import LOCAL_STORE_METHODS, RAG_METHODS

    with common.exit_on(2, ValueError):
        models = [EvalModel.parse(m) for m in options.model] if options.model else None
        names = [
            split_method(m, models or [EvalModel("default")])[0] for m in options.methods or []
        ]
        limits = dict(_count(x, "--limit-for") for x in options.limit_for or [])
    bad = [m for m in names if m not in RAG_METHODS]
    if bad:
        fail(f"--methods {' '.join(bad)}: not among {', '.join(RAG_METHODS)}", 2)
    for method in dict.fromkeys(m for m in names if m in LOCAL_STORE_METHODS):
        common.require_local(store, f"eval --methods {method}")
    for m in models or []:
        if m.ref is not None:
            preflight.model(m.ref)
    return models, limits


def _eval_retrieval(store: str, questions: Path, out: Path, options: EvalOptions) -> None:
    """``eval --retrieval-only``: hits of gold documents per search mode, no model."""
    from coinrag.inference.evaluation.retrieval_only import (
        RETRIEVAL_KCS,
        evaluate_retrieval,
        retrieval_text,
    )
    from coinrag.schemas.settings import DEFAULT_QUERY, RETRIEVAL_MODES

    with common.exit_on(2, ValueError), common.exit_on(1, FileNotFoundError):
        table = evaluate_retrieval(
            str(store),
            str(questions),
            str(out),
            kcs=options.kc or RETRIEVAL_KCS,
            ks=options.k or [DEFAULT_QUERY.k],
            retrievals=options.retrieval or RETRIEVAL_MODES,
            limit=options.limit,
            rerank=options.rerank,
        )
    Console().print(retrieval_text(table), highlight=False, soft_wrap=True)


def _count(text: str, option: str) -> tuple[str, int]:
    """``NAME=N`` -> ``(NAME, N)`` (ValueError naming ``option`` otherwise)."""
    name, _, n = text.rpartition("=")
    if not name or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{option} {text!r}: give METHOD=N with N >= 1")
    return name, int(n)
