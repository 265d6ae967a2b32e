"""Cartridge flows (CAS): self-study questions -> teacher answers -> cartridge training.

```
documents (latest version per doc_id)
   -> selfstudy (question generator, cached per call)   -> selfstudy_calls, selfstudy_questions
   -> teacher   (target model + document, cached)       -> teacher_answers
   -> train     (budgeted pool, mixed visibility)       -> STORE/cartridges/<model_fp>/, manifest
```

``selfstudy_flow`` runs the first two stages; ``train_cartridges_flow`` runs all three (the first
two cost nothing when already done). Both hold the store's write lock and record the run in the
``runs`` table. ``train_cartridges(store_path, docs, max_steps, ...)`` is the plain entry point of
``coinrag train cartridges``. A rerun with the same settings resumes the training checkpoint (or
does nothing when it already reached ``max_steps``); a larger ``max_steps`` continues it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from coinrag.flows.progress import ProgressLog
from coinrag.inference.model.loading import LoadedModel, load_model
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import model_rope
from coinrag.schemas.keys import fingerprint, new_run_id, sha256_hex
from coinrag.schemas.settings import CartridgeSettings
from coinrag.schemas.tables import DocumentRow, TeacherAnswerRow
from coinrag.storage.cartridges import CartridgeLayout, CartridgeMeta, CartridgeStore, cartridge_id
from coinrag.storage.corpus import live_documents_in
from coinrag.storage.runs import failing_run, finish_run, start_run
from coinrag.storage.store import Store
from coinrag.tasks.question_generators.factory import make_generator
from coinrag.tasks.questions import Question, selfstudy_stage
from coinrag.tasks.teacher import (
    doc_token_ids,
    teacher_fingerprint,
    teacher_stage,
    topk_tensors,
)
from coinrag.training.budget import (
    CartridgePool,
    CartridgeTrainer,
    PoolDoc,
    TrainReport,
    TrainRun,
)
from coinrag.training.cartridges import CartridgeSpec, Example, cartridge_fingerprint

# ---------------------------------------------------------------------------- pure helpers


@lru_cache(maxsize=2)
def _model(ref: str | None, device: str) -> LoadedModel:
    return load_model(ref, device=device)


def build_pool(
    loaded: LoadedModel,
    prompt: RagPrompt,
    docs: Sequence[DocumentRow],
    questions: Sequence[Question],
    answers: Sequence[TeacherAnswerRow],
    settings: CartridgeSettings,
) -> tuple[dict[str, PoolDoc], list[Example], str]:
    """The pool (one cartridge per document), the distillation examples, the cartridge_fp."""
    spec, tcfg = CartridgeSpec.from_settings(settings), settings.teacher()
    tfp = teacher_fingerprint(loaded.model_fp, prompt.prefix_sha, tcfg)
    cfp = cartridge_fingerprint(
        loaded.model_fp, prompt.prefix_sha, tfp, spec, settings.train().value_dict()
    )
    pool: dict[str, PoolDoc] = {}
    cid_of: dict[str, str] = {}
    for d in docs:
        ids = doc_token_ids(loaded.tokenizer, d.text, tcfg.max_doc_tokens)
        if not ids:
            continue
        cid = cartridge_id(d.doc_id, d.doc_version, cfp)
        meta = CartridgeMeta(
            cid,
            d.doc_id,
            d.doc_version,
            cfp,
            prompt.prefix_sha,
            spec.tokens_for(len(ids)),
            spec.init,
        )
        pool[cid] = PoolDoc(meta, tuple(ids))
        cid_of[d.doc_id] = cid
    by_q = {q.question_id: q for q in questions}
    examples = []
    for a in answers:
        if not a.answer_ids or a.doc_id not in cid_of:
            continue
        ids, lp = topk_tensors(a)
        query = tuple(prompt.query_ids(by_q[a.question_id].text))
        examples.append(Example(a.answer_id, cid_of[a.doc_id], query, tuple(a.answer_ids), ids, lp))
    return pool, examples, cfp


def train_key(cfp: str, pool: dict[str, PoolDoc], examples: Sequence[Example]) -> str:
    """The checkpoint name of a training run: cartridge_fp, documents and examples."""
    ex = sha256_hex("examples", ",".join(sorted(e.example_id for e in examples)))
    return fingerprint("train", {"cartridge_fp": cfp, "cartridges": sorted(pool), "examples": ex})


# ---------------------------------------------------------------------------- tasks


@task(name="selfstudy", cache_policy=NONE)
def selfstudy_task(
    store: Store, docs: list, settings: CartridgeSettings, loaded: LoadedModel, run_id: str
) -> tuple[list[Question], dict[str, Any], str]:
    logger = get_run_logger()
    generator = make_generator(settings, loaded)

    progress = ProgressLog(logger, "selfstudy", "questions written", 0)

    questions, counts = selfstudy_stage(
        store,
        docs,
        generator,
        run_id=run_id,
        settings=settings,
        progress=progress,
    )
    return questions, dataclasses.asdict(counts), generator.fingerprint


@task(name="teacher", cache_policy=NONE)
def teacher_task(
    store: Store,
    docs: list,
    questions: list,
    settings: CartridgeSettings,
    loaded: LoadedModel,
    run_id: str,
) -> tuple[list[TeacherAnswerRow], dict[str, Any]]:
    logger = get_run_logger()
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)

    progress = ProgressLog(logger, "teacher", "answers", 0)

    rows, counts = teacher_stage(
        store,
        loaded,
        prompt,
        {d.doc_id: d for d in docs},
        questions,
        settings.teacher(),
        run_id=run_id,
        progress=progress,
    )
    return rows, dataclasses.asdict(counts)


@task(name="train-cartridges", cache_policy=NONE)
def train_task(
    store: Store,
    docs: list,
    questions: list,
    answers: list,
    settings: CartridgeSettings,
    loaded: LoadedModel,
    max_steps: int,
    run_id: str,
) -> dict[str, Any]:
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    rope = model_rope(loaded.model.config)
    pool, examples, cfp = build_pool(loaded, prompt, docs, questions, answers, settings)
    if not examples:
        raise ValueError("no training examples: self-study produced no usable question")
    cstore = CartridgeStore.create(store, CartridgeLayout.for_model(loaded.model, loaded.model_fp))
    trainer = CartridgeTrainer(
        loaded.model,
        prompt,
        rope,
        CartridgePool(cstore, pool, CartridgeSpec.from_settings(settings)),
        examples,
        settings.train(),
        TrainRun(run_id, train_key(cfp, pool, examples), settings.device),
    )
    # Cartridges trained by an earlier run with the same settings continue from their last
    # version (a run over a grown document set); a checkpoint of this exact run wins.
    trainer.manager.rows.update(cstore.latest(cfp, [p.meta.doc_id for p in pool.values()]))

    report = trainer.run(max_steps, on_step=_step_progress(get_run_logger(), max_steps))
    return _training_summary(report, cfp, len(pool), len(examples))


def _step_progress(logger: Any, max_steps: int) -> Callable[[int, float], None]:
    """An ``on_step`` hook logging progress towards ``max_steps`` (of this run only)."""
    steps = ProgressLog(logger, "train", "steps", 0)
    first_step: list[int] = []

    def on_step(step: int, loss: float) -> None:
        if not first_step:  # a resumed run starts after its checkpoint: time only this run
            first_step.append(step - 1)
        steps.update(
            step - first_step[0],
            max_steps - first_step[0],
            what=f"step {step}/{max_steps}, loss {loss:.4f}",
        )

    return on_step


def _training_summary(
    report: TrainReport, cfp: str, n_cartridges: int, n_examples: int
) -> dict[str, Any]:
    """The ``training`` entry of a run's summary (losses: first step, mean of the last 20)."""
    tail = report.losses[-20:]
    return {
        "cartridge_fp": cfp,
        "cartridges": n_cartridges,
        "examples": n_examples,
        "steps": report.steps,
        "resumed_from": report.resumed_from,
        "loss_first": report.losses[0] if report.losses else None,
        "loss_last20": sum(tail) / len(tail) if tail else None,
        "rotations": report.rotations,
        "peak_resident": report.peak_resident,
        "evictions": report.evictions,
        "epochs": report.epochs,
        "bytes_written": report.bytes_written,
        "seconds": round(report.seconds, 3),
    }


