"""The retrieval flows over a built store: ``coinrag train fusion`` and ``coinrag train
retriever``.

```
train fusion:    published index -> store headings (no evaluation question) -> rankings
                 -> weight per grid point -> best on the fusion pages -> page support share
                 (rerank = support) per grid point at that weight -> recorded with the index
train retriever: store -> (heading, section text) pairs of the retriever pages (no evaluation
                 question), and with --generated N the question generator's questions about N
                 of their chunks -> fine-tuned embedder folder -> judged against the store's on
                 held-out questions (kept only where not worse) -> build with embedder=OUT
                 (re-embeds the index: a new published version) -> train fusion for the new vectors
```

Both are runs of the runs table (``tune-fusion``, ``train-retriever``) with their parameters
(the evaluation files' paths and sha256) and counts; the fusion is published with the index
version (``storage.publish.publish_fusion``), so a reader opened before it keeps the weight it
opened with and one opened after reads the new one. Every evaluation file named is read and its
questions never become training or tuning questions (``tasks.retrieval.fusion.excluding``; the
count of dropped ones is recorded).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import flow, get_run_logger

from coinrag.flows.progress import ProgressLog
from coinrag.schemas.keys import new_run_id
from coinrag.schemas.settings import settings_from_toml
from coinrag.storage.cache import file_sha256
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.publish import publish_fusion
from coinrag.storage.runs import failing_run, finish_run, start_run
from coinrag.storage.store import Store

if TYPE_CHECKING:
    from coinrag.schemas.settings import BuildSettings
    from coinrag.schemas.training_settings import RetrieverTrainSettings
    from coinrag.tasks.generated_questions import GeneratedQuestions
    from coinrag.tasks.retrieval.fusion import FusionChoice

FUSION_FLOW_NAME = "coinrag-train-fusion"
# the page split (tasks.retrieval.fusion.page_split) the embedder trains on
RETRIEVER = ("retriever",)


def evaluation_questions(paths: Sequence[str]) -> tuple[list[str], list[dict[str, str]]]:
    """Every ``question`` of these JSONL files, and each file's path and sha256 (what a run
    records); a missing file or a line without a question is an error naming it."""
    questions: list[str] = []
    files = []
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"--exclude-questions {raw}: no such file")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            question = json.loads(line).get("question")
            if not isinstance(question, str):
                raise ValueError(f"{path}:{n}: no 'question' string; is this a question file?")
            questions.append(question)
        files.append({"path": str(path), "sha256": file_sha256(str(path))})
    return questions, files


def store_embedder(st: Store, embedder: str | None = None) -> Any:
    """The embedder of the store's published index (``embedder``: a reference to load instead;
    the build settings' ``embedder`` by default), loaded on one thread's budget."""
    from coinrag.inference.retrieval.embedders import store_embedder_of

    settings = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    return store_embedder_of(settings, embedder, device=settings.device)


@flow(name=FUSION_FLOW_NAME)
def tune_fusion_flow(
    store: str,
    exclude_questions: Sequence[str] = (),
    max_questions: int | None = None,
    seed: int = 0,
    generated_chunks: int = 0,
    generator: str | None = None,
) -> dict[str, Any]:
    """Choose the store's hybrid fusion weight on its own headings
    (``tasks/retrieval/fusion.py``), or, with ``generated_chunks``, on the questions the
    configured question generator writes about that many chunks
    (``tasks/generated_questions.py``; ``generator``: ``local`` or ``openai``, default OpenAI
    where ``OPENAI_API_KEY`` is set, else local; cached in the store), and publish it with the
    index version. Returns the fusion record with ``run_id``."""
    from coinrag.inference.model.threads import set_process_threads
    from coinrag.tasks.retrieval.fusion import MAX_QUESTIONS, choose_fusion

    logger = get_run_logger()
    st = Store.at(store)
    st.require_local("coinrag train fusion")
    settings = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    set_process_threads(settings.threads)
    evaluation, files = evaluation_questions(exclude_questions)
    run_id = new_run_id("fusion")
    params = {
        "exclude_questions": files,
        "max_questions": max_questions,
        "seed": seed,
        "generated_chunks": generated_chunks,
        "generator": generator,
    }
    with st.write_lock(run_id):
        run = start_run(st, run_id, "tune-fusion", params)
        with failing_run(st, run):
            index = LanceIndex.open(st)
            embedder = store_embedder(st)
            made = None
            if generated_chunks > 0:
                made = _generated(st, index, settings, generated_chunks, run_id, seed, generator)
                logger.info(
                    "fusion of %s: %d questions generated about %d chunks (%d calls cached)",
                    st.root,
                    len(made.questions),
                    made.chunks,
                    made.counts.cached,
                )
            choice = choose_fusion(
                index,
                embedder,
                evaluation,
                max_questions or MAX_QUESTIONS,
                seed,
                made.questions if made is not None else None,
            )
            record = choice.record()
            if made is not None:
                record["question_generator_fp"] = made.generator_fp
            publish_fusion(st, run_id, "tune-fusion", record)
        counts = {
            "questions": choice.n_train,
            "held_out_questions": choice.n_held_out,
            "excluded_as_evaluation": choice.excluded,
            "dense_weight": choice.dense_weight,
        }
        fps = {"embedder_fp": index.embedder_fp}
        if made is not None:
            counts |= generated_counts(made)
            fps["question_generator_fp"] = made.generator_fp
        finish_run(st, run, "completed", fingerprints=fps, counts=counts)
    logger.info("fusion of %s: %s", st.root, _choice_line(choice, record))
    return {**record, "run_id": run_id}


def _choice_line(choice: FusionChoice, record: dict[str, Any]) -> str:
    """What ``train fusion`` chose, for its log: the weight and the page support share, the
    training questions' best of each and whether the held-out questions confirmed it."""
    held = (
        "confirmed"
        if record["confirmed_on_held_out"]
        else f"not better than the default {choice.default_weight:.2f}"
    )
    support = choice.support
    kept = "confirmed" if support.share == support.best_on_train else "the default"
    return (
        f"dense weight {choice.dense_weight:.2f} (best {record['best_on_train']:.2f} on "
        f"{choice.n_train} {choice.chosen_on}, {held} on the {choice.n_held_out} held out; "
        f"{choice.excluded} evaluation questions excluded); page support {support.share:.2f} "
        f"for rerank = support (best {support.best_on_train:.2f}, {kept})"
    )


