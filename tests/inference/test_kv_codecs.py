"""Quantized KV codecs (issue 13, item 2; issue 36): ``kv_codec = none | int8 | int4 | int2 |
int2mix``.

The bounds stated in ``storage/kv/codecs.py``, held here against the float entry:

- per value: ``|x̂ − x| <= step / 2`` with ``step <= (max − min + ulp16(min)) / levels *
  (1 + 2**-10)`` over its group (keys: a channel over a block's tokens, before RoPE; values: a
  token's head vector); so over any set of whole tokens ``‖x̂ − x‖² <= Σ (step / 2)²``;
- per layer (whole entries): ``‖x̂ − x‖ / ‖x‖ <= QuantizedCodec.relative_error_bound(n)``, ``n``
  the group size (``block_tokens`` for keys, ``head_dim`` for values);
- ``int2`` (8-bit scales on float16 units, ranges clipped where that lowers a group's error,
  ``storage/kv/lowbit.py``): per group, a squared error no larger than ``n (step / 2)²`` with
  ``step <= (max − min + lo_unit) / 3 + step_unit`` (:func:`fine_step_bounds`), so per layer
  ``‖x̂ − x‖² <= Σ (step / 2)²`` as above; its per-layer relative error (no useful closed form
  at 2 bits) is held to a measured ceiling in ``tests/inference/test_kv_lowbit.py``;
- ``int2mix`` (``storage/kv/mixed.py``: keys per block ranked by range, a quarter of the
  channels 4-bit, half 2-bit, a quarter their mean; values 2-bit per channel over the block):
  each coded group as ``int2``'s with its own levels, a mean-only channel's squared error at
  most ``n ((max − min + lo_unit) / 2)²`` (:func:`mixed_step_bounds`: its "step" is its range);
  its measured ceiling in ``tests/inference/test_kv_mixed.py``;
- plus the model dtype's rounding, half an ulp per value and per cast: the dequantized value,
  then the rotation's output, and the float reference's own rotation (``ROUNDING``: 4 half-ulps
  of the dtype, relative to the layer's norm).

Oracles: transformers' own cache (``forward(prefix)``, then ``forward(chunk)`` on it) for
turborag contexts of whole chunks; the float (``none``) store's context for coinrag's nugget
slices (which ``tests/inference/test_assembly_oracle.py`` holds to transformers); the re-rotation
contract: a slice of a quantized store rotated to its new positions is the dequantized entry's
keys rotated there, bit for bit. On SmolLM2 (bfloat16, as ``kv_dtype = auto`` builds it
here) and tiny random Qwen2, Llama (also dynamic NTK, whose frequencies depend on the
forward's length) and Qwen3.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from store_fixtures import TINY_DIMS, sample_docs, save_tiny_llama, synthetic_chunk, write_corpus
from typer.testing import CliRunner

from coinrag.flows.cli import app
from coinrag.inference.context.assemble import KvSlice, assemble_context
from coinrag.inference.model.encode import from_cache, keys_to_position_zero
from coinrag.inference.model.loading import LoadedModel, tokenizer_fingerprint
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import RopeSpec, rerotate_keys
from coinrag.schemas.keys import fingerprint
from coinrag.schemas.settings import KV_CODECS, BuildSettings, SettingsError
from coinrag.schemas.tables import RunRow
from coinrag.storage.kv import (
    SHARD_OVERHEAD_BYTES,
    CorruptKvEntry,
    KvFingerprintMismatch,
    KvLayout,
    KvStore,
    codec_named,
    kv_fingerprint,
    parse_location,
)
from coinrag.storage.kv.layout import LAYOUT_VERSION
from coinrag.storage.kv.transport import LocalTransport
from coinrag.storage.store import Store
from coinrag.storage.tables import read_rows
from coinrag.tasks.chunk import chunk_document
from coinrag.tasks.kv import KvOptions, kv_stage

# unit roundoff (half an ulp, relative): 2**-p for p significand bits
HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ROUNDING = 4  # half-ulps per value (module docstring)
DOCS = Path("/usr/share/doc/python3.11/html/_sources/faq/general.rst.txt")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------- the bounds


def _pad_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``(..., T, D)`` -> ``(..., ceil(T / block), block, D)``, padded with the last token."""
    t = x.shape[-2]
    k = -(-t // block)
    if k * block > t:
        last = x[..., t - 1 : t, :].expand(*x.shape[:-2], k * block - t, x.shape[-1])
        x = torch.cat([x, last], dim=-2)
    return x.reshape(*x.shape[:-2], k, block, x.shape[-1])


def _step_bound(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """An upper bound on the step of a group with minimum ``lo`` and maximum ``hi``: the range
    widened by the float16 rounding of ``lo`` (down) and of the step (up)."""
    ulp = np.spacing(np.abs(lo.numpy().astype(np.float16))).astype(np.float64)
    return ((hi - lo) + torch.from_numpy(ulp)) / levels * (1 + 2**-10) + 2**-24


def step_bounds(pre: torch.Tensor, block: int, levels: int) -> torch.Tensor:
    """Per value of a float entry ``(L, 2, H, T, D)`` in the stored frame (keys at position 0),
    the bound on its group's step, computed independently of the codec's code."""
    x = pre.to(torch.float64)
    t = x.shape[3]
    keys = _pad_blocks(x[:, 0], block)  # (L, H, k, block, D): a channel over a block
    k_step = _step_bound(keys.amin(-2, keepdim=True), keys.amax(-2, keepdim=True), levels)
    k_step = k_step.expand_as(keys).reshape(*x[:, 0].shape[:2], -1, x.shape[4])[:, :, :t]
    values = x[:, 1]  # a token over head_dim
    v_step = _step_bound(values.amin(-1, keepdim=True), values.amax(-1, keepdim=True), levels)
    return torch.stack([k_step, v_step.expand_as(values)], dim=1)


def _fine_step_bound(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``int2``'s bound on the step of each group with minimum ``lo`` and maximum ``hi``
    ``(L, H, k, a, b)`` (one group per ``(a, b)`` of a block): its range widened by the block's
    ``lo_unit`` (``max |min| / 127``), over 3, plus the block's ``step_unit`` (``max step /
    255``); each unit rounded up to float16 (``* (1 + 2**-10)``, or a subnormal's ulp)."""
    units = (-2, -1)
    lo_unit = lo.abs().amax(units, keepdim=True) / 127 * (1 + 2**-10) + 2**-24
    steps = (hi - lo + lo_unit) / 3 * (1 + 2**-20)
    step_unit = steps.amax(units, keepdim=True) / 255 * (1 + 2**-10) + 2**-24
    return steps + step_unit


def mixed_step_bounds(pre: torch.Tensor, block: int, counts: tuple[int, int] | None = None):
    """:func:`step_bounds` of ``int2mix``: per block, layer and head the key channels ranked by
    range (float32, as the codec ranks its input; largest first, ties by channel), the widest
    quarter bounded as 4-bit groups, the next half as 2-bit ones, the rest by ``range +
    lo_unit`` (the mean's group); ``lo_unit`` bounded by the largest ``|min|`` or ``|max|`` of
    the head's channels (a mean lies between); values as ``int2``'s keys (per channel)."""
    x = pre.to(torch.float64)
    t, dim = x.shape[3], x.shape[4]
    keys32 = _pad_blocks(pre[:, 0].to(torch.float32), block)  # (L, H, k, block, D)
    ranges = keys32.amax(-2) - keys32.amin(-2)
    order = torch.sort(ranges, dim=-1, descending=True, stable=True).indices
    rank = order.argsort(-1)
    wide, mid = counts or (dim // 4, dim // 2)  # the codec's key_counts
    levels = torch.where(rank < wide, 15.0, torch.where(rank < wide + mid, 3.0, 0.0))
    levels = levels.to(torch.float64).unsqueeze(-2)
    keys = _pad_blocks(x[:, 0], block)
    lo, hi = keys.amin(-2, keepdim=True), keys.amax(-2, keepdim=True)
    units = (-2, -1)
    lo_unit = torch.maximum(lo.abs(), hi.abs()).amax(units, keepdim=True) / 127
    lo_unit = lo_unit * (1 + 2**-10) + 2**-24
    coded = levels > 0
    coded_steps = (hi - lo + lo_unit) / torch.where(coded, levels, 1.0) * (1 + 2**-20)
    step_unit = torch.where(coded, coded_steps, 0).amax(units, keepdim=True) / 255
    step_unit = step_unit * (1 + 2**-10) + 2**-24
    k_step = torch.where(coded, coded_steps + step_unit, hi - lo + lo_unit)
    values = _pad_blocks(x[:, 1], block)
    v_step = _fine_step_bound(values.amin(-2, keepdim=True), values.amax(-2, keepdim=True))
    out = []
    for half, steps in ((keys, k_step), (values, v_step)):
        steps = steps.expand_as(half)
        out.append(steps.reshape(*x[:, 0].shape[:2], -1, dim)[:, :, :t])
    return torch.stack(out, dim=1)


def fine_step_bounds(pre: torch.Tensor, block: int) -> torch.Tensor:
    """:func:`step_bounds` of ``int2`` (:func:`_fine_step_bound` per group)."""
    x = pre.to(torch.float64)
    t = x.shape[3]
    out = []
    for half, dim in ((0, -2), (1, -1)):  # keys: a channel over a block; values: a token
        blocks = _pad_blocks(x[:, half], block)  # (L, H, k, block, D)
        lo, hi = blocks.amin(dim, keepdim=True), blocks.amax(dim, keepdim=True)
        steps = _fine_step_bound(lo, hi).expand_as(blocks)
        out.append(steps.reshape(*x[:, half].shape[:2], -1, x.shape[4])[:, :, :t])
    return torch.stack(out, dim=1)


def codec_step_bounds(pre: torch.Tensor, block: int, codec: str) -> torch.Tensor:
    """The step bound of each value for ``codec`` (int8 / int4: float16 scales; int2: 8-bit
    scales; int2mix: 8-bit scales, key channels of three widths)."""
    if codec == "int2":
        return fine_step_bounds(pre, block)
    if codec == "int2mix":
        return mixed_step_bounds(pre, block)
    return step_bounds(pre, block, codec_named(codec).levels)


def _round_trip(kv: torch.Tensor, layout: KvLayout) -> torch.Tensor:
    codec = layout.codec
    return codec.decode(codec.encode(kv, layout), layout)[:, :, :, : kv.shape[3]]


def _layer_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(‖got − ref‖, ‖ref‖)`` per layer and kind ``(L, 2)``."""
    diff = (got.to(torch.float64) - ref.to(torch.float64)).flatten(2).norm(dim=2)
    return diff, ref.to(torch.float64).flatten(2).norm(dim=2)


def _synthetic(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Keys with offset channels (KIVI's outliers: large, one-signed, narrow) and values with
    a few large dims: what per-channel / per-token quantization is for."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(3, 2, 2, n, 8, generator=g)
    kv[:, 0, :, :, 3] = 12.0 + 0.3 * kv[:, 0, :, :, 3]  # an outlier key channel
    kv[:, 1, :, :, 5] *= 20.0  # a large value dim
    return kv.to(dtype)


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "int2mix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [4, 16])
def test_every_value_within_half_a_step_and_each_layer_within_the_stated_bound(
    name, dtype, block
) -> None:
    codec = codec_named(name)
    layout = KvLayout("m", "p", 3, 2, 8, str(dtype).removeprefix("torch."), block, 4, name)
    kv = _synthetic(37, dtype)  # 37 tokens: a partial last block
    got = _round_trip(kv, layout)
    assert got.dtype == dtype and got.shape == kv.shape
    x = kv.to(torch.float64)
    half_step = codec_step_bounds(kv.float(), block, name) / 2
    bound = half_step + HALF_ULP[dtype] * (x.abs() + half_step)
    within = (got.to(torch.float64) - x).abs() <= bound
    if name in ("int2", "int2mix"):  # a clipped range leaves its extremes beyond half a step
        assert within.double().mean() > 0.5
    else:
        assert within.all()
    diff, norm = _layer_errors(got, kv)
    rel = diff / norm
    layer_bound = (half_step.pow(2).flatten(2).sum(2).sqrt() / norm).max()
    assert (rel <= layer_bound * (1 + 2**-10) + HALF_ULP[dtype]).all()
    rounding = HALF_ULP[dtype]
    assert (rel[:, 0] <= codec.relative_error_bound(block) + rounding).all(), rel[:, 0]
    value_group = block if name == "int2mix" else 8  # int2mix: values per channel
    assert (rel[:, 1] <= codec.relative_error_bound(value_group) + rounding).all(), rel[:, 1]
    assert rel.max() > 0  # lossy: the test can fail


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_writes_the_float32_dequantization_rounded_once(name, dtype) -> None:
    """The decoder writes each half straight into the result: the same values as
    dequantizing both halves in float32, stacking, permuting and rounding the whole once."""
    from coinrag.storage.kv.quantize import dequantize

    codec = codec_named(name)
    layout = KvLayout("m", "p", 3, 2, 8, str(dtype).removeprefix("torch."), 4, 4, name)
    payload = codec.encode(_synthetic(37, dtype), layout)
    got = codec.decode(payload, layout)
    raw = torch.from_numpy(payload.copy())
    k, (lay, heads, block, dim) = raw.shape[0], (3, 2, 4, 8)
    cut, at = {}, 0
    for section, n in codec._sections(layout):
        cut[section], at = raw[:, at : at + n], at + n

    def f16(section, shape):
        return cut[section].contiguous().view(torch.float16).reshape(shape)

    def codes(section):
        return codec._unpack(cut[section].reshape(k, lay, heads, block, dim * codec.bits // 8), dim)

    keys = dequantize(
        codes("k_codes"),
        f16("k_lo", (k, lay, heads, 1, dim)),
        f16("k_step", (k, lay, heads, 1, dim)),
    )
    values = dequantize(
        codes("v_codes"),
        f16("v_lo", (k, lay, heads, block, 1)),
        f16("v_step", (k, lay, heads, block, 1)),
    )
    want = torch.stack([keys, values], dim=2).permute(1, 2, 3, 0, 4, 5)
    want = want.reshape(lay, 2, heads, k * block, dim).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("name", ["none", "int8", "int4", "int2", "int2mix"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [4, 16])
def test_decode_tokens_writes_the_decoded_tokens_where_asked(name, dtype, block) -> None:
    """``decode_tokens``: each picked token range of each read written at its place in
    ``out`` (back to back, with gaps, out of order, inside one block, across blocks, to the
    padded end, empty), the same bits as :meth:`decode` then a cut."""
    codec = codec_named(name)
    layout = KvLayout("m", "p", 3, 2, 8, str(dtype).removeprefix("torch."), block, 4, name)
    reads = [codec.encode(_synthetic(n, dtype), layout) for n in (37, 16, 5)]
    decoded = [codec.decode(r, layout) for r in reads]
    picks_back_to_back = [(0, 3, 30), (1, 0, 16), (2, 1, 4), (0, 30, 37), (1, 7, 7)]
    for picks, gap in ((picks_back_to_back, 0), (picks_back_to_back[::-1], 3)):
        placed, at = [], 2  # out starts with 2 tokens of something else (C_p, say)
        for i, s, e in picks:
            placed.append((i, s, e, at))
            at += e - s + gap
        out = torch.full((3, 2, 2, at, 8), 7.0, dtype=dtype)
        codec.decode_tokens(reads, layout, placed, out)
        for i, s, e, a in placed:
            assert torch.equal(out[..., a : a + e - s, :], decoded[i][..., s:e, :]), (i, s, e)
        assert (out[..., :2, :] == 7.0).all()  # nothing written outside the picks
        if gap:
            a, n = placed[0][3], placed[0][2] - placed[0][1]
            assert (out[..., a + n : a + n + gap, :] == 7.0).all()


def test_the_bytes_each_codec_stores() -> None:
    """SmolLM2's dims (30 layers, 3 KV heads, head dim 64), 16-token blocks: int8 0.578 and
    int4 0.328 of the raw bfloat16 bytes (codes, plus a float16 minimum and step per key
    channel per block and per value token)."""
    raw = KvLayout("m", "p", 30, 3, 64, "bfloat16")
    assert raw.block_tokens == 4 and raw.token_bytes == raw.raw_token_bytes == 23_040
    for name, ratio, block in (("int8", 0.578125, 16), ("int4", 0.328125, 16)):
        lay = KvLayout("m", "p", 30, 3, 64, "bfloat16", kv_codec=name)
        assert lay.block_tokens == block
        assert lay.entry_bytes(512) / raw.entry_bytes(512) == ratio
        assert lay.needed_bytes(12) == 12 * lay.block_bytes // block
    # int2 in 64-token blocks: 2-bit codes, one byte of minimum and one of step per key
    # channel (over 64 tokens) and per value token, float16 units per layer and head
    lay = KvLayout("m", "p", 30, 3, 64, "bfloat16", kv_codec="int2")
    assert lay.block_tokens == 64 and lay.block_bytes == 90 * (2 * 64 * 64 // 4 + 4 * 64 + 8)
    assert lay.entry_bytes(512) / raw.entry_bytes(512) == 0.14111328125 <= 0.15
    # int2mix: the same codes and scales (a step and minimum per value channel instead of per
    # value token), plus 2 bits of width per key channel
    lay = KvLayout("m", "p", 30, 3, 64, "bfloat16", kv_codec="int2mix")
    assert lay.block_tokens == 64 and lay.block_bytes == 90 * (2 * 64 * 64 // 4 + 64 // 4 + 256 + 8)
    assert lay.entry_bytes(512) / raw.entry_bytes(512) == 0.14208984375 <= 0.15


def test_kv_fp_is_unchanged_for_none_and_names_a_lossy_codec_and_its_block() -> None:
    legacy = fingerprint("kv", {"model_fp": "m", "prefix_sha": "p", "layout_version": 1})
    assert LAYOUT_VERSION == 1
    assert KvLayout("m", "p", 2, 2, 8, "float32").kv_fp == legacy == kv_fingerprint("m", "p")
    assert KvLayout("m", "p", 2, 2, 8, "float32", block_tokens=16).kv_fp == legacy
    fps = {
        KvLayout("m", "p", 2, 2, 8, "float32", kv_codec=c, block_tokens=b).kv_fp
        for c, b in (("int8", 16), ("int4", 16), ("int4", 8))
    }
    assert len(fps) == 3 and legacy not in fps
    assert set(KV_CODECS) == {"none", "int8", "int4", "int2", "int2mix", "int2basis"}
    with pytest.raises(ValueError, match="unknown KV codec 'int3'"):
        KvLayout("m", "p", 2, 2, 8, "float32", kv_codec="int3")
    known = "none, int8, int4, int2, int2mix, int2basis"
    with pytest.raises(SettingsError, match=f"kv_codec 'int3' is not one of {known}"):
        BuildSettings(kv_codec="int3").validate()


# ---------------------------------------------------------------------------- the store


class ZarrLocal(LocalTransport):
    """Local disk read through Zarr's own reader (it returns the blocks' payloads)."""

    ranged_slice_reads = False


LENGTHS = [37, 40, 5, 33, 16, 1]


def _quantized_store(
    tmp_path: Path, name: str, codec: str = "int4", **options
) -> tuple[KvStore, list]:
    layout = KvLayout(
        model_fp="model-x",
        prefix_sha="ps-x",
        layers=3,
        kv_heads=2,
        head_dim=8,
        dtype="bfloat16",
        block_tokens=8,
        slots_per_shard=3,
        kv_codec=codec,
    )
    entries = [
        (synthetic_chunk(i, n), _synthetic(n, torch.float32, i)) for i, n in enumerate(LENGTHS)
    ]
    kv = KvStore.create(Store.at(tmp_path / name).init(), layout, **options)
    kv.write_entries(entries, "run-q")
    return kv, entries


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "int2mix"])
def test_a_quantized_store_reads_what_its_codec_decodes_on_every_path(tmp_path, codec) -> None:
    kv, entries = _quantized_store(tmp_path, "direct", codec)
    zarr_written, _ = _quantized_store(tmp_path, "zarr", codec, encoder="zarr")
    through_zarr = KvStore.open(kv.store, kv.kv_fp)
    through_zarr.transport = ZarrLocal(kv.store)
    assert kv.layout.keys_at_zero and kv.layout.storage_dtype == np.uint8
    requests = []
    for chunk, tensor in entries:
        expected = _round_trip(tensor, kv.layout)
        for reader in (kv, through_zarr, zarr_written):
            got = reader.read_entry(chunk.content_key)
            assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
        n = chunk.n_tokens
        spans = sorted({(0, n), (n - 1, n), (3, 5), (7, 9), (2, n)})
        requests += [(chunk.content_key, s, e) for s, e in spans if 0 <= s <= e <= n]
    for reader in (kv, through_zarr, zarr_written):
        for (ck, s, e), got in zip(requests, reader.read_slices(requests), strict=True):
            assert torch.equal(got, kv.read_entry(ck)[:, :, :, s:e]), (ck, s, e)
    # a shard encode_shard wrote: one byte range per read, no index read; its bytes needed are
    # the tokens' share of the stored bytes (codes and scales)
    kv.read_slices([(entries[1][0].content_key, 3, 30)])
    stats = kv.last_read
    assert stats.store_gets == 1
    assert stats.bytes_needed == kv.layout.needed_bytes(27)
    assert stats.bytes_read == 4 * (kv.layout.block_bytes + 4)  # blocks [0, 32): 4 of 8 tokens
    # written bytes are what the projection says
    projected = kv.layout.disk_bytes(LENGTHS[:3]) + kv.layout.disk_bytes(LENGTHS[3:])
    assert kv.write_stats.disk_bytes == projected - 2 * SHARD_OVERHEAD_BYTES
    assert kv.entry_problems(kv.manifest(), "crc32c") == {}
    assert kv.entry_problems(kv.manifest(), "sha256") == {}


@pytest.mark.parametrize("codec", ["int4", "int2", "int2mix"])
def test_a_flipped_byte_in_a_quantized_block_is_found_by_every_check(tmp_path, codec) -> None:
    kv, entries = _quantized_store(tmp_path, "s", codec)
    ck = entries[0][0].content_key
    shard = kv._shard(parse_location(kv.manifest()[ck].location)[1])
    data = kv.root / shard.name / shard.data_key
    assert shard.data_key == "c/0/0/0"  # the quantized array has three axes
    raw = bytearray(data.read_bytes())
    raw[kv.layout.block_bytes + 4 + 100] ^= 0x01  # slot 0, block 1
    data.write_bytes(bytes(raw))
    fresh = KvStore.open(kv.store, kv.kv_fp)
    with pytest.raises(CorruptKvEntry, match="block 1 fails its crc32c"):
        fresh.read_slices([(ck, 9, 10)])
    assert fresh.read_slices([(ck, 0, 8)])[0].shape[3] == 8  # block 0 still checks out
    with pytest.raises(CorruptKvEntry, match="block 1 fails its crc32c"):
        fresh.read_entry(ck)
    zarr_reader = KvStore.open(kv.store, kv.kv_fp)
    zarr_reader.transport = ZarrLocal(kv.store)
    with pytest.raises(CorruptKvEntry, match="block 1 fails its crc32c"):
        zarr_reader.read_entry(ck)
    assert set(fresh.entry_problems(fresh.manifest(), "crc32c")) == {ck}
    assert set(fresh.entry_problems(fresh.manifest(), "sha256")) == {ck}


def test_gc_moves_quantized_entries_bit_for_bit(tmp_path) -> None:
    kv, entries = _quantized_store(tmp_path, "s")
    before = {c.content_key: kv.read_stored(c.content_key) for c, _ in entries}
    tensors = {c.content_key: kv.read_entry(c.content_key) for c, _ in entries}
    live = {c.content_key for c, _ in entries[1:]}  # slot 0 of the first shard dies
    plan = kv.reclaim(live, "run-gc", dry_run=True)
    done = kv.reclaim(live, "run-gc")
    assert done.entries_moved == plan.entries_moved == 2 and done.entries_corrupt == 0
    assert done.bytes_written == plan.bytes_written  # the dry run's projection, exactly
    fresh = KvStore.open(kv.store, kv.kv_fp)
    assert set(fresh.manifest()) == live
    for ck in live:
        assert np.array_equal(fresh.read_stored(ck), before[ck])
        assert torch.equal(fresh.read_entry(ck), tensors[ck])


def test_a_store_opened_with_another_codec_is_refused(tmp_path) -> None:
    kv, _ = _quantized_store(tmp_path, "s", "int8")
    stored = KvStore.open(kv.store, kv.kv_fp).layout  # read back from the group's attributes
    assert stored.kv_fp == kv.kv_fp and (stored.kv_codec, stored.block_tokens) == ("int8", 8)
    as_int4 = dataclasses.replace(kv.layout, kv_codec="int4")
    with pytest.raises(KvFingerprintMismatch):
        KvStore.open(kv.store, kv.kv_fp, as_int4)
    with pytest.raises(ValueError, match="stored values of ch-0"):
        kv.write_stored([(synthetic_chunk(0, 37), np.zeros(7, dtype=np.uint8))], "r")


# ---------------------------------------------------------------------------- models


def _tiny(arch: str, tokenizer, **config) -> LoadedModel:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    cfg = config_cls(vocab_size=len(tokenizer), **{**TINY_DIMS, **config})
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32).eval()
    model_fp = fingerprint("model", {"test": arch, **{k: str(v) for k, v in config.items()}})
    return LoadedModel(model, tokenizer, Path("."), model_fp, tokenizer_fingerprint(tokenizer))


MODELS = {
    "qwen2": dict(max_position_embeddings=4096),
    "llama": dict(max_position_embeddings=4096),
    "qwen3": dict(max_position_embeddings=4096, head_dim=16),
    # dynamic NTK: chunk forwards (prefix + 50 or 30 tokens) on either side of the threshold
    "llama-dynamic": dict(
        max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ),
}


@pytest.fixture(scope="module", params=[*MODELS, "smollm2"])
def model(request, smollm2_tokenizer) -> LoadedModel:
    if request.param == "smollm2":
        from coinrag.inference.model.loading import load_model

        return load_model(None, dtype="bfloat16")
    arch = request.param.split("-")[0]
    return _tiny(arch, smollm2_tokenizer, **MODELS[request.param])


def codec_chunks(tok) -> list:
    """Three chunks of a FAQ page by ``tok``: two of 50 tokens and one cut to 30."""
    text = DOCS.read_text(encoding="utf-8") if DOCS.is_file() else "Python is a language. " * 80
    rows = chunk_document(
        tok, "d", "dv", text, tokenizer_fp=tokenizer_fingerprint(tok), chunk_size=50, run_id="r"
    )
    chunks = rows[:2] + [dataclasses.replace(rows[2], token_ids=rows[2].token_ids[:30])]
    chunks[2] = dataclasses.replace(chunks[2], n_tokens=30, content_key="ck-short")
    return chunks


@pytest.fixture(scope="module")
def stores(model, tmp_path_factory):
    """The same chunks stored by ``model`` with each codec: ``{codec: (KvStore, chunks)}``."""
    chunks = codec_chunks(model.tokenizer)
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    out = {}
    root = tmp_path_factory.mktemp("codecs")
    for codec in KV_CODECS:
        store = Store.at(root / codec).init()
        counts = kv_stage(
            store, chunks, model, prompt, "run-c", KvOptions(batch_size=1, kv_codec=codec)
        )
        assert counts.computed == 3
        out[codec] = (KvStore.open(store, counts.kv_fp), chunks)
    return out


def _own_cache(model: LoadedModel, prefix: list[int], chunk: list[int]) -> torch.Tensor:
    """transformers' own cache of ``forward(prefix)`` then ``forward(chunk)`` on that cache:
    ``(L, 2, H, |p| + n, D)`` (what the KV stage stores with batch size 1, bit for bit:
    ``tests/inference/test_kv_store.py``)."""
    from coinrag.inference.rope import reset_rotary

    reset_rotary(model.model)
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([prefix]), use_cache=True)
        reset_rotary(model.model)
        out = model.model(
            input_ids=torch.tensor([chunk]), past_key_values=out.past_key_values, use_cache=True
        )
    return from_cache(out.past_key_values)


def _within(got, ref, bound_sq, dtype) -> None:
    """Per layer and kind: ``‖got − ref‖ <= sqrt(Σ (step / 2)²) + ROUNDING half-ulps``."""
    diff, norm = _layer_errors(got, ref)
    allowed = bound_sq.sqrt() + ROUNDING * HALF_ULP[dtype] * norm
    assert (diff <= allowed).all(), (diff / norm).max(dim=0)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "int2mix"])
def test_turborag_contexts_of_a_quantized_store_against_the_models_own_cache(
    model, stores, codec
) -> None:
    """Whole chunks at their own positions (turborag): the assembled context against
    ``forward(prefix + chunk)``'s cache, per layer within the stated bound; the relative
    error per layer within ``relative_error_bound`` too."""
    kv, chunks = stores[codec]
    spec = RopeSpec.from_config(model.model.config)
    prompt = RagPrompt.for_tokenizer(model.tokenizer)
    prefix_kv, _ = kv.read_prefix()
    p = prompt.n_prefix
    dtype = prefix_kv.dtype
    c = codec_named(codec)
    for chunk in chunks:
        n = chunk.n_tokens
        (block,) = kv.read_slices([(chunk.content_key, 0, n)])
        ctx = assemble_context(prefix_kv, [KvSlice(block, p, p + n, at_zero=True)], spec)
        own = _own_cache(model, list(prompt.prefix_ids), list(chunk.token_ids))
        assert ctx.shape == own.shape
        # the bound: from the model's own entry in the stored frame (keys at position 0)
        pre = keys_to_position_zero(own[..., p:, :], spec, p)
        steps = codec_step_bounds(pre, kv.layout.block_tokens, codec)
        _within(ctx[..., p:, :], own[..., p:, :], (steps / 2).pow(2).flatten(2).sum(2), dtype)
        diff, norm = _layer_errors(ctx[..., p:, :], own[..., p:, :])
        rel = diff / norm
        rounding = ROUNDING * HALF_ULP[dtype]
        assert (rel[:, 0] <= c.relative_error_bound(kv.layout.block_tokens) + rounding).all()
        value_group = kv.layout.block_tokens if codec == "int2mix" else kv.layout.head_dim
        assert (rel[:, 1] <= c.relative_error_bound(value_group) + rounding).all()


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "int2mix"])
def test_coinrag_contexts_of_a_quantized_store_against_the_float_store(
    model, stores, codec
) -> None:
    """Nugget slices from three chunks, assembled at new contiguous positions: against the
    same slices of the float (``none``) store, per layer within the stated bound; and the
    re-rotation contract: each slice's keys are the dequantized entry's keys, rotated from
    position 0 to their new positions, bit for bit."""
    kv, chunks = stores[codec]
    ref, _ = stores["none"]
    spec = RopeSpec.from_config(model.model.config)
    p = RagPrompt.for_tokenizer(model.tokenizer).n_prefix
    spans = [(2, 5, 19), (0, 30, 42), (1, 0, 7), (0, 3, 13), (2, 21, 30)]
    requests = [(chunks[i].content_key, s, e) for i, s, e in spans]
    prefix_kv, _ = ref.read_prefix()
    total = p + sum(e - s for _, s, e in spans)
    contexts = {}
    bound_sq = torch.zeros(kv.layout.layers, 2, dtype=torch.float64)
    for name, store in (("q", kv), ("f", ref)):
        blocks = store.read_slices(requests)
        slices = [
            KvSlice(b, p + s, p + chunks[i].n_tokens, store.layout.keys_at_zero)
            for b, (i, s, _) in zip(blocks, spans, strict=True)
        ]
        contexts[name] = assemble_context(prefix_kv, slices, spec, new_seq_len=total + 4)
    start = p
    for i, s, e in spans:
        entry = ref.read_entry(chunks[i].content_key)
        pre = keys_to_position_zero(entry, spec, p)  # the float entry in the stored frame
        steps = codec_step_bounds(pre, kv.layout.block_tokens, codec)[:, :, :, s:e]
        bound_sq += (steps / 2).pow(2).flatten(2).sum(2)
        # the contract: rotate the dequantized entry's keys from 0 to the new positions
        deq = kv.read_entry(chunks[i].content_key)[:, 0, :, s:e]
        n = e - s
        expected = rerotate_keys(
            deq,
            torch.zeros(n, dtype=torch.long),
            torch.arange(start, start + n),
            spec,
            old_seq_len=p + chunks[i].n_tokens,
            new_seq_len=total + 4,
        )
        assert torch.equal(contexts["q"][:, 0, :, start : start + n], expected)
        values = kv.read_entry(chunks[i].content_key)[:, 1, :, s:e]
        assert torch.equal(contexts["q"][:, 1, :, start : start + n], values)
        start += n
    _within(contexts["q"], contexts["f"], bound_sq, prefix_kv.dtype)


# ---------------------------------------------------------------------------- end to end


@pytest.mark.heavy  # over 10 s: the second tier
@pytest.mark.usefixtures("prefect_harness")
def test_build_query_rebuild_and_gc_with_int4(tmp_path, smollm2_tokenizer, sample_corpus) -> None:
    source = write_corpus(tmp_path / "docs.jsonl", sample_docs(sample_corpus, 3))
    model = save_tiny_llama(tmp_path / "llama", smollm2_tokenizer, 5)
    stores = {codec: tmp_path / codec for codec in ("none", "int4")}
    config = tmp_path / "int4.toml"
    config.write_text('[build]\nkv_codec = "int4"\n')
    for codec, store in stores.items():
        args = ["--config", str(config)] if codec == "int4" else []  # the TOML, or the default
        result = CliRunner().invoke(
            app,
            ["build", str(source), "--store", str(store), "--extractor", "rules", "--model"]
            + [str(model), "--chunk-size", "64", "--kv-dtype", "bfloat16", *args],
        )
        assert result.exit_code == 0, result.output
    fps, summaries = {}, {}
    for codec, store in stores.items():
        (run,) = [r for r in read_rows(Store.at(store), RunRow) if r.status == "completed"]
        params, fps[codec] = json.loads(run.parameters_json), json.loads(run.fingerprints_json)
        summaries[codec] = json.loads(run.counts_json)
        toml = tomllib.loads((store / "coinrag.toml").read_text())["build"]
        assert params["kv_codec"] == toml["kv_codec"] == codec
        kv = KvStore.open(Store.at(store), fps[codec]["kv_fp"])
        assert kv.layout.kv_codec == codec and kv.layout.keys_at_zero == (codec == "int4")
    assert fps["int4"]["kv_fp"] != fps["none"]["kv_fp"]
    assert fps["int4"]["model_fp"] == fps["none"]["model_fp"]
    ratio = summaries["int4"]["kv_disk_bytes"] / summaries["none"]["kv_disk_bytes"]
    assert 0.25 < ratio < 0.45, ratio  # tiny dims: more scales per value than SmolLM2's 0.33
    for method in ("turborag", "coinrag"):  # answered from the quantized KV
        result = CliRunner().invoke(
            app,
            ["query", "Who directed 2001: A Space Odyssey?", "--store", str(stores["int4"])]
            + ["--method", method, "--kc", "2", "--k", "4", "--max-new-tokens", "4", "--json"],
        )
        assert result.exit_code == 0, result.output
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        assert answer["evidence"] and answer["timings"]["kv_load"] > 0
    # an unchanged rebuild reuses every entry (checked at crc32c); gc finds nothing to do
    store = stores["int4"]
    result = CliRunner().invoke(
        app,
        ["build", str(source), "--store", str(store), "--extractor", "rules", "--model"]
        + [str(model), "--chunk-size", "64", "--kv-dtype", "bfloat16", "--kv-codec", "int4"],
    )
    assert result.exit_code == 0, result.output
    runs = [r for r in read_rows(Store.at(store), RunRow) if r.status == "completed"]
    again = json.loads(max(runs, key=lambda r: r.started_at).counts_json)
    assert again["kv_computed"] == 0 and again["kv_reused"] == summaries["int4"]["kv_computed"]
    result = CliRunner().invoke(app, ["gc", "--store", str(store)])
    assert result.exit_code == 0, result.output
    bad = CliRunner().invoke(app, ["build", str(source), "--store", str(store), "--kv-codec", "q"])
    known = "none, int8, int4, int2, int2mix, int2basis"
    assert bad.exit_code == 2 and f"kv_codec 'q' is not one of {known}" in bad.output
