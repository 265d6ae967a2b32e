"""The KV stage's pipeline (``inference/model/kv_pipeline.py``) against the plain per-batch
forward (``inference.model.encode.compute_chunk_kv``, the stage's computation before the
pipeline): on a CPU the same batches give the same KV bit for bit, whole-chunk and in the
stored frame of a quantized codec, and the stage stores exactly those bits; each batch is
launched before the previous one is handed on. On a GPU (``-m cuda``) the pipelined copies
give the bits of the blocking ones.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from store_fixtures import synthetic_chunk, tiny_model

from coinrag.inference.model.encode import (
    KvBatching,
    compute_chunk_kv,
    compute_prefix_kv,
    keys_to_position_zero,
)
from coinrag.inference.model.kv_pipeline import (
    MAX_FILL_CHUNKS,
    BatchKvPipeline,
    fill_batch_size,
    groups_kv,
)
from coinrag.inference.model.loading import LoadedModel, tokenizer_fingerprint
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import model_rope
from coinrag.schemas.keys import fingerprint
from coinrag.storage.kv import KvStore
from coinrag.storage.store import Store
from coinrag.tasks.kv import KvOptions, kv_groups, kv_stage

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = (40, 40, 33, 40, 21, 40, 12)  # full chunks and short ones: padded batches


def _chunks(vocab: int, lengths=LENGTHS, tokenizer_fp: str = "tok"):
    g = torch.Generator().manual_seed(5)
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        rows.append(
            dataclasses.replace(synthetic_chunk(i, n), token_ids=ids, tokenizer_fp=tokenizer_fp)
        )
    return rows


def _reference(model, prefix_kv, groups, batch_size):
    """compute_chunk_kv batch by batch, as the stage computed before the pipeline."""
    batching = KvBatching.for_model(model, prefix_kv.shape[3], batch_size)
    out = {}
    for group in groups:
        for batch in batching.split(group):
            for chunk, kv in zip(batch, compute_chunk_kv(model, prefix_kv, batch), strict=True):
                out[chunk.chunk_id] = kv
    return out


def test_pipeline_gives_compute_chunk_kv_bits_on_cpu() -> None:
    model = tiny_model("qwen2", seed=4)
    prefix_kv = compute_prefix_kv(model, list(range(3, 14)))
    chunks = _chunks(model.config.vocab_size)
    groups = kv_groups(chunks, 2, 2)  # 4 groups of 2, 1 batch each (sorted by length)
    want = _reference(model, prefix_kv, groups, 2)
    got = list(groups_kv(model, prefix_kv, groups, 2))
    assert [len(out) for out, _ in got] == [len(g) for g in groups]
    for (out, seconds), group in zip(got, groups, strict=True):
        assert [c.chunk_id for c, _ in out] == [c.chunk_id for c in group]
        assert set(seconds) == {"forward", "extract"}
        for chunk, kv in out:
            assert kv.shape[3] == chunk.n_tokens and kv.device.type == "cpu"
            assert torch.equal(kv, want[chunk.chunk_id]), chunk.chunk_id


def test_pipeline_in_the_stored_frame_of_a_quantized_codec() -> None:
    """keys_at_zero: the pipeline's keys are compute_chunk_kv's rotated back to position 0."""
    model = tiny_model("llama3", seed=6)
    prefix_kv = compute_prefix_kv(model, list(range(3, 10)))
    chunks = _chunks(model.config.vocab_size)
    layout = _layout(model, "int4")
    assert layout.keys_at_zero
    want = _reference(model, prefix_kv, [chunks], 3)
    spec, p = model_rope(model.config), prefix_kv.shape[3]
    ((out, _),) = groups_kv(model, prefix_kv, [chunks], 3, layout=layout)
    for chunk, kv in out:
        assert torch.equal(kv, keys_to_position_zero(want[chunk.chunk_id], spec, p))


def _layout(model, codec: str):
    from coinrag.storage.kv import KvLayout

    return KvLayout.for_config(model.config, "model-x", "prefix-x", "float32", kv_codec=codec)


def test_each_batch_is_launched_before_the_previous_is_handed_on() -> None:
    model = tiny_model("qwen2", seed=4)
    prefix_kv = compute_prefix_kv(model, list(range(3, 8)))
    chunks = _chunks(model.config.vocab_size)
    forwards = []
    hook = model.model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        pipeline = BatchKvPipeline(model, prefix_kv)
        batches = [chunks[0:2], chunks[2:4], chunks[4:7]]
        seen = []
        for batch, kvs, seconds in pipeline.run(batches):
            seen.append((len(forwards), [c.chunk_id for c in batch], len(kvs)))
            assert set(seconds) == {"forward", "extract"}
    finally:
        hook.remove()
    assert seen == [
        (2, ["ch-0", "ch-1"], 2),  # batch 0 handed on after batch 1's forward
        (3, ["ch-2", "ch-3"], 2),
        (3, ["ch-4", "ch-5", "ch-6"], 3),
    ]
    assert pipeline.copies is None  # a CPU: nothing to overlap the copies with


def test_kv_stage_stores_the_bits_of_compute_chunk_kv(tmp_path: Path, smollm2_tokenizer) -> None:
    """The whole stage (groups, writer, shards) through the pipeline: every stored entry is
    the bits compute_chunk_kv gives for its batch."""
    tok = smollm2_tokenizer
    model = tiny_model("qwen2", seed=7, vocab_size=len(tok))
    tok_fp = tokenizer_fingerprint(tok)
    loaded = LoadedModel(model, tok, Path("."), fingerprint("model", {"t": 37}), tok_fp)
    prompt = RagPrompt.for_tokenizer(tok)
    chunks = _chunks(len(tok), tokenizer_fp=tok_fp)
    store = Store.at(tmp_path / "s").init()
    options = KvOptions(batch_size=2, slots_per_shard=2)
    counts = kv_stage(store, chunks, loaded, prompt, "run-1", options)
    assert counts.computed == len(chunks) and counts.forward_passes == 4
    prefix_kv, _ = KvStore.open(store, counts.kv_fp).read_prefix()
    want = _reference(model, prefix_kv, kv_groups(chunks, 2, 2), 2)
    kv = KvStore.open(store, counts.kv_fp)
    for chunk in chunks:
        assert torch.equal(kv.read_entry(chunk.content_key), want[chunk.chunk_id])


def test_fill_batch_size() -> None:
    """The docstring's example: Qwen2-7B dims, bf16, 512-token chunks after 32 tokens."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
    )
    assert fill_batch_size(config, 2, 512, 32, 10 * 10**9) == 36
    assert fill_batch_size(config, 2, 512, 32, 120 * 10**9) == MAX_FILL_CHUNKS
    assert fill_batch_size(config, 2, 512, 32, 10**6) == 1  # never below one chunk


