"""Where a build's tasks run (the flow process, a Dask cluster or a Ray cluster), and the KV and
embedding stages as many tasks on a distributed task runner.

Runners
-------
The one module that knows Dask and Ray (through ``prefect-dask`` and ``prefect-ray``). A
:class:`Runner` subclass per value of the ``runner`` setting, registered by name in
``Runner.registry`` (``schemas/registry.py``; :meth:`Runner.from_settings`). The build submits
its heavy tasks to the started runner (:func:`task_runner`) and publishes what they return; it
never asks which runner it has: what differs is the runner's methods (where a stage runs,
:meth:`Runner.stage`; where its model work runs, :meth:`Runner.kv_workers` and
:meth:`Runner.embed_parts`).

- ``default`` (:class:`LocalRunner`): Prefect's thread pool in the flow process, one task at
  a time (what a build did before scale-out); the KV and embedding stages are one task each,
  their model work in this process.
- ``dask`` (:class:`DaskRunner`): ``runner_address`` is a scheduler (``tcp://host:8786``);
  empty starts a ``distributed.LocalCluster`` of ``workers`` processes with one thread each.
- ``ray`` (:class:`RayRunner`): ``runner_address`` is a Ray address (``ray://host:10001``, or
  ``auto`` for the cluster this machine belongs to); empty starts a local Ray with ``workers``
  CPUs.

``kv_resources`` (e.g. ``"GPU=1"``) is what each KV task asks for: Dask worker resources
(``dask-worker --resources GPU=1``), Ray ``num_gpus``/``num_cpus``/custom resources; only
workers offering them take KV tasks, while extraction and embedding tasks go anywhere. A local
Dask cluster gives each of its workers these resources; a local Ray offers its own GPUs (and
``workers`` times the custom ones).

Stages on workers
-----------------
Workers compute; the flow process, which holds the store's write lock, publishes:

- KV: the one driver, ``tasks.kv.run_kv_stage``, runs in the flow over :class:`TaskKv`: a
  ``kv-prepare`` task loads the model on a worker and returns the layout (and ``C_p`` if the
  store lacks it: the driver writes it); the driver plans the chunks to compute and cuts them
  into groups of whole shards (``tasks.kv.kv_groups``); each ``kv-group`` task computes one
  group on a worker and writes its shards under ``.tmp-`` names (verified, never valid on their
  own); the driver renames them into place and appends their manifest rows, in group order.
  The batches, shard numbers and bytes are those of the default runner (``tasks.kv.LocalKv``).
- Embedding: ``tasks.embed.embed_stage`` runs in the flow and hands the texts to embed, in parts
  of ``embed_batch_size``, to ``embed-part`` tasks; it appends each part's vectors to the cache
  and upserts the index itself.

Every worker loads the generation model and the embedder once (memoised per process), and must
see the store folder at the same path (a shared file system).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import lru_cache, partial
from typing import Any, ClassVar

import numpy as np
from prefect import Task, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner
from prefect.utilities.annotations import quote

from coinrag.schemas.registry import Registered, Registry, UnknownPlugin
from coinrag.schemas.settings import RUNNERS, BuildSettings, SettingsError, parse_resources
from coinrag.schemas.tables import ChunkRow
from coinrag.storage.kv import KeptRanges, KvLayout, KvStore
from coinrag.storage.store import Store
from coinrag.tasks.embed import EmbedParts
from coinrag.tasks.kv import (
    GroupKv,
    KvJob,
    KvOptions,
    KvPrep,
    KvWorkers,
    LocalKv,
    StagedGroup,
    prepare_kv,
    stage_group_kv,
)

# ---------------------------------------------------------------------------- runners


class Runner(Registered, ABC):
    """Where a build's tasks run, for one build's ``settings`` (one subclass per value of the
    ``runner`` setting, registered by its ``name`` in ``Runner.registry``:
    :meth:`from_settings`). Use it started (:meth:`started`: a local cluster lives as long as
    the block)."""

    registry: ClassVar[Registry[Runner]] = Registry("runner", RUNNERS)

    @classmethod
    def from_settings(cls, settings: BuildSettings) -> Runner:
        """The runner ``settings.runner`` names (SettingsError listing the names if none)."""
        try:
            kind = cls.registry[settings.runner]
        except UnknownPlugin as exc:
            raise SettingsError(f"{exc}: set --runner to one of them") from None
        return kind(settings)

    def __init__(self, settings: BuildSettings) -> None:
        self.settings = settings
        self.resources = parse_resources(settings.kv_resources)
        self._tasks: TaskRunner | None = None

    @abstractmethod
    def task_runner(self) -> TaskRunner:
        """The (not yet started) Prefect task runner."""

    def placement(self) -> AbstractContextManager[Any]:
        """A context in which submitted tasks ask for ``kv_resources`` (a no-op without them,
        or on the default runner)."""
        return nullcontext()

    @contextmanager
    def started(self) -> Iterator[Runner]:
        with self.task_runner() as tasks:
            self._tasks = tasks
            try:
                yield self
            finally:
                self._tasks = None

    def submit(self, task: Task[..., Any], parameters: dict[str, Any]) -> PrefectFuture[Any]:
        """``task`` with ``parameters``, submitted to the started task runner."""
        if self._tasks is None:
            raise RuntimeError(f"the {self.name} runner is not started: use it in `started()`")
        return self._tasks.submit(task, parameters)

    def worker_threads(self) -> int:
        """The ``threads`` of each worker process (``inference.model.threads.worker_threads``): a
        local cluster's ``workers`` share this machine's CPUs; a remote cluster's resolve their
        own."""
        from coinrag.inference.model.threads import worker_threads

        s = self.settings
        return worker_threads(s.threads, None if s.runner_address else s.workers)

    @abstractmethod
    def stage(self, stage: Task[..., Any], **parameters: Any) -> Any:
        """Run a stage the flow drives (``flows/build.py``'s ``kv`` and ``embed-index``)."""

    @abstractmethod
    def kv_workers(self) -> KvWorkers:
        """Where the KV stage's model work runs (``tasks.kv.run_kv_stage``'s workers)."""

    @abstractmethod
    def embed_parts(self) -> EmbedParts | None:
        """Where vectors are computed (``tasks.embed.embed_texts``; None: in the stage)."""


class LocalRunner(Runner, name="default"):
    """The flow process: Prefect's thread pool, one task at a time; each stage is one task,
    its model work in this process."""

    def task_runner(self) -> TaskRunner:
        return ThreadPoolTaskRunner(max_workers=1)

    def stage(self, stage: Task[..., Any], **parameters: Any) -> Any:
        return stage(**{k: quote(v) for k, v in parameters.items()})  # passed as they are

    def kv_workers(self) -> KvWorkers:
        from coinrag.inference.model.prompt import RagPrompt

        loaded = _kv_model(self.settings)
        return LocalKv(loaded, RagPrompt.for_tokenizer(loaded.tokenizer))

    def embed_parts(self) -> EmbedParts | None:
        return None


class ClusterRunner(Runner):
    """A Dask or Ray cluster: a stage runs in the flow, which submits its model work to the
    workers (:class:`TaskKv`, :func:`embed_on_workers`) and writes what they return."""

    def stage(self, stage: Task[..., Any], **parameters: Any) -> Any:
        return stage.fn(**parameters)

    def kv_workers(self) -> KvWorkers:
        return TaskKv(self)

    def embed_parts(self) -> EmbedParts | None:
        return partial(embed_on_workers, self)


class DaskRunner(ClusterRunner, name="dask"):
    """``runner_address`` a scheduler, else a ``distributed.LocalCluster`` of ``workers``
    processes with one thread each (each offering ``kv_resources``)."""

    def task_runner(self) -> TaskRunner:
        from prefect_dask import DaskTaskRunner

        s = self.settings
        if s.runner_address:
            return DaskTaskRunner(address=s.runner_address)
        return DaskTaskRunner(
            cluster_kwargs={
                "n_workers": s.workers,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
                "resources": self.resources or None,
            }
        )

    def placement(self) -> AbstractContextManager[Any]:
        if not self.resources:
            return nullcontext()
        import dask

        return dask.annotate(resources=self.resources)


class RayRunner(ClusterRunner, name="ray"):
    """``runner_address`` a Ray address, else a local Ray with ``workers`` CPUs (its own GPUs,
    ``workers`` times the custom resources of ``kv_resources``)."""

    def task_runner(self) -> TaskRunner:
        from prefect_ray import RayTaskRunner

        s = self.settings
        if s.runner_address:
            return RayTaskRunner(address=s.runner_address)
        ray_kwargs = _ray_options(self.resources)
        init: dict[str, Any] = {
            "num_cpus": s.workers,
            "include_dashboard": False,
            "log_to_driver": False,
        }
        if "resources" in ray_kwargs:  # GPUs: Ray finds this machine's own
            init["resources"] = {k: v * s.workers for k, v in ray_kwargs["resources"].items()}
        return RayTaskRunner(init_kwargs=init)

    def placement(self) -> AbstractContextManager[Any]:
        if not self.resources:
            return nullcontext()
        from prefect_ray.context import remote_options

        return remote_options(**_ray_options(self.resources))


assert set(RUNNERS) == set(Runner.registry), "schemas.settings.RUNNERS names every runner"


@contextmanager
def task_runner(settings: BuildSettings) -> Iterator[Runner]:
    """The started runner of ``settings`` for one build."""
    with Runner.from_settings(settings).started() as runner:
        yield runner


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


# ---------------------------------------------------------------------------- stages on workers


def _worker_threads(settings: BuildSettings) -> int:
    """:meth:`Runner.worker_threads` of ``settings``' runner."""
    return Runner.from_settings(settings).worker_threads()


def _kv_model(settings: BuildSettings, dtype: str | None = None) -> Any:
    """The KV model of ``settings`` in this process (memoised): ``dtype`` as given (a worker
    computing for a layout), else ``kv_dtype`` resolved here (logged)."""
    from coinrag.inference.model.kv_dtype import resolve_kv_dtype
    from coinrag.inference.model.loading import load_shared_model

    if dtype is None:
        kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device)
        get_run_logger().info("kv: %s (%s)", kv_dtype.dtype, kv_dtype.reason)
        dtype = kv_dtype.dtype
    return load_shared_model(settings.model, settings.device, dtype)


