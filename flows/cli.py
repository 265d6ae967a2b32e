"""The ``coinrag`` command line.

Exit codes: 0 done; 1 failed (nothing or not everything was built: the message says why);
2 usage error (unknown option, bad value); 3 built, but some documents were rejected (listed);
4 built, but some work failed and is retried by the next build (chunk texts the LLM endpoint
did not answer, or answered only malformed: one ``error:`` line each); with rejects too, 4.
Chunk texts abandoned (malformed in ``abandon_after`` builds) are one ``warning:`` line, exit 0.
130 interrupted (Ctrl-C), 143 terminated (SIGTERM): both unwind, leaving no process behind.

What can be checked cheaply is checked before any work (``flows/preflight.py``: paths,
models, keys, the lock), so a mistake costs a second and one ``error:`` line; an unexpected
error is one ``error:`` line too, its traceback (and Prefect's) shown with ``--debug``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from coinrag.flows.cli_lists import ListOptionsCommand
from coinrag.flows.preflight import Preflight
from coinrag.flows.settings_options import with_settings_options
from coinrag.inference.quiet import quiet_libraries
from coinrag.schemas.secrets import API_KEY_ENV
from coinrag.schemas.settings import (
    RAG_METHODS,
    RETRIEVAL_MODES,
    ApiSettings,
    BuildSettings,
    FinetuneSettings,
    RuntimeSettings,
)

app = typer.Typer(
    help="coinrag: the offline asset factory for KV-cache-reuse RAG.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

SAMPLE = Path(__file__).parent / "sample" / "wiki_sample.jsonl"
_DEBUG = {"on": False}  # --debug: tracebacks of unexpected errors, Prefect's included

T = TypeVar("T")


@app.callback()
def _root(
    debug: Annotated[
        bool,
        typer.Option("--debug", help="Show tracebacks, and model libraries' progress bars."),
    ] = False,
) -> None:
    """coinrag: the offline asset factory for KV-cache-reuse RAG."""
    _DEBUG["on"] = debug
    if not debug:  # the model libraries' progress bars and self-talk: --debug shows them
        quiet_libraries()


def _error(message: str) -> None:
    # soft_wrap: never break an error line (paths stay whole, copyable and greppable)
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def _fail(message: str, code: int = 1) -> None:
    _error(message)
    raise typer.Exit(code)


def _check(check: Callable[..., T], *args: Any) -> T:
    """Run a check of ``flows/preflight.py``; its :class:`Preflight` becomes the error line."""
    try:
        return check(*args)
    except Preflight as exc:
        _fail(str(exc), exc.code)
        raise  # unreachable: _fail exits


def _prefect_run() -> None:
    """Before a command's first flow run: Prefect's temporary server bound to this process
    (``flows/prefect_api.py``), and Prefect's console tracebacks only with --debug."""
    from coinrag.flows.prefect_api import bind_temporary_server, hide_prefect_tracebacks

    if not _DEBUG["on"]:
        hide_prefect_tracebacks()
    bind_temporary_server()


def _require_local(store: str, what: str) -> None:
    """Fail (exit 1) before any work when ``what`` is asked of an object store."""
    from coinrag.flows.preflight import store_at
    from coinrag.storage.store import LocalStoreRequired

    try:
        _check(store_at, store).require_local(what)
    except LocalStoreRequired as exc:
        _fail(str(exc), 1)


# Build settings as options: generated from the fields of BuildSettings marked cli=True
# (flows/settings_options.py), the same for `build` and `serve`; None: the [build] table of
# --config, else the default.
ConfigOption = Annotated[
    Path | None, typer.Option(help="TOML file with a \\[build] table of the same settings.")
]


