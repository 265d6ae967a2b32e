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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE

from coinrag.inference.context.builders import FINETUNE_CONTEXTS
from coinrag.schemas.keys import new_run_id
from coinrag.schemas.qa import load_examples
from coinrag.schemas.settings import FinetuneSettings, settings_from_toml
from coinrag.storage.cache import file_sha256
from coinrag.storage.runs import failing_run, finish_run, start_run
from coinrag.storage.store import Store
from coinrag.training.data import write_documents
from coinrag.training.finetune import run_training
from coinrag.training.job import TrainJob
from coinrag.training.loop import RunControl

FLOW_NAME = "coinrag-train-nuggets"
KVLINK_FLOW_NAME = "coinrag-train-kvlink"


@task(name="load-qa-data", cache_policy=NONE)
def load_data_task(data: str) -> list:
    return load_examples(data)


@task(name="train-nuggets", cache_policy=NONE)
def train_task(job: TrainJob, cfg: FinetuneSettings) -> dict[str, Any]:
    return run_training(job, cfg, RunControl(logger=get_run_logger()))


@task(name="train-kvlink", cache_policy=NONE)
def train_kvlink_task(
    job: TrainJob, cfg: FinetuneSettings, link: dict[str, int], lineage: dict[str, Any]
) -> dict[str, Any]:
    from coinrag.training.kvlink import run_kvlink_training

    control = RunControl(logger=get_run_logger(), lineage=lineage)
    return run_kvlink_training(job, cfg, control=control, **link)


@dataclasses.dataclass
class _TrainingData:
    """The QA data of a training flow, loaded, with its documents built into the store:
    ``path`` (resolved), ``sha256``, ``examples``, ``build_settings`` (the store's, then the
    flow's overrides), the documents' JSONL ``docs_source`` and how many it holds (``n_docs``,
    0: none written), the build flow's summary."""

    path: str
    sha256: str
    examples: list
    build_settings: dict[str, Any]
    docs_source: Path
    n_docs: int
    build_summary: dict[str, Any]

    @classmethod
    def load_and_build(
        cls, st: Store, data: str, build_settings: dict[str, Any], logger: Any
    ) -> _TrainingData:
        """Load ``data`` and build its inline documents into ``st`` (incremental); with none,
        the store must exist already."""
        path = str(Path(data).expanduser().resolve())
        sha = file_sha256(path)
        examples = load_data_task(path)
        docs_source = st.root / "train-data" / f"{sha[:16]}.jsonl"
        n_docs = write_documents(examples, docs_source)
        build_summary: dict[str, Any] = {}
        if n_docs:
            from coinrag.flows.build import build_flow

            logger.info("building %d training documents into %s", n_docs, st.root)
            build_summary = build_flow(str(docs_source), str(st.root), build_settings)
        elif not st.exists():
            raise FileNotFoundError(f"{st} is not a coinrag store and the data has no documents")
        return cls(path, sha, examples, build_settings, docs_source, n_docs, build_summary)

    def params(self, out: str, base_model: str, hyperparameters: dict[str, Any]) -> dict:
        """The runs-table parameters every training run records."""
        return {
            "data": self.path,
            "data_sha256": self.sha256,
            "out": str(Path(out).expanduser().resolve()),
            "base_model": str(base_model),
            "hyperparameters": hyperparameters,
        }


def _build_settings(
    st: Store, overrides: dict[str, Any] | None, model: str | None
) -> dict[str, Any]:
    """The store's recorded build settings (defaults if none), then ``overrides``, then
    ``model`` (if given)."""
    base = settings_from_toml(st.read_toml(), st.uri(st.settings_path))
    out = {**base.to_dict(), **(overrides or {})}
    if model is not None:
        out["model"] = model
    return out