def _apply_worker_threads(settings: BuildSettings) -> int:
    """Set this worker process's torch/BLAS threads (:func:`_worker_threads`); returns them."""
    from coinrag.inference.model.threads import set_process_threads

    return set_process_threads(_worker_threads(settings))


@task(name="kv-prepare", cache_policy=NO_CACHE)
def kv_prepare_task(
    store: Store,
    settings: BuildSettings,
    options: KvOptions,
    keep: str,
    calibration: list[ChunkRow] | None = None,
) -> KvPrep:
    """Runs on a KV worker: ``kv_dtype = auto`` is resolved there (the device that computes the
    KV decides), and the layout carries the result to the other workers; a basis codec's key
    basis is calibrated there on ``calibration`` (``tasks.kv.prepare_kv``)."""
    from coinrag.inference.model.prompt import RagPrompt

    threads = _apply_worker_threads(settings)
    get_run_logger().info("kv: %d thread(s) per worker", threads)
    loaded = _kv_model(settings)
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    return prepare_kv(store, loaded, prompt, options, keep, calibration or ())


@task(name="kv-group", cache_policy=NO_CACHE)
def kv_group_task(
    store: Store,
    settings: BuildSettings,
    layout: KvLayout,
    group: list[ChunkRow],
    run_id: str,
    batch_size: int,
    kept: dict[str, KeptRanges] | None = None,
) -> StagedGroup:
    """Runs on a KV worker: one group computed and staged (``tasks.kv.stage_group_kv``)."""
    _apply_worker_threads(settings)
    loaded = _kv_model(settings, layout.dtype)
    kv = KvStore.open(store, layout.kv_fp, layout)
    return stage_group_kv(kv, loaded, group, run_id, batch_size, kept)


