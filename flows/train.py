"""The nugget-aware fine-tuning flow (``coinrag train nuggets``).

```
load+validate QA data -> build its documents (incremental build flow) -> train -> save model
    -> lineage (runs table, flow "train-nuggets") -> [KV rebuild for the new model]
```

- QA examples with inline ``documents`` (HotpotQA style: gold + distractors) are written as a
  JSONL source under ``STORE/train-data/`` and built into the store with
  :func:`flows.build.build_flow` (a subflow; incremental, so documents already built for the
  same model, chunker and extractor cost nothing). Examples with ``doc_ids`` use documents
  already in the store.
- Training is :func:`training.finetune.run_training` (see its module docstring for the modes;
  ``live`` is the default). Killed runs resume from ``OUT/checkpoints`` when started again with
  the same arguments.
- The runs table gets a ``train-nuggets`` row: parameters (data path and sha256, base model,
  hyperparameters, output folder), fingerprints (``base_model_fp``, ``model_fp`` of the new
  weights), counts (examples, skipped, truncated, RAFT-dropped, steps, losses).
- ``rebuild_kv=True`` chains a build of the same source with ``model=OUT``, so the store holds
  KV computed by the new weights (a different ``kv_fp``): serving the new model never reads the
  old model's cache. That build also records ``model=OUT`` as the store's default model.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from coinrag.inference.context import FINETUNE_CONTEXTS
from coinrag.schemas.keys import new_run_id
from coinrag.schemas.qa import load_examples
from coinrag.schemas.settings import FinetuneSettings, settings_from_toml
from coinrag.storage.runs import failing_run, finish_run, start_run
from coinrag.storage.store import Store
from coinrag.training.finetune import file_sha256, run_training, write_documents

FLOW_NAME = "coinrag-train-nuggets"


@task(name="load-qa-data", cache_policy=NONE)
def load_data_task(data: str) -> list:
    return load_examples(data)


@task(name="train-nuggets", cache_policy=NONE)
def train_task(
    store: str, data: str, out: str, cfg: FinetuneSettings, model: str | None, examples: list
) -> dict[str, Any]:
    return run_training(
        store, data, out, cfg, model=model, logger=get_run_logger(), examples=examples
    )


def _build_settings(st: Store, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The store's recorded build settings (defaults if none), then ``overrides``."""
    base = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    return {**base.to_dict(), **(overrides or {})}