def _generated(
    st: Store,
    index: LanceIndex,
    settings: BuildSettings,
    n_chunks: int,
    run_id: str,
    seed: int,
    generator: str | None = None,
    splits: Sequence[str] | None = None,
) -> GeneratedQuestions:
    """The question generator's questions about ``n_chunks`` chunks of the pages of ``splits``
    (default: the fusion and report pages), from ``generator`` (``local``: the store's
    generation model; ``openai``; None: OpenAI where ``OPENAI_API_KEY`` is set, else local),
    asked for :data:`~coinrag.tasks.generated_questions.QUESTIONS_PER_CHUNK` questions a chunk."""
    from coinrag.schemas.training_settings import CartridgeSettings
    from coinrag.tasks.generated_questions import (
        ASKED_SPLITS,
        QUESTIONS_PER_CHUNK,
        generated_questions,
    )
    from coinrag.tasks.question_generators.factory import make_generator

    cartridge = CartridgeSettings(
        model=settings.model,
        device=settings.device,
        generator=generator,
        n_questions=QUESTIONS_PER_CHUNK,
    )
    asker = make_generator(cartridge, settings.model)
    what = "fusion questions" if splits is None else f"questions of {'/'.join(splits)} pages"
    progress = ProgressLog(get_run_logger(), what, "questions written", 0)
    return generated_questions(
        st, index, asker, n_chunks, run_id, seed, progress, splits or ASKED_SPLITS
    )


def generated_counts(made: GeneratedQuestions) -> dict[str, int]:
    """What a run records of its generated questions."""
    return {
        "generated_questions": len(made.questions),
        "asked_chunks": made.chunks,
        "generator_calls_failed": made.counts.failed,
        "generator_calls_malformed": made.counts.malformed,
    }


def _retriever_questions(
    st: Store, settings: BuildSettings, run_id: str, cfg: RetrieverTrainSettings
) -> GeneratedQuestions:
    """``cfg.generator``'s questions about ``cfg.generated_chunks`` chunks of the
    ``retriever`` pages (the caller holds the store's lock; the sample seeded by ``cfg.seed``);
    ValueError where it wrote none (every call failed, say): nothing is trained then."""
    n_chunks = cfg.generated_chunks
    index = LanceIndex.open(st)
    made = _generated(
        st, index, settings, n_chunks, run_id, cfg.seed, cfg.generator, ("retriever",)
    )
    get_run_logger().info(
        "%d questions generated about %d chunks of the retriever pages (%d calls cached)",
        len(made.questions),
        made.chunks,
        made.counts.cached,
    )
    if not made.questions:
        raise ValueError(
            f"--generated {n_chunks}: no usable question about {made.chunks} chunks of the "
            f"retriever pages ({made.counts.failed} calls failed, {made.counts.malformed} "
            "malformed); nothing was trained"
        )
    return made


