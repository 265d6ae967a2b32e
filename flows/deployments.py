"""Prefect deployments of the build flow (``flows/build.py``) and of the nugget fine-tuning flow
(``flows/train.py``) and of the retriever's (``flows/retriever.py``): scheduled and on-change
rebuilds, retraining after each build.

:func:`make_build_deployment` returns one ``RunnerDeployment`` of ``coinrag-build`` with fixed
parameters (source, store, settings) that runs

- on a cron schedule (``cron="0 3 * * *"``: every day at 03:00, in ``timezone``), and
- whenever a ``coinrag.source.changed`` event names its source (see ``flows/source_events.py``,
  emitted by ``coinrag watch``).

Runs of the deployment are queued one at a time (deployment concurrency 1, ``ENQUEUE``): a
scheduled build that falls during an on-change build waits for it instead of failing on the
store lock. Each run is incremental, so a rebuild of an unchanged source makes no LLM call.

:func:`make_train_deployment` returns a ``RunnerDeployment`` of ``coinrag-train-nuggets`` with
fixed parameters (store, data, out, ...) that runs

- after every successful build (default): an event trigger on ``prefect.flow-run.Completed``
  whose related flow is the build flow (``coinrag-build``), or, with ``build_deployment``, runs
  of that build deployment only; so each completed build retrains on the fresh store;
- on a cron schedule (``cron="0 3 * * *"``), without a trigger.

Caveats of training after a build: a chained KV rebuild (``rebuild_kv=True``) itself completes a
``coinrag-build`` flow run, which would trigger training again; the deployment therefore keeps
``rebuild_kv=False`` (rebuild the KV as a separate step, or use the cron variant). Re-running
with the same ``out`` resumes from its checkpoints only while data, config and base model are
unchanged; otherwise training refuses (``ResumeMismatch``): point ``out`` at a fresh folder per
retraining.

:func:`serve_build` serves deployments (a long-running process that polls the Prefect API;
needs a Prefect server, see ``infra/prefect_server.py``): the build's, optionally beside the
fine-tuning one (:func:`make_serve_deployments`). This is what ``coinrag serve`` runs; Ctrl-C
stops it and pauses the schedules it registered. The fine-tuning deployment alone::

    python -m coinrag.flows.deployments --store /data/store --data /data/qa.jsonl \\
        --out /data/models/coinrag-ft [--mode live] [--lora] [--cron "0 3 * * *"]
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from coinrag.flows.source_events import SOURCE_CHANGED_EVENT, source_resource_id

DEPLOYMENT_NAME = "coinrag-build-scheduled"
TRAIN_DEPLOYMENT_NAME = "coinrag-train-after-build"
BUILD_FLOW_NAME = "coinrag-build"
TRAIN_ALONE_NAME = "train-nuggets-after-build"  # python -m coinrag.flows.deployments


def make_build_deployment(
    source: str,
    store: str,
    settings: dict[str, Any] | None = None,
    cron: str | None = None,
    name: str = DEPLOYMENT_NAME,
    timezone: str = "UTC",
    on_change: bool = True,
) -> Any:
    """A ``RunnerDeployment`` of :func:`flows.build.build_flow` (not registered yet).

    ``source`` and ``store`` are paths as the worker or server process sees them; ``settings``
    is a :class:`schemas.settings.BuildSettings` dict (validated here, so a bad value fails now
    rather than at 03:00). ``on_change`` adds the trigger on ``coinrag.source.changed``.
    """
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.events import DeploymentEventTrigger

    from coinrag.flows.build import build_flow
    from coinrag.schemas.settings import BuildSettings

    BuildSettings(**(settings or {})).validate()
    triggers = []
    if on_change:
        triggers.append(
            DeploymentEventTrigger(
                name="source-changed",
                expect={SOURCE_CHANGED_EVENT},
                match={"prefect.resource.id": source_resource_id(source)},
                posture="Reactive",
                threshold=1,
            )
        )
    return build_flow.to_deployment(
        name=name,
        parameters={"source": source, "store": store, "settings": settings or {}},
        schedules=[CronSchedule(cron=cron, timezone=timezone)] if cron else None,
        triggers=triggers or None,
        concurrency_limit=ConcurrencyLimitConfig(
            limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE
        ),
        tags=["coinrag", "build"],
        description=f"coinrag build of {source} into {store}",
    )


def make_serve_deployments(
    source: str,
    store: str,
    settings: dict[str, Any] | None = None,
    cron: str | None = None,
    name: str = DEPLOYMENT_NAME,
    train_data: str | None = None,
    train_out: str | None = None,
) -> list[Any]:
    """The build deployment, plus the training deployment run after each of its builds.

    Training is added only when both ``train_data`` (QA JSONL) and ``train_out`` are given.
    (The retriever's: :func:`make_retriever_deployment` with ``build_deployment=name``.)
    """
    if (train_data is None) != (train_out is None):
        raise ValueError("train_data and train_out go together: give both or neither")
    deployments = [make_build_deployment(source, store, settings, cron=cron, name=name)]
    if train_data and train_out:
        deployments.append(
            make_train_deployment(
                store, train_data, train_out, name=TRAIN_DEPLOYMENT_NAME, build_deployment=name
            )
        )
    return deployments


def make_train_deployment(
    store: str,
    data: str,
    out: str,
    *,
    cron: str | None = None,
    name: str = TRAIN_ALONE_NAME,
    build_deployment: str | None = None,
    **flow_parameters: Any,
) -> Any:
    """A ``RunnerDeployment`` of :func:`flows.train.train_nuggets_flow` (not registered yet).

    ``flow_parameters``: any other parameter of the flow (``model``, ``settings`` with
    ``mode``, ``lora``, ``max_steps``, ...; TypeError for one it does not take), fixed in the
    deployment with ``rebuild_kv=False`` (module docstring). Without ``cron``: triggered by the
    build flow's completion; with ``cron``: scheduled. ``build_deployment`` narrows the trigger
    to completed runs of that build deployment (its name): the training flow's own document
    build is a ``coinrag-build`` subflow run without a deployment, so it cannot retrigger training.
    """

    from coinrag.flows.train import train_nuggets_flow

    parameters = {"store": store, "data": data, "out": out, **flow_parameters, "rebuild_kv": False}
    inspect.signature(train_nuggets_flow.fn).bind(**parameters)  # TypeError: not a parameter
    kwargs = _training_schedule(name, parameters, cron, build_deployment)
    return train_nuggets_flow.to_deployment(**kwargs)


def _training_schedule(
    name: str, parameters: dict[str, Any], cron: str | None, build_deployment: str | None
) -> dict[str, Any]:
    """``to_deployment`` keywords of a training deployment: on ``cron``, else after each
    completed run of the build deployment ``build_deployment`` (of any ``coinrag-build`` flow
    run when None)."""
    from prefect.events import DeploymentEventTrigger

    kwargs: dict[str, Any] = {"name": name, "parameters": parameters, "tags": ["coinrag", "train"]}
    if cron:
        kwargs["cron"] = cron
        return kwargs
    kwargs["triggers"] = [
        DeploymentEventTrigger(
            name="after-build",
            expect={"prefect.flow-run.Completed"},
            match_related={
                "prefect.resource.role": "deployment" if build_deployment else "flow",
                "prefect.resource.name": build_deployment or BUILD_FLOW_NAME,
            },
            posture="Reactive",
            threshold=1,
        )
    ]
    return kwargs


RETRIEVER_DEPLOYMENT_NAME = "coinrag-train-retriever-after-build"


def make_retriever_deployment(
    store: str,
    out: str,
    exclude_questions: list[str],
    *,
    build_deployment: str | None = None,
    cron: str | None = None,
    name: str = RETRIEVER_DEPLOYMENT_NAME,
    **flow_parameters: Any,
) -> Any:
    """A ``RunnerDeployment`` of :func:`flows.retriever.train_retriever_flow` (not registered
    yet): after each completed run of the build deployment ``build_deployment``, or on ``cron``.

    Its own re-embedding build is a ``coinrag-build`` subflow run without a deployment, so the
    trigger is narrowed to the build deployment's runs (a trigger on every build flow run would
    retrain after its own re-embedding): one of ``build_deployment`` and ``cron`` is required.
    Each run writes ``out/<run id>`` (``versioned_out``): the folder readers load is never
    overwritten. ``flow_parameters``: ``settings``, ``source``, ... (TypeError for others)."""

    from coinrag.flows.retriever import train_retriever_flow

    if (build_deployment is None) == (cron is None):
        raise ValueError("give exactly one of build_deployment (train after its builds) and cron")
    parameters = {"store": store, "out": out, "exclude_questions": list(exclude_questions)}
    parameters |= {**flow_parameters, "versioned_out": True}
    inspect.signature(train_retriever_flow.fn).bind(**parameters)  # TypeError: not a parameter
    kwargs = _training_schedule(name, parameters, cron, build_deployment)
    return train_retriever_flow.to_deployment(**kwargs)


def serve_build(deployments: list[Any]) -> None:
    """Register and serve ``deployments`` until Ctrl-C (or SIGTERM); then pause their schedules.

    Needs ``PREFECT_API_URL`` pointing at a running Prefect server: a temporary server would
    vanish with this process, schedules and all.
    """
    from prefect import serve
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise RuntimeError(
            "PREFECT_API_URL is not set: start a server (python infra/prefect_server.py --home "
            "DIR) and export the URL it prints"
        )
    serve(*deployments, pause_on_shutdown=True)


def main(argv: list[str] | None = None) -> None:
    """Serve the fine-tuning deployment alone (``python -m coinrag.flows.deployments --help``)."""
    from prefect import serve

    ap = argparse.ArgumentParser(description="Serve the nugget fine-tuning deployment.")
    ap.add_argument("--store", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="live", choices=("live", "frozen"))
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--cron", default=None)
    a = ap.parse_args(argv)
    serve(
        make_train_deployment(
            a.store,
            a.data,
            a.out,
            cron=a.cron,
            settings={"mode": a.mode, "lora": a.lora, "max_steps": a.max_steps},
        )
    )


if __name__ == "__main__":
    main()
