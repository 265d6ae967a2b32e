"""The prompt prefix's own KV ``C_p`` (``STORE/kv/<kv_fp>/prefix/``), written once.

Every entry of a kv_fp was computed against the same bits of ``C_p`` (the KV stage reads the
stored copy back before computing), so a damaged ``C_p`` is recomputed and compared with what its
metadata recorded: equal bits keep the entries valid, other bits mean rebuilding them all
(``tasks/kv.py``). One Zarr array ``(layers, 2, kv_heads, |p|, head_dim)``, one inner chunk with
its crc32c; attributes ``prefix_ids``, ``prefix_sha`` and the sha256 of the stored bytes.
``C_p`` is always stored as computed (the identity codec, keys after RoPE at ``0 .. |p| - 1``),
whatever the entries' codec: it is a few dozen tokens, and every context starts with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from coinrag.storage.kv.codecs import AXES, entry_checksum, from_storage, to_storage
from coinrag.storage.kv.errors import CorruptKvEntry, KvFingerprintMismatch
from coinrag.storage.kv.layout import PREFIX
from coinrag.storage.kv.transport import OneArrayFolder


@dataclass(eq=False)
class PrefixFolder(OneArrayFolder):
    """``C_p`` of one KV store: ``root / "prefix"``, read through ``reader`` (the store's
    counting Zarr reader), written through ``transport``."""

    folder: ClassVar[str] = PREFIX

    def write(self, prefix_kv: torch.Tensor, prefix_ids: Sequence[int]) -> None:
        """Store ``C_p``: ``(layers, 2, kv_heads, len(prefix_ids), head_dim)``. Written once;
        a second call with the same ids is a no-op."""
        lay = self.layout
        ids = [int(t) for t in prefix_ids]
        expected = lay.entry_shape(len(ids))
        if tuple(prefix_kv.shape) != expected:
            raise ValueError(f"prefix KV has shape {tuple(prefix_kv.shape)}, expected {expected}")
        if prefix_kv.dtype != lay.torch_dtype:
            raise ValueError(f"prefix KV is {prefix_kv.dtype}, layout is {lay.dtype}")
        if self.exists():
            _, stored_ids = self.read()
            if stored_ids != ids:
                raise KvFingerprintMismatch(
                    lay.kv_fp, lay.kv_fp, "the stored prefix has other token ids"
                )
            return
        stored = to_storage(prefix_kv)
        attrs = {"prefix_ids": ids, "prefix_sha": lay.prefix_sha}
        self.write_array(stored, AXES[1:], {**attrs, "sha256": entry_checksum(stored)})

    def read(self) -> tuple[torch.Tensor, list[int]]:
        """``(C_p, prefix_ids)``: ``(layers, 2, kv_heads, |p|, head_dim)``, sha256-checked."""
        lay = self.layout
        stored, attrs = self.read_array(f"no prefix KV under {lay.kv_fp}")
        if attrs.get("prefix_sha") != lay.prefix_sha:
            raise KvFingerprintMismatch(str(attrs.get("prefix_sha")), lay.prefix_sha)
        if entry_checksum(stored) != attrs.get("sha256"):
            raise CorruptKvEntry(PREFIX, self.location, "sha256 differs")
        return from_storage(stored, lay.dtype), [int(t) for t in attrs["prefix_ids"]]

    def repair(self, prefix_kv: torch.Tensor, prefix_ids: Sequence[int]) -> bool:
        """Replace a stored ``C_p`` that fails its check by ``prefix_kv`` (recomputed by the
        caller, who holds the write lock). True when ``prefix_kv`` is bit for bit the prefix it
        replaces (the sha256 and token ids the damaged copy's metadata recorded): then the
        entries computed against it stay valid; otherwise the caller must rebuild them all.

        The damaged folder is moved aside as a ``.tmp-`` leftover (``gc`` removes it; an object
        store removes it at once) before the new one is written."""
        attrs = self.recorded()  # {} where unreadable: nothing to compare with
        try:
            recorded = (str(attrs["sha256"]), [int(t) for t in attrs["prefix_ids"]])
        except (KeyError, TypeError, ValueError):
            recorded = None
        self.transport.set_aside(self.root / PREFIX)
        self.write(prefix_kv, prefix_ids)
        fresh = (entry_checksum(to_storage(prefix_kv)), [int(t) for t in prefix_ids])
        return recorded == fresh