def _pairs(
    st: Store, evaluation: list[str], cfg: RetrieverTrainSettings, made: GeneratedQuestions | None
) -> tuple[list[Any], dict[str, Any]]:
    """The training pairs (``tasks.retrieval.retriever_pairs.training_pairs``, the generated
    questions first) and their counts, with the seconds they took and the generated questions'
    counts."""
    from coinrag.tasks.retrieval.retriever_pairs import training_pairs

    t0 = time.perf_counter()
    generated = made.questions if made is not None else ()
    index = LanceIndex.open(st)
    pairs, counts = training_pairs(index, evaluation, cfg.max_pairs, cfg.seed, generated=generated)
    counts["pairs_seconds"] = round(time.perf_counter() - t0, 1)
    if made is not None:
        counts |= generated_counts(made)
    get_run_logger().info("%d training pairs (%s)", len(pairs), counts)
    return pairs, counts


def _embedder_out(out: str, sub: str, build: BuildSettings) -> Path:
    """The folder the adapted embedder is written to: ``out/sub``, never the one the store's
    readers load (ValueError)."""
    out_dir = Path(out).expanduser().resolve() / sub
    if build.embedder not in ("", None) and Path(build.embedder).resolve() == out_dir:
        raise ValueError(
            f"--out {out_dir} is the store's embedder in use; write the new one to another "
            "folder (readers load the store's embedder from its folder)"
        )
    return out_dir


def _reembed(st: Store, source: str, build: BuildSettings, embedder: Path) -> dict[str, Any]:
    """Build ``source`` into the store with the last build's settings and ``embedder``: the
    index re-embedded and published as a new version. The build's summary."""
    from coinrag.flows.build import build_flow

    return build_flow(source, str(st.root), {**build.to_dict(), "embedder": str(embedder)})


RETRIEVER_FLOW_NAME = "coinrag-train-retriever"


@flow(name=RETRIEVER_FLOW_NAME)
def train_retriever_flow(
    store: str,
    out: str,
    exclude_questions: Sequence[str] = (),
    settings: dict[str, Any] | None = None,
    reembed: bool = True,
    source: str | None = None,
    versioned_out: bool = False,
) -> dict[str, Any]:
    """Fine-tune the store's embedder on its own pairs (``tasks/retrieval/retriever_pairs.py``,
    ``training/retriever.py``; ``settings``: ``RetrieverTrainSettings``, whose
    ``generated_chunks`` adds the generator's questions about that many chunks of the
    ``retriever`` pages, its ``generator`` as for :func:`tune_fusion_flow`), write the folder
    ``out``, then (``reembed``), where the guard adopts it (:func:`_adopt`), build ``source``
    (default: what the last build read) into the store with ``embedder = out``: the index is
    re-embedded and published as a new version, the store's settings name the new embedder
    (queries and later builds use it), and the fusion is chosen again for the new vectors. The
    base is the store's embedder followed back to the one it was adapted from
    (``embedders.root_embedder``). ``versioned_out``: write ``out/<run id>`` (a deployment
    retraining after each build: never overwrite the folder readers load).
    Returns the summary (``base_embedder_fp``, ``embedder_fp``, counts)."""
    from coinrag.inference.model.threads import set_process_threads
    from coinrag.inference.retrieval.embedders import (
        locate_embedder,
        root_embedder,
        store_embedder_of,
    )
    from coinrag.schemas.training_settings import RetrieverTrainSettings
    from coinrag.storage.gc import last_build_source
    from coinrag.training.retriever import finetune_embedder

    logger = get_run_logger()
    cfg = RetrieverTrainSettings(**(settings or {})).validate()
    st = Store.at(store)
    st.require_local("coinrag train retriever")
    build = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    set_process_threads(build.threads)
    src = source or last_build_source(st)
    if reembed and not src:
        raise ValueError(f"{st.root}: no completed build to re-embed from; pass source")
    evaluation, files = evaluation_questions(exclude_questions)
    run_id = new_run_id("train")
    out_dir = _embedder_out(out, run_id if versioned_out else "", build)
    base_ref = root_embedder(build.embedder)
    base = store_embedder(st, base_ref)
    params = {"out": str(out_dir), "base_embedder": base_ref, "source": src}
    params |= {"exclude_questions": files, "settings": cfg.to_dict(), "reembed": reembed}
    with st.write_lock(run_id):
        run = start_run(st, run_id, "train-retriever", params)
    with failing_run(st, run, relock=True):
        made = None
        if cfg.generated_chunks > 0:
            with st.write_lock(run_id):  # the self-study stage writes its calls to the store
                made = _retriever_questions(st, build, run_id, cfg)
        pairs, counts = _pairs(st, evaluation, cfg, made)
        lineage = {"base_embedder": base_ref, "base_embedder_fp": base.fingerprint}
        lineage |= {"replaces": build.embedder, "store": str(st.root)}
        lineage |= {"base_dir": str(locate_embedder(base_ref))}
        lineage |= {"run_id": run_id, "exclude_questions": files, "pair_counts": counts}
        if made is not None:
            lineage["question_generator_fp"] = made.generator_fp
        trained = finetune_embedder(
            locate_embedder(base_ref), base.max_length, pairs, out_dir, cfg, lineage
        )
        adapted = store_embedder_of(build, out_dir, device=build.device)
        summary = {"base_embedder_fp": base.fingerprint, "embedder_fp": adapted.fingerprint}
        summary |= {"model_dir": str(out_dir), "counts": {**counts, **trained}, "adopted": None}
        if reembed:
            adoption = _adopt(
                st, run_id, str(src), (build, cfg), (adapted, out_dir), exclude_questions
            )
            summary["counts"] |= adoption.pop("counts")
            summary |= adoption
    fps = {k: summary[k] for k in ("base_embedder_fp", "embedder_fp")}
    if made is not None:
        fps["question_generator_fp"] = made.generator_fp
    with st.write_lock(run_id):
        finish_run(st, run, "completed", fingerprints=fps, counts=summary["counts"])
    logger.info("train-retriever %s: %s -> %s", run_id, base.fingerprint, adapted.fingerprint)
    return {**summary, "run_id": run_id}


