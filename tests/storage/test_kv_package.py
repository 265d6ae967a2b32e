"""The roles of ``storage/kv/``: read planning, the transport interface, the codec registry.

No model: synthetic entries (random tensors of a small layout) in a real local store.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from store_fixtures import synthetic_chunk

from coinrag.storage.kv import CorruptKvEntry, KvLayout, KvStore, codec_named, parse_location
from coinrag.storage.kv.reads import plan_reads
from coinrag.storage.kv.shard import DATA_KEY
from coinrag.storage.kv.transport import LocalTransport, ObjectTransport, transport_for
from coinrag.storage.store import Store

LENGTHS = [37, 40, 5, 33]  # full blocks, a partial block, a padded short entry


class ZarrLocal(LocalTransport):
    """Local disk read through Zarr's own reader (the reference for the ranged reads)."""

    ranged_slice_reads = False


def _store(tmp_path: Path, dtype: str) -> tuple[KvStore, list[tuple[object, torch.Tensor]]]:
    layout = KvLayout(
        model_fp="model-x",
        prefix_sha="ps-x",
        layers=3,
        kv_heads=2,
        head_dim=8,
        dtype=dtype,
        block_tokens=8,
        slots_per_shard=3,
    )
    torch.manual_seed(0)
    entries = [
        (synthetic_chunk(i, n), torch.randn(*layout.entry_shape(n)).to(layout.torch_dtype))
        for i, n in enumerate(LENGTHS)
    ]
    kv = KvStore.create(Store.at(tmp_path / "store").init(), layout)
    kv.write_entries(entries, "run-p")
    return kv, entries


def test_plan_reads_merges_blocks_that_touch():
    per_slot = {("shard-000000", 0): [(100, 110, 2), (3, 5, 0), (20, 40, 1)]}
    plans = plan_reads(per_slot, lambda name: 16)
    assert [(p.t0, p.t1, p.requests) for p in plans] == [(0, 48, [0, 1]), (96, 112, [2])]
    # [0, 16) and [96, 112) lie 5 blocks apart
    apart = {("s", 0): [(3, 5, 0), (100, 110, 1)]}
    assert len(plan_reads(apart, lambda name: 16, merge_gap_blocks=4)) == 2
    merged = plan_reads(apart, lambda name: 16, merge_gap_blocks=5)
    assert [(p.t0, p.t1, p.requests) for p in merged] == [(0, 112, [0, 1])]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ranged_reads_on_local_disk_equal_zarr_reads(tmp_path, dtype):
    ranged, entries = _store(tmp_path, dtype)
    assert type(ranged.transport) is LocalTransport and ranged.transport.ranged_slice_reads
    requests = [(c.content_key, 3, min(21, t.shape[3])) for c, t in entries]
    requests.append((entries[1][0].content_key, 0, 40))
    by_ranges = ranged.read_slices(requests)
    kv = KvStore.open(ranged.store, ranged.kv_fp)
    kv.transport = ZarrLocal(kv.store)
    by_zarr = kv.read_slices(requests)
    for (ck, s, e), a, b in zip(requests, by_zarr, by_ranges, strict=True):
        tensor = next(t for c, t in entries if c.content_key == ck)
        assert torch.equal(a, tensor[..., s:e, :]) and torch.equal(b, a)
    # the ranged path fetches each slot's blocks in one range and reads no index (a shard
    # encode_shard wrote: where its blocks lie follows from the token counts)
    assert ranged.last_read.store_gets == 4 < kv.last_read.store_gets
    for chunk, tensor in entries:
        assert torch.equal(ranged.read_entry(chunk.content_key), tensor)
        assert torch.equal(kv.read_entry(chunk.content_key), tensor)


def test_ranged_reads_on_local_disk_find_a_flipped_byte(tmp_path):
    kv, entries = _store(tmp_path, "float32")
    ck = entries[0][0].content_key
    shard = parse_location(kv.manifest()[ck].location)[1]
    data = kv.root / shard / DATA_KEY
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # inside slot 0's first block
    data.write_bytes(bytes(raw))
    ranged = KvStore.open(kv.store, kv.kv_fp)
    with pytest.raises(CorruptKvEntry, match="block 0 fails its crc32c"):
        ranged.read_slices([(ck, 0, 4)])
    with pytest.raises(CorruptKvEntry, match="block 0 fails its crc32c"):
        ranged.read_entry(ck)


def test_transports_and_codecs_are_chosen_by_name(tmp_path):
    assert isinstance(transport_for(Store.at(tmp_path)), LocalTransport)
    assert ObjectTransport.ranged_slice_reads and ObjectTransport.remember_file_checks
    assert codec_named("none").storage_dtype("bfloat16").str == "<u2"
    assert codec_named("int4").storage_dtype("bfloat16").str == "|u1"
    assert codec_named("int2").storage_dtype("bfloat16").str == "|u1"
    assert codec_named("int2mix").storage_dtype("bfloat16").str == "|u1"
    known = r"\(int2, int2basis, int2mix, int4, int8, none\)"
    with pytest.raises(ValueError, match=rf"unknown KV codec 'int3' {known}"):
        codec_named("int3")