@flow(name=FLOW_NAME)
def train_nuggets_flow(
    store: str,
    data: str,
    out: str,
    mode: str = "live",
    lora: bool = False,
    max_steps: int | None = None,
    model: str | None = None,
    settings: dict[str, Any] | None = None,
    build: dict[str, Any] | None = None,
    rebuild_kv: bool = False,
    source: str | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` (default: the store's model) on the QA JSONL ``data``; write ``out``.

    ``settings``: :class:`schemas.settings.FinetuneSettings` fields (lr, batch_size, raft_p, ...);
    ``build``: build-settings overrides for building the data's documents and the KV rebuild
    (e.g. ``{"extractor": "rules"}``); ``source``: what the KV rebuild builds (default: the
    data's documents JSONL). Returns the summary (``model_fp``, losses, counts, ...).
    """
    logger = get_run_logger()
    cfg = FinetuneSettings(
        **{**(settings or {}), "mode": mode, "lora": lora, "max_steps": max_steps}
    ).validate()
    st = Store.at(store)
    st.require_local("coinrag train")
    data_path = str(Path(data).expanduser().resolve())
    data_sha = file_sha256(data_path)
    examples = load_data_task(data_path)
    build_settings = _build_settings(st, build)
    if model is not None:
        build_settings["model"] = model
    base_ref = build_settings["model"]
    if FINETUNE_CONTEXTS[cfg.mode].reads_stored_kv:
        build_settings["kv"] = True  # frozen mode reads the base model's stored KV
    docs_source = st.root / "train-data" / f"{data_sha[:16]}.jsonl"
    n_docs = write_documents(examples, docs_source)
    build_summary: dict[str, Any] = {}
    if n_docs:
        from coinrag.flows.build import build_flow

        logger.info("building %d training documents into %s", n_docs, st.root)
        build_summary = build_flow(str(docs_source), str(st.root), build_settings)
    elif not st.exists():
        raise FileNotFoundError(f"{st} is not a coinrag store and the data has no documents")

    run_id = new_run_id("train")
    params = {
        "data": data_path,
        "data_sha256": data_sha,
        "out": str(Path(out).expanduser().resolve()),
        "base_model": str(base_ref),
        "hyperparameters": cfg.to_dict(),
        "documents_source": str(docs_source) if n_docs else None,
        "rebuild_kv": rebuild_kv,
    }
    with st.write_lock(run_id):
        run = start_run(st, run_id, "train-nuggets", params)
    with failing_run(st, run, relock=True):
        summary = train_task(str(st.root), data_path, out, cfg, base_ref, examples)
    counts = {
        **summary["counts"],
        "steps": summary["steps"],
        "first_loss": summary["first_loss"],
        "final_loss": summary["final_loss"],
        "steps_per_s": summary["steps_per_s"],
        "resumed_from": summary["resumed_from"],
        "documents_built": build_summary.get("documents", 0),
    }
    fingerprints = {"base_model_fp": summary["base_model_fp"], "model_fp": summary["model_fp"]}
    with st.write_lock(run_id):
        finish_run(st, run, "completed", fingerprints=fingerprints, counts=counts)
    summary["run_id"] = run_id
    if rebuild_kv:
        from coinrag.flows.build import build_flow

        src = source or (str(docs_source) if n_docs else None)
        if src is None:
            raise ValueError("rebuild_kv needs `source` when the data has no inline documents")
        rebuild = {**build_settings, "model": summary["model_dir"], "kv": True}
        summary["kv_rebuild"] = build_flow(src, str(st.root), rebuild)
    logger.info(
        "train-nuggets %s done: %d steps, loss %.4f -> %.4f, model_fp %s",
        run_id,
        summary["steps"],
        summary["first_loss"] or 0.0,
        summary["final_loss"] or 0.0,
        summary["model_fp"],
    )
    return summary


def train_nuggets(
    store: str | os.PathLike[str],
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    mode: str = "live",
    lora: bool = False,
    max_steps: int | None = None,
    *,
    model: str | None = None,
    build: dict[str, Any] | None = None,
    rebuild_kv: bool = False,
    source: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """``coinrag train nuggets --store DIR --data qa.jsonl --out MODEL_DIR [--mode live|frozen]
    [--lora] [--max-steps N]``.

    ``settings``: any :class:`schemas.settings.FinetuneSettings` field (``lr``, ``batch_size``,
    ``epochs``, ``raft_p``, ``seed``, ``checkpoint_every``, ``device``, ...). Returns the summary.
    """
    fields = {f.name for f in dataclasses.fields(FinetuneSettings)} - {"mode", "lora", "max_steps"}
    unknown = set(settings) - fields
    if unknown:
        raise TypeError(f"unknown training settings: {', '.join(sorted(unknown))}")
    return train_nuggets_flow(
        str(store),
        str(data),
        str(out),
        mode=mode,
        lora=lora,
        max_steps=max_steps,
        model=model,
        settings=settings or None,
        build=build,
        rebuild_kv=rebuild_kv,
        source=source,
    )


KVLINK_FLOW_NAME = "coinrag-train-kvlink"


@task(name="train-kvlink", cache_policy=NONE)
def train_kvlink_task(
    store: str,
    data: str,
    out: str,
    cfg: FinetuneSettings,
    model: str | None,
    examples: list,
    link: dict[str, int],
    lineage: dict[str, Any],
) -> dict[str, Any]:
    from coinrag.training.kvlink import run_kvlink_training

    return run_kvlink_training(
        store,
        data,
        out,
        cfg,
        model=model,
        logger=get_run_logger(),
        examples=examples,
        lineage=lineage,
        **link,
    )


@flow(name=KVLINK_FLOW_NAME)
def train_kvlink_flow(
    store: str,
    data: str,
    out: str,
    n_link: int,
    max_docs: int,
    model: str | None = None,
    settings: dict[str, Any] | None = None,
    build: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train KVLink link tokens (``training/kvlink.py``) for ``model`` (default: the store's)
    on the QA JSONL ``data``; write the adapter folder ``out``. The data's inline documents are
    built into the store first (with KV: training reads the stored chunk KV); the runs table
    gets a ``train-kvlink`` row with ``base_model_fp`` and the adapter's ``kvlink_fp``."""
    logger = get_run_logger()
    cfg = FinetuneSettings(**{**(settings or {}), "mode": "frozen", "lora": False}).validate()
    st = Store.at(store)
    st.require_local("coinrag train kvlink")
    data_path = str(Path(data).expanduser().resolve())
    data_sha = file_sha256(data_path)
    examples = load_data_task(data_path)
    build_settings = {**_build_settings(st, build), "kv": True}
    if model is not None:
        build_settings["model"] = model
    docs_source = st.root / "train-data" / f"{data_sha[:16]}.jsonl"
    n_docs = write_documents(examples, docs_source)
    if n_docs:
        from coinrag.flows.build import build_flow

        logger.info("building %d training documents into %s", n_docs, st.root)
        build_flow(str(docs_source), str(st.root), build_settings)
    elif not st.exists():
        raise FileNotFoundError(f"{st} is not a coinrag store and the data has no documents")
    run_id = new_run_id("train")
    params = {
        "data": data_path,
        "data_sha256": data_sha,
        "out": str(Path(out).expanduser().resolve()),
        "base_model": str(build_settings["model"]),
        "hyperparameters": {**cfg.to_dict(), "n_link": n_link, "max_docs": max_docs},
    }
    with st.write_lock(run_id):
        run = start_run(st, run_id, "train-kvlink", params)
    with failing_run(st, run, relock=True):
        summary = train_kvlink_task(
            str(st.root),
            data_path,
            out,
            cfg,
            build_settings["model"],
            examples,
            {"n_link": n_link, "max_docs": max_docs},
            {"run_id": run_id},
        )
    counts = {
        **summary["counts"],
        "steps": summary["steps"],
        "first_loss": summary["first_loss"],
        "final_loss": summary["final_loss"],
        "resumed_from": summary["resumed_from"],
    }
    fingerprints = {"base_model_fp": summary["base_model_fp"], "kvlink_fp": summary["kvlink_fp"]}
    with st.write_lock(run_id):
        finish_run(st, run, "completed", fingerprints=fingerprints, counts=counts)
    summary["run_id"] = run_id
    logger.info(
        "train-kvlink %s done: %d steps, loss %.4f -> %.4f, kvlink_fp %s",
        run_id,
        summary["steps"],
        summary["first_loss"] or 0.0,
        summary["final_loss"] or 0.0,
        summary["kvlink_fp"],
    )
    return summary
