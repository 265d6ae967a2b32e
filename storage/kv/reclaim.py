"""Reclaiming KV space: garbage folders, dead entries, and the dry-run plan of both.

Shards are written once and never modified, so space comes back only by removing whole
folders: orphan and superseded shards (no current manifest row points to them), ``.tmp-``
leftovers of killed writes, and shards whose entries no live chunk needs any more, after their
still-live entries have been moved to new shards (:func:`reclaim_dead`). The caller holds the
store's write lock (``storage/gc.py``, ``coinrag gc``).
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

from coinrag.schemas.tables import KvManifestRow
from coinrag.storage.kv.errors import CorruptKvEntry, MissingKvEntry
from coinrag.storage.kv.kept import KvEntry
from coinrag.storage.kv.layout import parse_location
from coinrag.storage.kv.shard import create_shard_array, data_key, shard_attributes, shard_size

if TYPE_CHECKING:
    from coinrag.storage.kv.store import KvStore


@dataclass
class KvReclaim:
    """What :meth:`KvStore.reclaim` did for one kv_fp (bytes are bytes on disk)."""

    kv_fp: str
    entries_live: int = 0
    entries_dropped: int = 0  # entries no live chunk (or live nugget set) uses
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


def find_garbage(kv: KvStore) -> list[PurePath]:
    """Folders no current manifest row points to: orphan and superseded shards, ``.tmp-``
    leftovers of killed writes."""
    live = {parse_location(r.location)[1] for r in kv.manifest(refresh=True).values()}
    out = [kv.root / n for n in kv.shard_names() if n not in live]
    out += [kv.root / n for n in kv.store.list_names(kv.root) if n.startswith(".tmp-")]
    return out


def remove_garbage(kv: KvStore) -> list[PurePath]:
    """Remove :func:`find_garbage` (the caller holds the store's write lock); return it."""
    removed = find_garbage(kv)
    for path in removed:
        kv.forget_shard(path.name)
        kv.store.remove(path)
    return removed


def reclaim_dead(kv: KvStore, live: set[str], run_id: str, dry_run: bool = False) -> KvReclaim:
    """Drop the entries whose key is not in ``live``; return what was (or, with ``dry_run``,
    would be) reclaimed. The caller holds the store's write lock. Keys are
    ``storage.kv.kept.entry_key``: content_keys for whole chunks; with ``kv_keep = "nuggets"``
    the content_key and the digest of the kept ranges a live chunk's nuggets need, so an entry
    of spans no live nugget set uses any more (those of a replaced extractor) is dropped.

    Shards are written once and never modified, so a shard holding dead entries is dealt
    with whole: 1. the live entries of a partly dead shard are read as stored (sha256-checked)
    and written to new shards bit for bit (a lossy codec's values are never re-encoded), as
    the build writes them (written whole, read back and
    verified, renamed, then their manifest rows appended: the new rows supersede the old
    ones); 2. the ``kv_manifest`` files holding rows of this kv_fp that are no longer
    current and live are rewritten without them (new file first, then the old one goes);
    3. shard folders no manifest row points to any more, and ``.tmp-`` leftovers, are
    removed. A crash between steps leaves valid entries only: at worst duplicate manifest
    rows (identical) or orphan folders, which the next ``gc`` removes. An entry that fails
    its check while being moved is dropped (the kv stage rebuilds it when it is needed).
    """
    out = KvReclaim(kv_fp=kv.kv_fp)
    manifest = kv.manifest(refresh=True)
    by_shard: dict[str, list[tuple[int, str]]] = defaultdict(list)  # shard -> (slot, key)
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
    if dry_run:
        _plan(kv, manifest, by_shard, dead, moving, run_id, out)
    else:
        _move_live(kv, manifest, moving, run_id, out)
        _drop_dead(kv, live, run_id, out)
    return out


def _plan(
    kv: KvStore,
    manifest: dict[str, KvManifestRow],
    by_shard: dict[str, list[tuple[int, str]]],
    dead: set[str],
    moving: list[str],
    run_id: str,
    out: KvReclaim,
) -> None:
    """Fill ``out`` with what :func:`reclaim_dead` frees and writes, assuming every moved entry
    verifies: the folders of shards holding dead entries and the unreferenced ones go, the
    moved entries make new shards of :func:`planned_shard_bytes`."""
    step = kv.layout.slots_per_shard
    dropped = {name for name, slots in by_shard.items() if any(ck in dead for _, ck in slots)}
    unreferenced = [p for p in find_garbage(kv) if p.name not in by_shard]
    out.bytes_freed = sum(kv.store.tree_bytes(kv.root / n) for n in dropped) + sum(
        kv.store.tree_bytes(p) for p in unreferenced
    )
    out.folders_removed = len(dropped) + len(unreferenced)
    out.bytes_written = sum(
        planned_shard_bytes(kv, [manifest[ck] for ck in moving[i : i + step]], run_id)
        for i in range(0, len(moving), step)
    )


def _move_live(
    kv: KvStore, manifest: dict[str, KvManifestRow], moving: list[str], run_id: str, out: KvReclaim
) -> None:
    """Step 1 of :func:`reclaim_dead`: write the ``moving`` entries, as stored, to new shards
    (a shard's worth at a time); one that fails its check is counted in ``out`` and dropped."""
    step = kv.layout.slots_per_shard
    new_shards: set[str] = set()
    for start in range(0, len(moving), step):
        group = []
        for ck in moving[start : start + step]:
            row = manifest[ck]
            try:
                stored = kv.read_stored(ck)  # sha256-checked; moved as stored, never re-encoded
            except (CorruptKvEntry, MissingKvEntry):
                out.entries_corrupt += 1
                continue
            group.append((KvEntry.of_row(row), stored))  # what it stores, as stored
        if group:
            rows = kv.write_stored(group, run_id)
            new_shards.update(parse_location(r.location)[1] for r in rows)
    out.bytes_written = sum(kv.store.tree_bytes(kv.root / n) for n in new_shards)


def _drop_dead(kv: KvStore, live: set[str], run_id: str, out: KvReclaim) -> None:
    """Steps 2 and 3 of :func:`reclaim_dead`: rewrite the manifest without this kv_fp's rows
    that are not current and live, then remove the folders no row points to."""
    from coinrag.storage.tables import rewrite_rows

    current = kv.manifest()
    keep = {row.location for ck, row in current.items() if ck in live}
    prefix = kv.kv_fp + "/"
    out.manifest_rows_dropped = rewrite_rows(
        kv.store,
        KvManifestRow,
        lambda loc: not loc.startswith(prefix) or loc in keep,
        "location",
        run_id,
        "gc",
    )
    kv.forget_manifest()
    for path in find_garbage(kv):
        out.bytes_freed += kv.store.tree_bytes(path)
        out.folders_removed += 1
        kv.forget_shard(path.name)
        kv.store.remove(path)


def planned_shard_bytes(kv: KvStore, rows: list[KvManifestRow], run_id: str) -> int:
    """Bytes on disk of the shard :meth:`KvStore.stage_shard` would write for these entries:
    its data file (``shard.shard_size``, from the token counts) and its ``zarr.json`` (rendered
    by Zarr in a scratch folder, with the attributes the real shard gets)."""
    lay = kv.layout
    block = lay.block_tokens
    tokens = [KvEntry.of_row(r).stored_tokens for r in rows]
    width = max(block, -(-max(tokens) // block) * block)
    data = shard_size(lay, tokens, width)
    shape = lay.codec.array_shape(lay, len(rows), width)
    # as stage_shard writes them (tests/flows/test_cli_store_commands.py compares)
    keys = [r.content_key for r in rows]
    checksums = [r.checksum for r in rows]
    kept = [r.kept for r in rows]
    attrs = shard_attributes(lay, kv.encoder, run_id, keys, tokens, checksums, kept)
    attrs["files"] = {data_key(len(shape)): data}
    with tempfile.TemporaryDirectory(prefix="coinrag-gc-plan-") as scratch:
        create_shard_array(Path(scratch), lay, shape, attrs)
        meta = (Path(scratch) / "zarr.json").stat().st_size
    return data + meta
