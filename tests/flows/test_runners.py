"""Scale-out: a build on Dask or Ray workers stores exactly what the default runner stores.

A tiny build (3 sample documents, 64-token chunks, rules extractor, KV of SmolLM2, MiniLM
vectors) in several tasks per stage: the tables' content columns, every KV entry's bytes and
every LanceDB vector must be identical to the default runner's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from coinrag.flows.build import build_flow, run_kv
from coinrag.flows.cli import app
from coinrag.flows.scaleout import task_runner
from coinrag.schemas.settings import BuildSettings, SettingsError
from coinrag.schemas.tables import TABLES, ChunkRow
from coinrag.storage.index.lance import LanceIndex
from coinrag.storage.kv import KvStore, to_storage
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows, read_table

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness")]

SETTINGS = {
    "extractor": "rules",
    "chunk_size": 64,
    "extract_batch_size": 4,  # several extraction tasks
    "kv_batch_size": 2,  # 4 slots per shard: groups of 4 chunks, 2 forward passes each
    "embed_batch_size": 16,  # several embedding tasks
}
# Columns that say when and by which run, not what: left out of the comparison.
VOLATILE = {"run_id", "code_version", "time", "started_at", "ended_at", "call_id", "latency_ms"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, sample_corpus) -> Path:
    src = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    src.write_text("".join(sample_corpus.read_text(encoding="utf-8").splitlines(True)[:3]))
    return src


@pytest.fixture(scope="module")
def default_build(tmp_path_factory, corpus) -> tuple[Path, dict[str, Any]]:
    store = tmp_path_factory.mktemp("default") / "store"
    return store, build_flow(str(corpus), str(store), SETTINGS)


def _tables(store: Path) -> dict[str, list[tuple]]:
    out = {}
    for name, record in TABLES.items():
        if name == "runs":
            continue
        table = read_table(Store.at(store), record)
        keep = [c for c in table.column_names if c not in VOLATILE]
        rows = table.select(keep).to_pylist()
        out[name] = sorted(tuple(repr(r[c]) for c in keep) for r in rows)
    return out


def _kv_bytes(store: Path) -> dict[str, bytes]:
    st = Store.at(store)
    (kv_dir,) = [p for p in (st.root / "kv").iterdir() if not p.name.startswith(".")]
    kv = KvStore.open(st, kv_dir.name)
    return {ck: to_storage(kv.read_entry(ck)).tobytes() for ck in kv.manifest(refresh=True)}


def _vectors(store: Path) -> dict[str, dict[str, bytes]]:
    index = LanceIndex.open(Store.at(store))
    out = {}
    for name, key in (("chunks", "chunk_id"), ("nuggets", "nugget_id"), ("documents", "doc_id")):
        data = index.columns(name, [key, "vector"]).to_pydict()
        out[name] = {
            k: np.asarray(v, dtype=np.float32).tobytes()
            for k, v in zip(data[key], data["vector"], strict=True)
        }
    return out


def _assert_same_assets(built: Path, reference: Path) -> None:
    tables, expected = _tables(built), _tables(reference)
    assert expected["kv_manifest"] and expected["embeddings"] and expected["nuggets"]
    for name in expected:
        assert tables[name] == expected[name], f"table {name} differs"
    kv, kv_expected = _kv_bytes(built), _kv_bytes(reference)
    assert len(kv_expected) == len(expected["kv_manifest"]) > 4  # more than one KV group
    assert kv.keys() == kv_expected.keys()
    assert all(kv[ck] == kv_expected[ck] for ck in kv_expected), "KV bytes differ"
    vectors, vectors_expected = _vectors(built), _vectors(reference)
    assert all(vectors_expected.values())
    assert vectors == vectors_expected, "LanceDB vectors differ"


def _check_summary(summary: dict[str, Any], reference: dict[str, Any]) -> None:
    volatile = {"run_id", "rejected", "stage_seconds"}
    assert {k: v for k, v in summary.items() if k not in volatile} == {
        k: v for k, v in reference.items() if k not in volatile
    }


@pytest.mark.heavy
def test_dask_local_cluster_builds_the_same_assets(tmp_path, corpus, default_build) -> None:
    reference, ref_summary = default_build
    store = tmp_path / "store"
    summary = build_flow(str(corpus), str(store), SETTINGS | {"runner": "dask", "workers": 2})
    _check_summary(summary, ref_summary)
    _assert_same_assets(store, reference)
    # Nothing left half-published: every shard folder is in the manifest, no staged leftovers.
    (kv_dir,) = (store / "kv").iterdir()
    assert KvStore.open(Store.at(store), kv_dir.name).garbage() == []
    assert not list((store / "staging").rglob("*.parquet"))  # answers staged by workers moved in
    again = build_flow(str(corpus), str(store), SETTINGS | {"runner": "dask", "workers": 2})
    assert again["kv_computed"] == 0 and again["embedded"] == 0 and again["extract_requested"] == 0


@pytest.mark.heavy
def test_dask_workers_embed_in_the_builds_embed_dtype(tmp_path, corpus) -> None:
    """The workers compute the vectors in the build's ``embed_dtype``: bfloat16 vectors equal,
    byte for byte, to those a local build computes (float32 ones would differ)."""
    bf16 = SETTINGS | {"kv": False, "embed_dtype": "bfloat16"}
    build_flow(str(corpus), str(tmp_path / "local"), bf16)
    build_flow(str(corpus), str(tmp_path / "dask"), bf16 | {"runner": "dask", "workers": 2})
    local, dask = _vectors(tmp_path / "local"), _vectors(tmp_path / "dask")
    assert all(local.values()) and dask == local


@pytest.mark.heavy
def test_ray_local_cluster_builds_the_same_assets(tmp_path, corpus, default_build) -> None:
    reference, ref_summary = default_build
    store = tmp_path / "store"
    summary = build_flow(str(corpus), str(store), SETTINGS | {"runner": "ray", "workers": 2})
    _check_summary(summary, ref_summary)
    _assert_same_assets(store, reference)


def _finished_keys(dask_worker: Any) -> list[str]:
    """Keys of the tasks this Dask worker ran to completion."""
    return sorted({str(e[0]) for e in dask_worker.state.log if len(e) > 2 and e[2] == "memory"})


@pytest.mark.heavy
def test_kv_tasks_go_only_to_workers_offering_the_kv_resources(tmp_path, default_build) -> None:
    from distributed import Client, Nanny, Scheduler, SpecCluster
    from prefect import flow

    reference, _ = default_build
    chunks = read_rows(Store.at(reference), ChunkRow)
    workers = {
        "cpu": {"cls": Nanny, "options": {"nthreads": 1}},
        "gpu": {"cls": Nanny, "options": {"nthreads": 1, "resources": {"GPU": 1}}},
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": None}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster:
        settings = BuildSettings(
            **SETTINGS,
            runner="dask",
            runner_address=cluster.scheduler_address,
            kv_resources="GPU=1",
        )

        @flow
        def kv_only() -> dict[str, Any]:
            with task_runner(settings) as runner:
                store = Store.at(tmp_path / "store").init()
                # kv_keep = "chunks": whole chunks, so no extractor's nuggets are read
                return run_kv(runner, store, chunks, settings, "run-kv", extractor_fp="")

        counts = kv_only()
        with Client(cluster.scheduler_address) as client:
            names = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
            ran = {names[a]: keys for a, keys in client.run(_finished_keys).items()}
    kv_tasks = {name: [k for k in keys if k.startswith("kv_")] for name, keys in ran.items()}
    assert kv_tasks["cpu"] == []
    assert len(kv_tasks["gpu"]) == 1 + counts["shards"] > 2  # kv-prepare + one task per group
    assert _kv_bytes(tmp_path / "store") == _kv_bytes(reference)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"runner": "spark"}, "runner 'spark' is not one of"),
        ({"runner_address": "tcp://h:8786"}, "needs runner dask or ray"),
        ({"runner": "dask", "workers": 0}, "workers must be >= 1"),
        ({"runner": "dask", "kv_resources": "GPU"}, "is not NAME=AMOUNT"),
    ],
)
def test_bad_runner_settings_are_refused(values: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        BuildSettings(**values).validate()


def test_cli_runner_options_reach_the_settings(tmp_path) -> None:
    result = CliRunner().invoke(
        app, ["build", "sample", "--store", str(tmp_path / "s"), "--runner", "spark"]
    )
    assert result.exit_code == 2 and "runner 'spark'" in result.output
    result = CliRunner().invoke(
        app,
        ["build", "sample", "--store", str(tmp_path / "s"), "--runner", "dask"]
        + ["--kv-resources", "GPU=x"],
    )
    assert result.exit_code == 2 and "GPU=x" in result.output