# ---------------------------------------------------------------------------- flows


def _run_pipeline(
    store: str, doc_ids: list[str] | None, settings: dict[str, Any] | None, max_steps: int | None
) -> dict[str, Any]:
    s = CartridgeSettings(**(settings or {}))
    st = Store.at(store).init()
    st.require_local("training cartridges")
    flow_name = "selfstudy" if max_steps is None else "train-cartridges"
    run_id = new_run_id(flow_name)
    params = {"doc_ids": doc_ids, "max_steps": max_steps, **s.to_dict()}
    params["generator"] = s.resolved_generator()
    with st.write_lock(run_id):
        run = start_run(st, run_id, flow_name, params)
        with failing_run(st, run):
            docs = live_documents_in(st, doc_ids)
            if not docs:
                raise ValueError(f"the store {st} has no documents: run coinrag build first")
            loaded = _model(s.model, s.device)
            questions, q_counts, gen_fp = selfstudy_task(st, docs, s, loaded, run_id)
            answers, t_counts = teacher_task(st, docs, questions, s, loaded, run_id)
            summary: dict[str, Any] = {
                "run_id": run_id,
                "documents": len(docs),
                "questions": len(questions),
                "selfstudy": q_counts,
                "teacher": t_counts,
            }
            fps = {
                "model_fp": loaded.model_fp,
                "generator_fp": gen_fp,
                "teacher_fp": answers[0].teacher_fp if answers else "",
            }
            if max_steps is not None:
                summary["training"] = train_task(
                    st, docs, questions, answers, s, loaded, max_steps, run_id
                )
                fps["cartridge_fp"] = summary["training"]["cartridge_fp"]
        finish_run(
            st,
            run,
            "completed",
            fingerprints=fps,
            counts=summary,
            cost_usd=float(q_counts.get("cost_usd", 0.0)),
        )
    return summary


