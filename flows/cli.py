"""The ``coinrag`` command line.

Exit codes: 0 done; 1 failed (nothing or not everything was built: the message says why);
2 usage error (unknown option, bad value); 3 built, but some documents were rejected (listed).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(
    help="coinrag: the offline asset factory for KV-cache-reuse RAG.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

SAMPLE = Path(__file__).parent / "sample" / "wiki_sample.jsonl"


@app.callback()
def _root() -> None:
    """coinrag: the offline asset factory for KV-cache-reuse RAG."""


def _fail(message: str, code: int = 1) -> None:
    # soft_wrap: never break an error line (paths stay whole, copyable and greppable)
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def _require_local(store: str, what: str) -> None:
    """Fail (exit 1) before any work when ``what`` is asked of an object store."""
    from storage.store import LocalStoreRequired, Store

    try:
        Store.at(store).require_local(what)
    except (LocalStoreRequired, ValueError) as exc:
        _fail(str(exc), 1)


# Build settings as options, declared once: `build` and `serve` both take them (None: the
# [build] table of --config, else the default).
ExtractorOption = Annotated[
    str | None,
    typer.Option(
        help="openai | openai-batch | local | rules | none "
        "(default: openai if OPENAI_API_KEY is set, else local)."
    ),
]
LlmModelOption = Annotated[
    str | None, typer.Option("--llm-model", help="LLM for extraction (default gpt-4o-mini).")
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        help="Generation model whose tokenizer chunks: a folder, a .gguf file, or "
        "'smollm2' (default, the packaged SmolLM2-135M-Instruct)."
    ),
]
EmbedderOption = Annotated[
    str | None,
    typer.Option(help="'minilm' (default, packaged all-MiniLM-L6-v2) or a local BGE-M3 folder."),
]
ConfigOption = Annotated[
    Path | None, typer.Option(help="TOML file with a \\[build] table of the same settings.")
]
ChunkerOption = Annotated[str | None, typer.Option(help="fixed (default) | sentence | content")]
ChunkSizeOption = Annotated[int | None, typer.Option(help="Tokens per chunk (default 512).")]
TauOption = Annotated[float | None, typer.Option(help="Fuzzy recovery threshold (default 0.7).")]
ConcurrencyOption = Annotated[
    int | None, typer.Option(help="Simultaneous LLM requests (default 8).")
]
KvDtypeOption = Annotated[
    str | None,
    typer.Option(
        "--kv-dtype",
        help="auto | float32 | bfloat16 | float16: dtype of the KV forward and of the stored "
        "KV (default auto: bfloat16 where the device computes it natively, else float32).",
    ),
]


@app.command()
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
    extractor: ExtractorOption = None,
    llm_model: LlmModelOption = None,
    model: ModelOption = None,
    embedder: EmbedderOption = None,
    config: ConfigOption = None,
    chunker: ChunkerOption = None,
    chunk_size: ChunkSizeOption = None,
    tau: TauOption = None,
    concurrency: ConcurrencyOption = None,
    prune: Annotated[
        bool | None,
        typer.Option(
            "--prune", help="Tombstone the store's documents that are absent from SOURCE."
        ),
    ] = None,
    runner: Annotated[
        str | None,
        typer.Option(help="Where tasks run: default (this process) | dask | ray."),
    ] = None,
    runner_address: Annotated[
        str | None,
        typer.Option(
            "--runner-address",
            help="Dask scheduler (tcp://host:8786) or Ray address; default: a local cluster.",
        ),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Worker processes of a local Dask/Ray cluster (default 2).")
    ] = None,
    kv_resources: Annotated[
        str | None,
        typer.Option(
            "--kv-resources",
            help="Worker resources each KV task needs, e.g. GPU=1 (dask/ray).",
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="Torch device of the generation model (default cpu).")
    ] = None,
    kv_dtype: KvDtypeOption = None,
) -> None:
    """Build or update STORE from SOURCE: chunks, nuggets, and (later stages) KV and indexes."""
    from schemas.settings import SettingsError, load_settings
    from tasks.ingest import SourceError

    if source == "sample":
        source = str(SAMPLE)
    try:
        settings = load_settings(
            config,
            {
                "extractor": extractor,
                "llm_model": llm_model,
                "model": model,
                "embedder": embedder,
                "chunker": chunker,
                "chunk_size": chunk_size,
                "tau": tau,
                "concurrency": concurrency,
                "prune": prune,
                "runner": runner,
                "runner_address": runner_address,
                "workers": workers,
                "kv_resources": kv_resources,
                "device": device,
                "kv_dtype": kv_dtype,
            },
        )
    except SettingsError as exc:
        _fail(str(exc), 2)
    if not Path(source).expanduser().exists():
        _fail(f"source {source} does not exist", 1)

    from flows.build import build_flow
    from storage.store import StoreLocked

    try:
        summary = build_flow(source=source, store=str(store), settings=settings.to_dict())
    except (SourceError, StoreLocked) as exc:
        _fail(str(exc), 1)
    _print_summary(summary)
    if summary["rejected"]:
        for r in summary["rejected"]:
            console.print(f"[yellow]rejected[/] {r['doc_id'] or '-'}: {r['reason']}: {r['detail']}")
        _fail(f"{len(summary['rejected'])} document(s) rejected (see the rejects table)", 3)


@app.command()
def query(
    question: Annotated[str, typer.Argument(help="The question.")],
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    method: Annotated[
        str, typer.Option(help="coinrag | turborag | standard | cartridge")
    ] = "coinrag",
    kc: Annotated[int, typer.Option(help="Chunks retrieved in stage 1.")] = 4,
    k: Annotated[int, typer.Option(help="Nuggets retrieved in stage 2 (coinrag).")] = 10,
    max_new_tokens: Annotated[int, typer.Option(help="Upper bound on answer tokens.")] = 32,
    model: Annotated[
        str | None, typer.Option(help="Generation model (default: the store's).")
    ] = None,
    oracle_doc: Annotated[
        str | None,
        typer.Option(help="cartridge only: answer with this document's cartridge (oracle mode)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Answer QUESTION from STORE: retrieval, KV assembly, query prefill, greedy decoding.

    ``--method cartridge`` retrieves --k documents and answers from their trained cartridges.
    """
    import json

    from inference.methods import METHODS, MissingAssets, RagEngine

    if method not in (*METHODS, "cartridge"):
        _fail(f"--method {method!r} is not one of {', '.join(METHODS)}, cartridge", 2)
    if kc < 1 or k < 1 or max_new_tokens < 1:
        _fail("--kc, --k and --max-new-tokens must be >= 1", 2)
    try:
        if method == "cartridge":
            result = _cartridge_answer(str(store), question, k, oracle_doc, model, max_new_tokens)
        else:
            engine = RagEngine.open(str(store), model=model, max_new_tokens=max_new_tokens)
            result = engine.answer(question, method=method, kc=kc, k=k)
    except (MissingAssets, LookupError, ValueError) as exc:
        _fail(str(exc), 1)
    if json_out:
        print(json.dumps(result.to_json(), ensure_ascii=False))
        return
    out = Console()
    out.print(f"[bold]{result.answer}[/]")
    out.print(
        f"method {result.method}, {result.active_tokens} context tokens, "
        + ", ".join(f"{name} {ms:.1f} ms" for name, ms in result.timings.items())
    )
    for e in result.evidence:
        out.print(
            f"  [dim]{e['doc_id']} {e['chunk_id'][:12]} [{e['tok_start']}:{e['tok_end']})[/] "
            f"{e['text'].strip()[:100]}"
        )


