"""Threads of scale-out workers (``inference.model.threads.worker_threads``, applied by the KV and
embedding tasks of ``flows/scaleout.py``): a local cluster's workers share this machine's CPUs;
an explicit ``threads`` reaches every worker; a remote cluster's workers resolve their own."""

from __future__ import annotations

import os

import pytest
import torch

from coinrag.flows.scaleout import _worker_threads, embed_part_task
from coinrag.inference.model import threads
from coinrag.schemas.settings import BuildSettings


def test_worker_threads_share_the_cpus_of_a_local_cluster(monkeypatch) -> None:
    monkeypatch.setattr(threads, "usable_cpus", lambda: 16)
    assert threads.worker_threads(0, 2) == 4  # 16 / 2 = 8, capped at 4
    assert threads.worker_threads(0, 8) == 2
    assert threads.worker_threads(0, 32) == 1
    assert threads.worker_threads(3, 8) == 3  # explicit: as given
    assert threads.worker_threads(0, None) == 0  # remote: auto on the worker
    with pytest.raises(ValueError):
        threads.worker_threads(-1, 2)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    settings = BuildSettings(runner="dask", workers=2)
    assert _worker_threads(settings) == 1
    assert _worker_threads(BuildSettings(runner="dask", workers=2, threads=3)) == 3
    remote = BuildSettings(runner="dask", workers=2, runner_address="tcp://10.0.0.1:8786")
    assert _worker_threads(remote) == 0


def test_the_embedding_task_applies_its_threads(monkeypatch) -> None:
    before = torch.get_num_threads()
    for name in threads.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    try:
        vectors = embed_part_task.fn(BuildSettings().embedder, ["a worker's text"], threads=2)
        assert vectors.shape[0] == 1
        assert torch.get_num_threads() == 2
        assert all(os.environ[name] == "2" for name in threads.ENV_VARS)
    finally:
        threads.set_process_threads(before)
