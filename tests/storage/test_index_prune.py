"""Pruning old LanceDB versions never removes the published one, however long compaction takes.

Lance takes the cleanup cutoff (now minus ``cleanup_older_than``) when it prunes, after it has
compacted; ``LanceIndex`` measures the published version's age before calling. A compaction
longer than the margin (1 s; seen under load, and on object stores) used to move the cutoff
past the published version, which was then deleted: readers at the published version broke.
The test makes the compacting call slow (a delay in front of Lance's own ``optimize``) and
checks that the published version survives and the older ones go.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from lancedb.table import LanceTable

from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.publish import publish
from coinrag.storage.store import Store

DIM = 4


def _documents(index: LanceIndex, ids: list[str], version: str) -> None:
    n = len(ids)
    columns = {
        "doc_id": ids,
        "doc_version": [version] * n,
        "title": ids,
        "embedder_fp": [index.meta.embedder_fp] * n,
        "run_id": ["run"] * n,
    }
    vectors = np.random.default_rng(len(version)).normal(size=(n, DIM)).astype(np.float32)
    index.upsert("documents", index.build_table("documents", columns, vectors))


def test_a_slow_compaction_never_prunes_the_published_version(tmp_path: Path, monkeypatch):
    store = Store.at(tmp_path / "store").init()
    index, _ = LanceIndex.open_for_write(store, "emb-test", DIM)
    for i in range(3):  # three small appends: versions to prune, files to compact
        if i == 2:
            time.sleep(1.5)  # the earlier versions: older than the published by over the margin
        _documents(index, [f"d{i}-{j}" for j in range(5)], f"v{i}")
    publish(store, "run-1", "build")
    published = store.published()["index"]["versions"]["documents"]
    _documents(index, ["late"], "v9")  # an unpublished version after it (a killed build)

    real_optimize = LanceTable.optimize
    slowed: list[bool] = []

    def slow_first_optimize(self, **kwargs):
        if not slowed:  # the first call per run compacts: make it take 2.5 s
            slowed.append(True)
            time.sleep(2.5)
        return real_optimize(self, **kwargs)

    monkeypatch.setattr(LanceTable, "optimize", slow_first_optimize)
    removed = LanceIndex.open_latest(store).prune_versions()

    assert removed["documents"] >= 2  # the versions before the published one went
    reader = LanceIndex.open(store)  # checks the published version out
    assert reader.versions["documents"] == published
    ids = set(reader.columns("documents", ["doc_id"]).column(0).to_pylist())
    assert ids == {f"d{i}-{j}" for i in range(3) for j in range(5)}