class TaskKv(KvWorkers):
    """The KV stage's model work on a cluster runner's workers: one ``kv-prepare`` task, then
    one ``kv-group`` task per group, all submitted at once (asking for ``kv_resources``)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def prepare(
        self, store: Store, options: KvOptions, keep: str, calibration: Sequence[ChunkRow] = ()
    ) -> KvPrep:
        params = {"store": store, "settings": self.runner.settings, "options": options}
        with self.runner.placement():
            future = self.runner.submit(
                kv_prepare_task, params | {"keep": keep, "calibration": list(calibration)}
            )
        return future.result()

    def compute(self, job: KvJob, groups: list[list[ChunkRow]]) -> Iterator[GroupKv]:
        kv = job.kv
        params = {
            "store": kv.store,
            "settings": self.runner.settings,
            "layout": kv.layout,
            "run_id": job.run_id,
            "batch_size": job.options.batch_size,
        }
        with self.runner.placement():
            futures = [
                self.runner.submit(
                    kv_group_task,
                    params | {"group": group, "kept": job.kept_of(group)},
                )
                for group in groups
            ]
        for future in futures:
            yield future.result()


@lru_cache(maxsize=1)
def _worker_embedder(ref: str, document_dtype: str, window: int) -> Any:
    from coinrag.inference.retrieval.embedders import load_embedder

    return load_embedder(ref, document_dtype=document_dtype, max_length=window or None)


@task(name="embed-part", cache_policy=NO_CACHE)
def embed_part_task(
    embedder_ref: str,
    texts: list[str],
    threads: int = 0,
    document_dtype: str = "float32",
    window: int = 0,
) -> np.ndarray:
    """``(len(texts), dim)`` float32 vectors of one part of the texts to embed, computed with
    ``threads`` threads (:meth:`Runner.worker_threads`' answer; 0: auto on the worker) by the
    embedder in ``document_dtype`` (the build's ``embed_dtype``) at ``window`` word pieces (its
    ``embed_window``; 0: the embedder's own)."""
    from coinrag.inference.model.threads import set_process_threads

    set_process_threads(threads)
    return _worker_embedder(embedder_ref, document_dtype, window).embed_documents(texts)


def embed_on_workers(runner: Runner, parts: list[list[str]]) -> Iterator[np.ndarray]:
    """``tasks.embed.EmbedParts`` on ``runner``: every part submitted at once, vectors yielded
    in order as they come back."""
    params = {"embedder_ref": runner.settings.embedder, "threads": runner.worker_threads()}
    params["document_dtype"] = runner.settings.embed_dtype
    params["window"] = runner.settings.embed_window
    futures = [runner.submit(embed_part_task, params | {"texts": part}) for part in parts]
    for future in futures:
        yield future.result()
