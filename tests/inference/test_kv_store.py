"""KV store and KV stage: real Zarr files in temporary stores, real (tiny and SmolLM2) models.

Oracles
- round trip: what the stage hands the store is what ``read_entry`` returns, bit for bit;
- the model's own cache: with batch size 1 the stored KV *equals* (bit-exact) the cache the model
  builds for ``forward(prefix)`` then ``forward(chunk, past_key_values=that cache)``, at
  positions ``|p| ..``; against a single ``forward(prefix + chunk)`` it agrees within the
  float tolerance below (different matmul shapes round differently in the last bits);
- batching: a batched (right-padded) forward gives the one-by-one KV within the same tolerance.

Tolerance (stated, checked): ``max|a - b| <= rel * max|b|`` with ``rel = 1e-5`` for float32 and
``2**-5`` for bfloat16 (a few bf16 ulps at the largest magnitude), and the mean difference
``<= rel / 8 * max|b|``. Observed on this CPU: float32 <= 2e-5 at max|kv| ~ 20 (SmolLM2), i.e.
~1e-6 relative; bfloat16 <= 0.25 at ~20 (2 ulps); tiny models: float32 ~1e-7, bfloat16 <= 2 ulps.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import pytest
import torch
from store_fixtures import TINY_DIMS, synthetic_chunk

from coinrag.inference.model.encode import cache_to_kv, compute_chunk_kv, compute_prefix_kv, decoder
from coinrag.inference.model.loading import LoadedModel, tokenizer_fingerprint
from coinrag.inference.model.prompt import RagPrompt
from coinrag.schemas.keys import fingerprint
from coinrag.schemas.tables import KvManifestRow
from coinrag.storage.kv import (
    CorruptKvEntry,
    KvFingerprintMismatch,
    KvLayout,
    KvStore,
    MissingKvEntry,
    parse_location,
)
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows, table_files
from coinrag.tasks.chunk import chunk_document
from coinrag.tasks.kv import KvOptions, kv_stage

DOCS = Path("/usr/share/doc/python3.11/html/_sources/faq")
_TEXT_FALLBACK = (
    "Python is a programming language that lets you work quickly and integrate systems more "
    "effectively. It was created by Guido van Rossum and first released in 1991. "
) * 40
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-5}


def assert_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """The stated tolerance (module docstring)."""
    diff = (a.float() - b.float()).abs()
    scale = b.float().abs().max().item()
    rel = REL_TOL[dtype]
    assert diff.max().item() <= rel * scale, (diff.max().item(), scale)
    assert diff.mean().item() <= rel / 8 * scale, (diff.mean().item(), scale)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The CI box has 2 shared cores: one intra-op thread is faster and steadier for tiny
    models than two OpenMP threads fighting other processes. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def text() -> str:
    path = DOCS / "general.rst.txt"
    return path.read_text(encoding="utf-8") if path.is_file() else _TEXT_FALLBACK


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer) -> RagPrompt:
    return RagPrompt.for_tokenizer(smollm2_tokenizer)


def tiny(arch: str, dtype: torch.dtype, tokenizer) -> LoadedModel:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        **TINY_DIMS,
        max_position_embeddings=4096,
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model_fp = fingerprint("model", {"test": arch, "dtype": str(dtype)})
    return LoadedModel(model, tokenizer, Path("."), model_fp, tokenizer_fingerprint(tokenizer))


@pytest.fixture(scope="module")
def qwen2(smollm2_tokenizer) -> LoadedModel:
    return tiny("qwen2", torch.float32, smollm2_tokenizer)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    from coinrag.inference.model.loading import load_model

    return load_model(None)


def make_chunks(tokenizer, text: str, chunk_size: int, n: int, doc: str = "d1"):
    """``n`` chunks of one document: full ones and the (short) last one."""
    rows = chunk_document(
        tokenizer,
        doc,
        "dv-" + doc,
        text,
        tokenizer_fp=tokenizer_fingerprint(tokenizer),
        chunk_size=chunk_size,
        run_id="r",
    )
    return rows[: n - 1] + [rows[-1]]


def store_at(tmp_path: Path, name: str = "store") -> Store:
    return Store.at(tmp_path / name).init()


class ForwardCounter:
    """Counts the chunk rows the stage pushes through the model (prefix forwards excluded)."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.rows = 0
        self.calls = 0
        self.handle = decoder(loaded.model).register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if kwargs.get("past_key_values") is not None:
            self.calls += 1
            self.rows += kwargs["input_ids"].shape[0]

    def close(self) -> None:
        self.handle.remove()


