"""The KV store (``STORE/kv/``): per-chunk K/V of one (generation model, prompt prefix).

One module per job (import the public names from here):

- ``layout.py``: the layout contract (in memory, after RoPE, on disk, after re-rotation), the
  identity ``kv_fp``, :class:`KvLayout`, entry locations; ``errors.py``: :class:`KvError` and
  its kinds (corrupt, missing, unstored slice, fingerprint mismatch);
- ``kept.py``: which tokens of its chunk an entry holds (``kv_keep``: whole chunks or only the
  ranges its nuggets cover) and the entry's key;
- ``codecs.py``: how a tensor becomes stored values and back (:class:`KvCodec`, by name:
  ``none``, ``int8``, ``int4``); ``lowbit.py``: ``int2`` (2-bit codes, 8-bit scales);
  ``mixed.py``: ``int2mix`` (int2's bytes, keys in mixed precision by range);
- ``shard.py``: the shard file (Zarr v3 sharding format, per-block crc32c, index), encoded and
  checked;
- ``transport.py``: local disk or object store, one interface (stage, publish, ranged reads);
- ``reads.py``: slice reads planned into block reads and fetched;
- ``store.py``: :class:`KvStore` (manifest, reads, checks, writes, the prefix ``C_p``);
- ``basis.py``, ``basis_folder.py``: the key basis of ``int2basis`` and where it is stored;
- ``reclaim.py``: garbage, dead entries, and the dry-run plan.
"""

from coinrag.storage.kv.codecs import (
    KV_CODECS,
    KvCodec,
    codec_named,
    entry_checksum,
    from_storage,
    storage_view,
    to_storage,
)
from coinrag.storage.kv.errors import (
    CorruptKvEntry,
    KvError,
    KvFingerprintMismatch,
    MissingKvEntry,
    UnstoredKvSlice,
)
from coinrag.storage.kv.kept import KeptRanges, KvEntry, entry_key
from coinrag.storage.kv.layout import (
    DEFAULT_BLOCK_TOKENS,
    KV_CHECK_LEVELS,
    LAYOUT_VERSION,
    SHARD_OVERHEAD_BYTES,
    KvLayout,
    kv_fingerprint,
    parse_location,
)
from coinrag.storage.kv.lowbit import Int2Codec  # registers int2
from coinrag.storage.kv.mixed import Int2BasisCodec, Int2MixCodec  # registers int2mix, int2basis
from coinrag.storage.kv.reads import ReadStats
from coinrag.storage.kv.reclaim import KvReclaim
from coinrag.storage.kv.shard import encode_shard
from coinrag.storage.kv.store import KvStore, stored_content_keys
from coinrag.storage.kv.transport import kv_free_bytes
from coinrag.storage.kv.writes import StagedShard, WriteStats

assert set(KV_CODECS) == set(KvCodec.registry), "schemas.settings.KV_CODECS names every codec"

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "KV_CHECK_LEVELS",
    "KV_CODECS",
    "LAYOUT_VERSION",
    "SHARD_OVERHEAD_BYTES",
    "CorruptKvEntry",
    "Int2BasisCodec",
    "Int2Codec",
    "Int2MixCodec",
    "KeptRanges",
    "KvCodec",
    "KvEntry",
    "KvError",
    "KvFingerprintMismatch",
    "KvLayout",
    "KvReclaim",
    "KvStore",
    "MissingKvEntry",
    "ReadStats",
    "StagedShard",
    "UnstoredKvSlice",
    "WriteStats",
    "codec_named",
    "encode_shard",
    "entry_key",
    "entry_checksum",
    "from_storage",
    "kv_fingerprint",
    "kv_free_bytes",
    "parse_location",
    "storage_view",
    "stored_content_keys",
    "to_storage",
]
