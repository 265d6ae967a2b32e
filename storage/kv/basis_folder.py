"""A KV store's key basis on disk (``STORE/kv/<kv_fp>/basis/``), written once.

Only a codec that codes keys in a calibrated basis (``KvCodec.needs_basis``: ``int2basis``) has
one. Every entry of such a store was coded in the same basis, so it is written before the first
entry and never changed: a basis that fails its check means every entry must be rebuilt (the
KV stage sets it aside, calibrates a new one and rebuilds: ``tasks/kv.py``). One Zarr array
``(layers, 2, kv_heads, head_dim, head_dim)`` float32 (forward, inverse), one inner chunk with
its crc32c; attributes: the basis's sha256 and what it was calibrated on (``calibration``: the
chunks' content keys, tokens, where the queries were read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from coinrag.storage.kv.basis import KeyBasis
from coinrag.storage.kv.errors import CorruptKvEntry, KvError
from coinrag.storage.kv.transport import OneArrayFolder

BASIS = "basis"  # the folder of the key basis


@dataclass(eq=False)
class BasisFolder(OneArrayFolder):
    """The key basis of one KV store: ``root / "basis"``, read through ``reader``, written
    through ``transport``; what it reads or writes is set in the layout's ``key_basis`` slot."""

    folder: ClassVar[str] = BASIS

    def write(self, basis: KeyBasis, calibration: dict[str, Any]) -> None:
        """Store ``basis`` (calibrated on ``calibration``: JSON, e.g. the chunks' content
        keys). Written once: :class:`KvError` where a basis is stored already."""
        lay = self.layout
        expected = (lay.layers, lay.kv_heads, lay.head_dim)
        if basis.shape != expected:
            raise ValueError(f"a key basis of shape {basis.shape}, the layout needs {expected}")
        if self.exists():
            raise KvError(f"{lay.kv_fp} has a key basis already: it is written once")
        stored = torch.stack([basis.forward, basis.inverse], dim=1).numpy().astype("<f4")
        axes = ("layer", "map", "head", "row", "column")
        self.write_array(stored, axes, {"sha256": basis.sha256(), "calibration": calibration})
        lay.key_basis.set(basis)

    def read(self) -> KeyBasis:
        """The stored basis, its crc32c and sha256 checked (:class:`MissingKvEntry` where none
        is stored, :class:`CorruptKvEntry` where it fails a check)."""
        stored, attrs = self.read_array(
            f"no key basis under {self.layout.kv_fp}: its codec codes keys in one, which "
            "the kv stage writes before the first entry"
        )
        tensor = torch.from_numpy(stored.astype(np.float32))
        basis = KeyBasis(tensor[:, 0].contiguous(), tensor[:, 1].contiguous())
        if basis.sha256() != attrs.get("sha256"):
            raise CorruptKvEntry(BASIS, self.location, "sha256 differs")
        return basis

    def calibration(self) -> dict[str, Any]:
        """What the stored basis was calibrated on (its metadata; {} where unreadable)."""
        return dict(self.recorded().get("calibration") or {})

    def replace(self, basis: KeyBasis, calibration: dict[str, Any]) -> None:
        """Set a stored basis that fails its check aside (a ``.tmp-`` leftover ``gc``
        removes) and write ``basis``: the caller holds the write lock and rebuilds every
        entry."""
        self.layout.key_basis.forget()
        self.transport.set_aside(self.root / BASIS)
        self.write(basis, calibration)