def test_the_stage_batch_size_is_the_settings_on_a_cpu(smollm2_tokenizer) -> None:
    from coinrag.tasks.kv import LocalKv

    loaded = LoadedModel(tiny_model("qwen2"), smollm2_tokenizer, Path("."), "m", "t")
    workers = LocalKv(loaded, RagPrompt.for_tokenizer(smollm2_tokenizer))
    assert workers.batch_size(KvOptions(batch_size=3, fill_device=True), 512, 32) == 3


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_pipeline_on_cuda_gives_the_blocking_copies_bits() -> None:
    """On a GPU: the KV copied on a second stream into pinned memory, overlapped with the next
    forward, is bit for bit what compute_chunk_kv's blocking copy gives; it sits in pinned
    host memory, and the stage raises its batch to what the device holds."""
    model = tiny_model("qwen2", seed=4).to("cuda")
    prefix_kv = compute_prefix_kv(model, list(range(3, 14)))
    chunks = _chunks(model.config.vocab_size)
    groups = kv_groups(chunks, 2, 2)
    want = _reference(model, prefix_kv, groups, 2)
    for out, _ in groups_kv(model, prefix_kv, groups, 2):
        for chunk, kv in out:
            assert kv.device.type == "cpu" and kv.is_pinned()
            assert torch.equal(kv, want[chunk.chunk_id].cpu())
    free, _ = torch.cuda.mem_get_info()
    assert fill_batch_size(model.config, 4, 40, 11, free) == MAX_FILL_CHUNKS
