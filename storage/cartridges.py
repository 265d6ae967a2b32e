"""Cartridges on disk: Zarr arrays under ``STORE/cartridges/<model_fp>/``, their manifest rows,
and the training checkpoints of the runs that write them.

Layout contract (the KV layout of ``storage/kv/layout.py``, with canonical positions)
===================================================================================

In memory a cartridge is a KV block ``(layers, 2, kv_heads, p, head_dim)``, keys after RoPE, as
``storage/kv/layout.py`` states. Its keys are stored at the **canonical positions** ``0..p-1``:
whoever places the cartridge at position ``start`` re-rotates them with
``inference/rope/__init__.py`` (``training/cartridges.py`` and ``inference/methods/cartridge.py``
both go through ``inference.context.assemble.assemble_cartridges``), so one stored cartridge can
stand anywhere.

On disk::

    STORE/cartridges/<model_fp>/
      zarr.json                         group; attributes["coinrag_cartridges"] = the layout
      <cartridge_id>/<version>/         one Zarr array per saved version, shape
                                        (layers, 2, kv_heads, p, head_dim), one chunk,
                                        attributes: cartridge_id, doc_id, step, sha256, ...
      .tmp-<uuid>/                      a version being written (renamed into place when verified)
      train/<train_key>/state.pt        the checkpoint of a training run (see save_state)

- ``version`` is ``s<step:09d>-<time_ns>-<8 hex>``: versions sort by (step, write time).
- float32 / float16 are stored as themselves, bfloat16 as its raw bits in a ``uint16`` array
  (Zarr 3 has no bfloat16): bit-exact either way (``storage.kv.to_storage``).

Writes: array to ``.tmp-<uuid>``, read back and compare its sha256 with the tensor's, rename into
place, and only then append the :class:`~schemas.tables.CartridgeManifestRow` rows (one Parquet
file per call of :meth:`CartridgeStore.write`). A version is valid only once its manifest row
exists; a crash leaves at most an orphan folder. ``location`` in the manifest is
``"<model_fp>/<cartridge_id>/<version>"`` relative to ``STORE/cartridges/``.

Old versions are removed by :meth:`CartridgeStore.prune` (the training loop calls it after each
checkpoint, keeping what the checkpoint references); their manifest rows stay, and readers skip
rows whose array is gone.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import torch
import zarr
from zarr.storage import LocalStore

from coinrag.schemas.keys import CODE_VERSION, sha256_hex
from coinrag.schemas.tables import CartridgeManifestRow
from coinrag.storage.kv import entry_checksum, from_storage, to_storage
from coinrag.storage.kv.layout import config_dims, weights_dtype
from coinrag.storage.store import Store, safe_component
from coinrag.storage.tables import append_rows, read_rows

LAYOUT_VERSION = 1
AXES = ("layer", "kv", "head", "token", "dim")
_ATTR = "coinrag_cartridges"
_STORAGE_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}
KINDS = ("init", "rotation", "checkpoint", "final")


class CartridgeError(RuntimeError):
    """Base of the cartridge store's errors."""


class CorruptCartridge(CartridgeError):
    """A stored version failed a check (sha256, shape, missing array): never served."""


class MissingCartridge(CartridgeError, KeyError):
    """No valid stored version for what was asked."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "missing cartridge"


@dataclass(frozen=True)
class CartridgeLayout:
    """Dims and dtype of the cartridges of one generation model."""

    model_fp: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # float32 | bfloat16 | float16

    def __post_init__(self) -> None:
        if self.dtype not in _STORAGE_DTYPES:
            raise ValueError(
                f"unsupported cartridge dtype {self.dtype!r} (float32, bfloat16, float16)"
            )

    def shape(self, p: int) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.kv_heads, p, self.head_dim)

    def token_bytes(self) -> int:
        """Bytes of one cartridge token (K and V, every layer and head)."""
        return (
            self.layers
            * 2
            * self.kv_heads
            * self.head_dim
            * np.dtype(_STORAGE_DTYPES[self.dtype]).itemsize
        )

    def identity(self) -> dict[str, Any]:
        return {
            "layout_version": LAYOUT_VERSION,
            **asdict(self),
            "storage_dtype": _STORAGE_DTYPES[self.dtype],
            "axes": list(AXES),
            "positions": "canonical 0..p-1 (re-rotate keys to place)",
        }

    @classmethod
    def for_model(cls, model: Any, model_fp: str, dtype: str | None = None) -> CartridgeLayout:
        """The layout of a transformers causal LM (dims from its config)."""
        dtype = weights_dtype(model) if dtype is None else dtype
        return cls(model_fp=model_fp, dtype=dtype, **config_dims(model.config))


@dataclass(frozen=True)
class CartridgeMeta:
    """What identifies one cartridge (all its versions)."""

    cartridge_id: str
    doc_id: str
    doc_version: str
    cartridge_fp: str
    prefix_sha: str  # the prompt prefix the cartridge stands after
    p: int
    init: str


def cartridge_id(doc_id: str, doc_version: str, cartridge_fp: str) -> str:
    """Row identity of a cartridge: its document version and how it is made."""
    return "ct-" + sha256_hex("cartridge", doc_id, doc_version, cartridge_fp)[:24]


def version_order(location: str) -> tuple[int, int]:
    """``(step, time_ns)`` of a location's version: later versions sort last."""
    version = location.rsplit("/", 1)[-1]
    step, stamp, _ = version.split("-")
    return int(step.removeprefix("s")), int(stamp)