@app.command("eval")
def eval_cmd(
    questions: Annotated[
        Path, typer.Argument(help="JSONL: question, answers (list), optional doc_ids (gold).")
    ],
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    out: Annotated[Path, typer.Option("--out", help="Folder for results, plots.")],
    methods: Annotated[
        list[str] | None, typer.Option("--methods", help="Methods (default: all three).")
    ] = None,
    kc: Annotated[list[int] | None, typer.Option("--kc", help="kc values to sweep.")] = None,
    k: Annotated[list[int] | None, typer.Option("--k", help="k values to sweep.")] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Upper bound on answer tokens.")] = 32,
    limit: Annotated[int | None, typer.Option(help="Only the first N questions.")] = None,
    retrieval_only: Annotated[
        bool,
        typer.Option(
            "--retrieval-only",
            help="Only recall of gold documents (chunks, two-stage, one-stage): no model, no KV.",
        ),
    ] = False,
) -> None:
    """Answer QUESTIONS with each method and (kc, k); write results.parquet, per-question rows,
    best F1 under P99 TTFT budgets, and plots (F1 vs P99 TTFT, F1 vs active tokens).
    With --retrieval-only: write retrieval.parquet (recall, MRR, search latency) instead."""
    from inference.evaluate import evaluate
    from inference.methods import METHODS, MissingAssets

    if retrieval_only:
        from inference.evaluate_retrieval import evaluate_retrieval, retrieval_text
        from storage.index import EmbedderMismatch, IndexNotBuilt

        try:
            table = evaluate_retrieval(
                str(store),
                str(questions),
                str(out),
                kcs=kc or [1, 2, 4, 8],
                ks=k or [10],
                limit=limit,
            )
        except (IndexNotBuilt, FileNotFoundError) as exc:
            _fail(str(exc), 1)
        except (EmbedderMismatch, ValueError) as exc:
            _fail(str(exc), 2)
        Console().print(retrieval_text(table))
        return
    sweep = tuple((a, b) for a in (kc or [4]) for b in (k or [10]))
    try:
        evaluate(
            str(store),
            str(questions),
            str(out),
            methods=tuple(methods or METHODS),
            sweep=sweep,
            max_new_tokens=max_new_tokens,
            limit=limit,
        )
    except MissingAssets as exc:
        _fail(str(exc), 1)
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc), 2)