def own_cache_kv(loaded: LoadedModel, prompt: RagPrompt, token_ids: list[int]):
    """(incremental, single-pass) KV of a chunk from the model's own caches."""
    from transformers import DynamicCache

    dec = decoder(loaded.model)
    p = len(prompt.prefix_ids)
    with torch.inference_mode():
        past = dec(input_ids=torch.tensor([prompt.prefix_ids]), use_cache=True).past_key_values
        assert isinstance(past, DynamicCache)
        out = dec(input_ids=torch.tensor([token_ids]), past_key_values=past, use_cache=True)
        incremental = cache_to_kv(out.past_key_values, start=p)[0]
        ids = torch.tensor([prompt.prefix_ids + token_ids])
        single = cache_to_kv(dec(input_ids=ids, use_cache=True).past_key_values, start=p)[0]
    return incremental, single


def shard_data_file(kv: KvStore, name: str) -> Path:
    files = [p for p in (kv.root / name).rglob("*") if p.is_file() and p.name != "zarr.json"]
    assert len(files) == 1, files
    return files[0]


# ---------------------------------------------------------------------------- prompt


def test_prompt_pieces_follow_the_chat_template(smollm2_tokenizer, prompt):
    tok = smollm2_tokenizer
    assert prompt.uses_chat_template
    assert prompt.prefix_text.endswith("<|im_start|>user\nContext:\n")
    assert "Answer the question using the context." in prompt.prefix_text
    query = prompt.query_text("Who made Python?")
    assert query.startswith("\n\nQuestion: Who made Python?<|im_end|>")
    assert query.endswith("<|im_start|>assistant\n")
    chunk_ids = tok("Guido made it.", add_special_tokens=False)["input_ids"]
    ids = prompt.standard_ids([chunk_ids], "Who made Python?")
    assert ids == prompt.prefix_ids + chunk_ids + prompt.query_ids("Who made Python?")
    rendered = tok.apply_chat_template(
        [
            {"role": "system", "content": prompt.system_prompt},
            {"role": "user", "content": "Context:\nGuido made it.\n\nQuestion: Who made Python?"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(ids) == rendered
    assert prompt.prefix_sha == RagPrompt.for_tokenizer(tok).prefix_sha
    assert prompt.prefix_sha != RagPrompt.for_tokenizer(tok, system_prompt="Be terse.").prefix_sha


def test_prompt_fallback_without_chat_template(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    p = RagPrompt.for_tokenizer(tok)
    assert not p.uses_chat_template
    assert p.prefix_text.endswith("Context:\n")
    assert p.query_text("Why?") == "\n\nQuestion: Why?\nAnswer:"


# ---------------------------------------------------------------------------- oracles


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stored_kv_is_the_models_own_cache(tmp_path, smollm2_tokenizer, prompt, text, arch, dtype):
    loaded = tiny(arch, dtype, smollm2_tokenizer)
    chunks = make_chunks(smollm2_tokenizer, text, 40, 4)
    store = store_at(tmp_path)
    counts = kv_stage(
        store, chunks, loaded, prompt, "run-a", KvOptions(batch_size=1, slots_per_shard=3)
    )
    assert counts.computed == 4 and counts.shards == 2
    kv = KvStore.open(store, counts.kv_fp)
    assert kv.layout.dtype == str(dtype).removeprefix("torch.")
    assert (kv.layout.layers, kv.layout.kv_heads) == (2, 2)
    for chunk in chunks:
        got = kv.read_entry(chunk.content_key)
        assert got.dtype == dtype
        assert got.shape == kv.layout.entry_shape(chunk.n_tokens)
        incremental, single = own_cache_kv(loaded, prompt, chunk.token_ids)
        assert torch.equal(got, incremental)  # bit-exact through the store
        assert_close(got, single, dtype)
    # The prefix C_p is stored once and is the model's own prefix cache.
    prefix_kv, ids = kv.read_prefix()
    assert ids == prompt.prefix_ids
    assert torch.equal(prefix_kv, compute_prefix_kv(loaded.model, prompt.prefix_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batched_matches_one_by_one(tmp_path, smollm2_tokenizer, prompt, text, dtype):
    loaded = tiny("qwen3", dtype, smollm2_tokenizer)
    chunks = make_chunks(smollm2_tokenizer, text, 40, 6)  # five full chunks + a short one
    one = kv_stage(
        store_at(tmp_path, "a"), chunks, loaded, prompt, "run-1", KvOptions(batch_size=1)
    )
    many = kv_stage(
        store_at(tmp_path, "b"), chunks, loaded, prompt, "run-2", KvOptions(batch_size=4)
    )
    assert many.forward_passes == 2 and many.padded_tokens > 0
    kv1 = KvStore.open(store_at(tmp_path, "a"), one.kv_fp)
    kv4 = KvStore.open(store_at(tmp_path, "b"), many.kv_fp)
    for chunk in chunks:
        assert_close(kv4.read_entry(chunk.content_key), kv1.read_entry(chunk.content_key), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_oracle(tmp_path, smollm2, smollm2_tokenizer, prompt, text, dtype):
    from coinrag.inference.model.loading import load_model

    loaded = smollm2 if dtype == "float32" else load_model(None, dtype=dtype)
    chunks = make_chunks(smollm2_tokenizer, text, 24, 3)
    store = store_at(tmp_path)
    counts = kv_stage(store, chunks, loaded, prompt, "run-s", KvOptions(batch_size=3))
    kv = KvStore.open(
        store, counts.kv_fp, KvLayout.for_model(loaded.model, loaded.model_fp, prompt.prefix_sha)
    )
    assert (kv.layout.layers, kv.layout.kv_heads, kv.layout.head_dim) == (30, 3, 64)
    torch_dtype = getattr(torch, dtype)
    for chunk in chunks:
        got = kv.read_entry(chunk.content_key)
        incremental, single = own_cache_kv(loaded, prompt, chunk.token_ids)
        assert_close(got, incremental, torch_dtype)  # batched (3 rows) vs the model's own cache
        assert_close(got, single, torch_dtype)
    one = compute_chunk_kv(loaded.model, kv.read_prefix()[0], [chunks[0]])[0]
    assert torch.equal(one, own_cache_kv(loaded, prompt, chunks[0].token_ids)[0])


# ---------------------------------------------------------------------------- shard encoding


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_direct_shard_encoder_matches_zarrs_own_writer(tmp_path, dtype):
    """The shard files encoded here are what Zarr's sharding codec writes (byte for byte for a
    one-slot shard, whose inner chunks Zarr also lays out in block order) and decode to the
    entries; multi-slot shards differ only in the order of inner chunks inside the file."""
    layers, heads, dim = 3, 2, 8
    lengths = [37, 40, 5, 33, 16]  # full blocks, a partial block, a padded short entry
    torch.manual_seed(0)
    entries = [
        (synthetic_chunk(i, n), torch.randn(layers, 2, heads, n, dim).to(getattr(torch, dtype)))
        for i, n in enumerate(lengths)
    ]
    stores = {}
    variants = {"direct": {}, "buffered": {"direct_io": False}, "zarr": {"encoder": "zarr"}}
    for variant, options in variants.items():
        for slots in (1, 3):
            layout = KvLayout(
                model_fp="model-x",
                prefix_sha="ps-x",
                layers=layers,
                kv_heads=heads,
                head_dim=dim,
                dtype=dtype,
                block_tokens=8,
                slots_per_shard=slots,
            )
            kv = KvStore.create(store_at(tmp_path, f"{variant}-{slots}"), layout, **options)
            kv.write_entries(entries, "run-e")
            for chunk, tensor in entries:
                assert torch.equal(kv.read_entry(chunk.content_key), tensor)
                piece = kv.read_slices([(chunk.content_key, 3, 5)])[0]
                assert torch.equal(piece, tensor[..., 3:5, :])
            stores[variant, slots] = kv
    for name in stores["zarr", 1].shard_names():
        zarr_bytes = shard_data_file(stores["zarr", 1], name).read_bytes()
        assert shard_data_file(stores["direct", 1], name).read_bytes() == zarr_bytes
        assert shard_data_file(stores["buffered", 1], name).read_bytes() == zarr_bytes
    for slots in (1, 3):
        reference = stores["zarr", slots]
        for variant in ("direct", "buffered"):
            assert stores[variant, slots].write_stats.disk_bytes == reference.write_stats.disk_bytes
            assert stores[variant, slots].manifest() == reference.manifest()  # same rows


# ---------------------------------------------------------------------------- reads


def test_read_slices_are_sub_tensors_of_read_entry(tmp_path, qwen2, prompt, text):
    chunks = make_chunks(qwen2.tokenizer, text, 64, 4)
    store = store_at(tmp_path)
    counts = kv_stage(
        store, chunks, qwen2, prompt, "run-r", KvOptions(batch_size=2, slots_per_shard=2)
    )
    kv = KvStore.open(store, counts.kv_fp)
    a, b, c, last = (ch.content_key for ch in chunks)
    requests = [
        (a, 0, 12),  # inside block 0
        (a, 14, 18),  # across the first block boundary
        (b, 16, 32),  # exactly one block
        (c, 50, 64),  # the end of a full chunk
        (a, 10, 20),  # overlaps earlier requests on the same entry (merged read)
        (last, 0, chunks[-1].n_tokens),  # a whole short (padded) entry
        (b, 5, 5),  # empty
    ]
    slices = kv.read_slices(requests)
    stats = kv.last_read
    assert len(slices) == len(requests)
    for (ck, s, e), got in zip(requests, slices, strict=True):
        assert torch.equal(got, kv.read_entry(ck)[:, :, :, s:e])
    assert stats.requests == len(requests)
    assert stats.zarr_reads == 4  # a's three requests share one read
    assert stats.bytes_needed == kv.layout.token_bytes * sum(e - s for _, s, e in requests)
    # Reads cover the union of each entry's ranges (a's overlap is read once), in whole blocks.
    union = len({(ck, t) for ck, s, e in requests for t in range(s, e)})
    assert kv.layout.token_bytes * union <= stats.bytes_read < 3 * stats.bytes_needed
    with pytest.raises(IndexError):
        kv.read_slices([(a, 60, 65)])
    with pytest.raises(MissingKvEntry):
        kv.read_slices([("ck-nope", 0, 1)])


def test_same_tokens_in_another_document_reuse_the_entry(tmp_path, qwen2, prompt, text):
    first = make_chunks(qwen2.tokenizer, text, 64, 3, doc="d1")
    again = make_chunks(qwen2.tokenizer, text, 64, 3, doc="d2")  # other chunk_ids, same content
    store = store_at(tmp_path)
    kv_stage(store, first, qwen2, prompt, "run-1", KvOptions(slots_per_shard=2))
    counts = kv_stage(store, first + again, qwen2, prompt, "run-2", KvOptions(slots_per_shard=2))
    assert (counts.chunks, counts.unique, counts.reused, counts.computed) == (6, 3, 3, 0)


# ---------------------------------------------------------------------------- failures


def test_flipped_bytes_are_detected_and_rebuilt(tmp_path, qwen2, prompt, text):
    chunks = make_chunks(qwen2.tokenizer, text, 64, 4)
    store = store_at(tmp_path)
    counts = kv_stage(store, chunks, qwen2, prompt, "run-1", KvOptions(slots_per_shard=2))
    kv = KvStore.open(store, counts.kv_fp)
    originals = {c.content_key: kv.read_entry(c.content_key) for c in chunks}
    row = kv.manifest()[chunks[0].content_key]
    _, name, slot = parse_location(row.location)
    assert slot == 0
    data = shard_data_file(kv, name)
    with data.open("r+b") as f:  # inner chunks are in Morton order: slot 0, block 0 comes first
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = chunks[0].content_key
    with pytest.raises(CorruptKvEntry, match=bad):
        kv.read_entry(bad)
    with pytest.raises(CorruptKvEntry, match=bad):
        kv.read_slices([(bad, 2, 6)])  # a partial read of the damaged block
    assert kv.read_slices([(bad, 20, 30)])[0].shape[3] == 10  # other blocks still check out
    assert not kv.verify_entry(bad)
    assert kv.verify_entry(chunks[1].content_key)  # same shard, other slot
    assert kv.invalid_entries(originals, level="stat") == set()  # same size: only crc/sha see it
    assert kv.invalid_entries(originals, level="full") == {bad}

    counter = ForwardCounter(qwen2)
    try:
        again = kv_stage(
            store, chunks, qwen2, prompt, "run-2", KvOptions(check="full", slots_per_shard=2)
        )
    finally:
        counter.close()
    assert (again.rebuilt, again.computed, counter.rows) == (1, 1, 1)
    fresh = KvStore.open(store, counts.kv_fp)
    assert fresh.manifest()[bad].location != row.location  # the new row supersedes the old
    for ck, original in originals.items():
        assert torch.equal(fresh.read_entry(ck), original)


def test_truncated_shard_is_detected_and_rebuilt(tmp_path, qwen2, prompt, text):
    chunks = make_chunks(qwen2.tokenizer, text, 64, 4)
    store = store_at(tmp_path)
    counts = kv_stage(store, chunks, qwen2, prompt, "run-1", KvOptions(slots_per_shard=2))
    kv = KvStore.open(store, counts.kv_fp)
    originals = {c.content_key: kv.read_entry(c.content_key) for c in chunks}
    name = parse_location(kv.manifest()[chunks[2].content_key].location)[1]
    in_shard = {ck for ck, r in kv.manifest().items() if parse_location(r.location)[1] == name}
    assert len(in_shard) == 2
    data = shard_data_file(kv, name)
    os.truncate(data, data.stat().st_size - 1000)
    for ck in in_shard:
        with pytest.raises(CorruptKvEntry, match="bytes"):
            kv.read_entry(ck)
    # Without the size record, a read that reaches past the end still fails (the offsets of a
    # shard the writer encoded follow from the token counts: no Zarr index is read; the bytes
    # that are missing fail the read, never come back as zeros).
    shard = kv._shard(name)
    shard.files.clear()
    os.truncate(data, data.stat().st_size // 2)
    last = max(in_shard, key=lambda ck: parse_location(kv.manifest()[ck].location)[2])
    with pytest.raises(CorruptKvEntry, match="read failed"):
        kv.read_entry(last)
    kv._shards.clear()

    counter = ForwardCounter(qwen2)
    try:
        again = kv_stage(store, chunks, qwen2, prompt, "run-2", KvOptions(slots_per_shard=2))
    finally:
        counter.close()
    assert (again.rebuilt, again.computed, counter.rows) == (2, 2, 2)
    fresh = KvStore.open(store, counts.kv_fp)
    for ck, original in originals.items():
        assert torch.equal(fresh.read_entry(ck), original)
    assert [p.name for p in fresh.garbage()] == [name]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "inline"])
def test_resume_after_a_kill_computes_only_the_rest(tmp_path, qwen2, prompt, text, overlap):
    chunks = make_chunks(qwen2.tokenizer, text, 64, 7)
    store = store_at(tmp_path)

    def killed(done: int, total: int) -> None:
        raise KeyboardInterrupt(f"killed after {done}/{total}")

    with pytest.raises(KeyboardInterrupt):
        kv_stage(
            store,
            chunks,
            qwen2,
            prompt,
            "run-1",
            KvOptions(batch_size=2, slots_per_shard=2, overlap=overlap),
            killed,
        )
    assert len(read_rows(store, KvManifestRow)) == 2

    counter = ForwardCounter(qwen2)
    try:
        counts = kv_stage(
            store,
            chunks,
            qwen2,
            prompt,
            "run-2",
            KvOptions(batch_size=2, slots_per_shard=2, overlap=overlap),
        )
    finally:
        counter.close()
    assert (counts.reused, counts.computed, counter.rows) == (2, 5, 5)
    rows = read_rows(store, KvManifestRow)
    assert sorted(r.content_key for r in rows) == sorted(c.content_key for c in chunks)
    kv = KvStore.open(store, counts.kv_fp)
    assert all(kv.verify_entry(c.content_key) for c in chunks)
    assert kv.garbage() == []


def test_second_run_computes_nothing(tmp_path, qwen2, prompt, text):
    chunks = make_chunks(qwen2.tokenizer, text, 64, 3)
    store = store_at(tmp_path)
    first = kv_stage(store, chunks, qwen2, prompt, "run-1", KvOptions(slots_per_shard=2))
    files = table_files(store, KvManifestRow)
    shards = sorted(p.name for p in store.kv_dir(first.kv_fp).iterdir())
    counter = ForwardCounter(qwen2)
    try:
        counts = kv_stage(store, chunks, qwen2, prompt, "run-2", KvOptions(slots_per_shard=2))
    finally:
        counter.close()
    assert (counts.reused, counts.computed, counts.forward_passes, counter.calls) == (3, 0, 0, 0)
    assert table_files(store, KvManifestRow) == files
    assert sorted(p.name for p in store.kv_dir(counts.kv_fp).iterdir()) == shards


def test_crash_before_the_manifest_leaves_an_orphan(tmp_path, qwen2, prompt, text, monkeypatch):
    import coinrag.storage.tables as storage_tables

    chunks = make_chunks(qwen2.tokenizer, text, 64, 2)
    store = store_at(tmp_path)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(storage_tables, "append_rows", crash)
    with pytest.raises(OSError):
        kv_stage(store, chunks, qwen2, prompt, "run-1", KvOptions(slots_per_shard=2))
    monkeypatch.undo()
    kv = KvStore.create(store, _layout(qwen2, prompt))
    assert kv.manifest() == {} and kv.shard_names() == ["shard-000000"]
    with pytest.raises(MissingKvEntry):
        kv.read_entry(chunks[0].content_key)
    assert [p.name for p in kv.gc()] == ["shard-000000"]
    counts = kv_stage(store, chunks, qwen2, prompt, "run-2", KvOptions(slots_per_shard=2))
    assert counts.computed == 2


def _layout(loaded: LoadedModel, prompt: RagPrompt) -> KvLayout:
    return KvLayout.for_model(loaded.model, loaded.model_fp, prompt.prefix_sha)


def test_fingerprint_mismatch_names_both(tmp_path, smollm2_tokenizer, qwen2, prompt, text):
    chunks = make_chunks(qwen2.tokenizer, text, 64, 2)
    store = store_at(tmp_path)
    counts = kv_stage(store, chunks, qwen2, prompt, "run-1", KvOptions(slots_per_shard=2))
    other = tiny("llama", torch.float32, smollm2_tokenizer)
    theirs = _layout(other, prompt)
    with pytest.raises(KvFingerprintMismatch) as err:
        KvStore.open(store, counts.kv_fp, theirs)  # KV of qwen2 opened for the llama model
    assert counts.kv_fp in str(err.value) and theirs.kv_fp in str(err.value)
    assert qwen2.model_fp in str(err.value) and other.model_fp in str(err.value)
    # A KV folder that was moved under another fingerprint's name is refused too.
    os.rename(store.kv_dir(counts.kv_fp), store.kv_dir(theirs.kv_fp))
    with pytest.raises(KvFingerprintMismatch) as err:
        KvStore.open(store, theirs.kv_fp)
    assert counts.kv_fp in str(err.value) and theirs.kv_fp in str(err.value)
    with pytest.raises(FileNotFoundError):
        KvStore.open(store, counts.kv_fp)
    # Chunks cut by another tokenizer are refused before any work.
    foreign = [dataclasses.replace(c, tokenizer_fp="tok-other") for c in chunks]
    with pytest.raises(ValueError, match="tok-other"):
        kv_stage(store, foreign, qwen2, prompt, "run-2")
