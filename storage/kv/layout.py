"""The KV layout contract, the identity of a KV store and entry locations (its errors:
``storage/kv/errors.py``).

The layout contract (like the comment at the top of transformers' ``cache_utils.py``)
====================================================================================

This is the one statement of how coinrag holds KV; every other module points here.

In memory
---------
One entry (the KV of one chunk, or of the prompt prefix, or a cartridge) is a tensor::

    kv[layer, kind, head, token, dim]      shape (layers, 2, kv_heads, tokens, head_dim)

``kind`` 0 is K, 1 is V. transformers caches ``(batch, kv_heads, seq, head_dim)`` per layer
(``DynamicCache.layers[i].keys`` / ``.values``); ``inference/model/encode.py`` is the one module
that converts between such a cache and this layout (``cache_to_kv``, ``to_dynamic_cache``). The
dtype is the model's (``bfloat16``, ``float16`` or ``float32``).

After RoPE, at the positions of the forward that computed it
-----------------------------------------------------------
Keys are held *after* RoPE, exactly as transformers caches them. A chunk's entry was computed by
``forward(chunk, past_key_values=C_p)`` (``inference/model/encode.py``): token ``t`` of the chunk
sits at absolute position ``|p| + t``, right after the RAG prompt prefix ``p``
(``inference/model/prompt.py``), attending to ``p`` and to the chunk's earlier tokens, in a forward
of length ``|p| + tokens`` (RoPE types whose frequencies depend on the length, ``dynamic`` and
``longrope``, use that length). ``C_p`` (the prefix's own KV) sits at ``0 .. |p| - 1``. A
cartridge (``training/cartridges.py``) is held at the canonical positions ``0 .. p - 1``. Values
do not depend on position.

After re-rotation (assembly)
----------------------------
``inference/context/assemble.py`` moves slices of entries to new contiguous positions after ``C_p``
by re-rotating their keys (``inference/rope/__init__.py``: exact RoPE rotations, the
length-dependent frequencies of the forward the assembled context stands for); values are copied as
they are. The assembled context keeps this layout, ``(layers, 2, kv_heads, |p| + Σ n_i, head_dim)``,
and enters the model as a batch-1 ``DynamicCache``.

On disk (``STORE/kv/<kv_fp>/``, a Zarr 3 group)
-----------------------------------------------
::

    zarr.json            group; attributes["coinrag_kv"] = the KvLayout + kv_fp (checked on open)
    prefix/              array (layers, 2, kv_heads, |p|, head_dim): the prefix's own KV C_p,
                         attributes: prefix_ids, prefix_sha, sha256
    shard-000000/        array (slots, layers, 2, kv_heads, tokens, head_dim): one shard = one
    shard-000001/        file of `slots` entries, written once and never modified
    ...
    .tmp-<uuid>/         a shard being written (renamed into place when verified)

- Entries are stored exactly as held in memory, keys after RoPE; the codec
  (``storage/kv/codecs.py``) maps the model dtype to the stored one: bfloat16 as its raw bits in a
  ``uint16`` array (Zarr 3 has no bfloat16), float32 / float16 as themselves; bit-exact.
  Little-endian, C order.
- A shard array has exactly one Zarr shard, so it is one data file (``c/0/0/0/0/0/0``) plus its
  ``zarr.json``; inner chunks are ``(1, layers, 2, kv_heads, block_tokens, head_dim)``: one slot,
  every layer and head, a block of ``block_tokens`` (default 16) tokens, each with its crc32c
  (the byte format: ``storage/kv/shard.py``). Reading a token range ``[s, e)`` reads the shard
  index and the ``ceil``-aligned blocks covering the range, nothing else.
- The token axis of a shard is its longest entry rounded up to ``block_tokens``; shorter entries
  (a document's last chunk) are zero-padded, and blocks holding only padding are not stored.
- The shard's attributes record its files' sizes and, per slot, the entry's content_key, token
  count and sha256. An entry is valid only once its manifest row exists
  (``storage/kv/store.py``).

What an entry holds (``kv_keep``, ``storage/kv/kept.py``)
------------------------------------------------------
With ``kv_keep = "chunks"`` an entry is its whole chunk, as above. With ``kv_keep = "nuggets"``
the chunk is encoded exactly the same way (in full, after ``C_p``), and the entry holds only the
token ranges its nuggets cover, concatenated: ``(layers, 2, kv_heads, Σ (e_i - s_i), head_dim)``
for kept ranges ``[s_i, e_i)`` of the chunk. Keys stay in the frame of the full forward (token
``t`` of the chunk after RoPE at ``|p| + t``, whether or not its neighbours were kept; or, for a
quantized codec, rotated back to position 0 before the ranges are cut: ``KvLayout.keys_at_zero``),
so with codec ``none`` a nugget's slice read from such an entry is bit for bit the slice of the
whole-chunk entry (a quantized codec quantizes the concatenated ranges block by block: equal
within the codec's stated bound). A read of chunk tokens outside the kept ranges raises
:class:`UnstoredKvSlice` (never zeros).

Manifest rows: ``model_fp`` is the generation model's fingerprint; ``location`` is the entry's
path inside ``STORE/kv/``: ``"<kv_fp>/shard-000012#slot-5"``; ``tokens`` is the chunk's token
count; ``kept`` the ranges the entry holds (NULL: the whole chunk); ``bytes`` is the entry's
logical size (stored tokens x bytes per token); ``checksum`` is the sha256 of the entry's bytes as
stored (C-contiguous ``(layers, 2, kv_heads, stored tokens, head_dim)``, uint16 bits for
bfloat16).

Identity
--------
``kv_fp = fingerprint("kv", {model_fp, prefix_sha, layout_version[, kv_codec, block_tokens]
[, kv_keep]})`` (the codec only when lossy, ``kv_keep`` only when it is ``"nuggets"``, so stores
of whole chunks in codec ``none`` keep their fingerprint): the same
tokens after the same prefix through the same model give the same KV, and a store keeping only
nugget spans is another store. Entries are keyed by the chunk's ``content_key`` (plus a digest of
the kept ranges with ``kv_keep = "nuggets"``: ``storage/kv/kept.py``), so the same tokens in
another document reuse the entry. Opening the KV of another fingerprint raises
:class:`KvFingerprintMismatch` naming both.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coinrag.schemas.keys import fingerprint
from coinrag.schemas.settings import KV_KEEPS
from coinrag.storage.kv.basis import BasisSlot
from coinrag.storage.kv.codecs import (
    STORAGE_DTYPES,
    TORCH_DTYPES,
    IdentityCodec,
    KvCodec,
    codec_named,
)
from coinrag.storage.kv.errors import KvFingerprintMismatch

LAYOUT_VERSION = 1
DEFAULT_BLOCK_TOKENS = IdentityCodec.default_block_tokens  # tokens per block, codec "none"
DEFAULT_SHARD_BYTES = 64 * 2**20  # target size of a shard (slots_per_shard is derived from it)
MIN_SLOTS_PER_SHARD = 4
MAX_SLOTS_PER_SHARD = 64
# A shard's zarr.json and its folders (c/0/0/0/0/0/0), in file-system blocks.
SHARD_OVERHEAD_BYTES = 8 * 4096

ATTR = "coinrag_kv"  # the attributes key of coinrag's metadata in every zarr.json
PREFIX = "prefix"  # the folder of C_p
KV_CHECK_LEVELS = ("stat", "crc32c", "sha256", "full")  # "full": sha256
SHARD_RE = re.compile(r"^shard-(\d{6,})$")
_LOCATION_RE = re.compile(r"^(?P<kv_fp>[^/#]+)/(?P<shard>shard-\d{6,})#slot-(?P<slot>\d+)$")


# ---------------------------------------------------------------------------- identity, layout


def kv_fingerprint(
    model_fp: str,
    prefix_sha: str,
    codec: dict[str, Any] | None = None,
    keep: str = "chunks",
) -> str:
    """The identity of a KV store: model, prompt prefix, this storage layout's version and,
    for a lossy codec only, the codec and its block size (``{"kv_codec": "int4",
    "block_tokens": 16}``: they decide the stored values), and, when it keeps only nugget
    spans, ``kv_keep``. Stores of codec ``none`` keeping whole chunks keep the fingerprint
    they had before codecs and ``kv_keep`` existed."""
    parts: dict[str, Any] = {
        "model_fp": model_fp,
        "prefix_sha": prefix_sha,
        "layout_version": LAYOUT_VERSION,
    }
    if keep != "chunks":
        parts["kv_keep"] = keep
    return fingerprint("kv", {**parts, **(codec or {})})


@dataclass(frozen=True)
class KvLayout:
    """Shape, dtype, codec and identity of the KV entries of one (model, prompt prefix).

    ``kv_codec`` names how entries are stored (``storage/kv/codecs.py``: ``none``, ``int8``,
    ``int4``). ``block_tokens`` (0: the codec's default, 4 for ``none`` and 16 for the
    quantized codecs) and ``slots_per_shard`` are physical choices for new shards (each shard
    records its own in its metadata, so changing them never invalidates stored entries); they
    are not part of ``kv_fp``, except that a lossy codec quantizes per block, so its block size
    is part of its identity.
    """

    model_fp: str
    prefix_sha: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16
    block_tokens: int = 0  # 0: the codec's default_block_tokens
    slots_per_shard: int = 0  # 0: derived from DEFAULT_SHARD_BYTES for 512-token entries
    kv_codec: str = "none"
    keep: str = "chunks"  # kv_keep: whole chunks | only nugget spans (storage/kv/kept.py)
    # the store's key basis (a codec that ``needs_basis``), set by its KvStore; not identity
    key_basis: BasisSlot = field(default_factory=BasisSlot, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r} (float32, bfloat16, float16)")
        if self.keep not in KV_KEEPS:
            raise ValueError(f"kv_keep {self.keep!r} is not one of {', '.join(KV_KEEPS)}")
        codec = codec_named(self.kv_codec)  # ValueError naming the known codecs
        if self.block_tokens <= 0:
            object.__setattr__(self, "block_tokens", codec.default_block_tokens)
        if self.slots_per_shard <= 0:
            per_entry = self.entry_bytes(512)
            slots = DEFAULT_SHARD_BYTES // per_entry
            slots = max(MIN_SLOTS_PER_SHARD, min(MAX_SLOTS_PER_SHARD, slots))
            object.__setattr__(self, "slots_per_shard", int(slots))

    @property
    def codec_identity(self) -> dict[str, Any]:
        """What of the codec enters ``kv_fp`` and the group's attributes: nothing for the
        lossless ``none``, the name and block size for a lossy one."""
        if self.codec.lossless:
            return {}
        return {"kv_codec": self.kv_codec, "block_tokens": self.block_tokens}

    @property
    def kv_fp(self) -> str:
        return kv_fingerprint(self.model_fp, self.prefix_sha, self.codec_identity, self.keep)

    @property
    def keeps_chunks(self) -> bool:
        """True when entries hold whole chunks (``kv_keep = "chunks"``); False when they hold
        only the ranges their nuggets cover."""
        return self.keep == "chunks"

    @property
    def codec(self) -> KvCodec:
        """How entries are stored (``storage/kv/codecs.py``)."""
        return codec_named(self.kv_codec)

    @property
    def keys_at_zero(self) -> bool:
        """True when stored keys are rotated back to position 0 (before RoPE: the quantized
        codecs); False when they sit after RoPE at the positions of the chunk's forward."""
        return self.codec.keys_at_zero

    @property
    def storage_dtype(self) -> Any:
        """The numpy dtype of the stored arrays (``<u2`` for bfloat16, ``u1`` quantized)."""
        return self.codec.storage_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes of one value in the model dtype."""
        return STORAGE_DTYPES[self.dtype].itemsize

    @property
    def raw_token_bytes(self) -> int:
        """Bytes of one token's K and V over all layers and heads in the model dtype."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block (inner chunk) without its crc32c."""
        return self.codec.payload_bytes(self)

    @property
    def token_bytes(self) -> int:
        """Bytes one token costs as stored: the raw bytes for ``none``; a quantized block's
        payload (codes and scales) per token, rounded up."""
        if self.codec.lossless:
            return self.raw_token_bytes
        return -(-self.block_bytes // self.block_tokens)

    def entry_bytes(self, tokens: int) -> int:
        """Bytes of an entry as stored (the manifest's ``bytes``): tokens x bytes per token for
        ``none``; its blocks' payloads for a quantized codec."""
        return self.codec.stored_bytes(tokens, self)

    def needed_bytes(self, tokens: int) -> int:
        """The stored bytes ``tokens`` tokens need, read with no waste (a quantized codec's
        scales shared out per token): the denominator of a read's amplification."""
        return -(-tokens * self.block_bytes // self.block_tokens)

    def entry_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, tokens, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

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
            "storage_dtype": self.storage_dtype.str,
            "axes": list(self.codec.dimension_names()),
            "kv_keep": self.keep,
            **self.codec_identity,
        }

    def disk_bytes(self, tokens: Sequence[int]) -> int:
        """Bytes on disk of the shards that entries of these token counts become, written as
        the KV stage writes them (longest first, ``slots_per_shard`` per shard): each entry's
        blocks (its tokens rounded up to ``block_tokens``; each block the codec's payload plus a
        4-byte crc32c), each shard's index (16 bytes per slot and block of its widest entry,
        plus a crc32c) and its metadata and folders (:data:`SHARD_OVERHEAD_BYTES`, a few
        file-system blocks).

        E.g. float32 SmolLM2-135M (30 layers, 3 KV heads, dim 64: 46,080 bytes per token),
        4-token blocks and 2 entries of 512 tokens: 2 x 128 blocks x 184,324 bytes + 4,100 +
        overhead = ~45 MiB; int4 with 16-token blocks (120,960 bytes per block): ~7.3 MiB.
        """
        ordered = sorted((int(t) for t in tokens), reverse=True)
        block = self.block_tokens
        per_block = self.block_bytes + 4
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
        return cls.for_config(model.config, model_fp, prefix_sha, weights_dtype(model), **kwargs)

    @classmethod
    def for_config(
        cls, config: Any, model_fp: str, prefix_sha: str, dtype: str, **kwargs: Any
    ) -> KvLayout:
        """The layout of a transformers model config (no weights loaded) and a dtype."""
        dims = config_dims(config)
        return cls(model_fp=model_fp, prefix_sha=prefix_sha, dtype=dtype, **dims, **kwargs)


def config_dims(config: Any) -> dict[str, int]:
    """``layers``, ``kv_heads`` and ``head_dim`` (one token's K or V in a layer is ``(kv_heads,
    head_dim)``) of a transformers config (its decoder's, for a composite config), by the
    names :class:`KvLayout` and ``storage.cartridges.CartridgeLayout`` give these fields."""
    config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {"layers": config.num_hidden_layers, "kv_heads": kv_heads, "head_dim": head_dim}


def weights_dtype(model: Any) -> str:
    """The dtype of a torch model's (first) weights by name: ``"float32"``, ``"bfloat16"``."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def checked_layout(stored: dict[str, Any], kv_fp: str, layout: KvLayout | None) -> KvLayout:
    """The layout of a KV store whose group attributes are ``stored``, opened as ``kv_fp``:
    ``layout`` when given and equal to what is stored, else the stored one. Raises
    :class:`KvFingerprintMismatch` when the stored identity (model_fp, prefix, dims, dtype,
    codec, kv_keep, layout version) differs from ``layout`` or from ``kv_fp``."""
    stored = {"kv_keep": "chunks", **stored}  # stores written before kv_keep kept chunks
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
        if "kv_codec" in stored:  # a lossy codec: its block size is part of its identity
            kwargs.update(kv_codec=stored["kv_codec"], block_tokens=stored["block_tokens"])
        return KvLayout(
            model_fp=stored["model_fp"],
            prefix_sha=stored["prefix_sha"],
            keep=stored["kv_keep"],
            **kwargs,
        )
    expected = layout.identity()
    diffs = [k for k, v in expected.items() if stored.get(k) != v]
    diffs += [k for k in ("kv_codec", "block_tokens") if k in stored and k not in expected]
    if diffs:
        mine = f"model_fp {layout.model_fp}, prefix {layout.prefix_sha}"
        raise KvFingerprintMismatch(
            f"{stored_fp} ({detail})",
            f"{layout.kv_fp} ({mine})",
            "differs in " + ", ".join(diffs),
        )
    return layout


# ---------------------------------------------------------------------------- locations


def parse_location(location: str) -> tuple[str, str, int]:
    """``"<kv_fp>/shard-000012#slot-5"`` -> ``(kv_fp, "shard-000012", 5)``."""
    m = _LOCATION_RE.match(location)
    if not m:
        raise ValueError(f"not a KV location: {location!r}")
    return m["kv_fp"], m["shard"], int(m["slot"])


def location_order(location: str) -> tuple[int, int]:
    """``"<kv_fp>/shard-000012#slot-5"`` -> ``(12, 5)``: for one content_key, the row with the
    largest (shard, slot) wins."""
    _, shard, slot = parse_location(location)
    return int(shard.removeprefix("shard-")), slot
