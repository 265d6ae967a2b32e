"""The shards of one KV store as a process knows them, and their checks.

Names on disk, metadata parsed from each ``zarr.json`` (cached: shards are written once),
the sizes of their files (a ``stat`` per shard; object stores remember a shard that checked
out), and their blocks' crc32c (``shard.verify_slots``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

import zarr

from coinrag.storage.kv.errors import read_problem
from coinrag.storage.kv.layout import SHARD_RE
from coinrag.storage.kv.shard import ShardMeta, verify_slots
from coinrag.storage.kv.transport import KvFolder, ScratchBuffers


@dataclasses.dataclass(eq=False)
class ShardCatalog(KvFolder):
    """The shards under ``root``; ``reader`` is the store's (counting) Zarr reader, through
    which shard arrays open."""

    meta: dict[str, ShardMeta] = dataclasses.field(default_factory=dict, init=False)
    # shards whose files checked out (remembered)
    checked: set[str] = dataclasses.field(default_factory=set, init=False)
    # local checks read into it
    scratch: ScratchBuffers = dataclasses.field(default_factory=ScratchBuffers, init=False)

    def names(self) -> list[str]:
        """Shard folders on disk (verified and renamed into place), in write order."""
        names = [n for n in self.store.list_names(self.root) if SHARD_RE.match(n)]
        return sorted(names, key=lambda n: int(n.removeprefix("shard-")))

    def get(self, name: str) -> ShardMeta:
        """The shard's metadata, parsed from its ``zarr.json`` (a plain JSON read: checking
        thousands of shards must not open thousands of Zarr arrays); the array opens lazily."""
        shard = self.meta.get(name)
        if shard is None:
            meta = json.loads(self.store.read_bytes(self.root / name / "zarr.json"))
            shard = ShardMeta.parse(name, meta, self._open_array, self.layout)
            self.meta[name] = shard
        return shard

    def _open_array(self, name: str) -> zarr.Array:
        return zarr.open_array(store=self.reader, path=name, mode="r")

    def forget(self, name: str) -> None:
        """Drop what is known of a shard (it is being removed, or could not be read)."""
        self.meta.pop(name, None)
        self.checked.discard(name)

    def file_problem(
        self, shard: ShardMeta, file_checks: dict[str, str | None] | None, ranged: bool
    ) -> str | None:
        """Why the shard's files are not as written (missing, truncated, grown), or None.

        ``file_checks`` caches the result per shard across calls that run together.
        ``ranged``: the caller reads with ``reads.gather_ranges``, which fails on a missing
        object (Zarr would read zeros); then, where the transport remembers file checks (object
        stores: the check is a HEAD request per shard, a round trip per read otherwise; objects
        are written once), a passed check of a shard in that format is remembered for the life
        of this catalog, and a shard removed later fails its read instead.
        """
        name = shard.name
        if file_checks is not None and name in file_checks:
            return file_checks[name]
        if ranged and name in self.checked:
            return None
        problem = self._stat(shard)
        if file_checks is not None:
            file_checks[name] = problem
        if problem is None and self.transport.remember_file_checks and shard.direct:
            self.checked.add(name)
        return problem

    def _stat(self, shard: ShardMeta) -> str | None:
        for rel, size in shard.files.items():
            try:
                actual = self.transport.size(self.root / shard.name / rel)
            except FileNotFoundError:
                return f"data file {shard.name}/{rel} is missing"
            if actual != size:
                return f"data file {shard.name}/{rel} has {actual} bytes, {size} were written"
        return None

    def verify_slots(self, shard: ShardMeta, slots: Iterable[int]) -> dict[int, str]:
        """slot -> why its blocks fail their crc32c (``shard.verify_slots``)."""
        lay = dataclasses.replace(self.layout, block_tokens=shard.block_tokens)
        block_bytes = lay.block_bytes + 4
        path = self.root / shard.name / shard.data_key

        def read_ranges(ranges: list[tuple[int, int]]) -> list[Any]:
            return self.transport.read_ranges(path, ranges, self.scratch)

        at_once = self.transport.verify_ranges_at_once
        return verify_slots(shard, slots, block_bytes, read_ranges, at_once)

    def diagnose(self, shard: ShardMeta, slot: int, exc: BaseException) -> str:
        """Why a read of ``slot`` failed: which block (or the index) fails its crc32c, found by
        checking the slot's blocks (shards in ``encode_shard``'s format), else ``exc``."""
        if shard.direct:
            try:
                problem = self.verify_slots(shard, [slot]).get(slot)
            except Exception:  # the diagnosis is best effort: the read failed either way
                problem = None
            if problem:
                return problem
        return read_problem(exc)
