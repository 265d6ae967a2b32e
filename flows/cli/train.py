"""``coinrag train``: cartridges, nugget-aware fine-tuning, KVLink links (local stores)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from coinrag.flows.cli import common
from coinrag.flows.cli.common import LocalStore, fail
from coinrag.flows.cli_lists import ListOptionsCommand
from coinrag.flows.settings_options import with_options, with_settings_options
from coinrag.schemas.settings import FinetuneSettings
from coinrag.schemas.training_settings import KvLinkOptions, RetrieverTrainSettings

train_app = typer.Typer(help="Training flows over a built store.", no_args_is_help=True)
TRAIN_ERRORS = (KeyError, ValueError, FileNotFoundError)  # a flow's refusal of its inputs: exit 1


def _training_store(store: str, data: Path | None, out: Path | None, what: str) -> Any:
    """The checks every training command makes: a local store, ``--data`` read (every line,
    before any model loads), ``--out`` writable, the store built (or buildable, when the data
    carries documents) and unlocked."""
    from coinrag.flows import preflight
    from coinrag.schemas.qa import load_examples

    common.require_local(store, what)
    examples = []
    if data is not None:
        if not data.is_file():
            fail(f"--data {data} does not exist", 1)
        examples = load_examples(data)
    if out is not None:
        preflight.output_folder(out, "--out")
    if any(ex.documents for ex in examples):  # its documents are built into the store first
        st = preflight.store_to_write(store)
    else:
        st = preflight.built_store(store)
    preflight.unlocked(st)
    return st


@contextmanager
def _training_run(store: str, data: Path | None, out: Path | None, what: str) -> Iterator[None]:
    """Around a training command's flow run: the store's checks (:func:`_training_store`),
    Prefect's server, and a flow's refusal of its inputs (``TRAIN_ERRORS``) stopping the
    command with exit code 1."""
    _training_store(store, data, out, what)
    common.prefect_run()
    with common.exit_on(1, *TRAIN_ERRORS):
        yield


@train_app.command("cartridges", cls=ListOptionsCommand)
def train_cartridges_cmd(
    store: LocalStore,
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
    from coinrag.flows import preflight
    from coinrag.flows.cartridges import train_cartridges
    from coinrag.schemas.settings import QUESTION_GENERATORS

    if generator not in (None, *QUESTION_GENERATORS):
        fail(f"--generator {generator!r} is not one of {', '.join(QUESTION_GENERATORS)}", 2)
    common.require_local(store, "coinrag train cartridges")
    st = preflight.built_store(store)
    if generator == "openai":
        preflight.openai_key("--generator", generator)
    preflight.unlocked(st)
    extra = {"generator": generator} if generator else {}
    common.prefect_run()
    with common.exit_on(1, *TRAIN_ERRORS):
        summary = train_cartridges(str(store), docs or None, max_steps, **extra)
    common.print_json(summary)


DataOption = Annotated[
    Path,
    typer.Option(
        "--data",
        help="JSONL of QA examples: question, answer, and documents or doc_ids (the eval "
        "format, answers + doc_ids, is read too).",
    ),
]


@train_app.command("nuggets")
@with_settings_options(FinetuneSettings, panel="Fine-tuning settings")
def train_nuggets_cmd(
    store: LocalStore,
    data: DataOption,
    out: Annotated[Path, typer.Option("--out", help="Folder for the fine-tuned model.")],
    rebuild_kv: Annotated[
        bool, typer.Option("--rebuild-kv", help="Rebuild the store's KV for the new model.")
    ] = False,
    *,
    overrides: dict[str, Any],
) -> None:
    """Nugget-aware fine-tuning on (C_ctx, question) -> answer, with the inference assembly."""
    from coinrag.flows import train
    from coinrag.schemas.settings import FINETUNE_MODES

    given = common.given(overrides)
    if given.get("mode", "live") not in FINETUNE_MODES:
        fail(f"--mode {given['mode']!r} is not one of {', '.join(FINETUNE_MODES)}", 2)
    with _training_run(store, data, out, "coinrag train nuggets"):
        summary = train.train_nuggets(
            str(store), str(data), str(out), rebuild_kv=rebuild_kv, **given
        )
    common.print_json(summary)


@train_app.command("kvlink")
@with_options(KvLinkOptions)
def train_kvlink_cmd(
    store: LocalStore,
    data: Annotated[
        Path,
        typer.Option("--data", help="JSONL of QA examples (as for `train nuggets`)."),
    ],
    out: Annotated[Path, typer.Option("--out", help="Folder for the link adapter.")],
    options: KvLinkOptions,
) -> None:
    """KVLink: train link tokens after each retrieved chunk's stored KV (the base model frozen);
    serve them with `coinrag query --method kvlink --model OUT`."""
    from coinrag.flows.train import train_kvlink_flow

    if options.kc > options.max_docs:
        fail(f"--kc {options.kc} is more than --max-docs {options.max_docs}", 2)
    if options.lr <= 0:
        fail("--lr must be > 0", 2)
    with _training_run(store, data, out, "coinrag train kvlink"):
        summary = train_kvlink_flow(
            str(store),
            str(data),
            str(out),
            options.n_link,
            options.max_docs,
            model=options.model,
            settings=options.training(),
        )
    common.print_json(summary)


ExcludeOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--exclude-questions",
        help="Question JSONL files (evaluation sets) whose questions are never trained or "
        "tuned on; repeat the option for each file.",
    ),
]


GeneratorOption = Annotated[
    str | None,
    typer.Option(
        help="Question generator for --generated: local or openai (default: openai when "
        "OPENAI_API_KEY is set, else local; local sends no text anywhere)."
    ),
]


def _check_generator(generator: str | None, generated: int) -> None:
    """Exit 2 for an unknown ``--generator``, or one given without ``--generated``; the
    preflight's exit for ``--generator openai`` without ``OPENAI_API_KEY``."""
    from coinrag.flows import preflight
    from coinrag.schemas.settings import QUESTION_GENERATORS

    if generator is not None and generator not in QUESTION_GENERATORS:
        fail(f"--generator must be one of {', '.join(QUESTION_GENERATORS)}; got {generator!r}", 2)
    if generator is not None and generated <= 0:
        fail("--generator chooses who writes the --generated questions: give --generated N", 2)
    if generator == "openai":
        preflight.openai_key("--generator", generator)