def _cartridge_answer(
    store_path: str,
    question: str,
    k: int,
    oracle_doc: str | None,
    model: str | None,
    max_new_tokens: int,
):
    """Cartridge RAG through the same Answer record as the other methods."""
    from inference.cartridge_rag import CartridgeRag
    from inference.embedders import load_embedder
    from inference.methods import Answer, MissingAssets
    from inference.models import load_model
    from inference.retrieve import Retriever
    from schemas.settings import settings_from_toml
    from storage.store import Store

    store = Store.at(store_path)
    store.require_local("query --method cartridge")
    if not store.exists():
        raise MissingAssets(f"{store} is not a coinrag store (run coinrag build first)")
    settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    loaded = load_model(model or settings.model, device=settings.device)
    retriever = None if oracle_doc else Retriever(store, load_embedder(settings.embedder))
    rag = CartridgeRag(store, loaded, retriever=retriever)
    if oracle_doc:
        got = rag.oracle(question, oracle_doc, max_new_tokens=max_new_tokens)
    else:
        got = rag.answer(question, k=k, max_new_tokens=max_new_tokens)
    t = got.timings
    ttft = t["retrieve_ms"] + t["load_ms"] + t["assemble_ms"] + t["prefill_ms"]
    return Answer(
        answer=got.answer,
        method="cartridge",
        evidence=[
            {"doc_id": d, "cartridge_id": c}
            for d, c in zip(got.doc_ids, got.cartridge_ids, strict=True)
        ],
        active_tokens=got.context_tokens - rag.prompt.n_prefix,
        timings={
            "retrieval": round(t["retrieve_ms"], 3),
            "kv_load": round(t["load_ms"], 3),
            "assembly": round(t["assemble_ms"], 3),
            "prefill": round(t["prefill_ms"], 3),
            "ttft": round(ttft, 3),
            "decode": round(t["decode_ms"], 3),
        },
        kc=0,
        k=len(got.doc_ids),
        model_fp=loaded.model_fp,
        token_ids=got.token_ids,
    )


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
    from flows import lineage as lin
    from storage.lineage import LineageError
    from storage.store import Store

    walks = {k: v for k, v in {"nugget": nugget, "chunk": chunk, "doc": doc}.items() if v}
    modes = len(walks) + (sql is not None) + stale
    if modes > 1:
        _fail("give one of SQL, --nugget, --chunk, --doc, --stale", 2)
    if json_out and csv_out:
        _fail("--json and --csv exclude each other", 2)
    if csv_out and walks:
        _fail("--csv prints one table: use it with SQL or --stale (--json for a walk)", 2)
    st = Store.at(store)
    if not st.exists():
        _fail(f"{st} is not a coinrag store (run coinrag build first)", 1)
    out = Console()
    if modes == 0:
        lin.print_views(out)
        return
    try:
        if walks:
            ((kind, ident),) = walks.items()
            sections = lin.lineage_walk(st, kind, ident)
        else:
            result = lin.lineage_stale(st) if stale else lin.lineage_sql(st, sql or "")
    except LineageError as exc:
        _fail(str(exc), 1 if walks else 2)
    except (OSError, ValueError) as exc:  # settings or producers of --stale that cannot load
        _fail(f"cannot compute the current producers from {st.uri(st.settings_path)}: {exc}", 1)
    if walks:
        if json_out:
            print(lin.to_json(sections))
        else:
            for name, table in sections.items():
                lin.print_section(out, name, table)
    elif json_out:
        print(lin.to_json(result))
    elif csv_out:
        sys.stdout.write(lin.to_csv(result))
    else:
        lin.print_table(out, result, "stale assets" if stale else None)


