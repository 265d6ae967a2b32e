"""A shard file: the Zarr v3 ``sharding_indexed`` byte format as coinrag writes it, encoded and
checked here.

A shard array (``(slots, layers, 2, kv_heads, width, head_dim)`` for the identity codec,
``(slots, width / block_tokens, payload_bytes)`` uint8 for a quantized one; the layout:
``storage/kv/layout.py``) has exactly one Zarr shard (``shards`` = the whole array), so it is one
data file, ``c/0/0/0/0/0/0`` (``c/0/0/0`` for a quantized codec's three axes: the "default"
chunk key encoding of chunk (0, ...)), plus its ``zarr.json``. An inner chunk is one slot and
one block of ``block_tokens`` tokens over every layer and head: ``(1, layers, 2, kv_heads,
block_tokens, head_dim)``, or ``(1, 1, payload_bytes)``.

- Every inner chunk carries a crc32c (``codecs=[bytes, crc32c]`` inside the sharding codec), so
  a flipped byte is detected on a *partial* read too; the shard index (``(offset, nbytes)`` per
  inner chunk, 16 bytes each, at the end of the file) has its own crc32c, so a truncated file is
  detected as well. The shard's attributes record its files' sizes (truncation or loss is found
  with a ``stat``, before any read).
- Inner chunks that would hold only padding are not stored (index entry ``(2**64-1,
  2**64-1)``, read as zeros), as Zarr does for chunks equal to the fill value.
- A shard written by :func:`encode_shard` (attribute ``encoder`` = ``"direct"``) has its inner
  chunks back to back, slot after slot, so readers compute where a block lies from the token
  counts (:meth:`ShardMeta.computed_index`) and read no index at all; a shard Zarr wrote has
  its index read once per reader.

:func:`encode_shard` writes this format in one strided copy, byte for byte what Zarr's own
writer produces up to the order of inner chunks (Zarr reads the files; ``encoder="zarr"`` writes
through Zarr instead, the reference path). :func:`verify_slots` checks a shard's blocks by their
crc32c without Zarr.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c  # zarr's crc32c codec uses it (a dependency of zarr)
import numpy as np
import zarr
from zarr.codecs import Crc32cCodec
from zarr.storage import LocalStore

from coinrag.storage.kv.errors import KvError, read_problem
from coinrag.storage.kv.layout import ATTR, KvLayout
from coinrag.storage.kv.transport import LocalFiles, ScratchBuffers, round_up

DATA_KEY = "c/0/0/0/0/0/0"  # the one data file of a shard array of the identity codec


def data_key(ndim: int) -> str:
    """The one data file of a shard array of ``ndim`` axes: ``"c/0/0/0"`` for 3."""
    return "/".join(["c"] + ["0"] * ndim)


EMPTY = np.uint64(2**64 - 1)  # index entry of an inner chunk that is not stored
_DIRECT_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
# uint8 values (the quantized codecs' payloads) have no byte order: Zarr writes no endian
_DIRECT_BYTE_CODECS = [{"name": "bytes"}, {"name": "crc32c"}]


# ---------------------------------------------------------------------------- encoding


def encode_shard(
    entries: Sequence[np.ndarray],
    g: KvLayout,
    width: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The bytes of one shard file, per the Zarr v3 ``sharding_indexed`` codec as configured
    here (inner codecs ``[bytes(little), crc32c]``, index codecs ``[bytes(little), crc32c]``,
    index at the end).

    ``entries`` are the entries' stored values (``g.codec.view``: the identity codec's
    ``(layers, 2, kv_heads, n_i, head_dim)`` in the stored dtype, any strides; a quantized
    codec's ``(blocks, payload_bytes)`` uint8); the shard array is ``g.codec.array_shape(g,
    len(entries), width)`` with one inner chunk per slot and block of ``g.block_tokens``
    tokens. Each inner chunk is its C-order payload followed by the payload's crc32c
    (little-endian uint32); inner chunks of an entry are written back to back, entry after
    entry; inner chunks that would hold only padding are not stored (index entry ``(2**64-1,
    2**64-1)``, read as zeros), as Zarr does for chunks equal to the fill value. The index is
    ``(slots, width / block)`` uint64 ``(offset, nbytes)`` in C order (its array shape has the
    array's other axes as 1), followed by its crc32c.

    Why not ``array[...] = data``: Zarr's writer makes several passes over the data (gathering
    each inner chunk, comparing it with the fill value, appending the checksum, concatenating
    the shard): several times the CPU of this single strided copy into the final file buffer
    (measured here, with the write and its verification: ~10 vs ~40 ms per 11.8 MB bfloat16
    entry); the KV stage writes every token it computes. Zarr itself reads these files (tests
    check that they decode to the entries, and that a one-slot shard is byte-identical to what
    Zarr writes).

    ``out``: a uint8 buffer to encode into (reused across shards: fresh memory costs a page
    fault per page on first touch); the result is a view of it.
    """
    codec = g.codec
    block = g.block_tokens
    payload = codec.payload_bytes(g)
    row = payload + 4
    rows = [codec.block_count(e, g) for e in entries]
    index = np.full((len(entries), width // block, 2), EMPTY, dtype="<u8")
    body = sum(rows) * row
    size = body + index.nbytes + 4
    if out is None or out.nbytes < size:
        out = np.empty(size, dtype=np.uint8)
    out = out[:size]
    start = 0
    for i, entry in enumerate(entries):
        codec.write_blocks(entry, g, out, start, row)
        for j in range(rows[i]):
            at = start + j * row
            crc = google_crc32c.value(out[at : at + payload])
            out[at + payload : at + row] = np.array([crc], dtype="<u4").view(np.uint8)
            index[i, j] = (at, row)
        start += rows[i] * row
    index_bytes = index.view(np.uint8).reshape(-1)
    out[body : body + index.nbytes] = index_bytes
    crc = google_crc32c.value(index_bytes)
    out[body + index.nbytes :] = np.array([crc], dtype="<u4").view(np.uint8)
    return out


def shard_size(g: KvLayout, tokens: Sequence[int], width: int) -> int:
    """Bytes of the file :func:`encode_shard` makes for entries of these token counts."""
    block = g.block_tokens
    blocks = sum(-(-int(t) // block) for t in tokens)
    return blocks * (g.block_bytes + 4) + len(tokens) * (width // block) * 16 + 4


def direct_index(g: KvLayout, tokens: Sequence[int], width: int) -> np.ndarray:
    """The index :func:`encode_shard` writes for entries of these token counts, computed:
    ``(slots, width / block, 2)`` uint64 ``(offset, nbytes)``, ``EMPTY`` for blocks not
    stored. A reader of a shard written by ``encode_shard`` (its ``encoder`` attribute is
    ``"direct"``) needs no index read at all."""
    block = g.block_tokens
    row = g.block_bytes + 4
    index = np.full((len(tokens), width // block, 2), EMPTY, dtype="<u8")
    at = 0
    for slot, n in enumerate(tokens):
        k = -(-int(n) // block)
        index[slot, :k, 0] = at + row * np.arange(k, dtype=np.uint64)
        index[slot, :k, 1] = row
        at += k * row
    return index


def index_bytes(slots: int, width: int, block: int) -> int:
    """Bytes of a shard's index: uint64 ``(offset, nbytes)`` per slot and block, then a crc32c."""
    return slots * (width // block) * 16 + 4


def parse_index(raw: Any, slots: int, width: int, block: int) -> np.ndarray | None:
    """A shard index read from the end of its file -> ``(slots, width / block, 2)`` uint64
    ``(offset, nbytes)``, or None when it fails its crc32c (or has the wrong size)."""
    body, crc = raw[:-4], int.from_bytes(bytes(raw[-4:]), "little")
    if len(raw) != index_bytes(slots, width, block) or google_crc32c.value(body) != crc:
        return None
    return np.frombuffer(body, dtype="<u8").reshape(slots, width // block, 2).copy()


def block_problem(chunk: Any, b: int, expected: int) -> str | None:
    """Why inner chunk ``b`` (its payload, then the payload's crc32c) is not as written, or None.
    ``expected``: its size (payload bytes + 4)."""
    if len(chunk) != expected:
        return f"block {b} has {len(chunk)} bytes, expected {expected}"
    if google_crc32c.value(chunk[:-4]) != int.from_bytes(bytes(chunk[-4:]), "little"):
        return f"block {b} fails its crc32c"
    return None


def stored_blocks(index_row: np.ndarray, b0: int = 0) -> list[tuple[int, int, int]]:
    """``(block, offset, nbytes)`` of the stored inner chunks of one slot's index row
    ``(blocks, 2)`` (its part from block ``b0`` on), skipping blocks that are not stored."""
    return [(b0 + j, int(o), int(n)) for j, (o, n) in enumerate(index_row) if o != EMPTY]


def back_to_back(blocks: Sequence[tuple[int, int, int]]) -> bool:
    """True when the blocks ``(block, offset, nbytes)`` lie one after the other in the file
    (always for one slot of a shard written by :func:`encode_shard`): one read serves them."""
    return all(blocks[j + 1][1] == blocks[j][1] + blocks[j][2] for j in range(len(blocks) - 1))


# ---------------------------------------------------------------------------- metadata


@dataclass
class ShardMeta:
    """A shard's metadata (read from its zarr.json) and, once needed, its open Zarr array."""

    name: str
    content_keys: list[str]
    tokens: list[int]  # stored tokens per slot
    files: dict[str, int]
    block_tokens: int
    kept: list[list[int] | None] = dataclasses.field(default_factory=list)  # per slot, flat
    opener: Any = None
    _array: zarr.Array | None = None
    shape: tuple[int, ...] = ()  # the codec's array shape (codec.array_shape)
    width: int = 0  # tokens per slot (a multiple of block_tokens)
    direct: bool = False  # the exact format of encode_shard: readers may decode it themselves
    encoder: str = ""  # "direct" (encode_shard: blocks back to back, slot after slot) | "zarr"
    index: np.ndarray | None = None  # (slots, width / block, 2) uint64 (offset, nbytes), once known

    @classmethod
    def parse(
        cls, name: str, meta: dict[str, Any], opener: Callable[[str], Any], layout: KvLayout
    ) -> ShardMeta:
        """From the shard's ``zarr.json`` (a plain JSON read: checking thousands of shards must
        not open thousands of Zarr arrays); ``opener(name)`` opens the array when needed;
        ``layout`` (the store's) says how its codec lays the array out."""
        attrs = dict(meta.get("attributes", {}).get(ATTR) or {})
        (sharding,) = meta["codecs"]
        shape = tuple(int(n) for n in meta["shape"])
        chunk_shape = sharding["configuration"]["chunk_shape"]
        block = int(attrs.get("block_tokens") or chunk_shape[4])
        return cls(
            name=name,
            content_keys=list(attrs.get("content_keys", [])),
            tokens=[int(t) for t in attrs.get("tokens", [])],
            kept=list(attrs.get("kept") or [None] * len(attrs.get("content_keys", []))),
            files={str(k): int(v) for k, v in dict(attrs.get("files", {})).items()},
            block_tokens=block,
            opener=opener,
            shape=shape,
            width=layout.codec.width_of(shape, block),
            direct=is_direct_format(meta, sharding)
            and data_key(len(shape)) in attrs.get("files", {}),
            encoder=str(attrs.get("encoder", "")),
        )

    @property
    def array(self) -> zarr.Array:
        if self._array is None:
            self._array = self.opener(self.name)
        return self._array

    @property
    def data_key(self) -> str:
        """Its data file, relative to its folder."""
        return data_key(len(self.shape))

    def index_range(self) -> tuple[int, int]:
        """``[start, end)`` of the index in the data file."""
        size = self.files[self.data_key]
        return size - index_bytes(self.shape[0], self.width, self.block_tokens), size

    def computed_index(self, layout: KvLayout) -> np.ndarray | None:
        """The index of a shard :func:`encode_shard` wrote (encoder ``"direct"``), computed from
        its token counts and block size without reading it, when it accounts for the data
        file's size exactly (which the reads' ``stat`` check holds the file to); else None
        (the index is read)."""
        if not self.direct or self.encoder != "direct":
            return None
        g = dataclasses.replace(layout, block_tokens=self.block_tokens)
        expected = shard_size(g, self.tokens, self.width)
        if expected != self.files.get(self.data_key):
            return None
        return direct_index(g, self.tokens, self.width)


def is_direct_format(meta: dict[str, Any], sharding: dict[str, Any]) -> bool:
    """True when a shard's zarr.json says exactly the format :func:`encode_shard` writes (one
    shard per array; inner and index codecs ``[bytes(little), crc32c]``; index at the end)."""
    config = sharding.get("configuration", {})
    shape = list(meta.get("shape", []))
    grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
    return (
        sharding.get("name") == "sharding_indexed"
        and config.get("codecs") in (_DIRECT_CODECS, _DIRECT_BYTE_CODECS)
        and config.get("index_codecs") == _DIRECT_CODECS
        and config.get("index_location", "end") == "end"
        and grid == shape
        and meta.get("chunk_key_encoding", {}).get("configuration", {}).get("separator") == "/"
    )


# ---------------------------------------------------------------------------- writing


def shard_attributes(
    layout: KvLayout,
    encoder: str,
    run_id: str,
    content_keys: Sequence[str],
    tokens: Sequence[int],
    checksums: Sequence[str],
    kept: Sequence[Sequence[int] | None] | None = None,
) -> dict[str, Any]:
    """A shard's ``coinrag_kv`` attributes: the layout's ``kv_fp``, ``block_tokens`` and (a
    lossy one only) ``kv_codec``, the ``encoder`` and ``run_id`` that wrote it, and per slot its
    content_key, stored token count and sha256 (the writer adds ``files``: data file -> bytes);
    ``kept``: per slot the chunk's token ranges the entry holds, flat
    (``storage/kv/kept.py``), recorded only when some slot holds ranges
    (``kv_keep = "nuggets"``)."""
    attrs: dict[str, Any] = {
        "kv_fp": layout.kv_fp,
        "content_keys": list(content_keys),
        "tokens": list(tokens),
        "sha256": list(checksums),
        "run_id": run_id,
        "block_tokens": layout.block_tokens,
        "encoder": encoder,
        **({} if layout.kv_codec == "none" else {"kv_codec": layout.kv_codec}),
    }
    if kept is not None and any(k is not None for k in kept):
        attrs["kept"] = [None if k is None else list(k) for k in kept]
    return attrs


def create_shard_array(
    folder: Path, layout: KvLayout, shape: tuple[int, ...], attrs: dict[str, Any]
) -> zarr.Array:
    """The (empty) shard array in a local ``folder``: its ``zarr.json``, attributes under
    ``coinrag_kv``."""
    codec = layout.codec
    return zarr.create_array(
        store=LocalStore(folder),
        shape=shape,
        chunks=codec.chunk_shape(layout),
        shards=shape,
        dtype=layout.storage_dtype,
        compressors=[Crc32cCodec()],
        fill_value=0,
        dimension_names=codec.dimension_names(),
        chunk_key_encoding={"name": "default", "separator": "/"},
        attributes={ATTR: attrs},
        zarr_format=3,
    )


@dataclass(frozen=True)
class ShardContent:
    """What one shard holds, ready to be written: per slot its stored values (``views``:
    ``layout.codec.view`` of each entry's KV, or the values as stored), the shard array's
    ``shape`` (``layout.codec.array_shape``) and its ``coinrag_kv`` attributes (``attrs``:
    :func:`shard_attributes`; the writer adds ``files``)."""

    layout: KvLayout
    views: list[np.ndarray]
    shape: tuple[int, ...]
    attrs: dict[str, Any]


def write_shard_direct(
    folder: Path, content: ShardContent, scratch: ScratchBuffers, files: LocalFiles
) -> tuple[dict[str, int], float]:
    """Encode the shard file here (:func:`encode_shard`), write it with one call, read it back
    and compare the whole file's crc32c with the encoded buffer's: the bytes on disk are the
    bytes encoded from the very arrays the manifest's sha256 were computed from, and each inner
    chunk carries its own crc32c, checked by every read. Returns the files written (``{path:
    bytes}``, also put in ``content.attrs["files"]``) and the time the write ended."""
    layout, shape, attrs = content.layout, content.shape, content.attrs
    width = layout.codec.width_of(shape, layout.block_tokens)
    size = shard_size(layout, attrs["tokens"], width)
    padded = round_up(size)
    encoded = scratch.get("encode", padded)
    data = encode_shard(content.views, layout, width, encoded)
    expected = google_crc32c.value(data)
    key = data_key(len(shape))
    attrs["files"] = {key: size}
    create_shard_array(folder, layout, shape, attrs)
    path = folder / key
    path.parent.mkdir(parents=True, exist_ok=True)
    direct = files.write(path, encoded[:padded], size)
    t1 = time.perf_counter()
    back = scratch.get("verify", padded)
    got = LocalFiles.read(path, back[:padded], direct)
    if got != size or google_crc32c.value(back[:got]) != expected:
        raise KvError(f"shard {folder.name} does not read back as written")
    return attrs["files"], t1


def write_shard_zarr(
    folder: Path,
    content: ShardContent,
    scratch: ScratchBuffers | None = None,
    files: LocalFiles | None = None,
) -> tuple[dict[str, int], float]:
    """The reference path: Zarr's own sharding encoder (whole shard in one write), read back
    through Zarr (every crc32c checked) and compared with the entries. (``scratch`` and
    ``files`` are not used: Zarr allocates and writes itself; they keep the signature of
    :func:`write_shard_direct`.)"""
    layout, shape, attrs = content.layout, content.shape, content.attrs
    data = np.zeros(shape, dtype=layout.storage_dtype)
    for i, v in enumerate(content.views):
        data[i][tuple(slice(0, n) for n in v.shape)] = v
    array = create_shard_array(folder, layout, shape, {**attrs, "files": {}})
    array[...] = data
    attrs["files"] = {
        str(p.relative_to(folder)): p.stat().st_size
        for p in folder.rglob("*")
        if p.is_file() and p.name != "zarr.json"
    }
    array.update_attributes({ATTR: attrs})
    t1 = time.perf_counter()
    back = zarr.open_array(store=LocalStore(folder, read_only=True), mode="r")[...]
    if not np.array_equal(back, data):
        raise KvError(f"shard {folder.name} does not read back as written")
    return attrs["files"], t1


# ---------------------------------------------------------------------------- checking


def verify_slots(
    shard: ShardMeta,
    slots: Iterable[int],
    block_bytes: int,
    read_ranges: Callable[[list[tuple[int, int]]], list[Any]],
    at_once: bool,
) -> dict[int, str]:
    """slot -> why its blocks are not as written (slots that check out are absent): the shard
    index and each slot's stored blocks are read (``read_ranges([(start, end), ...])`` of the
    data file; OSError when it cannot), and their crc32c checked. ``block_bytes``: an inner
    chunk's size (payload + 4). ``at_once``: every range requested in one call (object stores);
    else one slot's blocks at a time (memory: one entry, whatever the shard's size). A shard in
    another format than :func:`encode_shard`'s is read through Zarr (which checks each block's
    crc32c)."""
    slots = sorted(set(slots))
    if not shard.direct:
        problems = {}
        for slot in slots:
            try:
                shard.array[slot, :, :, :, : shard.tokens[slot], :]
            except Exception as exc:
                problems[slot] = read_problem(exc)
        return problems
    try:
        (raw,) = read_ranges([shard.index_range()])
    except OSError as exc:
        return dict.fromkeys(slots, f"read failed: {exc}")
    index = parse_index(raw, shard.shape[0], shard.width, shard.block_tokens)
    if index is None:
        return dict.fromkeys(slots, "the shard index fails its crc32c")
    groups: list[tuple[int, list[tuple[int, int, int]]]] = []  # (slot, [(block, off, n)])
    for slot in slots:
        stored = sorted(stored_blocks(index[slot]), key=lambda item: item[1])
        # blocks of one slot lie back to back (encode_shard); else one read per block
        if back_to_back(stored):
            groups.append((slot, stored))
        else:
            groups += [(slot, [item]) for item in stored]
    groups = [(slot, group) for slot, group in groups if group]
    step = max(1, len(groups)) if at_once else 1
    problems: dict[int, str] = {}
    for first in range(0, len(groups), step):
        part = groups[first : first + step]
        try:
            got = read_ranges([(g[0][1], g[-1][1] + g[-1][2]) for _, g in part])
        except OSError as exc:
            problems.update((slot, f"read failed: {exc}") for slot, _ in part)
            continue
        for (slot, group), raw in zip(part, got, strict=True):
            at = 0
            for b, _, n in group:
                problem = block_problem(raw[at : at + n], b, block_bytes)
                at += n
                if problem and slot not in problems:
                    problems[slot] = problem
    return problems