@flow(name="coinrag-selfstudy")
def selfstudy_flow(
    store: str, doc_ids: list[str] | None = None, settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Self-study questions and teacher answers for ``doc_ids`` (default: every document)."""
    return _run_pipeline(store, doc_ids, settings, None)


@flow(name="coinrag-train-cartridges")
def train_cartridges_flow(
    store: str,
    doc_ids: list[str] | None = None,
    max_steps: int = 200,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Self-study (cached), teacher (cached) and cartridge training up to ``max_steps``."""
    return _run_pipeline(store, doc_ids, settings, max_steps)


def train_cartridges(
    store_path: str | os.PathLike[str],
    docs: Sequence[str] | None = None,
    max_steps: int = 200,
    **settings: Any,
) -> dict[str, Any]:
    """``coinrag train cartridges --store DIR [--docs ID ...] [--max-steps N]``.

    ``settings``: any :class:`CartridgeSettings` field (e.g. ``generator="local"``, ``p=64``,
    ``p_iso=0.5``). Returns the run summary (its ``training`` entry: steps, losses, rotations).
    """
    unknown = set(settings) - {f.name for f in dataclasses.fields(CartridgeSettings)}
    if unknown:
        raise TypeError(f"unknown cartridge settings: {', '.join(sorted(unknown))}")
    return train_cartridges_flow(
        str(store_path), list(docs) if docs else None, int(max_steps), settings
    )