def _recorded_run(
    st: Store,
    flow: str,
    params: dict[str, Any],
    train_fn: Callable[[str], dict[str, Any]],
    fingerprint_keys: tuple[str, ...],
    extra_counts: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``train_fn(run_id)`` as a ``flow`` row of the runs table (failed if it raises;
    completed with the summary's counts, ``extra_counts`` and its ``fingerprint_keys``);
    return the summary with ``run_id``."""
    run_id = new_run_id("train")
    with st.write_lock(run_id):
        run = start_run(st, run_id, flow, params)
    with failing_run(st, run, relock=True):
        summary = train_fn(run_id)
    counts = {
        **summary["counts"],
        "steps": summary["steps"],
        "first_loss": summary["first_loss"],
        "final_loss": summary["final_loss"],
        "steps_per_s": summary["steps_per_s"],
        "resumed_from": summary["resumed_from"],
        **(extra_counts or {}),
    }
    fingerprints = {key: summary[key] for key in fingerprint_keys}
    with st.write_lock(run_id):
        finish_run(st, run, "completed", fingerprints=fingerprints, counts=counts)
    summary["run_id"] = run_id
    return summary


def _log_done(logger: Any, flow: str, summary: dict[str, Any], fp_key: str) -> None:
    logger.info(
        "%s %s done: %d steps, loss %.4f -> %.4f, %s %s",
        flow,
        summary["run_id"],
        summary["steps"],
        summary["first_loss"] or 0.0,
        summary["final_loss"] or 0.0,
        fp_key,
        summary[fp_key],
    )


@flow(name=FLOW_NAME)
def train_nuggets_flow(
    store: str,
    data: str,
    out: str,
    model: str | None = None,
    settings: dict[str, Any] | None = None,
    build: dict[str, Any] | None = None,
    rebuild_kv: bool = False,
    source: str | None = None,
) -> dict[str, Any]:
    """Fine-tune ``model`` (default: the store's model) on the QA JSONL ``data``; write ``out``.

    ``settings``: :class:`schemas.settings.FinetuneSettings` fields (mode, lora, max_steps, lr,
    batch_size, raft_p, ...); ``build``: build-settings overrides for building the data's
    documents and the KV rebuild (e.g. ``{"extractor": "rules"}``); ``source``: what the KV
    rebuild builds (default: the data's documents JSONL). Returns the summary (``model_fp``,
    losses, counts, ...).
    """
    logger = get_run_logger()
    cfg = FinetuneSettings(**(settings or {})).validate()
    st = Store.at(store)
    st.require_local("coinrag train")
    build_settings = _build_settings(st, build, model)
    if FINETUNE_CONTEXTS[cfg.mode].reads_stored_kv:
        build_settings["kv"] = True  # frozen mode reads the base model's stored KV
    td = _TrainingData.load_and_build(st, data, build_settings, logger)
    base_ref = build_settings["model"]
    params = {
        **td.params(out, base_ref, cfg.to_dict()),
        "documents_source": str(td.docs_source) if td.n_docs else None,
        "rebuild_kv": rebuild_kv,
    }
    job = TrainJob(str(st.root), td.path, out, model=base_ref, examples=td.examples)
    summary = _recorded_run(
        st,
        "train-nuggets",
        params,
        lambda run_id: train_task(job, cfg),
        ("base_model_fp", "model_fp"),
        {"documents_built": td.build_summary.get("documents", 0)},
    )
    if rebuild_kv:
        from coinrag.flows.build import build_flow

        src = source or (str(td.docs_source) if td.n_docs else None)
        if src is None:
            raise ValueError("rebuild_kv needs `source` when the data has no inline documents")
        rebuild = {**build_settings, "model": summary["model_dir"], "kv": True}
        summary["kv_rebuild"] = build_flow(src, str(st.root), rebuild)
    _log_done(logger, "train-nuggets", summary, "model_fp")
    return summary


def train_nuggets(
    store: str | os.PathLike[str],
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    model: str | None = None,
    build: dict[str, Any] | None = None,
    rebuild_kv: bool = False,
    source: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """``coinrag train nuggets --store DIR --data qa.jsonl --out MODEL_DIR [--mode live|frozen]
    [--lora] [--max-steps N]``.

    ``settings``: any :class:`schemas.settings.FinetuneSettings` field (``mode``, ``lora``,
    ``max_steps``, ``lr``, ``batch_size``, ``epochs``, ``raft_p``, ``seed``,
    ``checkpoint_every``, ``device``, ...). Returns the summary.
    """
    unknown = set(settings) - {f.name for f in dataclasses.fields(FinetuneSettings)}
    if unknown:
        raise TypeError(f"unknown training settings: {', '.join(sorted(unknown))}")
    return train_nuggets_flow(
        str(store),
        str(data),
        str(out),
        model=model,
        settings=settings or None,
        build=build,
        rebuild_kv=rebuild_kv,
        source=source,
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
    build_settings = {**_build_settings(st, build, model), "kv": True}
    td = _TrainingData.load_and_build(st, data, build_settings, logger)
    link = {"n_link": n_link, "max_docs": max_docs}
    base_ref = build_settings["model"]
    params = td.params(out, base_ref, {**cfg.to_dict(), **link})
    job = TrainJob(str(st.root), td.path, out, model=base_ref, examples=td.examples)
    summary = _recorded_run(
        st,
        "train-kvlink",
        params,
        lambda run_id: train_kvlink_task(job, cfg, link, {"run_id": run_id}),
        ("base_model_fp", "kvlink_fp"),
    )
    _log_done(logger, "train-kvlink", summary, "kvlink_fp")
    return summary
