"""Prefect deployment of the build flow (``flows/build.py``): scheduled and on-change rebuilds.

:func:`make_build_deployment` returns one ``RunnerDeployment`` of ``coinrag-build`` with fixed
parameters (source, store, settings) that runs

- on a cron schedule (``cron="0 3 * * *"``: every day at 03:00, in ``timezone``), and
- whenever a ``coinrag.source.changed`` event names its source (see ``infra/source_events.py``,
  emitted by ``coinrag watch``).

Runs of the deployment are queued one at a time (deployment concurrency 1, ``ENQUEUE``): a
scheduled build that falls during an on-change build waits for it instead of failing on the
store lock. Each run is incremental, so a rebuild of an unchanged source makes no LLM call.

:func:`serve_build` serves it (a long-running process that polls the Prefect API; needs a
Prefect server, see ``infra/prefect_server.py``), optionally beside the fine-tuning deployment
of ``infra/train_deployment.py`` triggered by each completed run of this build deployment.
This is what ``coinrag serve`` runs; Ctrl-C stops it and pauses the schedules it registered.
"""

from __future__ import annotations

from typing import Any

from flows.source_events import SOURCE_CHANGED_EVENT, source_resource_id

DEPLOYMENT_NAME = "coinrag-build-scheduled"
TRAIN_DEPLOYMENT_NAME = "coinrag-train-after-build"


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

    from flows.build import build_flow
    from schemas.settings import BuildSettings

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
    """
    if (train_data is None) != (train_out is None):
        raise ValueError("train_data and train_out go together: give both or neither")
    deployments = [make_build_deployment(source, store, settings, cron=cron, name=name)]
    if train_data and train_out:
        from infra.train_deployment import make_deployment

        deployments.append(
            make_deployment(
                store, train_data, train_out, name=TRAIN_DEPLOYMENT_NAME, build_deployment=name
            )
        )
    return deployments


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