train_app = typer.Typer(help="Training flows over a built store.", no_args_is_help=True)
app.add_typer(train_app, name="train")


@train_app.command("cartridges")
def train_cartridges_cmd(
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    docs: Annotated[
        list[str] | None, typer.Option("--docs", help="Document ids (default: all).")
    ] = None,
    max_steps: Annotated[int, typer.Option(help="Training steps.")] = 200,
    generator: Annotated[
        str | None,
        typer.Option(help="Question generator: openai | local (default: openai if a key is set)."),
    ] = None,
) -> None:
    """Self-study data, then CAS cartridges (one trainable KV prefix per document)."""
    import json

    from flows.cartridges import train_cartridges
    from storage.store import StoreLocked

    if max_steps < 1:
        _fail("--max-steps must be >= 1", 2)
    _require_local(store, "coinrag train cartridges")
    extra = {"generator": generator} if generator else {}
    try:
        summary = train_cartridges(str(store), docs or None, max_steps, **extra)
    except (KeyError, ValueError, StoreLocked) as exc:
        _fail(str(exc), 1)
    Console().print_json(json.dumps(summary, default=str))


@train_app.command("nuggets")
def train_nuggets_cmd(
    store: Annotated[str, typer.Option("--store", help="A built store (folder or s3:// URL).")],
    data: Annotated[Path, typer.Option("--data", help="JSONL of QA examples.")],
    out: Annotated[Path, typer.Option("--out", help="Folder for the fine-tuned model.")],
    mode: Annotated[str, typer.Option(help="live (default) | frozen")] = "live",
    lora: Annotated[bool, typer.Option("--lora", help="Train LoRA adapters (merged).")] = False,
    max_steps: Annotated[int | None, typer.Option(help="Stop after N optimizer steps.")] = None,
    rebuild_kv: Annotated[
        bool, typer.Option("--rebuild-kv", help="Rebuild the store's KV for the new model.")
    ] = False,
) -> None:
    """Nugget-aware fine-tuning on (C_ctx, question) -> answer, with the inference assembly."""
    import json

    from flows.train import train_nuggets
    from storage.store import StoreLocked

    if mode not in ("live", "frozen"):
        _fail(f"--mode {mode!r} is not one of live, frozen", 2)
    _require_local(store, "coinrag train nuggets")
    if not data.is_file():
        _fail(f"--data {data} does not exist", 1)
    try:
        summary = train_nuggets(
            str(store),
            str(data),
            str(out),
            mode=mode,
            lora=lora,
            max_steps=max_steps,
            rebuild_kv=rebuild_kv,
        )
    except (KeyError, ValueError, StoreLocked) as exc:
        _fail(str(exc), 1)
    Console().print_json(json.dumps(summary, default=str))


