"""Prefect deployment of the nugget-aware fine-tuning flow (``flows/train.py``).

Two ways to run it on a schedule, both from :func:`make_deployment`:

- after every successful build (default): an event trigger on ``prefect.flow-run.Completed``
  whose related flow is the build flow (``coinrag-build``). The deployment's parameters are
  fixed (store, data, out, ...), so each completed build retrains on the fresh store;
- on a cron schedule (``cron="0 3 * * *"``), without a trigger.

Serve it (a long-running process polling the Prefect API; needs a Prefect server)::

    python infra/train_deployment.py --store /data/store --data /data/qa.jsonl \\
        --out /data/models/coinrag-ft [--mode live] [--lora] [--cron "0 3 * * *"]

Caveats: a chained KV rebuild (``rebuild_kv=True``) itself completes a ``coinrag-build`` flow
run, which would trigger training again; the deployment therefore keeps ``rebuild_kv=False``
(rebuild the KV as a separate step, or use the cron variant). Re-running with the same ``out``
resumes from its checkpoints only while data, config and base model are unchanged; otherwise
training refuses (``ResumeMismatch``): point ``out`` at a fresh folder per retraining.
"""

from __future__ import annotations

import argparse
from typing import Any

BUILD_FLOW_NAME = "coinrag-build"
DEPLOYMENT_NAME = "train-nuggets-after-build"


def make_deployment(
    store: str,
    data: str,
    out: str,
    mode: str = "live",
    lora: bool = False,
    max_steps: int | None = None,
    settings: dict[str, Any] | None = None,
    cron: str | None = None,
    name: str = DEPLOYMENT_NAME,
    build_deployment: str | None = None,
) -> Any:
    """A ``RunnerDeployment`` of :func:`flows.train.train_nuggets_flow` (not registered yet).

    Without ``cron``: triggered by the build flow's completion; with ``cron``: scheduled.
    ``build_deployment`` narrows the trigger to completed runs of that build deployment (its
    name): the training flow's own document build is a ``coinrag-build`` subflow run without a
    deployment, so it cannot retrigger training.
    """
    from prefect.events import DeploymentEventTrigger

    from flows.train import train_nuggets_flow

    parameters = {
        "store": store,
        "data": data,
        "out": out,
        "mode": mode,
        "lora": lora,
        "max_steps": max_steps,
        "settings": settings,
        "rebuild_kv": False,
    }
    kwargs: dict[str, Any] = {"name": name, "parameters": parameters, "tags": ["coinrag", "train"]}
    if cron:
        kwargs["cron"] = cron
    else:
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
    return train_nuggets_flow.to_deployment(**kwargs)


def main(argv: list[str] | None = None) -> None:
    from prefect import serve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", default="live", choices=("live", "frozen"))
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--cron", default=None)
    a = ap.parse_args(argv)
    serve(make_deployment(a.store, a.data, a.out, a.mode, a.lora, a.max_steps, cron=a.cron))


if __name__ == "__main__":
    main()
