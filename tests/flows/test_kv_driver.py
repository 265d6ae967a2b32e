"""One KV stage driver over its workers, one layout function, runners registered by name.

``tasks.kv.run_kv_stage`` is the only code that plans, stores and counts the KV stage; the
default runner's workers (``tasks.kv.LocalKv``) compute in this process and write each shard
here, a cluster's workers (``flows/scaleout.py``) stage shards that the driver publishes. The
staged path is exercised here in one process (a worker's share, ``stage_group_kv``, run
inline): same counts, same manifest, same bytes as the local path. The Dask and Ray runs of
the same driver are ``tests/flows/test_runners.py`` (heavy).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from store_fixtures import TINY_DIMS

from coinrag.flows.scaleout import DaskRunner, LocalRunner, RayRunner, Runner
from coinrag.inference.model.encode import KvModel, kv_layout
from coinrag.inference.model.loading import LoadedModel, tokenizer_fingerprint
from coinrag.inference.model.prompt import RagPrompt
from coinrag.schemas.keys import fingerprint
from coinrag.schemas.settings import BuildSettings, SettingsError
from coinrag.storage.kv import KvStore, to_storage
from coinrag.storage.store import Store
from coinrag.tasks.chunk import chunk_document
from coinrag.tasks.kv import (
    GroupKv,
    KvJob,
    KvOptions,
    LocalKv,
    kv_stage,
    run_kv_stage,
    stage_group_kv,
)

TEXT = " ".join(f"Sentence {i} says something about topic {i % 7}." for i in range(120))


@pytest.fixture(scope="module")
def loaded(smollm2_tokenizer) -> LoadedModel:
    from transformers import AutoModelForCausalLM, Qwen2Config

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    config = Qwen2Config(
        vocab_size=len(smollm2_tokenizer), **TINY_DIMS, max_position_embeddings=4096
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config).eval()
    fp = fingerprint("model", {"test": "qwen2-driver"})
    yield LoadedModel(
        model, smollm2_tokenizer, Path("."), fp, tokenizer_fingerprint(smollm2_tokenizer)
    )
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def chunks(smollm2_tokenizer) -> list:
    rows = chunk_document(
        smollm2_tokenizer,
        "d1",
        "dv1",
        TEXT,
        tokenizer_fp=tokenizer_fingerprint(smollm2_tokenizer),
        chunk_size=48,
        run_id="r",
    )
    assert len(rows) >= 6
    return rows[:6]


class InlineStagingKv(LocalKv):
    """A cluster's workers in one process: each group staged by ``stage_group_kv`` (what a
    ``kv-group`` task runs), the driver publishing the staged shards."""

    def __init__(self, loaded: LoadedModel, prompt: RagPrompt) -> None:
        super().__init__(loaded, prompt)
        self.staged = 0

    def compute(self, job: KvJob, groups: list[list]) -> Iterator[GroupKv]:
        for group in groups:
            kv = KvStore.open(job.kv.store, job.kv.kv_fp, job.kv.layout)  # a worker's own
            done = stage_group_kv(
                kv, self.loaded, group, job.run_id, job.options.batch_size, job.kept_of(group)
            )
            self.staged += len(done.shards)
            yield done


def _entries(store: Store, kv_fp: str) -> dict[str, bytes]:
    kv = KvStore.open(store, kv_fp)
    return {ck: to_storage(kv.read_entry(ck)).tobytes() for ck in kv.manifest(refresh=True)}


def test_staged_and_local_workers_store_the_same_entries_through_one_driver(
    tmp_path, loaded, chunks
) -> None:
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    options = KvOptions(batch_size=2, slots_per_shard=2, overlap=False)
    local = Store.at(tmp_path / "local").init()
    staged = Store.at(tmp_path / "staged").init()
    workers = InlineStagingKv(loaded, prompt)
    a = kv_stage(local, chunks, loaded, prompt, "run-local", options)
    b = run_kv_stage(staged, chunks, workers, "run-staged", options)
    assert workers.staged == b.shards == a.shards == 3
    volatile = {"seconds"}
    assert {k: v for k, v in a.as_dict().items() if k not in volatile} == {
        k: v for k, v in b.as_dict().items() if k not in volatile
    }
    assert (a.model_fp, a.kv_dtype) == (loaded.model_fp, "float32")
    assert _entries(local, a.kv_fp) == _entries(staged, b.kv_fp)
    assert KvStore.open(staged, b.kv_fp).garbage() == []  # every staged shard published
    again = run_kv_stage(staged, chunks, workers, "run-again", options)
    assert (again.computed, again.reused, workers.staged) == (0, len(chunks), 3)


def test_the_layout_of_a_model_without_weights_is_the_loaded_models(loaded) -> None:
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    options = KvOptions(kv_codec="int8").layout_options("nuggets")
    shape_only = KvModel(loaded.model.config, loaded.model_fp, "float32")
    assert kv_layout(shape_only, prompt, **options) == kv_layout(loaded, prompt, **options)
    assert kv_layout(loaded, prompt, **options).kv_fp != kv_layout(loaded, prompt).kv_fp


def test_kv_options_come_from_the_build_settings() -> None:
    settings = BuildSettings(kv_batch_size=7, kv_verify="stat", kv_codec="int4")
    assert KvOptions.from_settings(settings) == KvOptions(
        batch_size=7, check="stat", kv_codec="int4"
    )
    assert KvOptions.from_settings(BuildSettings()) == KvOptions()  # one default each


def test_runners_are_chosen_by_their_registered_name() -> None:
    kinds = {
        name: type(Runner.from_settings(BuildSettings(runner=name))) for name in Runner.registry
    }
    assert kinds == {"default": LocalRunner, "dask": DaskRunner, "ray": RayRunner}

    class Spark(LocalRunner, name="spark-test"):
        pass

    try:
        assert isinstance(Runner.from_settings(BuildSettings(runner="spark-test")), Spark)
    finally:
        del Runner.registry["spark-test"]
    with pytest.raises(SettingsError, match=r"unknown runner 'nope' \(dask, default, ray\)"):
        Runner.from_settings(BuildSettings(runner="nope"))
    with pytest.raises(RuntimeError, match="not started"):
        Runner.from_settings(BuildSettings()).submit(None, {})  # type: ignore[arg-type]
