"""``kv_keep = "nuggets"`` in the KV store: entries that hold only some token ranges of their chunk
(``storage/kv/kept.py``), read as exactly the slices of the whole chunk's KV, never as zeros
where nothing was stored; their keys, identity, checks and reclaim.

No model: synthetic entries (random tensors of a small layout) in a real local store; the model
side (a whole build, the oracle against a store of whole chunks) is
``tests/storage/test_kv_keep.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from store_fixtures import synthetic_chunk

from coinrag.schemas.keys import fingerprint
from coinrag.storage.kv import (
    LAYOUT_VERSION,
    KeptRanges,
    KvEntry,
    KvFingerprintMismatch,
    KvLayout,
    KvStore,
    MissingKvEntry,
    UnstoredKvSlice,
    entry_key,
)
from coinrag.storage.kv.transport import LocalTransport
from coinrag.storage.store import Store

LAYOUT = KvLayout(
    model_fp="model-x",
    prefix_sha="ps-x",
    layers=3,
    kv_heads=2,
    head_dim=8,
    dtype="float32",
    keep="nuggets",
    block_tokens=8,
    slots_per_shard=3,
)
# chunk tokens, nugget spans (overlapping, touching, one crossing a block boundary)
CHUNKS = [
    (40, [(3, 9), (7, 12), (20, 25)]),
    (37, [(0, 37)]),  # every token: the whole chunk, still as kept ranges
    (33, [(30, 33), (1, 2), (2, 4)]),
    (21, [(5, 18)]),
]


class RangedLocal(LocalTransport):
    """Local disk read the way object stores are: slices as byte ranges decoded here."""

    ranged_slice_reads = True


def test_kept_ranges_worked_example():
    kept = KeptRanges.of_spans([(7, 12), (3, 9), (20, 25), (12, 14), (30, 30)])
    assert kept.ranges == ((3, 14), (20, 25)) and kept.stored == 16 and kept.end == 25
    assert kept.flat() == [3, 14, 20, 25] and KeptRanges.from_flat(kept.flat()) == kept
    assert kept.locate(8, 11) == 5 and kept.locate(20, 22) == 11 and kept.locate(3, 14) == 0
    assert kept.locate(10, 22) is None and kept.locate(0, 1) is None and kept.locate(24, 26) is None
    kv = torch.arange(40.0).reshape(1, 1, 1, 40, 1)
    assert kept.cut(kv).flatten().tolist() == [*range(3, 14), *range(20, 25)]
    assert KeptRanges.of_spans([]).cut(kv).shape == (1, 1, 1, 0, 1)
    for bad in ([3, 14, 12, 25], [3], [5, 2]):  # overlapping, odd, reversed: a damaged row
        with pytest.raises(ValueError):
            KeptRanges.from_flat(bad)
    # the key: content_key for a whole chunk, with the ranges' digest otherwise
    assert entry_key("ck-1", None) == "ck-1"
    assert (
        entry_key("ck-1", kept)
        == f"ck-1@{kept.digest()}"
        != entry_key("ck-1", KeptRanges.of_spans([(3, 14)]))
    )
    with pytest.raises(ValueError, match="end after"):
        KvEntry("c", "ck", 20, kept)


def test_identity_keeps_whole_chunk_stores_and_separates_nugget_stores(tmp_path):
    whole = dataclasses.replace(LAYOUT, keep="chunks")
    # the fingerprint of a store of whole chunks is the one it had before kv_keep existed
    before = {"model_fp": "model-x", "prefix_sha": "ps-x", "layout_version": LAYOUT_VERSION}
    assert whole.kv_fp == fingerprint("kv", before) != LAYOUT.kv_fp
    st = Store.at(tmp_path / "store").init()
    KvStore.create(st, LAYOUT)
    with pytest.raises(KvFingerprintMismatch, match="kv_keep"):
        KvStore.open(st, LAYOUT.kv_fp, dataclasses.replace(LAYOUT, keep="chunks"))
    assert KvStore.open(st, LAYOUT.kv_fp).layout.keep == "nuggets"
    with pytest.raises(ValueError, match="kv_keep 'spans'"):
        dataclasses.replace(LAYOUT, keep="spans")


def _nugget_store(tmp_path: Path) -> tuple[KvStore, list[tuple[KvEntry, torch.Tensor]]]:
    """A nuggets store of CHUNKS: the entries written, each with its chunk's whole KV."""
    torch.manual_seed(0)
    kv = KvStore.create(Store.at(tmp_path / "store").init(), LAYOUT)
    full = []
    for i, (n, spans) in enumerate(CHUNKS):
        entry = KvEntry.of(synthetic_chunk(i, n))
        entry = dataclasses.replace(entry, kept=KeptRanges.of_spans(spans))
        full.append((entry, torch.randn(*LAYOUT.entry_shape(n))))
    kv.write_entries([(e, e.cut(t)) for e, t in full], "run-k")
    return kv, full


