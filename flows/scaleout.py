"""Where a build's tasks run (the flow process, a Dask cluster or a Ray cluster), and the KV and
embedding stages as many tasks on a distributed task runner.

Runners
-------
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

Stages on workers
-----------------
Workers compute; the flow process, which holds the store's write lock, publishes:

- KV: a ``kv-prepare`` task loads the model on a worker and returns the layout (and ``C_p`` if
  the store lacks it: the flow writes it); the flow plans the chunks to compute and cuts them
  into groups of whole shards (``tasks.kv.kv_groups``); each ``kv-group`` task computes one
  group on a worker and writes its shards under ``.tmp-`` names (verified, never valid on their
  own); the flow renames them into place and appends their manifest rows, in group order. The
  batches, shard numbers and bytes are those of the default runner's ``kv_stage``.
- Embedding: ``tasks.embed.embed_stage`` runs in the flow and hands the texts to embed, in parts
  of ``embed_batch_size``, to ``embed-part`` tasks; it appends each part's vectors to the cache
  and upserts the index itself.

Every worker loads the generation model and the embedder once (memoised per process), and must
see the store folder at the same path (a shared file system).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from coinrag.inference.rope import ForwardFrequencies
from coinrag.schemas.settings import BuildSettings, parse_resources
from coinrag.schemas.tables import ChunkRow
from coinrag.storage.kv import KeptRanges, KvLayout, KvStore, StagedShard
from coinrag.storage.store import Store

# ---------------------------------------------------------------------------- runners


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


# ---------------------------------------------------------------------------- stages on workers


def _worker_threads(settings: BuildSettings) -> int:
    """The ``threads`` of each worker process (``inference.threads.worker_threads``): a local
    cluster's ``workers`` share this machine's CPUs; a remote cluster's resolve their own."""
    from coinrag.inference.threads import worker_threads

    local = None if settings.runner_address else settings.workers
    return worker_threads(settings.threads, local)


def _apply_worker_threads(settings: BuildSettings) -> int:
    """Set this worker process's torch/BLAS threads (:func:`_worker_threads`); returns them."""
    from coinrag.inference.threads import set_process_threads

    return set_process_threads(_worker_threads(settings))


@dataclass(frozen=True)
class KvPrep:
    """What the flow needs from the model to plan the KV stage (computed on a worker)."""

    layout: KvLayout
    tokenizer_fp: str
    prefix_ids: tuple[int, ...]
    prefix_kv: torch.Tensor | None  # C_p, when the store does not hold it yet
    frequencies: ForwardFrequencies  # how the workers batch (inference.encode.KvBatching)


@task(name="kv-prepare", cache_policy=NO_CACHE)
def kv_prepare_task(store: Store, settings: BuildSettings) -> KvPrep:
    """Runs on a KV worker: ``kv_dtype = auto`` is resolved there (the device that computes the
    KV decides), and the layout carries the result to the other workers."""
    from coinrag.inference.encode import compute_prefix_kv, kv_layout
    from coinrag.inference.kv_dtype import resolve_kv_dtype
    from coinrag.inference.models import load_shared_model
    from coinrag.inference.prompt import RagPrompt

    threads = _apply_worker_threads(settings)
    kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device)
    get_run_logger().info(
        "kv: %s (%s), %d thread(s) per worker", kv_dtype.dtype, kv_dtype.reason, threads
    )
    loaded = load_shared_model(settings.model, settings.device, kv_dtype.dtype)
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    layout = kv_layout(loaded, prompt, kv_codec=settings.kv_codec, keep=settings.kv_keep)
    kv = KvStore(store, layout)  # reads only: the flow creates the store
    usable = kv.has_prefix() and kv.corrupt_prefix() is None
    return KvPrep(
        layout=layout,
        tokenizer_fp=loaded.tokenizer_fp,
        prefix_ids=tuple(prompt.prefix_ids),
        prefix_kv=None if usable else compute_prefix_kv(loaded.model, prompt.prefix_ids),
        frequencies=ForwardFrequencies.from_config(loaded.model.config),
    )


@task(name="kv-group", cache_policy=NO_CACHE)
def kv_group_task(
    store: Store,
    settings: BuildSettings,
    layout: KvLayout,
    group: list[ChunkRow],
    run_id: str,
    kept: dict[str, KeptRanges] | None = None,
) -> tuple[list[StagedShard], dict[str, float]]:
    from coinrag.inference.models import load_shared_model
    from coinrag.tasks.kv import stage_group_kv

    _apply_worker_threads(settings)
    loaded = load_shared_model(settings.model, settings.device, layout.dtype)
    kv = KvStore.open(store, layout.kv_fp, layout)
    prefix_kv, _ = kv.read_prefix()
    return stage_group_kv(kv, loaded, prefix_kv, group, run_id, settings.kv_batch_size, kept)