@app.command()
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
    extractor: ExtractorOption = None,
    llm_model: LlmModelOption = None,
    model: ModelOption = None,
    embedder: EmbedderOption = None,
    chunker: ChunkerOption = None,
    chunk_size: ChunkSizeOption = None,
    tau: TauOption = None,
    concurrency: ConcurrencyOption = None,
    kv_dtype: KvDtypeOption = None,
) -> None:
    """Serve the build as a Prefect deployment: on --cron, and on `coinrag watch` events.

    Long-running (needs PREFECT_API_URL, see infra/prefect_server.py); Ctrl-C stops it and
    pauses its schedule. Deployment construction: infra/build_deployment.py.
    """
    from infra.build_deployment import make_serve_deployments, serve_build
    from schemas.settings import SettingsError, load_settings
    from storage.store import Store

    source = str(SAMPLE) if source == "sample" else source
    if not Path(source).expanduser().exists():
        _fail(f"source {source} does not exist", 1)
    if (train_data is None) != (train_out is None):
        _fail("--train-data and --train-out go together", 2)
    if train_data is not None and not train_data.is_file():
        _fail(f"--train-data {train_data} does not exist", 1)
    overrides = {
        "extractor": extractor,
        "llm_model": llm_model,
        "model": model,
        "embedder": embedder,
        "chunker": chunker,
        "chunk_size": chunk_size,
        "tau": tau,
        "concurrency": concurrency,
        "kv_dtype": kv_dtype,
    }
    try:
        settings = load_settings(config, overrides)
        deployments = make_serve_deployments(
            str(Path(source).expanduser().resolve()),
            Store.at(store).url,
            settings.to_dict(),
            cron=cron,
            name=name,
            train_data=str(train_data.resolve()) if train_data else None,
            train_out=str(train_out.expanduser().resolve()) if train_out else None,
        )
    except (SettingsError, ValueError) as exc:  # a bad cron is a ValueError too
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
    """Emit `coinrag.source.changed` (Prefect event) when SOURCE holds documents STORE lacks
    or STORE holds live documents SOURCE no longer has.

    A deployment served by `coinrag serve` for SOURCE rebuilds on that event (and drops the
    removed documents when its settings have prune = true). Needs PREFECT_API_URL.
    """
    from infra.source_events import watch_source
    from tasks.ingest import SourceError

    source = str(SAMPLE) if source == "sample" else source
    if interval <= 0:
        _fail("--interval must be > 0", 2)

    def report(ids: list[str], removed: list[str]) -> None:
        text = f"coinrag.source.changed: {len(ids)} document(s): {', '.join(ids[:10])}"
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
    from flows.maintenance import delete_documents
    from storage.store import StoreLocked
    from tasks.delete import UnknownDocuments

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
    from flows.maintenance import gc_counts, gc_store
    from storage.store import StoreLocked

    try:
        report = gc_store(str(store), dry_run=dry_run)
    except (StoreLocked, FileNotFoundError) as exc:
        _fail(str(exc), 1)
    counts = gc_counts(report)
    verb = "would reclaim" if dry_run else "reclaimed"
    table = Table(title=f"coinrag gc ({verb})")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in counts.items():
        if key != "kv":
            table.add_row(key, str(value))
    Console().print(table)
    Console().print(
        f"{verb} {counts['kv_entries_dropped']} KV entries, "
        f"{counts['index_versions_removed']} index versions, "
        f"{counts['temp_paths_removed']} leftovers: {counts['bytes_reclaimed']} bytes"
    )


def _print_summary(summary: dict) -> None:
    table = Table(title=f"coinrag build {summary['run_id']}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if isinstance(value, dict):  # stage_seconds: one row per stage
            for name, sub in value.items():
                table.add_row(f"{key}.{name}", str(sub))
        elif key not in ("run_id", "rejected"):
            table.add_row(key, str(value))
    Console().print(table)


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Prefect's temporary API server gets 20 s to start by default: too little on a loaded
    # machine (seen: a build failing with "Timed out while attempting to connect").
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from storage.store import LocalStoreRequired

    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted")
        sys.exit(130)
    except LocalStoreRequired as exc:  # e.g. training asked of an s3:// store
        console.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