@app.command()
@with_settings_options(BuildSettings)
def build(
    source: Annotated[
        str,
        typer.Argument(
            help="Folder of .txt/.md files, a .jsonl file ({id, text, ...}), a .parquet file "
            "(id, text columns), or 'sample' for the bundled sample corpus."
        ),
    ],
    store: Annotated[
        str,
        typer.Option(
            "--store", help="The store: a folder (created if absent) or s3://bucket/prefix."
        ),
    ],
    config: ConfigOption = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Build or update STORE from SOURCE: chunks, nuggets, and (later stages) KV and indexes."""
    from coinrag.schemas.settings import SettingsError, load_settings
    from coinrag.tasks.ingest import SourceError

    if source == "sample":
        source = str(SAMPLE)
    try:
        settings = load_settings(config, overrides)
    except SettingsError as exc:
        _fail(str(exc), 2)
    from coinrag.flows import preflight

    _check(preflight.source, source)
    st = _check(preflight.store_to_write, store)
    _check(preflight.build_settings, settings)
    existed = st.is_local and Path(st.root).exists()

    from coinrag.flows.build import build_flow
    from coinrag.storage.store import StoreLocked
    from coinrag.tasks.kv_space import KvSpaceError

    _prefect_run()
    try:
        summary = build_flow(source=source, store=str(store), settings=settings.to_dict())
    except (SourceError, StoreLocked, KvSpaceError) as exc:
        preflight.remove_skeleton(st, existed)
        _fail(str(exc), 1)
    except BaseException:
        preflight.remove_skeleton(st, existed)
        raise
    from coinrag.flows import render

    render.print_build_summary(Console(), summary)
    rejected, failures = summary["rejected"], summary["failures"]
    for r in rejected:
        console.print(f"[yellow]rejected[/] {r['doc_id'] or '-'}: {r['reason']}: {r['detail']}")
    if rejected:
        _error(f"{len(rejected)} document(s) rejected (see the rejects table)")
    for line in failures:
        _error(f"{line}; run coinrag build again to retry them")
    for line in summary.get("warnings", []):
        console.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)
    if failures or rejected:
        raise typer.Exit(4 if failures else 3)


@app.command()
@with_settings_options(RuntimeSettings, panel="Runtime settings")
def query(
    question: Annotated[str, typer.Argument(help="The question.")],
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    method: Annotated[str, typer.Option(help=" | ".join(RAG_METHODS))] = "coinrag",
    kc: Annotated[int, typer.Option(min=1, help="Chunks retrieved in stage 1.")] = 4,
    k: Annotated[
        int,
        typer.Option(min=1, help="Nuggets retrieved in stage 2 (coinrag); documents (cartridge)."),
    ] = 10,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Upper bound on answer tokens.")] = 32,
    model: Annotated[
        str | None, typer.Option(help="Generation model (default: the store's).")
    ] = None,
    oracle_doc: Annotated[
        str | None,
        typer.Option(
            help="Oracle mode: answer from this document only (cartridge: its cartridge; the "
            "others: retrieval among its chunks)."
        ),
    ] = None,
    retrieval: Annotated[
        str | None,
        typer.Option(
            help=" | ".join(RETRIEVAL_MODES) + " (default: the store's retrieval setting)."
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    *,
    overrides: dict[str, Any],
) -> None:
    """Answer QUESTION from STORE: retrieval, KV assembly, query prefill, greedy decoding.

    ``--method cartridge`` retrieves --k documents and answers from their trained cartridges.
    """
    from coinrag.flows import preflight
    from coinrag.schemas.qa import BlankQuestion, require_question
    from coinrag.schemas.settings import LOCAL_STORE_METHODS, RAG_METHODS

    if method not in RAG_METHODS:
        _fail(f"--method {method!r} is not one of {', '.join(RAG_METHODS)}", 2)
    if retrieval is not None and retrieval not in RETRIEVAL_MODES:
        _fail(f"--retrieval {retrieval!r} is not one of {', '.join(RETRIEVAL_MODES)}", 2)
    try:
        require_question(question)
    except BlankQuestion as exc:
        _fail(str(exc), 2)
    if method in LOCAL_STORE_METHODS:
        _require_local(store, f"query --method {method}")
    st = _check(preflight.built_store, store)
    _check(preflight.store_methods, st, [method])
    if model is not None:
        _check(preflight.model, model)

    from coinrag.inference.threads import apply_runtime

    apply_runtime(_check(preflight.runtime_settings, _given(overrides)), serving=False)
    from coinrag.inference.methods import MissingAssets, RagEngine

    doc_ids = [oracle_doc] if oracle_doc else None
    try:
        engine = RagEngine.open(
            str(store), model=model, max_new_tokens=max_new_tokens, methods=[method]
        )
        result = engine.answer(question, method, kc=kc, k=k, doc_ids=doc_ids, retrieval=retrieval)
    except (MissingAssets, LookupError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc), 1)
    if json_out:
        print(result.to_json_text())
        return
    from coinrag.flows import render

    render.print_answer(Console(), result)


@app.command(cls=ListOptionsCommand)
@with_settings_options(ApiSettings, panel="Server settings")
def api(
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    workers: Annotated[
        int, typer.Option(min=1, help="Server processes (each loads the model once).")
    ] = 1,
    methods: Annotated[
        list[str] | None,
        typer.Option(
            "--methods",
            help="Methods served (default: coinrag turborag standard): --methods coinrag",
        ),
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Generation model (default: the store's).")
    ] = None,
    max_new_tokens: Annotated[
        int, typer.Option(min=1, help="A request's max_new_tokens when it gives none.")
    ] = 32,
    config: Annotated[
        Path | None, typer.Option(help="TOML file with an \\[api] table of the server settings.")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            show_default=False,
            help="API key requests must send (Authorization: Bearer KEY); prefer the env var.",
        ),
    ] = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Serve STORE over HTTP: POST /query (and streaming), GET /health, GET /metrics.

    Loads the model, embedder, index and KV readers once and warms them; follows every version
    a build, delete or gc publishes (in-flight requests finish on theirs). Runs until Ctrl-C.
    Listening beyond loopback (--host 0.0.0.0) needs an API key (or --insecure).
    """
    from coinrag.flows import preflight
    from coinrag.schemas.settings import (
        DEFAULT_RAG_METHODS,
        RAG_METHODS,
        SettingsError,
        load_api_settings,
    )

    bad = [m for m in methods or [] if m not in RAG_METHODS]
    if bad:
        _fail(f"--methods {' '.join(bad)}: not among {', '.join(RAG_METHODS)}", 2)
    try:
        settings = load_api_settings(config, overrides)
    except SettingsError as exc:
        _fail(str(exc), 2)
    import dataclasses
    import logging

    from coinrag.inference.methods import MissingAssets
    from coinrag.inference.server.app import LOG_FORMAT, ServerConfig, serve

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    insecure = _check(preflight.api_access, host, api_key, settings)  # before the port binds
    if insecure:
        logging.getLogger("coinrag.api").warning(insecure)
    _check(preflight.built_store, store)
    if model is not None:
        _check(preflight.model, model)
    served = ServerConfig(
        store=str(store),
        model=model,
        methods=tuple(dict.fromkeys(methods or DEFAULT_RAG_METHODS)),
        max_new_tokens=max_new_tokens,
        settings=dataclasses.asdict(settings),
        api_key=api_key,
    )
    try:
        serve(served, host, port, workers)
    except (MissingAssets, LookupError, ValueError) as exc:
        _fail(str(exc), 1)


def _given(overrides: dict[str, Any]) -> dict[str, Any]:
    """The generated options that were given (``None``: not given)."""
    return {name: value for name, value in overrides.items() if value is not None}


@app.command("eval", cls=ListOptionsCommand)
@with_settings_options(RuntimeSettings, panel="Runtime settings")
def eval_cmd(
    questions: Annotated[
        Path,
        typer.Argument(
            help="JSONL: question, answers (list), optional doc_ids (gold); the train nuggets "
            "format (answer, gold_doc_ids or documents) is read too."
        ),
    ],
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    out: Annotated[Path, typer.Option("--out", help="Folder for results, plots.")],
    methods: Annotated[
        list[str] | None,
        typer.Option(
            "--methods",
            help="Methods (default: coinrag turborag standard): --methods coinrag cartridge",
        ),
    ] = None,
    kc: Annotated[
        list[int] | None, typer.Option("--kc", min=1, help="kc values to sweep: --kc 1 2 4")
    ] = None,
    k: Annotated[
        list[int] | None, typer.Option("--k", min=1, help="k values to sweep: --k 5 10")
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Upper bound on answer tokens.")] = 32,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N questions.")] = None,
    model: Annotated[
        list[str] | None,
        typer.Option(
            "--model",
            help="Models to compare, LABEL=REF (REF: a model folder, a KVLink adapter folder, or "
            "default for the store's): --model trained=OUT base=default; run a method on one "
            "with --methods coinrag@base (a bare name runs on the first).",
        ),
    ] = None,
    limit_for: Annotated[
        list[str] | None,
        typer.Option(
            "--limit-for",
            help="A method on the first N questions only: --limit-for standard=20 kvlink@links=20",
        ),
    ] = None,
    retrieval: Annotated[
        list[str] | None,
        typer.Option(
            "--retrieval",
            help="Search modes to compare: --retrieval dense lexical hybrid (default: the "
            "store's retrieval setting; with --retrieval-only: all three).",
        ),
    ] = None,
    retrieval_only: Annotated[
        bool,
        typer.Option(
            "--retrieval-only",
            help="Only hits of gold documents (chunks, two-stage, one-stage) per search mode: "
            "no model, no KV.",
        ),
    ] = False,
    *,
    overrides: dict[str, Any],
) -> None:
    """Answer QUESTIONS with each method, model and (kc, k); write results.parquet,
    per-question rows, Table 3 (table3.md / table3.parquet: best F1 under P99 TTFT budgets) and
    plots (F1 vs P99 TTFT on a log axis, F1 vs active tokens, F1 vs budget, the ablations).
    With --retrieval-only: write retrieval.parquet (recall, MRR, search latency) instead.
    The report is printed on stdout, progress on stderr."""
    from coinrag.flows import preflight
    from coinrag.inference.evaluate import EvalModel, split_method
    from coinrag.schemas.qa import QuestionsError, load_questions
    from coinrag.schemas.settings import DEFAULT_RAG_METHODS, LOCAL_STORE_METHODS, RAG_METHODS

    try:
        models = [EvalModel.parse(m) for m in model] if model else None
        names = [split_method(m, models or [EvalModel("default")])[0] for m in methods or []]
        limits = dict(_count(x, "--limit-for") for x in limit_for or [])
    except ValueError as exc:
        _fail(str(exc), 2)
    bad = [m for m in names if m not in RAG_METHODS]
    if bad:
        _fail(f"--methods {' '.join(bad)}: not among {', '.join(RAG_METHODS)}", 2)
    bad = [m for m in retrieval or [] if m not in RETRIEVAL_MODES]
    if bad:
        _fail(f"--retrieval {' '.join(bad)}: not among {', '.join(RETRIEVAL_MODES)}", 2)
    for method in dict.fromkeys(m for m in names if m in LOCAL_STORE_METHODS):
        _require_local(store, f"eval --methods {method}")
    for m in models or []:
        if m.ref is not None:
            _check(preflight.model, m.ref)
    try:
        load_questions(questions)  # every line checked before any model loads
    except QuestionsError as exc:
        _fail(str(exc), 2)
    _check(preflight.output_folder, out, "--out")
    st = _check(preflight.built_store, store)

    from coinrag.inference.threads import apply_runtime

    apply_runtime(_check(preflight.runtime_settings, _given(overrides)), serving=True)
    from coinrag.inference.evaluate import evaluate

    if retrieval_only:
        from coinrag.inference.evaluate_retrieval import evaluate_retrieval, retrieval_text
        from coinrag.storage.index import EmbedderMismatch, IndexNotBuilt

        try:
            table = evaluate_retrieval(
                str(store),
                str(questions),
                str(out),
                kcs=kc or [1, 2, 4, 8],
                ks=k or [10],
                retrievals=retrieval or RETRIEVAL_MODES,
                limit=limit,
            )
        except (IndexNotBuilt, FileNotFoundError) as exc:
            _fail(str(exc), 1)
        except (EmbedderMismatch, ValueError) as exc:
            _fail(str(exc), 2)
        Console().print(retrieval_text(table), highlight=False, soft_wrap=True)
        return
    from coinrag.inference.methods import MissingAssets, methods_for, unavailable_methods

    if methods:  # METHOD or METHOD@LABEL: the store must serve each method
        _check(
            preflight.store_methods, st, list(dict.fromkeys(m.partition("@")[0] for m in methods))
        )
    else:  # the default methods the store's assets can run
        methods = methods_for(st, DEFAULT_RAG_METHODS)
        for left_out, why in unavailable_methods(st, DEFAULT_RAG_METHODS).items():
            console.print(f"note: {left_out} left out: {escape(why)}", soft_wrap=True)
    sweep = tuple((a, b) for a in (kc or [4]) for b in (k or [10]))
    try:
        evaluate(
            str(store),
            str(questions),
            str(out),
            methods=tuple(methods),
            sweep=sweep,
            max_new_tokens=max_new_tokens,
            limit=limit,
            models=models,
            limit_for=limits,
            retrievals=retrieval,
        )
    except MissingAssets as exc:
        _fail(str(exc), 1)
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc), 2)