def _adopt(
    st: Store,
    run_id: str,
    src: str,
    settings: tuple[BuildSettings, RetrieverTrainSettings],
    embedder: tuple[Any, Path],
    exclude_questions: Sequence[str],
) -> dict[str, Any]:
    """Judge the adapted embedder (``embedder``: it and its folder) against the store's
    (``cfg.adopt == "if-better"``, ``tasks/retrieval/retriever_guard.py``), then, where
    adopted, re-embed ``src`` with it and choose the fusion again for the new vectors. What the
    run's summary gains: ``adopted``, ``guard`` (the judgment's record), ``build`` and ``fusion``;
    ``counts`` gains the seconds."""
    build, cfg = settings
    adapted, folder = embedder
    counts: dict[str, Any] = {}
    out: dict[str, Any] = {"adopted": True}
    if cfg.adopt == "if-better":
        t0 = time.perf_counter()
        verdict = _judge(st, run_id, build, cfg, adapted, exclude_questions)
        counts["guard_seconds"] = round(time.perf_counter() - t0, 1)
        out |= {"adopted": verdict.adopted, "guard": verdict.record()}
    if out["adopted"]:
        t1 = time.perf_counter()
        out["build"] = _reembed(st, src, build, folder)
        counts["reembed_seconds"] = round(time.perf_counter() - t1, 1)
        fusion = (None, cfg.seed, cfg.generated_chunks, cfg.generator)
        out["fusion"] = tune_fusion_flow(str(st.root), list(exclude_questions), *fusion)
    return {**out, "counts": counts}


def _judge(
    st: Store,
    run_id: str,
    build: BuildSettings,
    cfg: RetrieverTrainSettings,
    adapted: Any,
    exclude_questions: Sequence[str],
) -> Any:
    """The guard's verdict (``tasks.retrieval.retriever_guard.judge_adapted``) on held-out
    questions: the generator's about ``cfg.generated_chunks`` chunks of the fusion and report
    pages (the calls the fusion choice after re-embedding makes: cached then), else the store's
    headings and nuggets; never an evaluation file's question. Logged either way."""
    from coinrag.tasks.retrieval.fusion import excluding, store_headings, store_nuggets
    from coinrag.tasks.retrieval.retriever_guard import judge_adapted

    index = LanceIndex.open(st)
    if cfg.generated_chunks > 0:
        with st.write_lock(run_id):  # the self-study stage writes its calls to the store
            found = _generated(
                st, index, build, cfg.generated_chunks, run_id, cfg.seed, cfg.generator
            ).questions
    else:
        found = store_headings(index.columns("chunks", ["doc_id", "section", "text"]).to_pylist())
        found += store_nuggets(index.columns("nuggets", ["doc_id", "text"]).to_pylist())
    questions, _ = excluding(found, evaluation_questions(exclude_questions)[0])
    verdict = judge_adapted(
        index, store_embedder(st), adapted, questions, cfg.guard_pages, cfg.seed
    )
    if not verdict.questions:
        get_run_logger().warning(
            "no held-out heading, nugget or generated question to judge the adapted embedder "
            "on: adopting it unjudged"
        )
        return verdict
    what = "adopting it" if verdict.adopted else "keeping the store's embedder (not re-embedded)"
    get_run_logger().info(
        "adapted embedder on %d held-out %ss of %d pages (%d windows): MRR %.3f against the "
        "store's %.3f, hit@1 %.3f against %.3f; %s",
        verdict.questions,
        verdict.kind,
        verdict.pages,
        verdict.windows,
        verdict.adapted["mrr"],
        verdict.base["mrr"],
        verdict.adapted["hit@1"],
        verdict.base["hit@1"],
        what,
    )
    return verdict