def kv_on_workers(
    runner: TaskRunner,
    store: Store,
    chunks: list[ChunkRow],
    settings: BuildSettings,
    run_id: str,
    extractor_fp: str,
) -> dict[str, Any]:
    """The KV stage on ``runner``'s workers; the same counts as ``tasks.kv.kv_stage`` (and,
    with ``kv_keep = "nuggets"``, the same kept ranges of the chunks' nuggets)."""
    from coinrag.inference.encode import KvBatching
    from coinrag.tasks.kv import (
        KvCounts,
        build_kept_ranges,
        count_batches,
        kv_groups,
        plan_kv,
        repair_prefix_kv,
        stored_prefix_kv,
    )

    logger = get_run_logger()
    started = time.perf_counter()
    with kv_placement(settings):
        prep = runner.submit(kv_prepare_task, {"store": store, "settings": settings}).result()
    kv = KvStore.create(store, prep.layout)
    if prep.prefix_kv is not None and not kv.has_prefix():
        kv.write_prefix(prep.prefix_kv, prep.prefix_ids)
    counts = KvCounts(kv_fp=kv.kv_fp, chunks=len(chunks))
    rebuild: set[str] = set()
    fresh_prefix = prep.prefix_kv
    if fresh_prefix is not None and repair_prefix_kv(
        kv, counts, lambda: fresh_prefix, prep.prefix_ids
    ):
        rebuild = set(kv.manifest(refresh=True))
    kept = build_kept_ranges(store, chunks, settings.kv_keep, extractor_fp, settings.tau)
    todo = plan_kv(kv, chunks, prep.tokenizer_fp, counts, settings.kv_verify, rebuild, kept)
    stored_prefix_kv(kv, prep.prefix_ids)  # the stored C_p is this prompt's
    groups = kv_groups(todo, settings.kv_batch_size, prep.layout.slots_per_shard)
    batching = KvBatching(settings.kv_batch_size, len(prep.prefix_ids), prep.frequencies)
    with kv_placement(settings):
        futures = [
            runner.submit(
                kv_group_task,
                {
                    "store": store,
                    "settings": settings,
                    "layout": prep.layout,
                    "group": group,
                    "run_id": run_id,
                    "kept": None if kept is None else {c.chunk_id: kept[c.chunk_id] for c in group},
                },
            )
            for group in groups
        ]
    secs = counts.seconds
    secs.update(forward=0.0, extract=0.0)
    for group, future in zip(groups, futures, strict=True):
        staged, worker_secs = future.result()
        for shard in staged:
            counts.computed += len(kv.publish_shard(shard, run_id))
        count_batches(counts, group, batching)
        for name, value in worker_secs.items():
            secs[name] = secs.get(name, 0.0) + value
        logger.info("kv: %d/%d chunks stored", counts.computed, len(todo))
    ws = kv.write_stats
    counts.shards, counts.disk_bytes, counts.logical_bytes = (
        ws.shards,
        ws.disk_bytes,
        ws.logical_bytes,
    )
    secs.update(write=ws.encode_write_s, verify=ws.verify_s, manifest=ws.manifest_s)
    secs["total"] = time.perf_counter() - started
    return {"model_fp": prep.layout.model_fp, "kv_dtype": prep.layout.dtype, **counts.as_dict()}


@lru_cache(maxsize=1)
def _worker_embedder(ref: str) -> Any:
    from coinrag.inference.embedders import load_embedder

    return load_embedder(ref)


@task(name="embed-part", cache_policy=NO_CACHE)
def embed_part_task(embedder_ref: str, texts: list[str], threads: int = 0) -> np.ndarray:
    """``(len(texts), dim)`` float32 vectors of one part of the texts to embed, computed with
    ``threads`` threads (:func:`worker_threads`' answer; 0: auto on the worker)."""
    from coinrag.inference.threads import set_process_threads

    set_process_threads(threads)
    return _worker_embedder(embedder_ref).embed_documents(texts)


def embed_on_workers(
    runner: TaskRunner, settings: BuildSettings, parts: list[list[str]]
) -> Iterator[np.ndarray]:
    """``tasks.embed.EmbedParts`` on ``runner``: every part submitted at once, vectors yielded
    in order as they come back."""
    threads = _worker_threads(settings)
    futures = [
        runner.submit(
            embed_part_task,
            {"embedder_ref": settings.embedder, "texts": part, "threads": threads},
        )
        for part in parts
    ]
    for future in futures:
        yield future.result()