@train_app.command("fusion", cls=ListOptionsCommand)
def train_fusion_cmd(
    store: LocalStore,
    exclude_questions: ExcludeOption = None,
    max_questions: Annotated[
        int | None, typer.Option(min=10, help="Headings asked (default 800).")
    ] = None,
    generated: Annotated[
        int,
        typer.Option(
            min=0,
            help="Choose on questions the question generator writes about this many chunks "
            "(3 each; OpenAI with OPENAI_API_KEY, else the local model: about a question a "
            "second on a CPU; cached in the store) instead of the headings. 0: headings.",
        ),
    ] = 0,
    generator: GeneratorOption = None,
) -> None:
    """Choose hybrid search's fusion weight for the store's index on its own headings and
    record it with the published index version (--generated: on generated questions)."""
    from coinrag.flows.retriever import tune_fusion_flow

    _check_generator(generator, generated)
    with _training_run(store, None, None, "coinrag train fusion"):
        summary = tune_fusion_flow(
            str(store),
            [str(p) for p in exclude_questions or []],
            max_questions,
            generated_chunks=generated,
            generator=generator,
        )
    common.print_json(summary)


@train_app.command("retriever", cls=ListOptionsCommand)
@with_options(RetrieverTrainSettings)
def train_retriever_cmd(
    store: LocalStore,
    out: Annotated[Path, typer.Option("--out", help="Folder for the fine-tuned embedder.")],
    options: RetrieverTrainSettings,
    exclude_questions: ExcludeOption = None,
    no_reembed: Annotated[
        bool, typer.Option("--no-reembed", help="Only write the embedder folder.")
    ] = False,
    generated: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also train on questions the question generator writes about this many "
            "chunks of the pages trained on (3 each; OpenAI with OPENAI_API_KEY, else the "
            "local model: about 3 questions a second on a 2-core CPU; cached in the store), and "
            "judge the adapted embedder (--adopt if-better) and choose the fusion again on "
            "questions about as many chunks of the fusion and report pages (2N chunks asked in "
            "all; none with --no-reembed). 0: headings (and nuggets) only.",
        ),
    ] = 0,
    generator: GeneratorOption = None,
) -> None:
    """Fine-tune the store's embedder on its own headings and nuggets (--generated: and
    questions), judge it on held-out questions (--adopt), re-embed the index with it
    as a new published version, choose its fusion."""
    from coinrag.flows.retriever import train_retriever_flow

    try:
        options.validate()
    except ValueError as exc:
        fail(str(exc), 2)
    _check_generator(generator, generated)
    with _training_run(store, None, out, "coinrag train retriever"):
        summary = train_retriever_flow(
            str(store),
            str(out),
            [str(p) for p in exclude_questions or []],
            settings={**options.to_dict(), "generated_chunks": generated, "generator": generator},
            reembed=not no_reembed,
        )
    common.print_json(summary)
