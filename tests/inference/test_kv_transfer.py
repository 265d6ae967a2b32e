"""Moving a question's KV to the model's device (``inference/model/kv_transfer.py``): on a CPU
exactly the move of before (a plain buffer, ``to(device, dtype)``); the resident slices an LRU
under a byte budget. The builder's resident path against its host path:
``tests/inference/test_kv_keep_codecs.py``; on a GPU (``-m cuda``) the pinned buffer and its
one non-blocking copy.
"""

from __future__ import annotations

import pytest
import torch

from coinrag.inference.model.kv_transfer import (
    ResidentKv,
    host_buffer,
    resident_kv_bytes,
    set_resident_kv_bytes,
    to_device,
)
from coinrag.schemas.settings import ApiSettings, RuntimeSettings, SettingsError


def test_on_a_cpu_the_buffer_and_the_move_are_as_before() -> None:
    buf = host_buffer((2, 2, 3, 5, 4), torch.bfloat16, "cpu")
    assert not buf.is_pinned() and buf.dtype == torch.bfloat16 and buf.shape == (2, 2, 3, 5, 4)
    buf.copy_(torch.randn(buf.shape))
    moved = to_device(buf, torch.device("cpu"), torch.float32)
    assert torch.equal(moved, buf.to("cpu", dtype=torch.float32))
    assert to_device(buf, "cpu", torch.bfloat16) is buf  # nothing to move or cast: no copy


def test_resident_slices_are_an_lru_under_the_budget() -> None:
    """The docstring's example: 100 bytes, slices of 40."""
    slices = {k: torch.zeros(10, dtype=torch.float32) for k in "abcd"}  # 40 bytes each
    lru = ResidentKv(100)
    lru.put("a", slices["a"])
    lru.put("b", slices["b"])
    assert lru.get("a") is slices["a"] and lru.bytes == 80
    lru.put("c", slices["c"])  # b, the least recently used, is dropped
    assert "b" not in lru and "a" in lru and "c" in lru and lru.bytes == 80
    assert lru.get("b") is None and (lru.hits, lru.misses) == (1, 1)
    lru.put("big", torch.zeros(26, dtype=torch.float32))  # 104 bytes: never kept
    assert "big" not in lru and len(lru) == 2
    lru.put("d", slices["d"])
    assert set(lru._slices) == {"c", "d"} and lru.bytes == 80


def test_the_kv_resident_bytes_setting() -> None:
    assert RuntimeSettings().kv_resident_bytes == ApiSettings().kv_resident_bytes == 0
    with pytest.raises(SettingsError, match="kv_resident_bytes must be >= 0, got -1"):
        RuntimeSettings(kv_resident_bytes=-1)
    with pytest.raises(SettingsError, match="kv_resident_bytes must be >= 0, got -1"):
        ApiSettings(kv_resident_bytes=-1).validate()
    before = resident_kv_bytes()
    try:
        set_resident_kv_bytes(2**30)
        assert resident_kv_bytes() == 2**30
        with pytest.raises(ValueError, match="got -5"):
            set_resident_kv_bytes(-5)
    finally:
        set_resident_kv_bytes(before)


@pytest.mark.cuda
def test_on_cuda_one_pinned_buffer_one_non_blocking_copy() -> None:
    buf = host_buffer((2, 2, 3, 5, 4), torch.float32, "cuda")
    assert buf.is_pinned()
    buf.copy_(torch.randn(buf.shape))
    moved = to_device(buf, torch.device("cuda"), torch.bfloat16)
    assert moved.device.type == "cuda" and moved.dtype == torch.bfloat16
    assert torch.equal(moved.cpu(), buf.to(torch.bfloat16))  # the cast on the device: same bits


@pytest.mark.cuda
def test_stored_context_on_cuda_one_copy_and_resident(tmp_path) -> None:
    """A store built on the CPU, read for a model on the GPU: the host path (one pinned copy)
    gives the CPU context's bits; with kv_resident_bytes the slices stay on the device, the
    second question reads none, and the context assembled on the device is the CPU one up to
    the rotation's float32 rounding there. No tokenizer (a bare GPU machine has no SmolLM2):
    the prompt's prefix is given as ids, the chunks are random ids."""
    # the builders read chunk tables and evidence (pyarrow, the retrieval layer's imports):
    # a machine without them skips this test, saying why (-rs)
    pytest.importorskip("coinrag.inference.context.builders")
    import copy
    from pathlib import Path

    from store_fixtures import tiny_model
    from test_kv_pipeline import _chunks

    from coinrag.inference.context.builders import StoredKvContext
    from coinrag.inference.model.loading import LoadedModel
    from coinrag.inference.model.prompt import RagPrompt
    from coinrag.inference.retrieval.retriever import Evidence
    from coinrag.storage.kv import KvStore
    from coinrag.storage.store import Store
    from coinrag.tasks.kv import KvOptions, kv_stage

    model = tiny_model("qwen2", seed=7)
    loaded = LoadedModel(model, None, Path("."), "model-37", "tok")  # pad id 0
    prefix = list(range(3, 14))
    prompt = RagPrompt(None, "", "", prefix, "prefix-37", uses_chat_template=False)
    chunks = _chunks(model.config.vocab_size, tokenizer_fp="tok")
    store = Store.at(tmp_path / "s").init()
    counts = kv_stage(store, chunks, loaded, prompt, "run-1", KvOptions(batch_size=2))
    kv = KvStore.open(store, counts.kv_fp)
    spans = [(0, 3, 9), (2, 10, 30), (4, 0, 21), (1, 30, 38)]
    evidence = [
        Evidence(chunks[i].chunk_id, "d", chunks[i].content_key, s, e, "", 0.0) for i, s, e in spans
    ]
    with torch.inference_mode():
        want, _ = StoredKvContext(store, model, prompt, kv).build(evidence, 4)
        on_gpu = StoredKvContext(store, copy.deepcopy(model).to("cuda"), prompt, kv)
        assert on_gpu.resident is None
        got, _ = on_gpu.build(evidence, 4)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
        on_gpu.resident = ResidentKv(10**9)
        first, _ = on_gpu.build(evidence, 4)
        again, _ = on_gpu.build(evidence, 4)
    assert on_gpu.resident.hits == len(evidence) and torch.equal(first, again)
    scale = float(want.abs().max())
    assert float((first.cpu() - want).abs().max()) <= 1e-6 * scale
    before = resident_kv_bytes()
    try:
        set_resident_kv_bytes(10**9)
        assert StoredKvContext(store, on_gpu.model, prompt, kv).resident is not None
    finally:
        set_resident_kv_bytes(before)
