"""The KV store: per-chunk K/V of one (generation model, RAG prompt prefix), in Zarr 3.

Layout contract (like the comment at the top of transformers' ``cache_utils.py``)
==============================================================================

In memory, one entry (the KV of one chunk) is a tensor::

    kv[layer, kind, head, token, dim]      shape (layers, 2, kv_heads, tokens, head_dim)

``kind`` 0 is K, 1 is V. Keys are stored *after* RoPE, exactly as transformers caches them
(``DynamicCache.layers[i].keys`` is ``(batch, kv_heads, seq, head_dim)``): token ``t`` of a chunk
was encoded at absolute position ``|p| + t``, right after the RAG prompt prefix ``p``
(``inference/prompt.py``), attending to ``p`` and to the chunk's earlier tokens. The dtype is the
model's (``bfloat16``, ``float16`` or ``float32``).

On disk (``STORE/kv/<kv_fp>/``, a Zarr 3 group)::

    zarr.json            group; attributes["coinrag_kv"] = the KvLayout + kv_fp (checked on open)
    prefix/              array (layers, 2, kv_heads, |p|, head_dim): the prefix's own KV C_p,
                         attributes: prefix_ids, prefix_sha, sha256
    shard-000000/        array (slots, layers, 2, kv_heads, tokens, head_dim): one shard = one
    shard-000001/        file of `slots` entries, written once and never modified
    ...
    .tmp-<uuid>/         a shard being written (renamed into place when verified)

- bfloat16 is stored as its raw bits in a ``uint16`` array (Zarr 3 has no bfloat16): bit-exact.
  float32 / float16 are stored as themselves. Little-endian, C order.
- A shard array has exactly one Zarr shard (``shards`` = the whole array), so it is one data file
  (``c/0/0/0/0/0/0``) plus its ``zarr.json``: not a file per chunk. Inner chunks are
  ``(1, layers, 2, kv_heads, block_tokens, head_dim)``: one slot, every layer and head, a block of
  ``block_tokens`` (default 16) tokens. Reading a nugget's token range ``[s, e)`` reads the shard
  index (crc32c-protected, 16 bytes per inner chunk) and the ``ceil``-aligned blocks covering the
  range, nothing else.
- Every inner chunk carries a crc32c (``codecs=[bytes, crc32c]`` inside the sharding codec), so a
  flipped byte is detected on a *partial* read too; the shard index has its own crc32c, so a
  truncated file (the index sits at its end) is detected as well. The shard's attributes record
  its files' sizes (truncation or loss is found with a ``stat``, before any read) and, per slot,
  the entry's content_key, token count and sha256.
- The token axis of a shard is its longest entry rounded up to ``block_tokens``; shorter entries
  (a document's last chunk) are zero-padded. Zarr does not store inner chunks that are entirely
  fill value, so the padding costs at most one partly filled block per entry.

Writes
------
Zarr rewrites a whole shard on a partial write, so shards are written *whole*, once: the build
stage hands ``write_entries`` up to ``slots_per_shard`` entries at a time (default: as many as
fit in 64 MiB, at least 4 and at most 64: few files, yet small enough that writing a shard
overlaps the computation of the next ones and the write buffers stay small). For each shard:

1. the shard file is encoded in one buffer (:func:`encode_shard`: the Zarr v3 sharding format,
   byte for byte what Zarr's own writer produces up to the order of inner chunks, for a
   fraction of its CPU) and written with one call (O_DIRECT where the file system takes it),
   next to the ``zarr.json`` Zarr writes, in ``.tmp-<uuid>/``; ``encoder="zarr"`` uses Zarr's
   ``array[...] = data`` instead (the reference path);
2. it is read back and verified: the file's bytes against the encoded buffer (crc32c of the
   whole file), the buffer having been encoded from the very arrays whose sha256 go to the
   manifest (with ``encoder="zarr"``: decoded by Zarr, every inner crc32c checked, and compared);
3. the folder is renamed to ``shard-NNNNNN`` (atomic), optionally after fsync (``fsync=True``:
   durability against power loss, not only against a killed process);
4. only then are its ``KvManifestRow`` rows appended (``storage.tables``).

An entry is valid only once its manifest row exists: a crash leaves at most an orphan shard (or
a ``.tmp-`` folder), never a half-written entry that reads as valid; ``gc`` removes orphans.
Shard numbers only grow (1 + the largest number on disk or in the manifest), and for one
content_key the row with the largest (shard, slot) wins, so a rebuilt entry supersedes the old row.

Manifest rows: ``model_fp`` is the generation model's fingerprint; ``location`` is the entry's
path inside ``STORE/kv/``: ``"<kv_fp>/shard-000012#slot-5"``; ``bytes`` is the entry's logical
size (tokens x bytes per token); ``checksum`` is the sha256 of the entry's bytes as stored
(C-contiguous ``(layers, 2, kv_heads, tokens, head_dim)``, uint16 bits for bfloat16).

Identity
--------
``kv_fp = fingerprint("kv", {model_fp, prefix_sha, layout_version})``: the same tokens after the
same prefix through the same model give the same KV. Entries are keyed by the chunk's
``content_key``, so the same tokens in another document reuse the entry. Opening the KV of
another fingerprint raises :class:`KvFingerprintMismatch` naming both.

Object stores (``s3://``)
------------------------
The same layout, one object per file. A shard is encoded and verified in a local temporary
folder exactly as above, then uploaded to ``.tmp-<uuid>/`` (data file first, ``zarr.json``
last) and read back (crc32c of the whole data file against the local one); publishing copies it
to ``shard-NNNNNN/`` (server-side copies, data first, ``zarr.json`` last) and removes the staged
objects. A shard is never valid before its manifest rows exist, so a crash between the copies
leaves an orphan prefix that ``gc`` removes, as a crash before a rename does on disk. Shard
numbers are claimed with a conditional create (``.claim``). Slices (``read_slices``) are ranged
GETs issued at once, one per slice, decoded here with each block's crc32c checked (the shard
index is fetched once per reader); whole entries and the prefix are read through Zarr's
``FsspecStore`` (s3fs).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import google_crc32c  # zarr's crc32c codec uses it (a dependency of zarr)
import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec
from zarr.core.sync import sync as _zarr_sync
from zarr.storage import FsspecStore, LocalStore, WrapperStore

from schemas.keys import CODE_VERSION, fingerprint
from schemas.tables import ChunkRow, KvManifestRow
from storage.location import zarr_storage_options
from storage.object_lock import precondition_failed
from storage.store import Store

LAYOUT_VERSION = 1
AXES = ("slot", "layer", "kv", "head", "token", "dim")
DEFAULT_BLOCK_TOKENS = 16
DEFAULT_SHARD_BYTES = 64 * 2**20  # target size of a shard (slots_per_shard is derived from it)
MIN_SLOTS_PER_SHARD = 4
MAX_SLOTS_PER_SHARD = 64
# A shard's zarr.json and its seven folders (c/0/0/0/0/0/0), in file-system blocks.
SHARD_OVERHEAD_BYTES = 8 * 4096

_ATTR = "coinrag_kv"
# Key of a shard array's only data file: the "default" chunk key encoding ("c" + "/"-joined
# coordinates) of chunk (0, 0, 0, 0, 0, 0), as the Zarr v3 spec defines it.
_DATA_KEY = "c/0/0/0/0/0/0"
_PREFIX = "prefix"
KV_CHECK_LEVELS = ("stat", "crc32c", "sha256", "full")  # "full": sha256
_SHARD_RE = re.compile(r"^shard-(\d{6,})$")
_LOCATION_RE = re.compile(r"^(?P<kv_fp>[^/#]+)/(?P<shard>shard-\d{6,})#slot-(?P<slot>\d+)$")

_STORAGE_DTYPES = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------- errors


class KvError(RuntimeError):
    """Base of the KV store's errors."""


class CorruptKvEntry(KvError):
    """A stored entry failed a check (crc32c, sha256, size, slot identity): never served."""

    def __init__(self, content_key: str, location: str, reason: str) -> None:
        self.content_key = content_key
        self.location = location
        self.reason = reason
        super().__init__(f"corrupt KV entry {content_key} at {location}: {reason}")


class MissingKvEntry(KvError, KeyError):
    """No valid manifest row for this content_key under this kv_fp."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "missing KV entry"


class KvFingerprintMismatch(KvError):
    """KV built for one fingerprint was asked for by another."""

    def __init__(self, stored: str, expected: str, detail: str = "") -> None:
        self.stored = stored
        self.expected = expected
        msg = (
            f"KV fingerprint mismatch: the stored KV was built for {stored}, but {expected} "
            "was asked for; KV is tied to the model weights, dtype, RoPE and prompt prefix, "
            "so it must be rebuilt (run the kv stage) for the current model"
        )
        super().__init__(msg + (f" ({detail})" if detail else ""))


# ---------------------------------------------------------------------------- identity, layout


def kv_fingerprint(model_fp: str, prefix_sha: str) -> str:
    """The identity of a KV store: model, prompt prefix and this storage layout's version."""
    return fingerprint(
        "kv", {"model_fp": model_fp, "prefix_sha": prefix_sha, "layout_version": LAYOUT_VERSION}
    )