class CartridgeStore:
    """The cartridges of one ``model_fp`` under ``STORE/cartridges/<model_fp>/``.

    Not safe for concurrent writers (a training run holds the store's write lock).
    """

    def __init__(self, store: Store, layout: CartridgeLayout) -> None:
        self.store = store
        self.layout = layout
        self.root: Path = store.cartridges_dir(layout.model_fp)
        self.bytes_written = 0
        self.bytes_read = 0

    @classmethod
    def create(cls, store: Store, layout: CartridgeLayout) -> CartridgeStore:
        """Open the cartridges of ``layout.model_fp``, creating the group if absent."""
        root = store.cartridges_dir(layout.model_fp)
        if (root / "zarr.json").is_file():
            found = cls.open(store, layout.model_fp)
            if found.layout != layout:
                raise CartridgeError(
                    f"cartridges of {layout.model_fp} were stored with layout {found.layout}, "
                    f"not {layout}; use the stored dtype or another store"
                )
            return found
        root.mkdir(parents=True, exist_ok=True)
        zarr.create_group(store=LocalStore(root), attributes={_ATTR: layout.identity()})
        return cls(store, layout)

    @classmethod
    def open(cls, store: Store, model_fp: str) -> CartridgeStore:
        """Open existing cartridges (layout read from the group's attributes)."""
        root = store.cartridges_dir(model_fp)
        if not (root / "zarr.json").is_file():
            raise MissingCartridge(
                f"no cartridges for model {model_fp} in {store}: train them first "
                "(coinrag train cartridges)"
            )
        ident = zarr.open_group(store=LocalStore(root, read_only=True), mode="r").attrs[_ATTR]
        layout = CartridgeLayout(
            ident["model_fp"], ident["layers"], ident["kv_heads"], ident["head_dim"], ident["dtype"]
        )
        return cls(store, layout)

    # ------------------------------------------------------------------ versions

    def path_of(self, location: str) -> Path:
        model_fp, cid, version = location.split("/")
        if model_fp != self.layout.model_fp:
            raise CartridgeError(f"location {location!r} belongs to another model than {model_fp}")
        return self.root / safe_component(cid) / safe_component(version)

    def write(
        self,
        items: Sequence[tuple[CartridgeMeta, torch.Tensor]],
        *,
        step: int,
        kind: str,
        run_id: str,
    ) -> list[CartridgeManifestRow]:
        """Store one version of each cartridge (array, verify, rename), then their manifest rows.

        ``items``: ``(meta, kv)`` with ``kv`` ``(layers, 2, kv_heads, p, head_dim)`` in the
        layout's dtype (canonical positions). Returns the rows in ``items`` order.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        rows = [self._write_one(meta, kv, step, kind, run_id) for meta, kv in items]
        append_rows(self.store, rows, run_id, f"cartridges-{kind}")
        return rows

    def _write_one(
        self, meta: CartridgeMeta, kv: torch.Tensor, step: int, kind: str, run_id: str
    ) -> CartridgeManifestRow:
        """Store one version of one cartridge (:meth:`write`); its manifest row, not yet
        appended."""
        expected = self.layout.shape(meta.p)
        if tuple(kv.shape) != expected:
            raise ValueError(
                f"cartridge {meta.cartridge_id}: shape {tuple(kv.shape)} != {expected}"
            )
        if str(kv.dtype).removeprefix("torch.") != self.layout.dtype:
            raise ValueError(f"cartridge dtype {kv.dtype} != layout dtype {self.layout.dtype}")
        data = to_storage(kv)
        checksum = entry_checksum(data)
        version = f"s{step:09d}-{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        attributes = {
            "cartridge_id": meta.cartridge_id,
            "doc_id": meta.doc_id,
            "doc_version": meta.doc_version,
            "cartridge_fp": meta.cartridge_fp,
            "step": step,
            "kind": kind,
            "dtype": self.layout.dtype,
            "sha256": checksum,
        }
        final = self.root / safe_component(meta.cartridge_id) / version
        self._write_verified(final, data, attributes)
        self.bytes_written += data.nbytes
        return CartridgeManifestRow(
            cartridge_id=meta.cartridge_id,
            doc_id=meta.doc_id,
            doc_version=meta.doc_version,
            model_fp=self.layout.model_fp,
            cartridge_fp=meta.cartridge_fp,
            prefix_sha=meta.prefix_sha,
            p=meta.p,
            init=meta.init,
            step=step,
            kind=kind,
            location=f"{self.layout.model_fp}/{meta.cartridge_id}/{version}",
            dtype=self.layout.dtype,
            bytes=int(data.nbytes),
            checksum=checksum,
            run_id=run_id,
            code_version=CODE_VERSION,
        )

    def _write_verified(self, final: Path, data: np.ndarray, attributes: dict[str, Any]) -> None:
        """Write ``data`` as a Zarr array into a ``.tmp-`` folder, read it back and check its
        sha256 (``attributes["sha256"]``), then rename it to ``final``; :class:`CorruptCartridge`
        if the read-back differs (the temporary folder never stays)."""
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        try:
            array = zarr.create_array(
                store=LocalStore(tmp),
                shape=data.shape,
                chunks=data.shape,
                dtype=data.dtype,
                compressors=None,
                fill_value=0,
                attributes=attributes,
            )
            array[...] = data
            back = zarr.open_array(store=LocalStore(tmp, read_only=True), mode="r")[...]
            if entry_checksum(back) != attributes["sha256"]:
                raise CorruptCartridge(
                    f"{attributes['cartridge_id']}: read-back sha256 differs after write"
                )
            final.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def read(self, row: CartridgeManifestRow, verify: bool = True) -> torch.Tensor:
        """The stored tensor of one version ``(layers, 2, kv_heads, p, head_dim)``, on CPU.

        Raises :class:`CorruptCartridge` when the array is missing, mis-shaped or (``verify``)
        its sha256 differs from the manifest's.
        """
        path = self.path_of(row.location)
        if not (path / "zarr.json").is_file():
            raise CorruptCartridge(f"{row.cartridge_id}: array {row.location} is missing")
        data = zarr.open_array(store=LocalStore(path, read_only=True), mode="r")[...]
        if tuple(data.shape) != self.layout.shape(row.p):
            raise CorruptCartridge(f"{row.cartridge_id}: stored shape {data.shape} != p={row.p}")
        if verify and entry_checksum(data) != row.checksum:
            raise CorruptCartridge(f"{row.cartridge_id}: sha256 of {row.location} != manifest")
        self.bytes_read += data.nbytes
        return from_storage(data, self.layout.dtype)

    def manifest(
        self, cartridge_fp: str | None = None, doc_ids: Iterable[str] | None = None
    ) -> list[CartridgeManifestRow]:
        """Every manifest row of this model (optionally of one cartridge_fp / some documents)."""
        flt = pc.field("model_fp") == self.layout.model_fp
        if cartridge_fp is not None:
            flt = flt & (pc.field("cartridge_fp") == cartridge_fp)
        if doc_ids is not None:
            flt = flt & pc.field("doc_id").isin(list(doc_ids))
        return read_rows(self.store, CartridgeManifestRow, filter=flt)

    def latest(
        self, cartridge_fp: str | None = None, doc_ids: Iterable[str] | None = None
    ) -> dict[str, CartridgeManifestRow]:
        """The newest existing version per ``cartridge_id`` (by step, then write time)."""
        best: dict[str, CartridgeManifestRow] = {}
        for row in sorted(
            self.manifest(cartridge_fp, doc_ids), key=lambda r: version_order(r.location)
        ):
            if (self.path_of(row.location) / "zarr.json").is_file():
                best[row.cartridge_id] = row
        return best

    def prune(self, keep: Iterable[str], cartridge_ids: Iterable[str], before_step: int) -> int:
        """Delete versions of ``cartridge_ids`` older than ``before_step`` that are not in
        ``keep`` (locations); return how many were removed."""
        keep_set = set(keep)
        removed = 0
        for cid in cartridge_ids:
            folder = self.root / safe_component(cid)
            if not folder.is_dir():
                continue
            for version in folder.iterdir():
                location = f"{self.layout.model_fp}/{cid}/{version.name}"
                if location in keep_set or version_order(location)[0] >= before_step:
                    continue
                shutil.rmtree(version, ignore_errors=True)
                removed += 1
        return removed

    def garbage(self) -> list[Path]:
        """Leftovers of interrupted writes (``.tmp-`` folders)."""
        return sorted(self.root.glob(".tmp-*")) if self.root.is_dir() else []

    # ------------------------------------------------------------------ training checkpoints

    def state_path(self, train_key: str) -> Path:
        return self.root / "train" / safe_component(train_key) / "state.pt"

    def save_state(self, train_key: str, state: dict[str, Any]) -> Path:
        """Write a training checkpoint atomically (tmp file, fsync, rename).

        ``state`` holds plain containers, ints, floats, strings and tensors only (it is read
        back with ``torch.load(weights_only=True)``).
        """
        path = self.state_path(train_key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".state-{uuid.uuid4().hex[:8]}.tmp")
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def load_state(self, train_key: str) -> dict[str, Any] | None:
        """The last checkpoint of ``train_key``, or None."""
        path = self.state_path(train_key)
        if not path.is_file():
            return None
        return torch.load(path, map_location="cpu", weights_only=True)

    def clear_state(self, train_key: str) -> None:
        path = self.state_path(train_key)
        if path.is_file():
            path.unlink()