@pytest.mark.parametrize("ranged", [False, True])
def test_slices_inside_kept_ranges_are_the_whole_chunks_slices(tmp_path, ranged):
    kv, full = _nugget_store(tmp_path)
    if ranged:  # the object stores' path: blocks fetched as byte ranges, decoded here
        kv = KvStore.open(kv.store, kv.kv_fp)
        kv.transport = RangedLocal(kv.store)
    requests = []
    for entry, _ in full:
        for s, e in entry.kept.ranges:
            requests += [(entry.content_key, s, e), (entry.content_key, s + (e - s) // 2, e)]
    got = kv.read_slices(requests)
    for (ck, s, e), tensor in zip(requests, got, strict=True):
        whole = next(t for en, t in full if en.content_key == ck)
        assert torch.equal(tensor, whole[:, :, :, s:e]), (ck, s, e)
    # the stored bytes are the kept tokens only: the amplification counts stored blocks
    assert kv.last_read.bytes_needed == sum((e - s) for _, s, e in requests) * LAYOUT.token_bytes
    for entry, whole in full:  # a whole entry is its ranges, concatenated
        assert torch.equal(kv.read_entry(entry.key), entry.cut(whole))
        assert kv.chunk_tokens(entry.content_key) == entry.n_tokens
    assert kv.entry_problems([e.key for e, _ in full], "crc32c") == {}
    assert kv.entry_problems([e.key for e, _ in full], "sha256") == {}


def test_a_slice_outside_the_kept_ranges_is_an_error_never_zeros(tmp_path):
    kv, full = _nugget_store(tmp_path)
    ck = full[0][0].content_key  # keeps [3, 12) and [20, 25) of 40 tokens
    for s, e in [(0, 3), (12, 13), (10, 22), (25, 40), (2, 5)]:
        with pytest.raises(UnstoredKvSlice, match=r"kv_keep = \"nuggets\".*\[3, 12\), \[20, 25\)"):
            kv.read_slices([(ck, 4, 8), (ck, s, e)])
    with pytest.raises(IndexError, match="out of range"):
        kv.read_slices([(ck, 30, 41)])
    with pytest.raises(MissingKvEntry):
        kv.read_slices([("ck-none", 0, 1)])
    assert kv.read_slices([(ck, 0, 0)])[0].shape[3] == 0  # an empty slice reads nothing


def test_new_spans_make_a_new_entry_beside_the_old_one(tmp_path):
    """Another extractor's spans: a new entry (its own key), the old one still served, until
    reclaim drops what no live nugget set uses; the moved entries are still bit for bit."""
    kv, full = _nugget_store(tmp_path)
    entry, whole = full[0]
    new = dataclasses.replace(entry, kept=KeptRanges.of_spans([(10, 30)]))
    assert new.key != entry.key
    kv.write_entries([(new, new.cut(whole))], "run-2")
    assert kv.entries_of(entry.content_key) == [new.key, entry.key]
    ck = entry.content_key
    # [10, 30) from the new entry, [3, 9) only the old one holds; both exactly the chunk's
    got = kv.read_slices([(ck, 12, 28), (ck, 3, 9)])
    assert torch.equal(got[0], whole[:, :, :, 12:28]) and torch.equal(got[1], whole[:, :, :, 3:9])
    with pytest.raises(UnstoredKvSlice):
        kv.read_slices([(ck, 0, 2)])

    live = {new.key} | {e.key for e, _ in full[1:]}
    dry = kv.reclaim(live, "gc-2", dry_run=True)  # same length: attrs hold it
    assert (dry.entries_dropped, dry.entries_moved, dry.shards_compacted) == (1, 2, 1)
    done = kv.reclaim(live, "gc-1")
    assert (done.entries_dropped, done.entries_moved) == (1, 2)
    assert done.bytes_reclaimed == dry.bytes_reclaimed > 0
    again = KvStore.open(kv.store, kv.kv_fp)
    assert set(again.manifest()) == live and again.garbage() == []
    assert again.entries_of(ck) == [new.key]
    for e, t in [(new, whole), *full[1:]]:
        assert torch.equal(again.read_entry(e.key), e.cut(t))
        row = again.manifest()[e.key]
        assert (row.tokens, row.kept) == (e.n_tokens, e.kept.flat())
        assert row.bytes == e.kept.stored * LAYOUT.token_bytes
    with pytest.raises(UnstoredKvSlice):
        again.read_slices([(ck, 3, 9)])


def test_entries_must_match_what_the_store_keeps(tmp_path):
    kv, full = _nugget_store(tmp_path)
    chunk = synthetic_chunk(9, 16)
    with pytest.raises(ValueError, match="keeps nugget spans"):
        kv.write_entries([(chunk, torch.zeros(LAYOUT.entry_shape(16)))], "r")
    entry = dataclasses.replace(KvEntry.of(chunk), kept=KeptRanges.of_spans([(2, 6)]))
    with pytest.raises(ValueError, match="shape"):  # the chunk's whole KV, not the kept part
        kv.write_entries([(entry, torch.zeros(LAYOUT.entry_shape(16)))], "r")
    whole = KvStore.create(kv.store, dataclasses.replace(LAYOUT, keep="chunks"))
    with pytest.raises(ValueError, match="keeps whole chunks"):
        whole.write_entries([(entry, torch.zeros(LAYOUT.entry_shape(4)))], "r")