def _count(text: str, option: str) -> tuple[str, int]:
    """``NAME=N`` -> ``(NAME, N)`` (ValueError naming ``option`` otherwise)."""
    name, _, n = text.rpartition("=")
    if not name or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{option} {text!r}: give METHOD=N with N >= 1")
    return name, int(n)


@app.command()
def lineage(
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    sql: Annotated[
        str | None, typer.Argument(help="One SELECT over the lineage views and the tables.")
    ] = None,
    nugget: Annotated[
        str | None, typer.Option(help="Walk up and down from this nugget_id.")
    ] = None,
    chunk: Annotated[str | None, typer.Option(help="Walk up and down from this chunk_id.")] = None,
    doc: Annotated[str | None, typer.Option(help="Walk down from this doc_id.")] = None,
    stale: Annotated[
        bool, typer.Option("--stale", help="Assets whose producer differs from the settings'.")
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    csv_out: Annotated[bool, typer.Option("--csv", help="Print CSV (SQL and --stale).")] = False,
) -> None:
    """Lineage of a store's assets: run SQL over its views, walk the chain through one nugget,
    chunk or document, or list stale assets. Without any of these: list the views. Read-only
    (works while a build runs)."""
    from coinrag.flows import preflight, render
    from coinrag.storage.lineage import LineageError
    from coinrag.tasks import lineage as queries

    walks = {k: v for k, v in {"nugget": nugget, "chunk": chunk, "doc": doc}.items() if v}
    modes = len(walks) + (sql is not None) + stale
    if modes > 1:
        _fail("give one of SQL, --nugget, --chunk, --doc, --stale", 2)
    if json_out and csv_out:
        _fail("--json and --csv exclude each other", 2)
    if csv_out and walks:
        _fail("--csv prints one table: use it with SQL or --stale (--json for a walk)", 2)
    st = _check(preflight.built_store, store)
    out = Console()
    if modes == 0:
        render.print_views(out)
        return
    try:
        if walks:
            ((kind, ident),) = walks.items()
            sections = queries.lineage_walk(st, kind, ident)
        else:
            result = queries.lineage_stale(st) if stale else queries.lineage_sql(st, sql or "")
    except LineageError as exc:
        _fail(str(exc), 1 if walks else 2)
    except (OSError, ValueError) as exc:  # settings or producers of --stale that cannot load
        _fail(f"cannot compute the current producers from {st.uri(st.settings_path)}: {exc}", 1)
    if walks:
        if json_out:
            print(render.to_json(sections))
        else:
            for name, table in sections.items():
                render.print_section(out, name, table)
    elif json_out:
        print(render.to_json(result))
    elif csv_out:
        sys.stdout.write(render.to_csv(result))
    else:
        render.print_table(out, result, "stale assets" if stale else None)


train_app = typer.Typer(help="Training flows over a built store.", no_args_is_help=True)
app.add_typer(train_app, name="train")


@train_app.command("cartridges", cls=ListOptionsCommand)
def train_cartridges_cmd(
    store: Annotated[str, typer.Option("--store", help="A built store (a local folder).")],
    docs: Annotated[
        list[str] | None, typer.Option("--docs", help="Document ids (default: all): --docs a b")
    ] = None,
    max_steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = 200,
    generator: Annotated[
        str | None,
        typer.Option(help="Question generator: openai | local (default: openai if a key is set)."),
    ] = None,
) -> None:
    """Self-study data, then CAS cartridges (one trainable KV prefix per document)."""
    import json

    from coinrag.flows import preflight

    if generator not in (None, "openai", "local"):
        _fail(f"--generator {generator!r} is not one of openai, local", 2)
    _require_local(store, "coinrag train cartridges")
    st = _check(preflight.built_store, store)
    if generator == "openai":
        _check(preflight.openai_key, "--generator", generator)
    _check(preflight.unlocked, st)

    from coinrag.flows.cartridges import train_cartridges
    from coinrag.storage.store import StoreLocked

    extra = {"generator": generator} if generator else {}
    _prefect_run()
    try:
        summary = train_cartridges(str(store), docs or None, max_steps, **extra)
    except (KeyError, ValueError, StoreLocked) as exc:
        _fail(str(exc), 1)
    Console().print_json(json.dumps(summary, default=str))


@train_app.command("nuggets")
@with_settings_options(FinetuneSettings, panel="Fine-tuning settings")
def train_nuggets_cmd(
    store: Annotated[str, typer.Option("--store", help="A built store (a local folder).")],
    data: Annotated[
        Path,
        typer.Option(
            "--data",
            help="JSONL of QA examples: question, answer, and documents or doc_ids (the eval "
            "format, answers + doc_ids, is read too).",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="Folder for the fine-tuned model.")],
    rebuild_kv: Annotated[
        bool, typer.Option("--rebuild-kv", help="Rebuild the store's KV for the new model.")
    ] = False,
    *,
    overrides: dict[str, Any],
) -> None:
    """Nugget-aware fine-tuning on (C_ctx, question) -> answer, with the inference assembly."""
    import json

    from coinrag.flows import preflight
    from coinrag.schemas.settings import FINETUNE_MODES

    given = {name: value for name, value in overrides.items() if value is not None}
    if given.get("mode", "live") not in FINETUNE_MODES:
        _fail(f"--mode {given['mode']!r} is not one of {', '.join(FINETUNE_MODES)}", 2)
    _require_local(store, "coinrag train nuggets")
    if not data.is_file():
        _fail(f"--data {data} does not exist", 1)
    from coinrag.schemas.qa import DataError, load_examples

    try:
        examples = load_examples(data)  # every line checked before any model loads
    except DataError as exc:
        _fail(str(exc), 2)
    _check(preflight.output_folder, out, "--out")
    if any(ex.documents for ex in examples):  # its documents are built into the store first
        st = _check(preflight.store_to_write, store)
    else:
        st = _check(preflight.built_store, store)
    _check(preflight.unlocked, st)

    from coinrag.flows.train import train_nuggets
    from coinrag.storage.store import StoreLocked

    _prefect_run()
    try:
        summary = train_nuggets(
            str(store),
            str(data),
            str(out),
            rebuild_kv=rebuild_kv,
            **given,
        )
    except (KeyError, ValueError, StoreLocked) as exc:
        _fail(str(exc), 1)
    Console().print_json(json.dumps(summary, default=str))


@train_app.command("kvlink")
def train_kvlink_cmd(
    store: Annotated[str, typer.Option("--store", help="A built store (a local folder).")],
    data: Annotated[
        Path,
        typer.Option("--data", help="JSONL of QA examples (as for `train nuggets`)."),
    ],
    out: Annotated[Path, typer.Option("--out", help="Folder for the link adapter.")],
    n_link: Annotated[int, typer.Option(min=1, help="Link tokens after each chunk.")] = 5,
    max_docs: Annotated[
        int, typer.Option(min=1, help="Document slots with their own links (bounds --kc).")
    ] = 16,
    kc: Annotated[int, typer.Option(min=1, help="Chunks per example (as kvlink serves).")] = 5,
    lr: Annotated[float, typer.Option(min=0.0, help="Learning rate of the link tokens.")] = 1e-3,
    batch_size: Annotated[int, typer.Option(min=1, help="Examples per optimizer step.")] = 16,
    epochs: Annotated[int, typer.Option(min=1, help="Passes over the data.")] = 1,
    max_steps: Annotated[
        int | None, typer.Option(min=1, help="Stop after N optimizer steps.")
    ] = None,
    checkpoint_every: Annotated[
        int, typer.Option(min=1, help="Checkpoint every N steps (a killed run resumes).")
    ] = 50,
    model: Annotated[
        str | None, typer.Option(help="Base model (default: the store's); stays frozen.")
    ] = None,
) -> None:
    """KVLink: train link tokens after each retrieved chunk's stored KV (the base model frozen);
    serve them with `coinrag query --method kvlink --model OUT`."""
    import json

    from coinrag.flows import preflight

    _require_local(store, "coinrag train kvlink")
    if not data.is_file():
        _fail(f"--data {data} does not exist", 1)
    if kc > max_docs:
        _fail(f"--kc {kc} is more than --max-docs {max_docs}", 2)
    if lr <= 0:
        _fail("--lr must be > 0", 2)
    from coinrag.schemas.qa import DataError, load_examples

    try:
        examples = load_examples(data)
    except DataError as exc:
        _fail(str(exc), 2)
    _check(preflight.output_folder, out, "--out")
    if any(ex.documents for ex in examples):
        st = _check(preflight.store_to_write, store)
    else:
        st = _check(preflight.built_store, store)
    _check(preflight.unlocked, st)

    from coinrag.flows.train import train_kvlink_flow
    from coinrag.inference.methods import MissingAssets
    from coinrag.storage.kv import KvError
    from coinrag.storage.store import StoreLocked

    settings = {
        "kc": kc,
        "lr": lr,
        "batch_size": batch_size,
        "epochs": epochs,
        "max_steps": max_steps,
        "checkpoint_every": checkpoint_every,
    }
    _prefect_run()
    try:
        summary = train_kvlink_flow(
            str(store), str(data), str(out), n_link, max_docs, model=model, settings=settings
        )
    except (KeyError, ValueError, StoreLocked, MissingAssets, KvError, FileNotFoundError) as exc:
        _fail(str(exc), 1)
    Console().print_json(json.dumps(summary, default=str))


@app.command()
@with_settings_options(BuildSettings)
def serve(
    source: Annotated[
        str, typer.Argument(help="What to build (as for `coinrag build`), or 'sample'.")
    ],
    store: Annotated[
        str,
        typer.Option(
            "--store", help="The store: a folder (created if absent) or s3://bucket/prefix."
        ),
    ],
    cron: Annotated[
        str | None,
        typer.Option(help='Cron schedule, e.g. "0 3 * * *" (UTC); none: on change only.'),
    ] = None,
    name: Annotated[str, typer.Option(help="Deployment name.")] = "coinrag-build-scheduled",
    train_data: Annotated[
        Path | None,
        typer.Option("--train-data", help="QA JSONL: also fine-tune after each build."),
    ] = None,
    train_out: Annotated[
        Path | None, typer.Option("--train-out", help="Folder of the fine-tuned model.")
    ] = None,
    config: ConfigOption = None,
    *,
    overrides: dict[str, Any],
) -> None:
    """Serve the build as a Prefect deployment: on --cron, and on `coinrag watch` events.

    Long-running (needs PREFECT_API_URL, see infra/prefect_server.py); Ctrl-C stops it and
    pauses its schedule. Deployment construction: flows/deployments.py.
    """
    from coinrag.flows import preflight
    from coinrag.schemas.settings import SettingsError, load_settings

    source = str(SAMPLE) if source == "sample" else source
    _check(preflight.prefect_api, "serve")
    _check(preflight.source, source)
    st = _check(preflight.store_to_write, store, False)
    if (train_data is None) != (train_out is None):
        _fail("--train-data and --train-out go together", 2)
    if train_data is not None and not train_data.is_file():
        _fail(f"--train-data {train_data} does not exist", 1)
    try:
        settings = load_settings(config, overrides)
    except SettingsError as exc:
        _fail(str(exc), 2)
    _check(preflight.build_settings, settings)

    from coinrag.flows.deployments import make_serve_deployments, serve_build

    try:
        deployments = make_serve_deployments(
            str(Path(source).expanduser().resolve()),
            st.url,
            settings.to_dict(),
            cron=cron,
            name=name,
            train_data=str(train_data.resolve()) if train_data else None,
            train_out=str(train_out.expanduser().resolve()) if train_out else None,
        )
    except ValueError as exc:  # a bad cron
        _fail(str(exc), 2)
    try:
        serve_build(deployments)
    except RuntimeError as exc:
        _fail(str(exc), 1)


@app.command()
def watch(
    source: Annotated[str, typer.Argument(help="The source a served build deployment builds.")],
    store: Annotated[str, typer.Option("--store", help="Its store (folder or s3:// URL).")],
    interval: Annotated[float, typer.Option(help="Seconds between checks.")] = 30.0,
    once: Annotated[bool, typer.Option("--once", help="Check once and exit.")] = False,
) -> None:
    """Emit `coinrag.source.changed` (Prefect event) when SOURCE holds documents a build would
    (re)build (new, edited, or deleted from STORE) or STORE holds live documents SOURCE no
    longer has.

    A deployment served by `coinrag serve` for SOURCE rebuilds on that event (and drops the
    removed documents when its settings have prune = true). Needs PREFECT_API_URL; exits 1 when
    the server does not confirm it received the event.
    """
    from coinrag.flows import preflight

    source = str(SAMPLE) if source == "sample" else source
    if interval <= 0:
        _fail("--interval must be > 0", 2)
    _check(preflight.prefect_api, "watch")
    _check(preflight.source, source)
    _check(preflight.store_to_write, store, False)

    from coinrag.flows.source_events import watch_source
    from coinrag.tasks.changes import deleted_doc_ids
    from coinrag.tasks.ingest import SourceError

    def report(ids: list[str], removed: list[str]) -> None:
        text = f"coinrag.source.changed: {len(ids)} document(s): {', '.join(ids[:10])}"
        back = deleted_doc_ids(str(store), ids)
        if back:
            text += (
                f" ({len(back)} deleted from the store but still in SOURCE: a build brings "
                f"them back: {', '.join(back[:10])})"
            )
        if removed:
            text += f"; {len(removed)} removed: {', '.join(removed[:10])}"
        console.print(text, soft_wrap=True, markup=False)

    try:
        changed, removed = watch_source(
            source, str(store), interval=interval, once=once, report=report
        )
    except (SourceError, RuntimeError) as exc:
        _fail(str(exc), 1)
    if not changed and not removed:
        console.print("no changed documents")


@app.command()
def delete(
    doc_ids: Annotated[list[str], typer.Argument(help="Ids of the documents to delete.")],
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
) -> None:
    """Delete documents: tombstoned in the tables, gone from the index (their KV is reclaimed
    by `coinrag gc`). An id that is not a live document fails the whole command."""
    from coinrag.flows import preflight

    _check(preflight.unlocked, _check(preflight.built_store, store))

    from coinrag.flows.maintenance import delete_documents
    from coinrag.storage.store import StoreLocked
    from coinrag.tasks.delete import UnknownDocuments

    try:
        deleted = delete_documents(str(store), doc_ids)
    except (UnknownDocuments, StoreLocked, FileNotFoundError) as exc:
        _fail(str(exc), 1)
    for doc_id, version in deleted.items():
        Console().print(f"deleted {doc_id} (version {version})")


@app.command()
def gc(
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only report what would be reclaimed.")
    ] = False,
) -> None:
    """Reclaim space: KV entries no live chunk uses, old index versions, leftovers of killed
    writes. Takes the store's write lock."""
    from coinrag.flows import preflight

    _check(preflight.unlocked, _check(preflight.built_store, store))

    from coinrag.flows.maintenance import gc_counts, gc_store
    from coinrag.storage.store import StoreLocked

    try:
        report = gc_store(str(store), dry_run=dry_run)
    except (StoreLocked, FileNotFoundError) as exc:
        _fail(str(exc), 1)
    counts = gc_counts(report)
    verb = "would reclaim" if dry_run else "reclaimed"
    from coinrag.flows import render

    render.print_gc(Console(), counts, verb)


