"""KV codecs: how an entry's tensor becomes the values stored on disk, and back.

A codec is a subclass of :class:`KvCodec` registered by name (``class IdentityCodec(KvCodec,
name="none")``) and chosen with :func:`codec_named`. Today there is one, ``none``: entries are
stored as the model computed them, bit for bit (bfloat16 as its raw bits in ``uint16``, since
Zarr 3 has no bfloat16; float32 / float16 as themselves).

The store calls its codec at these points (``storage/kv/store.py``, ``shard.py``, ``reads.py``):

- writing: :meth:`KvCodec.view` (the entry as stored values, no copy where possible: the shard
  encoder copies it once, straight into the file buffer) and :meth:`KvCodec.encode` (the same,
  C-contiguous: the prefix, checksums);
- reading: :meth:`KvCodec.decode` (stored values of whole entries or token ranges, as Zarr
  returns them, -> a tensor in the model dtype), and for reads that decode the shard file's
  blocks themselves (object stores), :meth:`KvCodec.payload_bytes` and
  :meth:`KvCodec.decode_block` (one inner chunk's payload, without its crc32c).

Where a quantized codec plugs in (``int8`` / ``int4``, issue 13): a subclass whose stored values
are per-block payloads, keys quantized per channel and values per token within each block of
``block_tokens`` tokens, with the block's scales stored in the block (so a block stays
self-contained: one crc32c, decodable alone by a ranged read). It overrides the methods above
(``payload_bytes`` then differs from the values' size) and states its error bound; the layout
(``KvLayout.codec``) names it, and the name enters the layout's identity so entries of different
codecs never mix.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import numpy as np
import torch

# model dtype -> the numpy dtype its values are stored as (identity codec)
STORAGE_DTYPES = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class KvCodec:
    """How KV tensors ``(layers, 2, kv_heads, tokens, head_dim)`` are stored; one subclass per
    codec, registered by its ``name``."""

    name: ClassVar[str]
    _registry: ClassVar[dict[str, type[KvCodec]]] = {}

    def __init_subclass__(cls, *, name: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = name
        KvCodec._registry[name] = cls

    def storage_dtype(self, dtype: str) -> np.dtype:
        """The numpy dtype of the stored array for entries of model dtype ``dtype``."""
        raise NotImplementedError

    def view(self, kv: torch.Tensor) -> np.ndarray:
        """``kv`` as stored values (a view where possible; strides kept)."""
        raise NotImplementedError

    def encode(self, kv: torch.Tensor) -> np.ndarray:
        """``kv`` as the C-contiguous stored array."""
        return np.ascontiguousarray(self.view(kv))

    def decode(self, stored: np.ndarray, dtype: str) -> torch.Tensor:
        """Stored values (any strides) -> a tensor of model dtype ``dtype``."""
        raise NotImplementedError

    def payload_bytes(self, shape: tuple[int, ...], dtype: str) -> int:
        """Bytes of one inner chunk's payload (without its crc32c) for a block of ``shape``
        ``(layers, 2, kv_heads, block_tokens, head_dim)``."""
        raise NotImplementedError

    def decode_block(self, payload: Any, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """One inner chunk's payload (bytes-like, crc32c removed) -> its stored values of
        ``shape``, as Zarr would return them."""
        raise NotImplementedError


class IdentityCodec(KvCodec, name="none"):
    """Entries stored as computed, bit for bit (bfloat16 as ``uint16`` bits)."""

    def storage_dtype(self, dtype: str) -> np.dtype:
        return STORAGE_DTYPES[dtype]

    def view(self, kv: torch.Tensor) -> np.ndarray:
        t = kv.detach().to("cpu")
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def decode(self, stored: np.ndarray, dtype: str) -> torch.Tensor:
        array = np.ascontiguousarray(stored)  # a copy only where not contiguous
        if dtype == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    def payload_bytes(self, shape: tuple[int, ...], dtype: str) -> int:
        return int(np.prod(shape)) * STORAGE_DTYPES[dtype].itemsize

    def decode_block(self, payload: Any, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.frombuffer(payload, dtype=STORAGE_DTYPES[dtype]).reshape(shape)


def codec_named(name: str) -> KvCodec:
    """The codec registered as ``name`` (ValueError naming the known ones otherwise)."""
    cls = KvCodec._registry.get(name)
    if cls is None:
        known = ", ".join(sorted(KvCodec._registry))
        raise ValueError(f"unknown KV codec {name!r} ({known})")
    return cls()


_IDENTITY = IdentityCodec()


def storage_view(kv: torch.Tensor) -> np.ndarray:
    """A KV tensor as a numpy view in the stored dtype (bfloat16 -> uint16 bits), no copy on
    CPU; strides kept (not necessarily contiguous)."""
    return _IDENTITY.view(kv)


def to_storage(kv: torch.Tensor) -> np.ndarray:
    """A KV tensor as the C-contiguous numpy array that is stored (bfloat16 -> uint16 bits)."""
    return _IDENTITY.encode(kv)


def from_storage(array: np.ndarray, dtype: str) -> torch.Tensor:
    """The inverse of :func:`to_storage` (a copy only where the array is not contiguous)."""
    return _IDENTITY.decode(array, dtype)


def entry_checksum(stored: np.ndarray) -> str:
    """sha256 of an entry's stored bytes (C-contiguous ``(layers, 2, heads, tokens, dim)``)."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(stored)).cast("B")).hexdigest()