@dataclass(frozen=True)
class KvLayout:
    """Shape, dtype and identity of the KV entries of one (model, prompt prefix).

    ``block_tokens`` and ``slots_per_shard`` are physical choices for new shards (each shard
    records its own in its metadata, so changing them never invalidates stored entries); they are
    not part of ``kv_fp``.
    """

    model_fp: str
    prefix_sha: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    slots_per_shard: int = 0  # 0: derived from DEFAULT_SHARD_BYTES for 512-token entries

    def __post_init__(self) -> None:
        if self.dtype not in _STORAGE_DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r} (float32, bfloat16, float16)")
        if self.slots_per_shard <= 0:
            per_entry = self.entry_bytes(512)
            slots = DEFAULT_SHARD_BYTES // per_entry
            slots = max(MIN_SLOTS_PER_SHARD, min(MAX_SLOTS_PER_SHARD, slots))
            object.__setattr__(self, "slots_per_shard", int(slots))

    @property
    def kv_fp(self) -> str:
        return kv_fingerprint(self.model_fp, self.prefix_sha)

    @property
    def itemsize(self) -> int:
        return _STORAGE_DTYPES[self.dtype].itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V over all layers and heads."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.itemsize

    def entry_bytes(self, tokens: int) -> int:
        return tokens * self.token_bytes

    def entry_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, tokens, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    def identity(self) -> dict[str, Any]:
        """What the group's attributes record and what :meth:`KvStore.open` checks."""
        return {
            "layout_version": LAYOUT_VERSION,
            "kv_fp": self.kv_fp,
            "model_fp": self.model_fp,
            "prefix_sha": self.prefix_sha,
            "layers": self.layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "storage_dtype": _STORAGE_DTYPES[self.dtype].str,
            "axes": list(AXES),
        }

    def disk_bytes(self, tokens: Sequence[int]) -> int:
        """Bytes on disk of the shards that entries of these token counts become, written as
        the KV stage writes them (longest first, ``slots_per_shard`` per shard): each entry's
        blocks (its tokens rounded up to ``block_tokens``, plus a 4-byte crc32c per block), each
        shard's index (16 bytes per slot and block of its widest entry, plus a crc32c) and its
        metadata and folders (:data:`SHARD_OVERHEAD_BYTES`, a few file-system blocks).

        E.g. float32 SmolLM2-135M (30 layers, 3 KV heads, dim 64: 46,080 bytes per token) and
        2 entries of 512 tokens: 2 x 32 blocks x 737,284 bytes + 1,028 + overhead = ~45 MiB.
        """
        ordered = sorted((int(t) for t in tokens), reverse=True)
        block = self.block_tokens
        per_block = block * self.token_bytes + 4
        total = 0
        for start in range(0, len(ordered), self.slots_per_shard):
            shard = ordered[start : start + self.slots_per_shard]
            width_blocks = max(1, -(-shard[0] // block))
            total += sum(-(-t // block) for t in shard) * per_block
            total += len(shard) * width_blocks * 16 + 4 + SHARD_OVERHEAD_BYTES
        return total

    @classmethod
    def for_model(cls, model: Any, model_fp: str, prefix_sha: str, **kwargs: Any) -> KvLayout:
        """The layout of a transformers causal LM (dims from its config, dtype from its weights)."""
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        return cls.for_config(model.config, model_fp, prefix_sha, dtype, **kwargs)

    @classmethod
    def for_config(
        cls, config: Any, model_fp: str, prefix_sha: str, dtype: str, **kwargs: Any
    ) -> KvLayout:
        """The layout of a transformers model config (no weights loaded) and a dtype."""
        config = config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            model_fp=model_fp,
            prefix_sha=prefix_sha,
            layers=config.num_hidden_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            **kwargs,
        )


def parse_location(location: str) -> tuple[str, str, int]:
    """``"<kv_fp>/shard-000012#slot-5"`` -> ``(kv_fp, "shard-000012", 5)``."""
    m = _LOCATION_RE.match(location)
    if not m:
        raise ValueError(f"not a KV location: {location!r}")
    return m["kv_fp"], m["shard"], int(m["slot"])


def _location_order(location: str) -> tuple[int, int]:
    _, shard, slot = parse_location(location)
    return int(shard.removeprefix("shard-")), slot


def kv_free_bytes(store: Store) -> int | None:
    """Bytes free on the file system that holds ``STORE/kv/`` (the nearest existing folder on
    the way there); None for an object store, which has no such limit to check."""
    if not store.is_local:
        return None
    path = Path(store.root) / "kv"
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def stored_content_keys(store: Store, layout: KvLayout) -> set[str]:
    """The content_keys with a manifest row under ``layout``'s kv_fp (no shard is read)."""
    return set(KvStore(store, layout).manifest())


# ---------------------------------------------------------------------------- tensors <-> bytes


def storage_view(kv: torch.Tensor) -> np.ndarray:
    """A KV tensor as a numpy view in the stored dtype (bfloat16 -> uint16 bits), no copy on
    CPU; strides kept (not necessarily contiguous)."""
    t = kv.detach().to("cpu")
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def to_storage(kv: torch.Tensor) -> np.ndarray:
    """A KV tensor as the C-contiguous numpy array that is stored (bfloat16 -> uint16 bits)."""
    return np.ascontiguousarray(storage_view(kv))


def from_storage(array: np.ndarray, dtype: str) -> torch.Tensor:
    """The inverse of :func:`to_storage` (a copy only where the array is not contiguous)."""
    array = np.ascontiguousarray(array)
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def entry_checksum(stored: np.ndarray) -> str:
    """sha256 of an entry's stored bytes (C-contiguous ``(layers, 2, heads, tokens, dim)``)."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(stored)).cast("B")).hexdigest()


# ---------------------------------------------------------------------------- shard encoding

_EMPTY = np.uint64(2**64 - 1)


def encode_shard(
    entries: Sequence[np.ndarray], width: int, block: int, out: np.ndarray | None = None
) -> np.ndarray:
    """The bytes of one shard file, per the Zarr v3 ``sharding_indexed`` codec as configured
    here (inner codecs ``[bytes(little), crc32c]``, index codecs ``[bytes(little), crc32c]``,
    index at the end).

    ``entries`` are stored-dtype arrays ``(layers, 2, kv_heads, n_i, head_dim)`` (any strides);
    the shard array is ``(len(entries), layers, 2, kv_heads, width, head_dim)`` with inner chunks
    ``(1, layers, 2, kv_heads, block, head_dim)``. Each inner chunk is its C-order payload
    followed by the payload's crc32c (little-endian uint32); inner chunks that would hold only
    padding are not stored (index entry ``(2**64-1, 2**64-1)``, read as zeros), as Zarr does
    for chunks equal to the fill value. The index is ``(slots, 1, 1, 1, width / block, 1, 2)``
    uint64 ``(offset, nbytes)`` in C order, followed by its crc32c.

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
    first = entries[0]
    layers, _, heads, _, dim = first.shape
    dtype = first.dtype
    item = dtype.itemsize
    payload = layers * 2 * heads * block * dim * item
    row = payload + 4
    rows = [-(-int(e.shape[3]) // block) for e in entries]
    index = np.full((len(entries), 1, 1, 1, width // block, 1, 2), _EMPTY, dtype="<u8")
    body = sum(rows) * row
    size = body + index.nbytes + 4
    if out is None or out.nbytes < size:
        out = np.empty(size, dtype=np.uint8)
    out = out[:size]
    inner = (2 * heads * block * dim * item, heads * block * dim * item, block * dim * item)
    strides = (row, *inner, dim * item, item)
    start = 0
    for i, entry in enumerate(entries):
        n = int(entry.shape[3])
        k = rows[i]
        # The entry's k inner chunks, in place in the file buffer: (k, L, 2, H, block, D).
        chunks = np.ndarray(
            (k, layers, 2, heads, block, dim),
            dtype=dtype,
            buffer=out,
            offset=start,
            strides=strides,
        )
        dst = chunks.transpose(1, 2, 3, 0, 4, 5)  # (L, 2, H, k, block, D)
        full = n // block
        if full:
            dst[:, :, :, :full] = entry[:, :, :, : full * block].reshape(
                layers, 2, heads, full, block, dim
            )
        if n > full * block:
            dst[:, :, :, full, : n - full * block] = entry[:, :, :, full * block :]
            dst[:, :, :, full, n - full * block :] = 0
        for j in range(k):
            at = start + j * row
            crc = google_crc32c.value(out[at : at + payload])
            out[at + payload : at + row] = np.array([crc], dtype="<u4").view(np.uint8)
            index[i, 0, 0, 0, j, 0] = (at, row)
        start += k * row
    index_bytes = index.view(np.uint8).reshape(-1)
    out[body : body + index.nbytes] = index_bytes
    crc = google_crc32c.value(index_bytes)
    out[body + index.nbytes :] = np.array([crc], dtype="<u4").view(np.uint8)
    return out


def _index_bytes(slots: int, width: int, block: int) -> int:
    """Bytes of a shard's index: uint64 ``(offset, nbytes)`` per slot and block, then a crc32c."""
    return slots * (width // block) * 16 + 4


def _parse_index(raw: Any, slots: int, width: int, block: int) -> np.ndarray | None:
    """A shard index read from the end of its file -> ``(slots, width / block, 2)`` uint64
    ``(offset, nbytes)``, or None when it fails its crc32c (or has the wrong size)."""
    body, crc = raw[:-4], int.from_bytes(bytes(raw[-4:]), "little")
    if len(raw) != _index_bytes(slots, width, block) or google_crc32c.value(body) != crc:
        return None
    return np.frombuffer(body, dtype="<u8").reshape(slots, width // block, 2).copy()


def _block_problem(chunk: Any, b: int, expected: int) -> str | None:
    """Why inner chunk ``b`` (its payload, then the payload's crc32c) is not as written, or None.
    ``expected``: its size (payload bytes + 4)."""
    if len(chunk) != expected:
        return f"block {b} has {len(chunk)} bytes, expected {expected}"
    if google_crc32c.value(chunk[:-4]) != int.from_bytes(bytes(chunk[-4:]), "little"):
        return f"block {b} fails its crc32c"
    return None


def _read_problem(exc: BaseException) -> str:
    """A failed read as a short reason (Zarr's checksum error quotes raw bytes: not in a
    message a user reads)."""
    if "checksum" in str(exc).lower():
        return "read failed: a crc32c does not match"
    return f"read failed: {exc}"


def _shard_size(entries: Sequence[np.ndarray], width: int, block: int) -> int:
    """Bytes of the file :func:`encode_shard` makes."""
    layers, _, heads, _, dim = entries[0].shape
    row = layers * 2 * heads * block * dim * entries[0].dtype.itemsize + 4
    blocks = sum(-(-int(e.shape[3]) // block) for e in entries)
    return blocks * row + len(entries) * (width // block) * 16 + 4


_ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and sizes (a page)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on an ``_ALIGN`` boundary."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % _ALIGN
    return raw[start : start + nbytes]


def _read_file(path: Path, buf: np.ndarray, direct: bool) -> int:
    """Read a whole file into ``buf`` (page-aligned and page-sized when ``direct``, and at
    least as large as the file); return the bytes read. ``direct`` reads with O_DIRECT (from
    the device, not the page cache)."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    try:
        view = memoryview(buf)
        total = 0
        while total < len(view):
            n = os.readv(fd, [view[total:]])
            if not n:
                break
            total += n
        return total
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- I/O accounting


class _CountingStore(WrapperStore[Any]):
    """A read-only store wrapper (LocalStore or FsspecStore) that counts the data bytes it
    returns (not metadata)."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.data_bytes = 0
        self.data_gets = 0

    def _count(self, key: str, buf: Any) -> None:
        if buf is not None and not key.endswith("zarr.json"):
            self.data_bytes += len(buf)
            self.data_gets += 1

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        buf = await self._store.get(key, prototype, byte_range)
        self._count(key, buf)
        return buf

    async def get_partial_values(self, prototype: Any, key_ranges: Iterable[Any]) -> list[Any]:
        key_ranges = list(key_ranges)
        bufs = await self._store.get_partial_values(prototype, key_ranges)
        for (key, _), buf in zip(key_ranges, bufs, strict=True):
            self._count(key, buf)
        return bufs


@dataclass
class ReadStats:
    """What one read call cost. ``bytes_read`` counts data bytes returned by the store (inner
    chunks and shard indexes), ``bytes_needed`` the bytes of the tokens asked for."""

    requests: int = 0
    bytes_read: int = 0
    bytes_needed: int = 0
    store_gets: int = 0
    zarr_reads: int = 0
    seconds: float = 0.0

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 0.0


@dataclass
class WriteStats:
    """Cumulative cost of writes through one KvStore."""

    shards: int = 0
    entries: int = 0
    logical_bytes: int = 0
    disk_bytes: int = 0
    encode_write_s: float = 0.0
    verify_s: float = 0.0
    manifest_s: float = 0.0


@dataclass(frozen=True)
class StagedShard:
    """A shard written and verified under ``.tmp-<uuid>/`` but not yet valid: no manifest row
    points to it until :meth:`KvStore.publish_shard` renames it into place and appends its rows.

    It can be made on another process or machine that sees the same store folder (a worker of
    a distributed build) and published by the holder of the store's write lock. Per slot:
    ``chunk_ids``, ``content_keys``, ``tokens`` and ``checksums`` (sha256 of the stored bytes).
    """

    kv_fp: str
    tmp_name: str  # folder name under STORE/kv/<kv_fp>/
    chunk_ids: tuple[str, ...]
    content_keys: tuple[str, ...]
    tokens: tuple[int, ...]
    checksums: tuple[str, ...]
    logical_bytes: int
    disk_bytes: int
    encode_write_s: float
    verify_s: float


@dataclass
class _Shard:
    """A shard's metadata (read from its zarr.json) and, once needed, its open Zarr array."""

    name: str
    content_keys: list[str]
    tokens: list[int]
    files: dict[str, int]
    block_tokens: int
    opener: Any = None
    _array: zarr.Array | None = None
    shape: tuple[int, ...] = ()  # (slots, layers, 2, kv_heads, width, head_dim)
    direct: bool = False  # the exact format of encode_shard: read_slices may decode it itself
    index: np.ndarray | None = None  # (slots, width / block, 2) uint64 (offset, nbytes), once read

    @property
    def array(self) -> zarr.Array:
        if self._array is None:
            self._array = self.opener(self.name)
        return self._array


@dataclass
class _Plan:
    """One zarr read: token range [t0, t1) of one slot, serving some requests."""

    shard: str
    slot: int
    t0: int
    t1: int
    requests: list[int]


# ---------------------------------------------------------------------------- the store


class KvStore:
    """The KV entries of one ``kv_fp`` under ``STORE/kv/<kv_fp>/``.

    Use :meth:`create` (build side) or :meth:`open` (read side). Not safe for concurrent
    writers: the build holds the store's write lock.
    """

    def __init__(
        self,
        store: Store,
        layout: KvLayout,
        *,
        fsync: bool = False,
        encoder: str = "direct",
        direct_io: bool = True,
    ) -> None:
        if encoder not in ("direct", "zarr"):
            raise ValueError(f"unknown shard encoder {encoder!r} (direct, zarr)")
        self.encoder = encoder
        self.store = store
        self.layout = layout
        self.kv_fp = layout.kv_fp
        self.root: PurePath = store.kv_dir(self.kv_fp)  # a Path for a local store
        self.fsync = fsync
        self._reader = _CountingStore(_zarr_store(store, self.root, read_only=True))
        self._shards: dict[str, _Shard] = {}
        self._shards_checked: set[str] = set()  # object stores: shards whose files checked out
        self._manifest: dict[str, KvManifestRow] | None = None
        self._max_manifest_shard = -1
        self.write_stats = WriteStats()
        self.last_read = ReadStats()
        self._scratch: dict[str, np.ndarray] = {}
        self.direct_io = direct_io

    def _buffer(self, name: str, nbytes: int) -> np.ndarray:
        """A reusable, page-aligned uint8 scratch buffer of at least ``nbytes`` (grown by 25%
        when short): fresh memory costs a page fault per page on first touch."""
        buf = self._scratch.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = _aligned_empty(_round_up(int(nbytes * 1.25), _ALIGN))
            self._scratch[name] = buf
        return buf

    def release_buffers(self) -> None:
        """Free the write path's scratch buffers (about two shards' worth)."""
        self._scratch.clear()

    # ------------------------------------------------------------------ open / create

    @classmethod
    def create(cls, store: Store, layout: KvLayout, **options: Any) -> KvStore:
        """Open the KV store of ``layout``, creating its group if it does not exist yet.

        ``options`` (write side): ``fsync`` (False), ``encoder`` ("direct" | "zarr"),
        ``direct_io`` (True: O_DIRECT shard writes where the file system supports them).
        """
        root = store.kv_dir(layout.kv_fp)
        if store.is_file(root / "zarr.json"):
            return cls.open(store, layout.kv_fp, layout, **options)
        if not store.is_local:  # one PUT of zarr.json: atomic
            zarr.create_group(store=_zarr_store(store, root), attributes={_ATTR: layout.identity()})
            return cls.open(store, layout.kv_fp, layout, **options)
        root = Path(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = root.parent / f".tmp-{layout.kv_fp}-{uuid.uuid4().hex[:8]}"
        zarr.create_group(store=LocalStore(tmp), attributes={_ATTR: layout.identity()})
        if options.get("fsync"):
            _fsync_tree(tmp)
        try:
            os.rename(tmp, root)
        except OSError as exc:  # created meanwhile by someone else
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        return cls.open(store, layout.kv_fp, layout, **options)

    @classmethod
    def open(
        cls, store: Store, kv_fp: str, layout: KvLayout | None = None, **options: Any
    ) -> KvStore:
        """Open the KV store ``kv_fp``; with ``layout``, check that it is the one asked for.

        Raises :class:`KvFingerprintMismatch` when the stored identity (model_fp, prefix,
        dims, dtype) differs from ``layout`` or from ``kv_fp``, and FileNotFoundError when no KV
        was built for ``kv_fp``.
        """
        root = store.kv_dir(kv_fp)
        if not store.is_file(root / "zarr.json"):
            raise FileNotFoundError(
                f"no KV store for {kv_fp} at {store.uri(root)} (run the kv stage)"
            )
        group = zarr.open_group(store=_zarr_store(store, root, read_only=True), mode="r")
        stored = dict(group.attrs.get(_ATTR) or {})
        if not stored:
            raise KvError(f"{root} is not a coinrag KV store (no {_ATTR} attributes)")
        stored_fp = stored.get("kv_fp", "?")
        detail = f"model_fp {stored.get('model_fp')}, prefix {stored.get('prefix_sha')}"
        if stored_fp != kv_fp:
            raise KvFingerprintMismatch(stored_fp, kv_fp, f"store folder renamed? {detail}")
        if stored.get("layout_version") != LAYOUT_VERSION:
            raise KvFingerprintMismatch(
                stored_fp, kv_fp, f"layout version {stored.get('layout_version')}"
            )
        if layout is None:
            kwargs = {k: stored[k] for k in ("layers", "kv_heads", "head_dim", "dtype")}
            layout = KvLayout(
                model_fp=stored["model_fp"], prefix_sha=stored["prefix_sha"], **kwargs
            )
        else:
            expected = layout.identity()
            diffs = [k for k, v in expected.items() if stored.get(k) != v]
            if diffs:
                mine = f"model_fp {layout.model_fp}, prefix {layout.prefix_sha}"
                raise KvFingerprintMismatch(
                    f"{stored_fp} ({detail})",
                    f"{layout.kv_fp} ({mine})",
                    "differs in " + ", ".join(diffs),
                )
        return cls(store, layout, **options)

    # ------------------------------------------------------------------ manifest

    def manifest(self, refresh: bool = False) -> dict[str, KvManifestRow]:
        """content_key -> its current manifest row under this kv_fp (the latest row wins)."""
        if self._manifest is None or refresh:
            import pyarrow.compute as pc

            from storage.tables import read_rows

            rows = read_rows(
                self.store,
                KvManifestRow,
                filter=pc.starts_with(pc.field("location"), pattern=self.kv_fp + "/"),
            )
            current: dict[str, tuple[tuple[int, int], KvManifestRow]] = {}
            top = -1
            for row in rows:
                if row.model_fp != self.layout.model_fp:
                    raise KvFingerprintMismatch(
                        row.model_fp,
                        self.layout.model_fp,
                        f"manifest row {row.location} of {row.content_key}",
                    )
                order = _location_order(row.location)
                top = max(top, order[0])
                if row.content_key not in current or current[row.content_key][0] < order:
                    current[row.content_key] = (order, row)
            self._manifest = {ck: row for ck, (_, row) in current.items()}
            self._max_manifest_shard = top
        return self._manifest

    def __contains__(self, content_key: str) -> bool:
        return content_key in self.manifest()

    def _row(self, content_key: str) -> KvManifestRow:
        row = self.manifest().get(content_key)
        if row is None:
            raise MissingKvEntry(f"no KV entry for {content_key} under {self.kv_fp}")
        kv_fp, _, _ = parse_location(row.location)
        if kv_fp != self.kv_fp:  # defensive: manifest() filters by kv_fp
            raise KvFingerprintMismatch(kv_fp, self.kv_fp, f"entry {content_key}")
        return row

    # ------------------------------------------------------------------ shards

    def shard_names(self) -> list[str]:
        """Shard folders on disk (verified and renamed into place), in write order."""
        names = [n for n in self.store.list_names(self.root) if _SHARD_RE.match(n)]
        return sorted(names, key=lambda n: int(n.removeprefix("shard-")))

    def _shard(self, name: str) -> _Shard:
        """The shard's metadata, parsed from its ``zarr.json`` (a plain JSON read: checking
        thousands of shards must not open thousands of Zarr arrays); the array opens lazily."""
        shard = self._shards.get(name)
        if shard is None:
            meta = json.loads(self.store.read_bytes(self.root / name / "zarr.json"))
            attrs = dict(meta.get("attributes", {}).get(_ATTR) or {})
            (sharding,) = meta["codecs"]
            shard = _Shard(
                name=name,
                content_keys=list(attrs.get("content_keys", [])),
                tokens=[int(t) for t in attrs.get("tokens", [])],
                files={str(k): int(v) for k, v in dict(attrs.get("files", {})).items()},
                block_tokens=int(sharding["configuration"]["chunk_shape"][4]),
                opener=self._open_shard_array,
                shape=tuple(int(n) for n in meta["shape"]),
                direct=_is_direct_format(meta, sharding) and _DATA_KEY in attrs.get("files", {}),
            )
            self._shards[name] = shard
        return shard

    def _open_shard_array(self, name: str) -> zarr.Array:
        return zarr.open_array(store=self._reader, path=name, mode="r")

    def _check_shard_files(self, shard: _Shard) -> str | None:
        """Why the shard's files are not as written (missing, truncated, grown), or None."""
        for rel, size in shard.files.items():
            try:
                actual = self._size(self.root / shard.name / rel)
            except FileNotFoundError:
                return f"data file {shard.name}/{rel} is missing"
            if actual != size:
                return f"data file {shard.name}/{rel} has {actual} bytes, {size} were written"
        return None

    def _size(self, path: PurePath) -> int:
        if self.store.is_local:
            return os.stat(path).st_size
        return int(self.store.fs.size(str(path)))

    def _resolve(
        self,
        content_key: str,
        file_checks: dict[str, str | None] | None = None,
        ranged: bool = False,
    ) -> tuple[KvManifestRow, _Shard, int]:
        """The row, its opened shard and slot; raises CorruptKvEntry on a cheap failed check.

        ``file_checks`` caches the per-shard file check (shard name -> problem or None) across
        calls that run together. ``ranged``: the caller reads with :meth:`_gather_ranges`, which
        fails on a missing object (Zarr would read zeros); then, on an object store, a passed
        check of a shard in that format is remembered for the life of this object (objects are
        written once, and the check is a HEAD request per shard: a round trip per read
        otherwise), and a shard removed later fails its read instead.
        """
        row = self._row(content_key)
        _, name, slot = parse_location(row.location)
        try:
            shard = self._shard(name)
        except Exception as exc:  # missing folder, unreadable zarr.json
            self._shards.pop(name, None)
            raise CorruptKvEntry(content_key, row.location, f"shard unreadable: {exc}") from exc
        if slot >= len(shard.content_keys) or shard.content_keys[slot] != content_key:
            raise CorruptKvEntry(content_key, row.location, "slot holds another entry")
        if shard.tokens[slot] != row.tokens:
            raise CorruptKvEntry(content_key, row.location, "token count differs from manifest")
        if file_checks is not None and name in file_checks:
            problem = file_checks[name]
        elif ranged and name in self._shards_checked:
            problem = None
        else:
            problem = self._check_shard_files(shard)
            if file_checks is not None:
                file_checks[name] = problem
            if problem is None and not self.store.is_local and shard.direct:
                self._shards_checked.add(name)
        if problem:
            raise CorruptKvEntry(content_key, row.location, problem)
        return row, shard, slot

    # ------------------------------------------------------------------ reads

    def read_entry(self, content_key: str, verify: bool = True) -> torch.Tensor:
        """The KV of one chunk: ``(layers, 2, kv_heads, tokens, head_dim)`` in the model dtype.

        Every inner chunk's crc32c is checked by the read; ``verify`` also checks the manifest's
        sha256 of the whole entry. Raises :class:`CorruptKvEntry` or :class:`MissingKvEntry`.
        """
        t0 = time.perf_counter()
        before = (self._reader.data_bytes, self._reader.data_gets)
        row, shard, slot = self._resolve(content_key)
        try:
            stored = shard.array[slot, :, :, :, : row.tokens, :]
        except Exception as exc:
            problem = self._diagnose(shard, slot, exc)
            raise CorruptKvEntry(content_key, row.location, problem) from exc
        stored = np.ascontiguousarray(stored)
        if verify and entry_checksum(stored) != row.checksum:
            raise CorruptKvEntry(content_key, row.location, "sha256 differs from the manifest")
        self.last_read = ReadStats(
            requests=1,
            bytes_read=self._reader.data_bytes - before[0],
            bytes_needed=self.layout.entry_bytes(row.tokens),
            store_gets=self._reader.data_gets - before[1],
            zarr_reads=1,
            seconds=time.perf_counter() - t0,
        )
        return from_storage(stored, self.layout.dtype)

    def verify_entry(self, content_key: str) -> bool:
        """True iff the entry has a manifest row and its stored bytes match it (sha256)."""
        try:
            self.read_entry(content_key, verify=True)
        except (CorruptKvEntry, MissingKvEntry):
            return False
        return True

    def read_slices(
        self, requests: Sequence[tuple[str, int, int]], merge_gap_blocks: int = 0
    ) -> list[torch.Tensor]:
        """Token ranges of entries: ``[(content_key, tok_start, tok_end), ...]`` ->
        ``[(layers, 2, kv_heads, tok_end - tok_start, head_dim), ...]`` in request order.

        Requests on the same entry whose block-aligned ranges overlap or touch (or lie at most
        ``merge_gap_blocks`` blocks apart) are served by one read; all reads are issued at once
        (concurrently, on Zarr's I/O loop). Each touched inner chunk is crc32c-checked; the
        whole-entry sha256 is not (it would need the whole entry: use :meth:`verify_entry`).
        ``self.last_read`` says what it cost.
        """
        t0 = time.perf_counter()
        before = (self._reader.data_bytes, self._reader.data_gets)
        plans: list[_Plan] = []
        per_slot: dict[tuple[str, int], list[tuple[int, int, int]]] = defaultdict(list)
        resolved: dict[str, tuple[KvManifestRow, _Shard, int]] = {}
        out: list[torch.Tensor | None] = [None] * len(requests)
        needed = 0
        file_checks: dict[str, str | None] = {}
        for i, (ck, s, e) in enumerate(requests):
            if ck not in resolved:
                resolved[ck] = self._resolve(ck, file_checks, ranged=True)
            row, shard, slot = resolved[ck]
            if not 0 <= s <= e <= row.tokens:
                raise IndexError(f"slice [{s}, {e}) out of range for {ck} ({row.tokens} tokens)")
            if s == e:
                out[i] = torch.empty(self.layout.entry_shape(0), dtype=self.layout.torch_dtype)
                continue
            needed += (e - s) * self.layout.token_bytes
            per_slot[(shard.name, slot)].append((s, e, i))
        for (name, slot), items in per_slot.items():
            block = self._shards[name].block_tokens
            items.sort()
            for s, e, i in items:
                b0 = (s // block) * block
                b1 = -(-e // block) * block
                last = plans[-1] if plans else None
                if (
                    last is not None
                    and (last.shard, last.slot) == (name, slot)
                    and b0 <= last.t1 + merge_gap_blocks * block
                ):
                    last.t1 = max(last.t1, b1)
                    last.requests.append(i)
                else:
                    plans.append(_Plan(name, slot, b0, b1, [i]))
        if plans:
            if self.store.is_local:
                results = self._gather(plans, requests, resolved)
            else:
                results = self._gather_ranges(plans, requests, resolved)
            for plan, stored in zip(plans, results, strict=True):
                for i in plan.requests:
                    _, s, e = requests[i]
                    piece = stored[:, :, :, s - plan.t0 : e - plan.t0, :]
                    out[i] = from_storage(piece, self.layout.dtype)
        self.last_read = ReadStats(
            requests=len(requests),
            bytes_read=self._reader.data_bytes - before[0],
            bytes_needed=needed,
            store_gets=self._reader.data_gets - before[1],
            zarr_reads=len(plans),
            seconds=time.perf_counter() - t0,
        )
        return [t for t in out if t is not None]

    def _gather(
        self,
        plans: list[_Plan],
        requests: Sequence[tuple[str, int, int]],
        resolved: dict[str, tuple[KvManifestRow, _Shard, int]],
    ) -> list[np.ndarray]:
        import asyncio

        arrays = []
        for plan in plans:
            try:
                arrays.append(self._shards[plan.shard].array.async_array)
            except Exception as exc:
                ck = requests[plan.requests[0]][0]
                location = resolved[ck][0].location
                raise CorruptKvEntry(ck, location, f"shard unreadable: {exc}") from exc

        async def run() -> list[Any]:
            coros = []
            for plan, array in zip(plans, arrays, strict=True):
                t1 = min(plan.t1, array.shape[4])
                sel = (plan.slot, slice(None), slice(None), slice(None), slice(plan.t0, t1))
                coros.append(array.getitem(sel))
            return await asyncio.gather(*coros, return_exceptions=True)

        results = _zarr_sync(run())
        for plan, result in zip(plans, results, strict=True):
            if isinstance(result, BaseException):
                ck = requests[plan.requests[0]][0]
                row = resolved[ck][0]
                problem = self._diagnose(self._shards[plan.shard], plan.slot, result)
                raise CorruptKvEntry(ck, row.location, problem) from result
        return [np.asarray(r) for r in results]

    def _gather_ranges(
        self,
        plans: list[_Plan],
        requests: Sequence[tuple[str, int, int]],
        resolved: dict[str, tuple[KvManifestRow, _Shard, int]],
    ) -> list[np.ndarray]:
        """Object stores: the plans' blocks fetched by ranged GETs issued all at once, one per
        plan where its blocks lie back to back in the file (always, for shards written by
        :func:`encode_shard`; Zarr's own writer may order a multi-slot shard's blocks otherwise,
        and then each block is one GET), decoded here with every block's crc32c checked; each
        shard's index is fetched once per reader (one GET, crc32c-checked). Zarr's reader would
        issue one GET for the index and then one per block, one after the other, on every read.
        A shard whose ``zarr.json`` describes another format goes through Zarr
        (:meth:`_gather`)."""
        lay = self.layout
        dtype = _STORAGE_DTYPES[lay.dtype]
        out: list[np.ndarray | None] = [None] * len(plans)
        zarr_plans = [i for i, p in enumerate(plans) if not self._shards[p.shard].direct]
        if zarr_plans:
            got = self._gather([plans[i] for i in zarr_plans], requests, resolved)
            for i, array in zip(zarr_plans, got, strict=True):
                out[i] = array
        direct = [i for i in range(len(plans)) if out[i] is None]

        def fail(plan: _Plan, reason: str) -> CorruptKvEntry:
            ck = requests[plan.requests[0]][0]
            return CorruptKvEntry(ck, resolved[ck][0].location, reason)

        shards = [self._shards[n] for n in sorted({plans[i].shard for i in direct})]
        need_index = [s for s in shards if s.index is None]
        if need_index:
            paths, starts, ends = [], [], []
            for shard in need_index:
                slots, width = shard.shape[0], shard.shape[4]
                size = shard.files[_DATA_KEY]
                paths.append(str(self.root / shard.name / _DATA_KEY))
                starts.append(size - _index_bytes(slots, width, shard.block_tokens))
                ends.append(size)
            for shard, raw in zip(need_index, self._cat_ranges(paths, starts, ends), strict=True):
                plan = next(plans[i] for i in direct if plans[i].shard == shard.name)
                if isinstance(raw, BaseException):
                    raise fail(plan, f"read failed: {raw}") from raw
                shard.index = _parse_index(raw, shard.shape[0], shard.shape[4], shard.block_tokens)
                if shard.index is None:
                    raise fail(plan, "the shard index fails its crc32c")
        ranges: list[tuple[int, list[tuple[int, int, int]]]] = []  # (plan, [(block, off, n)])
        paths, starts, ends = [], [], []
        for i in direct:
            plan = plans[i]
            shard = self._shards[plan.shard]
            block = shard.block_tokens
            b0, b1 = plan.t0 // block, min(plan.t1, shard.shape[4]) // block
            entries = shard.index[plan.slot, b0:b1]  # type: ignore[index]
            stored = [
                (b, int(o), int(n))
                for b, (o, n) in zip(range(b0, b1), entries, strict=True)
                if o != _EMPTY
            ]
            path = str(self.root / plan.shard / _DATA_KEY)
            contiguous = all(
                stored[j + 1][1] == stored[j][1] + stored[j][2] for j in range(len(stored) - 1)
            )
            if stored and contiguous:
                groups = [stored]
            else:
                groups = [[item] for item in stored]
            for group in groups:
                ranges.append((i, group))
                paths.append(path)
                starts.append(group[0][1])
                ends.append(group[-1][1] + group[-1][2])
        fetched = self._cat_ranges(paths, starts, ends) if paths else []
        payload = lay.layers * 2 * lay.kv_heads * lay.head_dim * dtype.itemsize
        arrays: dict[int, np.ndarray] = {}
        for i in direct:
            plan = plans[i]
            t1 = min(plan.t1, self._shards[plan.shard].shape[4])
            arrays[i] = np.zeros(lay.entry_shape(t1 - plan.t0), dtype=dtype)
        for (i, group), raw in zip(ranges, fetched, strict=True):
            plan = plans[i]
            if isinstance(raw, BaseException):
                raise fail(plan, f"read failed: {raw}") from raw
            block = self._shards[plan.shard].block_tokens
            at = 0
            for b, _, n in group:
                chunk = raw[at : at + n]
                at += n
                problem = _block_problem(chunk, b, payload * block + 4)
                if problem:
                    raise fail(plan, problem)
                values = np.frombuffer(chunk[:-4], dtype=dtype).reshape(
                    lay.layers, 2, lay.kv_heads, block, lay.head_dim
                )
                t = b * block - plan.t0
                arrays[i][:, :, :, t : t + block] = values
        for i in direct:
            out[i] = arrays[i]
        return [a for a in out if a is not None]

    def _cat_ranges(self, paths: list[str], starts: list[int], ends: list[int]) -> list[Any]:
        """Byte ranges of objects, fetched concurrently; an exception in place of a failed one.
        Counted in the reader's statistics like Zarr's reads."""
        got = self.store.fs.cat_ranges(paths, starts, ends, on_error="return")
        for raw in got:
            if not isinstance(raw, BaseException):
                self._reader.data_bytes += len(raw)
                self._reader.data_gets += 1
        return got

    # ------------------------------------------------------------------ checks

    def invalid_entries(self, content_keys: Iterable[str], level: str = "stat") -> set[str]:
        """The keys (with a manifest row) whose entries fail a check (:meth:`entry_problems`)."""
        return set(self.entry_problems(content_keys, level))

    def entry_problems(self, content_keys: Iterable[str], level: str = "stat") -> dict[str, str]:
        """key -> why its entry fails a check, for the keys (with a manifest row) that do.

        ``stat``: the shard folder and metadata are readable, the slot holds that key and the
        data files have the sizes they were written with (one stat per shard; finds deleted and
        truncated shards). ``crc32c``: also reads each entry's blocks and the shard indexes and
        checks their crc32c (finds flipped bytes; reads every byte of the entries once, at
        crc32c's hardware speed). ``sha256`` (or ``full``): also reads every entry and checks
        the manifest's sha256 (the strongest check; sha256 costs about 6x crc32c per byte).
        """
        if level not in KV_CHECK_LEVELS:
            raise ValueError(f"unknown check level {level!r} ({', '.join(KV_CHECK_LEVELS)})")
        bad: dict[str, str] = {}
        file_checks: dict[str, str | None] = {}
        manifest = self.manifest()
        slots: dict[str, dict[int, str]] = defaultdict(dict)  # shard -> slot -> key
        for ck in content_keys:
            if ck not in manifest:
                continue
            try:
                if level in ("sha256", "full"):
                    self.read_entry(ck, verify=True)
                else:
                    _, shard, slot = self._resolve(ck, file_checks)
                    slots[shard.name][slot] = ck
            except CorruptKvEntry as exc:
                bad[ck] = f"{exc.reason} ({exc.location})"
        if level == "crc32c":
            for name, keys in slots.items():
                for slot, problem in self._verify_slots(self._shards[name], keys).items():
                    bad[keys[slot]] = f"{problem} ({manifest[keys[slot]].location})"
        return bad

    def _verify_slots(self, shard: _Shard, slots: Iterable[int]) -> dict[int, str]:
        """slot -> why its blocks are not as written (slots that check out are absent): the
        shard index and each slot's stored blocks are read, and their crc32c checked. A shard
        in another format than :func:`encode_shard`'s is read through Zarr (which checks each
        block's crc32c)."""
        slots = sorted(set(slots))
        if not shard.direct:
            problems = {}
            for slot in slots:
                try:
                    shard.array[slot, :, :, :, : shard.tokens[slot], :]
                except Exception as exc:
                    problems[slot] = _read_problem(exc)
            return problems
        n_slots, width, block = shard.shape[0], shard.shape[4], shard.block_tokens
        size = shard.files[_DATA_KEY]
        ranges = [(size - _index_bytes(n_slots, width, block), size)]
        try:
            (raw,) = self._read_ranges(shard, ranges)
        except OSError as exc:
            return dict.fromkeys(slots, f"read failed: {exc}")
        index = _parse_index(raw, n_slots, width, block)
        if index is None:
            return dict.fromkeys(slots, "the shard index fails its crc32c")
        expected = block * self.layout.token_bytes + 4
        groups: list[tuple[int, list[tuple[int, int, int]]]] = []  # (slot, [(block, off, n)])
        for slot in slots:
            stored = [(b, int(o), int(n)) for b, (o, n) in enumerate(index[slot]) if o != _EMPTY]
            stored.sort(key=lambda item: item[1])
            # blocks of one slot lie back to back (encode_shard); else one read per block
            if all(stored[j + 1][1] == stored[j][1] + stored[j][2] for j in range(len(stored) - 1)):
                groups.append((slot, stored))
            else:
                groups += [(slot, [item]) for item in stored]
        groups = [(slot, group) for slot, group in groups if group]
        # Object stores: every range requested at once; local: one slot's blocks at a time,
        # into one reused buffer (memory: one entry, whatever the shard's size).
        step = 1 if self.store.is_local else max(1, len(groups))
        problems: dict[int, str] = {}
        for first in range(0, len(groups), step):
            part = groups[first : first + step]
            try:
                got = self._read_ranges(shard, [(g[0][1], g[-1][1] + g[-1][2]) for _, g in part])
            except OSError as exc:
                problems.update((slot, f"read failed: {exc}") for slot, _ in part)
                continue
            for (slot, group), raw in zip(part, got, strict=True):
                at = 0
                for b, _, n in group:
                    problem = _block_problem(raw[at : at + n], b, expected)
                    at += n
                    if problem and slot not in problems:
                        problems[slot] = problem
        return problems

    def _diagnose(self, shard: _Shard, slot: int, exc: BaseException) -> str:
        """Why a read of ``slot`` failed: which block (or the index) fails its crc32c, found by
        checking the slot's blocks (shards in :func:`encode_shard`'s format), else ``exc``."""
        if shard.direct:
            try:
                problem = self._verify_slots(shard, [slot]).get(slot)
            except Exception:  # the diagnosis is best effort: the read failed either way
                problem = None
            if problem:
                return problem
        return _read_problem(exc)

    def _read_ranges(self, shard: _Shard, ranges: Sequence[tuple[int, int]]) -> list[Any]:
        """Byte ranges ``[start, end)`` of a shard's data file (OSError when one cannot be read
        whole). Local: into one reused buffer, so a range is valid until the next call."""
        path = self.root / shard.name / _DATA_KEY
        if not self.store.is_local:
            paths = [str(path)] * len(ranges)
            got = self._cat_ranges(paths, [a for a, _ in ranges], [b for _, b in ranges])
            for raw in got:
                if isinstance(raw, BaseException):
                    raise OSError(f"{self.store.uri(path)}: {raw}")
            return got
        buf = self._buffer("check", sum(b - a for a, b in ranges))
        out = []
        at = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            for start, end in ranges:
                view = buf[at : at + end - start]
                n = os.preadv(fd, [memoryview(view)], start)
                if n != end - start:
                    raise OSError(f"{path}: read {n} of {end - start} bytes at {start}")
                out.append(view)
                at += end - start
        finally:
            os.close(fd)
        return out

    # ------------------------------------------------------------------ writes

    def _next_shard_number(self) -> int:
        on_disk = [int(n.removeprefix("shard-")) for n in self.shard_names()]
        self.manifest()
        return max([-1, self._max_manifest_shard, *on_disk]) + 1

    def write_entries(
        self, entries: Sequence[tuple[ChunkRow, torch.Tensor]], run_id: str
    ) -> list[KvManifestRow]:
        """Store entries, ``slots_per_shard`` per shard, and append their manifest rows.

        ``entries``: ``(chunk, kv)`` with ``kv`` of shape ``(layers, 2, kv_heads,
        chunk.n_tokens, head_dim)`` in the layout's dtype. Entries are keyed by
        ``chunk.content_key``; a key repeated in ``entries`` is stored once (first chunk wins).
        Each shard is written whole, read back and verified, renamed into place, and only then
        are its rows appended; the rows of all shards are returned.
        """
        unique = self._checked(entries)
        rows: list[KvManifestRow] = []
        step = self.layout.slots_per_shard
        for start in range(0, len(unique), step):
            staged = self.stage_shard(unique[start : start + step], run_id)
            rows += self.publish_shard(staged, run_id)
        return rows

    def _checked(
        self, entries: Sequence[tuple[ChunkRow, torch.Tensor]]
    ) -> list[tuple[ChunkRow, torch.Tensor]]:
        """The entries with distinct content_keys (first wins), each checked against the
        layout's shape and dtype (ValueError naming the chunk)."""
        seen: set[str] = set()
        unique: list[tuple[ChunkRow, torch.Tensor]] = []
        for chunk, kv in entries:
            if chunk.content_key in seen:
                continue
            seen.add(chunk.content_key)
            expected = self.layout.entry_shape(chunk.n_tokens)
            if tuple(kv.shape) != expected:
                raise ValueError(
                    f"KV of {chunk.chunk_id} has shape {tuple(kv.shape)}, expected {expected}"
                )
            if kv.dtype != self.layout.torch_dtype:
                raise ValueError(
                    f"KV of {chunk.chunk_id} is {kv.dtype}, the layout is {self.layout.dtype}"
                )
            unique.append((chunk, kv))
        return unique

    def stage_shard(
        self, group: Sequence[tuple[ChunkRow, torch.Tensor]], run_id: str
    ) -> StagedShard:
        """Write one shard of ``group`` (``(chunk, kv)``, distinct content_keys, at most
        ``slots_per_shard``) under ``.tmp-<uuid>/``, read it back and verify it; nothing is
        valid until :meth:`publish_shard`. Safe to call from several processes at once: it
        writes only its own new folder."""
        group = self._checked(group)
        if not 0 < len(group) <= self.layout.slots_per_shard:
            raise ValueError(
                f"a shard holds 1..{self.layout.slots_per_shard} entries, got {len(group)}"
            )
        lay = self.layout
        t0 = time.perf_counter()
        views = [storage_view(kv) for _, kv in group]
        tokens = [int(v.shape[3]) for v in views]
        block = lay.block_tokens
        width = max(block, -(-max(tokens) // block) * block)
        shape = (len(group), *lay.entry_shape(width))
        checksums = [entry_checksum(v) for v in views]
        tmp_name = f".tmp-{uuid.uuid4().hex}"
        if self.store.is_local:
            tmp = Path(self.root) / tmp_name
        else:  # encoded and verified here, then uploaded (see the module doc)
            scratch = Path(tempfile.mkdtemp(prefix="coinrag-shard-"))
            tmp = scratch / tmp_name
        attrs: dict[str, Any] = {
            "kv_fp": self.kv_fp,
            "content_keys": [chunk.content_key for chunk, _ in group],
            "tokens": tokens,
            "sha256": checksums,
            "run_id": run_id,
            "block_tokens": block,
            "encoder": self.encoder,
        }
        try:
            if self.encoder == "zarr":
                files, t1 = self._write_with_zarr(tmp, views, shape, attrs)
            else:
                files, t1 = self._write_direct(tmp, views, shape, attrs)
            if self.fsync and self.store.is_local:
                _fsync_tree(tmp)
            if not self.store.is_local:
                try:
                    _upload_folder(self.store, tmp, self.root / tmp_name)
                except BaseException:
                    self.store.remove(self.root / tmp_name)
                    raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if not self.store.is_local:
                shutil.rmtree(tmp.parent, ignore_errors=True)
        return StagedShard(
            kv_fp=self.kv_fp,
            tmp_name=tmp_name,
            chunk_ids=tuple(chunk.chunk_id for chunk, _ in group),
            content_keys=tuple(chunk.content_key for chunk, _ in group),
            tokens=tuple(tokens),
            checksums=tuple(checksums),
            logical_bytes=sum(lay.entry_bytes(t) for t in tokens),
            disk_bytes=sum(files.values()),
            encode_write_s=t1 - t0,
            verify_s=time.perf_counter() - t1,
        )

    def publish_shard(self, staged: StagedShard, run_id: str) -> list[KvManifestRow]:
        """Make a staged shard valid: rename it to the next ``shard-NNNNNN`` (atomic) and append
        its manifest rows (``run_id``: the publishing run's). Only the write-lock holder calls
        this, so shard numbers are given in publication order."""
        if staged.kv_fp != self.kv_fp:
            raise KvFingerprintMismatch(staged.kv_fp, self.kv_fp, f"staged {staged.tmp_name}")
        from storage.tables import append_rows

        tmp = self.root / staged.tmp_name
        if not self.store.is_file(tmp / "zarr.json"):
            raise KvError(
                f"staged shard {self.store.uri(tmp)} is missing "
                "(was it written on another machine's local disk?)"
            )
        try:
            name = self._rename_into_place(tmp)
        except BaseException:
            self.store.remove(tmp)
            raise
        lay = self.layout
        st = self.write_stats
        st.shards += 1
        st.entries += len(staged.content_keys)
        st.logical_bytes += staged.logical_bytes
        st.disk_bytes += staged.disk_bytes
        st.encode_write_s += staged.encode_write_s
        st.verify_s += staged.verify_s
        rows = [
            KvManifestRow(
                chunk_id=chunk_id,
                content_key=content_key,
                model_fp=lay.model_fp,
                location=f"{self.kv_fp}/{name}#slot-{i}",
                tokens=tokens,
                bytes=lay.entry_bytes(tokens),
                checksum=checksum,
                run_id=run_id,
                code_version=CODE_VERSION,
            )
            for i, (chunk_id, content_key, tokens, checksum) in enumerate(
                zip(
                    staged.chunk_ids,
                    staged.content_keys,
                    staged.tokens,
                    staged.checksums,
                    strict=True,
                )
            )
        ]
        t0 = time.perf_counter()
        append_rows(self.store, rows, run_id, "kv")
        st.manifest_s += time.perf_counter() - t0
        manifest = self.manifest()
        for row in rows:
            manifest[row.content_key] = row
        self._max_manifest_shard = max(
            self._max_manifest_shard, _location_order(rows[0].location)[0]
        )
        return rows

    def _create_shard_array(
        self, tmp: Path, shape: tuple[int, ...], attrs: dict[str, Any]
    ) -> zarr.Array:
        lay = self.layout
        return zarr.create_array(
            store=LocalStore(tmp),
            shape=shape,
            chunks=(1, lay.layers, 2, lay.kv_heads, lay.block_tokens, lay.head_dim),
            shards=shape,
            dtype=_STORAGE_DTYPES[lay.dtype],
            compressors=[Crc32cCodec()],
            fill_value=0,
            dimension_names=AXES,
            chunk_key_encoding={"name": "default", "separator": "/"},
            attributes={_ATTR: attrs},
            zarr_format=3,
        )

    def _write_direct(
        self, tmp: Path, views: list[np.ndarray], shape: tuple[int, ...], attrs: dict[str, Any]
    ) -> tuple[dict[str, int], float]:
        """Encode the shard file here (see :func:`encode_shard`), write it with one call, read
        it back and compare the whole file's crc32c with the encoded buffer's: the bytes on disk
        are the bytes encoded from the very arrays the manifest's sha256 were computed from,
        and each inner chunk carries its own crc32c, checked by every read."""
        size = _shard_size(views, shape[4], self.layout.block_tokens)
        padded = _round_up(size, _ALIGN)
        encoded = self._buffer("encode", padded)
        data = encode_shard(views, shape[4], self.layout.block_tokens, encoded)
        expected = google_crc32c.value(data)
        rel = _DATA_KEY  # the one shard of the array: chunk (0, ..., 0)
        attrs["files"] = {rel: size}
        self._create_shard_array(tmp, shape, attrs)
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        direct = self._write_file(path, encoded[:padded], size)
        t1 = time.perf_counter()
        back = self._buffer("verify", padded)
        got = _read_file(path, back[:padded], direct)
        if got != size or google_crc32c.value(back[:got]) != expected:
            raise KvError(f"shard {tmp.name} does not read back as written")
        return attrs["files"], t1

    def _write_file(self, path: Path, padded: np.ndarray, size: int) -> bool:
        """Write ``padded[:size]`` to a new file; True if written with O_DIRECT.

        O_DIRECT (Linux, when the file system takes it) sends the pages straight to the device:
        no page-cache copy (on this kind of VM, allocating page cache for a new file costs more
        CPU than encoding the shard), and the read-back then really reads the device. The write
        is page-aligned and page-sized (``padded``), then the file is truncated to ``size``.
        Without O_DIRECT support the file is written through the page cache.
        """
        if self.direct_io and hasattr(os, "O_DIRECT"):
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT
            try:
                fd = os.open(path, flags, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct_io = False  # e.g. tmpfs
            else:
                try:
                    view = memoryview(padded)
                    done = 0
                    while done < len(view):
                        done += os.write(fd, view[done:])
                    os.ftruncate(fd, size)
                    return True
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self.direct_io = False
                    os.unlink(path)
                finally:
                    os.close(fd)
        with open(path, "wb") as f:
            f.write(memoryview(padded[:size]))
        return False

    def _write_with_zarr(
        self, tmp: Path, views: list[np.ndarray], shape: tuple[int, ...], attrs: dict[str, Any]
    ) -> tuple[dict[str, int], float]:
        """The reference path: Zarr's own sharding encoder (whole shard in one write), read
        back through Zarr (every crc32c checked) and compared with the entries."""
        data = np.zeros(shape, dtype=_STORAGE_DTYPES[self.layout.dtype])
        for i, v in enumerate(views):
            data[i, :, :, :, : v.shape[3], :] = v
        array = self._create_shard_array(tmp, shape, {**attrs, "files": {}})
        array[...] = data
        attrs["files"] = {
            str(p.relative_to(tmp)): p.stat().st_size
            for p in tmp.rglob("*")
            if p.is_file() and p.name != "zarr.json"
        }
        array.update_attributes({_ATTR: attrs})
        t1 = time.perf_counter()
        back = zarr.open_array(store=LocalStore(tmp, read_only=True), mode="r")[...]
        if not np.array_equal(back, data):
            raise KvError(f"shard {tmp.name} does not read back as written")
        return attrs["files"], t1

    def _rename_into_place(self, tmp: PurePath) -> str:
        number = self._next_shard_number()
        if not self.store.is_local:
            self.store.check_write_lock()
            while not _claim(self.store, self.root / f"shard-{number:06d}" / _CLAIM):
                number += 1
            name = f"shard-{number:06d}"
            _copy_folder(self.store, tmp, self.root / name)
            self.store.remove(tmp)
            return name
        while True:
            name = f"shard-{number:06d}"
            try:
                os.rename(tmp, self.root / name)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    number += 1
                    continue
                raise
            if self.fsync:
                _fsync_dir(self.root)
            return name

    # ------------------------------------------------------------------ prefix

    def write_prefix(self, prefix_kv: torch.Tensor, prefix_ids: Sequence[int]) -> None:
        """Store ``C_p``: ``(layers, 2, kv_heads, len(prefix_ids), head_dim)``. Written once;
        a second call with the same ids is a no-op."""
        ids = [int(t) for t in prefix_ids]
        expected = self.layout.entry_shape(len(ids))
        if tuple(prefix_kv.shape) != expected:
            raise ValueError(f"prefix KV has shape {tuple(prefix_kv.shape)}, expected {expected}")
        if prefix_kv.dtype != self.layout.torch_dtype:
            raise ValueError(f"prefix KV is {prefix_kv.dtype}, layout is {self.layout.dtype}")
        if self.has_prefix():
            _, stored_ids = self.read_prefix()
            if stored_ids != ids:
                raise KvFingerprintMismatch(
                    self.kv_fp, self.kv_fp, "the stored prefix has other token ids"
                )
            return
        stored = to_storage(prefix_kv)
        if self.store.is_local:
            tmp = Path(self.root) / f".tmp-{uuid.uuid4().hex}"
        else:
            tmp = Path(tempfile.mkdtemp(prefix="coinrag-prefix-")) / "prefix"
        try:
            array = zarr.create_array(
                store=LocalStore(tmp),
                shape=stored.shape,
                chunks=stored.shape,
                dtype=stored.dtype,
                compressors=[Crc32cCodec()],
                fill_value=0,
                dimension_names=AXES[1:],
                attributes={
                    _ATTR: {
                        "prefix_ids": ids,
                        "prefix_sha": self.layout.prefix_sha,
                        "sha256": entry_checksum(stored),
                    }
                },
                zarr_format=3,
            )
            array[...] = stored
            back = zarr.open_array(store=LocalStore(tmp, read_only=True), mode="r")[...]
            if not np.array_equal(back, stored):
                raise KvError("prefix KV does not read back as written")
            if not self.store.is_local:
                _upload_folder(self.store, tmp, self.root / _PREFIX)
                return
            if self.fsync:
                _fsync_tree(tmp)
            try:
                os.rename(tmp, self.root / _PREFIX)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        finally:
            shutil.rmtree(tmp if self.store.is_local else tmp.parent, ignore_errors=True)

    def has_prefix(self) -> bool:
        return self.store.is_file(self.root / _PREFIX / "zarr.json")

    def read_prefix(self) -> tuple[torch.Tensor, list[int]]:
        """``(C_p, prefix_ids)``: ``(layers, 2, kv_heads, |p|, head_dim)``, sha256-checked."""
        location = f"{self.kv_fp}/{_PREFIX}"
        try:
            array = zarr.open_array(store=self._reader, path=_PREFIX, mode="r")
            attrs = dict(array.attrs.get(_ATTR) or {})
            stored = np.ascontiguousarray(array[...])
        except FileNotFoundError as exc:
            raise MissingKvEntry(f"no prefix KV under {self.kv_fp}") from exc
        except Exception as exc:
            raise CorruptKvEntry("prefix", location, _read_problem(exc)) from exc
        if attrs.get("prefix_sha") != self.layout.prefix_sha:
            raise KvFingerprintMismatch(str(attrs.get("prefix_sha")), self.layout.prefix_sha)
        if entry_checksum(stored) != attrs.get("sha256"):
            raise CorruptKvEntry("prefix", location, "sha256 differs")
        return from_storage(stored, self.layout.dtype), [int(t) for t in attrs["prefix_ids"]]

    def corrupt_prefix(self) -> str | None:
        """Why the stored ``C_p`` fails its check (unreadable, a crc32c or its sha256), or
        None when it checks out or none is stored."""
        if not self.has_prefix():
            return None
        try:
            self.read_prefix()
        except MissingKvEntry:
            return None
        except CorruptKvEntry as exc:
            return exc.reason
        return None

    def repair_prefix(self, prefix_kv: torch.Tensor, prefix_ids: Sequence[int]) -> bool:
        """Replace a stored ``C_p`` that fails its check by ``prefix_kv`` (recomputed by the
        caller, who holds the write lock). True when ``prefix_kv`` is bit for bit the prefix it
        replaces (the sha256 and token ids the damaged copy's metadata recorded): then the
        entries computed against it stay valid; otherwise the caller must rebuild them all.

        The damaged folder is moved aside as a ``.tmp-`` leftover (``gc`` removes it) before
        the new one is written."""
        recorded: tuple[str, list[int]] | None = None
        try:
            meta = json.loads(self.store.read_bytes(self.root / _PREFIX / "zarr.json"))
            attrs = meta["attributes"][_ATTR]
            recorded = (str(attrs["sha256"]), [int(t) for t in attrs["prefix_ids"]])
        except Exception:  # unreadable metadata: nothing to compare with
            recorded = None
        if self.store.is_local:
            aside = Path(self.root) / f".tmp-corrupt-prefix-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(Path(self.root) / _PREFIX, aside)
            except FileNotFoundError:
                pass
        else:
            self.store.remove(self.root / _PREFIX)
        self.write_prefix(prefix_kv, prefix_ids)
        fresh = (entry_checksum(to_storage(prefix_kv)), [int(t) for t in prefix_ids])
        return recorded == fresh

    # ------------------------------------------------------------------ garbage

    def garbage(self) -> list[PurePath]:
        """Folders no current manifest row points to: orphan and superseded shards, ``.tmp-``
        leftovers of killed writes."""
        live = {parse_location(r.location)[1] for r in self.manifest(refresh=True).values()}
        out = [self.root / n for n in self.shard_names() if n not in live]
        out += [self.root / n for n in self.store.list_names(self.root) if n.startswith(".tmp-")]
        return out

    def gc(self) -> list[PurePath]:
        """Remove :meth:`garbage` (the caller holds the store's write lock); return it."""
        removed = self.garbage()
        for path in removed:
            self._shards.pop(path.name, None)
            self._shards_checked.discard(path.name)
            self.store.remove(path)
        return removed

    def reclaim(self, live: set[str], run_id: str, dry_run: bool = False) -> KvReclaim:
        """Drop the entries whose content_key is not in ``live``; return what was (or, with
        ``dry_run``, would be) reclaimed. The caller holds the store's write lock.

        Shards are written once and never modified, so a shard holding dead entries is dealt
        with whole: 1. the live entries of a partly dead shard are read (sha256-checked) and
        written to new shards exactly as the build writes them (written whole, read back and
        verified, renamed, then their manifest rows appended: the new rows supersede the old
        ones); 2. the ``kv_manifest`` files holding rows of this kv_fp that are no longer
        current and live are rewritten without them (new file first, then the old one goes);
        3. shard folders no manifest row points to any more, and ``.tmp-`` leftovers, are
        removed. A crash between steps leaves valid entries only: at worst duplicate manifest
        rows (identical) or orphan folders, which the next ``gc`` removes. An entry that fails
        its check while being moved is dropped (the kv stage rebuilds it when it is needed).
        """
        from storage.tables import rewrite_rows

        out = KvReclaim(kv_fp=self.kv_fp)
        manifest = self.manifest(refresh=True)
        by_shard: dict[str, list[tuple[int, str]]] = defaultdict(list)
        for ck, row in manifest.items():
            _, name, slot = parse_location(row.location)
            by_shard[name].append((slot, ck))
        dead = {ck for ck in manifest if ck not in live}
        out.entries_dropped = len(dead)
        out.entries_live = len(manifest) - len(dead)
        out.logical_bytes_dropped = sum(manifest[ck].bytes for ck in dead)
        moving: list[str] = []
        for _name, slots in sorted(by_shard.items()):
            n_dead = sum(ck in dead for _, ck in slots)
            if n_dead and n_dead < len(slots):
                out.shards_compacted += 1
                moving += [ck for _, ck in sorted(slots) if ck not in dead]
        out.entries_moved = len(moving)
        step = self.layout.slots_per_shard
        if dry_run:  # what the run below frees and writes, assuming every moved entry verifies
            dropped = {
                name for name, slots in by_shard.items() if any(ck in dead for _, ck in slots)
            }
            unreferenced = [p for p in self.garbage() if p.name not in by_shard]
            out.bytes_freed = sum(self.store.tree_bytes(self.root / n) for n in dropped) + sum(
                self.store.tree_bytes(p) for p in unreferenced
            )
            out.folders_removed = len(dropped) + len(unreferenced)
            out.bytes_written = sum(
                self._planned_shard_bytes([manifest[ck] for ck in moving[i : i + step]], run_id)
                for i in range(0, len(moving), step)
            )
            return out
        new_shards: set[str] = set()
        for start in range(0, len(moving), step):
            group = []
            for ck in moving[start : start + step]:
                row = manifest[ck]
                try:
                    kv = self.read_entry(ck, verify=True)
                except (CorruptKvEntry, MissingKvEntry):
                    out.entries_corrupt += 1
                    continue
                group.append((_EntryRef(row.chunk_id, ck, row.tokens), kv))
            if group:
                rows = self.write_entries(group, run_id)  # type: ignore[arg-type]
                new_shards.update(parse_location(r.location)[1] for r in rows)
        out.bytes_written = sum(self.store.tree_bytes(self.root / n) for n in new_shards)
        current = self.manifest()
        keep = {row.location for ck, row in current.items() if ck in live}
        prefix = self.kv_fp + "/"
        out.manifest_rows_dropped = rewrite_rows(
            self.store,
            KvManifestRow,
            lambda loc: not loc.startswith(prefix) or loc in keep,
            "location",
            run_id,
            "gc",
        )
        self._manifest = None
        for path in self.garbage():
            out.bytes_freed += self.store.tree_bytes(path)
            out.folders_removed += 1
            self._shards.pop(path.name, None)
            self._shards_checked.discard(path.name)
            self.store.remove(path)
        return out

    def _planned_shard_bytes(self, rows: list[KvManifestRow], run_id: str) -> int:
        """Bytes on disk of the shard :meth:`stage_shard` would write for these entries: its
        data file (:func:`_shard_size`, from the token counts) and its ``zarr.json``
        (rendered by Zarr in a scratch folder, with the attributes the real shard gets)."""
        lay = self.layout
        block = lay.block_tokens
        tokens = [r.tokens for r in rows]
        width = max(block, -(-max(tokens) // block) * block)
        zero = np.zeros((), dtype=_STORAGE_DTYPES[lay.dtype])
        shapes = [np.broadcast_to(zero, lay.entry_shape(t)) for t in tokens]  # no memory
        data = _shard_size(shapes, width, block)
        attrs = {  # as stage_shard writes them (tests/test_cli_store_commands.py compares)
            "kv_fp": self.kv_fp,
            "content_keys": [r.content_key for r in rows],
            "tokens": tokens,
            "sha256": [r.checksum for r in rows],
            "run_id": run_id,
            "block_tokens": block,
            "encoder": self.encoder,
            "files": {_DATA_KEY: data},
        }
        with tempfile.TemporaryDirectory(prefix="coinrag-gc-plan-") as scratch:
            self._create_shard_array(Path(scratch), (len(rows), *lay.entry_shape(width)), attrs)
            meta = (Path(scratch) / "zarr.json").stat().st_size
        return data + meta


@dataclass
class KvReclaim:
    """What :meth:`KvStore.reclaim` did for one kv_fp (bytes are bytes on disk)."""

    kv_fp: str
    entries_live: int = 0
    entries_dropped: int = 0  # content_keys no live chunk references
    logical_bytes_dropped: int = 0
    entries_moved: int = 0  # live entries copied out of partly dead shards
    entries_corrupt: int = 0  # failed their check while being moved: dropped
    shards_compacted: int = 0
    manifest_rows_dropped: int = 0
    folders_removed: int = 0  # shard folders and .tmp- leftovers
    bytes_freed: int = 0
    bytes_written: int = 0  # new shards of moved entries (their folders: data + zarr.json)

    @property
    def bytes_reclaimed(self) -> int:
        return self.bytes_freed - self.bytes_written


@dataclass(frozen=True)
class _EntryRef:
    """What :meth:`KvStore.write_entries` reads of a chunk, for an entry being moved."""

    chunk_id: str
    content_key: str
    n_tokens: int


_DIRECT_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


def _is_direct_format(meta: dict[str, Any], sharding: dict[str, Any]) -> bool:
    """True when a shard's zarr.json says exactly the format :func:`encode_shard` writes (one
    shard per array; inner and index codecs ``[bytes(little), crc32c]``; index at the end)."""
    config = sharding.get("configuration", {})
    shape = list(meta.get("shape", []))
    grid = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
    return (
        sharding.get("name") == "sharding_indexed"
        and config.get("codecs") == _DIRECT_CODECS
        and config.get("index_codecs") == _DIRECT_CODECS
        and config.get("index_location", "end") == "end"
        and grid == shape
        and meta.get("chunk_key_encoding", {}).get("configuration", {}).get("separator") == "/"
    )


def _zarr_store(store: Store, path: PurePath, read_only: bool = False) -> Any:
    """The Zarr store of a folder of ``store``: a LocalStore, or an FsspecStore (async s3fs)."""
    if store.is_local:
        return LocalStore(path, read_only=read_only)
    return FsspecStore.from_url(
        store.uri(path), storage_options=zarr_storage_options(store.scheme), read_only=read_only
    )


def _upload_order(files: Iterable[PurePath]) -> list[PurePath]:
    """Data files before metadata: a folder's ``zarr.json`` lands last, so a folder whose
    metadata can be read has all its data."""
    return sorted(files, key=lambda p: (p.name == "zarr.json", str(p)))


def _upload_folder(store: Store, local: Path, remote: PurePath) -> None:
    """Upload every file under ``local`` to ``remote`` (data first, ``zarr.json`` last) and
    read each data file back: its crc32c must be the local file's."""
    fs = store.fs
    for path in _upload_order(p for p in local.rglob("*") if p.is_file()):
        rel = path.relative_to(local).as_posix()
        data = path.read_bytes()
        fs.pipe_file(str(remote / rel), data)
        if path.name != "zarr.json":
            back = fs.cat_file(str(remote / rel))
            if google_crc32c.value(bytes(back)) != google_crc32c.value(data):
                raise KvError(f"{store.uri(remote / rel)} does not read back as uploaded")


_CLAIM = ".claim"  # object stores: created (conditionally) before a shard is copied into place


def _claim(store: Store, path: PurePath) -> bool:
    """Create ``path`` only if it does not exist (``If-None-Match: *``): True if we created it.
    A shard number is claimed this way, so two writers (one of them fenced off too late) never
    copy into one shard folder."""
    bucket, _, key = str(path).partition("/")
    try:
        store.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"", IfNoneMatch="*")
    except OSError as exc:
        if precondition_failed(exc):
            return False
        raise
    return True


def _copy_folder(store: Store, src: PurePath, dst: PurePath) -> None:
    """Server-side copy of every object under ``src`` to ``dst`` (data first, ``zarr.json``
    last)."""
    fs = store.fs
    files = [PurePath(p) for p in fs.find(str(src))]
    for path in _upload_order(files):
        fs.copy(str(path), str(dst / path.relative_to(src)))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (durability against power loss)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))