@app.command()
def verify(
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    level: Annotated[
        str,
        typer.Option(help="crc32c (every block, default) | stat (file sizes) | sha256 (entries)."),
    ] = "crc32c",
) -> None:
    """Check every stored KV entry (and prompt-prefix KV); list the corrupt ones with their
    chunk and document. Read-only. Exit 1 if any is corrupt: `coinrag build` repairs them."""
    from coinrag.flows import preflight
    from coinrag.flows.verify import verify_store
    from coinrag.inference.methods import repair_command
    from coinrag.schemas.settings import KV_VERIFY_LEVELS
    from coinrag.storage.store import Store

    if level not in KV_VERIFY_LEVELS:
        _fail(f"--level {level!r} is not one of {', '.join(KV_VERIFY_LEVELS)}", 2)
    _check(preflight.built_store, store)
    try:
        report = verify_store(str(store), level)
    except FileNotFoundError as exc:
        _fail(str(exc), 1)
    out = Console()
    for bad in report.corrupt:
        what = f"chunk {bad.chunk_id} (document {bad.doc_id})" if bad.chunk_id else bad.content_key
        out.print(f"corrupt: {what}: {bad.problem}", soft_wrap=True, markup=False)
    out.print(
        f"checked {report.entries} KV entries ({report.logical_bytes:,} bytes) in "
        f"{report.kv_stores} KV store(s) at level {level} in {report.seconds:.1f} s: "
        f"{len(report.corrupt)} corrupt",
        soft_wrap=True,
    )
    if report.corrupt:
        command = repair_command(Store.at(store))
        _fail(f"{len(report.corrupt)} corrupt KV entries: {command} recomputes them", 1)


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Prefect's temporary API server gets 20 s to start by default: too little on a loaded
    # machine (seen: a build failing with "Timed out while attempting to connect").
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from coinrag.flows.prefect_api import exit_on_sigterm
    from coinrag.storage.store import LocalStoreRequired

    exit_on_sigterm()  # SIGTERM unwinds like Ctrl-C: no orphan server, the run marked failed
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
    except LocalStoreRequired as exc:  # e.g. training asked of an s3:// store
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)
    except Exception as exc:
        if _DEBUG["on"] or "--debug" in sys.argv[1:]:
            raise
        # One line, whatever the error: the traceback is for --debug.
        text = " ".join(str(exc).split()) or "(no message)"
        console.print(
            f"[bold red]error:[/] {escape(type(exc).__name__)}: {escape(text)} "
            "(coinrag --debug ... shows the traceback)",
            soft_wrap=True,
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
