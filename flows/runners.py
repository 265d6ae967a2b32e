"""Where a build's tasks run: the flow process, a Dask cluster or a Ray cluster.

The one module that knows Dask and Ray (through ``prefect-dask`` and ``prefect-ray``). The
build submits its heavy tasks to :func:`task_runner` and publishes what they return; it never
asks which runner it has, except that the ``default`` runner keeps the KV stage in the flow
process (``flows/build.py``).

- ``default``: Prefect's thread pool in the flow process, one task at a time (what a build did
  before scale-out).
- ``dask``: ``runner_address`` is a scheduler (``tcp://host:8786``); empty starts a
  ``distributed.LocalCluster`` of ``workers`` processes with one thread each.
- ``ray``: ``runner_address`` is a Ray address (``ray://host:10001``, or ``auto`` for the
  cluster this machine belongs to); empty starts a local Ray with ``workers`` CPUs.

``kv_resources`` (e.g. ``"GPU=1"``) is what each KV task asks for: Dask worker resources
(``dask-worker --resources GPU=1``), Ray ``num_gpus``/``num_cpus``/custom resources; only
workers offering them take KV tasks, while extraction and embedding tasks go anywhere. A local
Dask cluster gives each of its workers these resources; a local Ray offers its own GPUs (and
``workers`` times the custom ones).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from schemas.settings import BuildSettings, parse_resources


def make_task_runner(settings: BuildSettings) -> TaskRunner:
    """The (not yet started) Prefect task runner of ``settings.runner``."""
    resources = parse_resources(settings.kv_resources)
    if settings.runner == "dask":
        from prefect_dask import DaskTaskRunner

        if settings.runner_address:
            return DaskTaskRunner(address=settings.runner_address)
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": settings.workers,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
                "resources": resources or None,
            }
        )
    if settings.runner == "ray":
        from prefect_ray import RayTaskRunner

        if settings.runner_address:
            return RayTaskRunner(address=settings.runner_address)
        ray_kwargs = _ray_options(resources)
        init: dict[str, Any] = {
            "num_cpus": settings.workers,
            "include_dashboard": False,
            "log_to_driver": False,
        }
        if "resources" in ray_kwargs:  # GPUs: Ray finds this machine's own
            init["resources"] = {
                k: v * settings.workers for k, v in ray_kwargs["resources"].items()
            }
        return RayTaskRunner(init_kwargs=init)
    return ThreadPoolTaskRunner(max_workers=1)


@contextmanager
def task_runner(settings: BuildSettings) -> Iterator[TaskRunner]:
    """A started task runner for one build (a local cluster lives as long as the block)."""
    with make_task_runner(settings) as runner:
        yield runner


def kv_placement(settings: BuildSettings) -> Any:
    """A context in which submitted tasks ask for ``settings.kv_resources`` (a no-op without
    them, or on the default runner)."""
    resources = parse_resources(settings.kv_resources)
    if not resources or settings.runner == "default":
        return nullcontext()
    if settings.runner == "dask":
        import dask

        return dask.annotate(resources=resources)
    from prefect_ray.context import remote_options

    return remote_options(**_ray_options(resources))


def _ray_options(resources: dict[str, float]) -> dict[str, Any]:
    """Resources as Ray ``@remote`` options: GPU and CPU have their own keywords."""
    out: dict[str, Any] = {}
    rest = dict(resources)
    if "GPU" in rest:
        out["num_gpus"] = rest.pop("GPU")
    if "CPU" in rest:
        out["num_cpus"] = rest.pop("CPU")
    if rest:
        out["resources"] = rest
    return out
