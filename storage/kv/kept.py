"""Which tokens of its chunk a KV entry holds (the setting ``kv_keep``), and the entry's key.

- ``kv_keep = "chunks"`` (the default): an entry holds the whole chunk, ``(layers, 2, kv_heads,
  n_tokens, head_dim)``, and its key is the chunk's ``content_key``. Its manifest row's ``kept``
  is NULL.
- ``kv_keep = "nuggets"``: the chunk is still encoded in full (its KV stays contextual: every
  token attended to the prompt prefix and to all earlier tokens of the chunk), but the entry
  holds only the token ranges its nuggets cover, :class:`KeptRanges`: sorted, disjoint and not
  touching ``[start, end)`` ranges in the chunk's token coordinates (overlapping or touching
  nugget spans merge). The entry stores their concatenation, ``(layers, 2, kv_heads,
  Σ (end - start), head_dim)``, exactly (no rounding of each range to blocks: only the entry's
  last block is padded, as for a whole chunk); its manifest row's ``kept`` lists the ranges flat,
  ``[s0, e0, s1, e1, ...]``.

E.g. a 40-token chunk whose nuggets are ``[3, 9)``, ``[7, 12)`` and ``[20, 25)`` keeps
``[3, 12)`` and ``[20, 25)``: 14 stored tokens; chunk tokens ``[8, 11)`` are stored tokens
``[5, 8)``, and ``[10, 22)`` crosses the gap: reading it raises
:class:`storage.kv.errors.UnstoredKvSlice`, never zeros.

Identity: an entry's key is ``content_key`` (whole chunk) or ``content_key@<16 hex digits of the
sha256 of its flat ranges>``. An unchanged chunk whose nugget spans did not change has the same
key and is reused; a chunk whose spans changed (a new extractor) gets a new entry, computed by the
next build, while the old one stays valid (so readers of the published index are served during
that build) until ``gc`` finds that no live nugget set uses it (``storage/gc.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

KEY_SEPARATOR = "@"  # content_key@digest: the key of an entry holding only some ranges


@dataclass(frozen=True)
class KeptRanges:
    """The ``[start, end)`` token ranges of a chunk an entry holds, sorted, disjoint and not
    touching (build with :meth:`of_spans`)."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of_spans(cls, spans: Iterable[tuple[int, int]]) -> KeptRanges:
        """The ranges covering ``spans`` (any order; overlapping and touching ones merge, empty
        ones are dropped). ``[(7, 12), (3, 9), (20, 25), (12, 14)]`` -> ``[(3, 14), (20, 25)]``.
        """
        merged: list[list[int]] = []
        for s, e in sorted((int(s), int(e)) for s, e in spans):
            if s < 0:
                raise ValueError(f"a kept range starts at {s} < 0")
            if e <= s:
                continue
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        return cls(tuple((s, e) for s, e in merged))

    @classmethod
    def from_flat(cls, flat: Sequence[int]) -> KeptRanges:
        """``[s0, e0, s1, e1, ...]`` (a manifest row's ``kept``) -> the ranges; ValueError when
        they are not sorted, disjoint and non-touching (a damaged row)."""
        if len(flat) % 2:
            raise ValueError(f"kept ranges {list(flat)} are not [start, end) pairs")
        pairs = tuple((int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2))
        kept = cls.of_spans(pairs)
        if kept.ranges != pairs:
            raise ValueError(f"kept ranges {list(flat)} are not sorted, disjoint ranges")
        return kept

    def flat(self) -> list[int]:
        """``[s0, e0, s1, e1, ...]``."""
        return [t for pair in self.ranges for t in pair]

    @property
    def stored(self) -> int:
        """Tokens the entry stores: ``Σ (end - start)``."""
        return sum(e - s for s, e in self.ranges)

    @property
    def end(self) -> int:
        """The last kept token + 1 (0 when nothing is kept)."""
        return self.ranges[-1][1] if self.ranges else 0

    def digest(self) -> str:
        """16 hex digits of the sha256 of the flat ranges (the entry key's suffix)."""
        text = json.dumps(self.flat(), separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def locate(self, start: int, end: int) -> int | None:
        """Where chunk tokens ``[start, end)`` begin among the stored tokens, or None when they
        are not all inside one kept range (not stored). ``[(3, 12), (20, 25)]``: ``locate(8,
        11) == 5``, ``locate(20, 22) == 9``, ``locate(10, 22) is None``."""
        offset = 0
        for s, e in self.ranges:
            if s <= start and end <= e:
                return offset + start - s
            offset += e - s
        return None

    def cut(self, kv: torch.Tensor) -> torch.Tensor:
        """The stored part of a chunk's KV: ``(layers, 2, kv_heads, n_tokens, head_dim)`` ->
        ``(layers, 2, kv_heads, stored, head_dim)``, the kept ranges one after the other (a
        copy)."""
        if not self.ranges:
            return kv[:, :, :, :0].clone()
        if self.end > kv.shape[3]:
            raise ValueError(f"kept ranges {self} end after the chunk's {kv.shape[3]} tokens")
        return torch.cat([kv[:, :, :, s:e] for s, e in self.ranges], dim=3)

    def __str__(self) -> str:
        return ", ".join(f"[{s}, {e})" for s, e in self.ranges) or "no tokens"


def entry_key(content_key: str, kept: KeptRanges | None) -> str:
    """The key of an entry: ``content_key`` for a whole chunk (``kept`` None), else
    ``content_key@<kept.digest()>``."""
    return content_key if kept is None else f"{content_key}{KEY_SEPARATOR}{kept.digest()}"


def kept_of(flat: Sequence[int] | None) -> KeptRanges | None:
    """A manifest row's ``kept`` column -> its ranges (None: the whole chunk)."""
    return None if flat is None else KeptRanges.from_flat(flat)


@dataclass(frozen=True)
class KvEntry:
    """One entry as the store writes it: the chunk it was computed for, its content, the chunk's
    token count and the ranges it keeps (None: the whole chunk)."""

    chunk_id: str
    content_key: str
    n_tokens: int  # tokens of the chunk (the forward that computed the KV had |p| + n_tokens)
    kept: KeptRanges | None = None

    def __post_init__(self) -> None:
        if self.kept is not None and self.kept.end > self.n_tokens:
            raise ValueError(
                f"entry of {self.chunk_id}: kept ranges {self.kept} end after its "
                f"{self.n_tokens} tokens"
            )

    @classmethod
    def of(cls, ref: Any) -> KvEntry:
        """``ref`` itself when it is a :class:`KvEntry`; a whole-chunk entry of anything with
        ``chunk_id``, ``content_key`` and ``n_tokens`` (a ``ChunkRow``)."""
        if isinstance(ref, KvEntry):
            return ref
        return cls(ref.chunk_id, ref.content_key, int(ref.n_tokens))

    @classmethod
    def of_row(cls, row: Any) -> KvEntry:
        """The entry a manifest row describes."""
        return cls(row.chunk_id, row.content_key, int(row.tokens), kept_of(row.kept))

    @property
    def key(self) -> str:
        return entry_key(self.content_key, self.kept)

    @property
    def stored_tokens(self) -> int:
        return self.n_tokens if self.kept is None else self.kept.stored

    def cut(self, kv: torch.Tensor) -> torch.Tensor:
        """What the entry stores of the chunk's KV ``(layers, 2, kv_heads, n_tokens,
        head_dim)``: all of it, or its kept ranges (:meth:`KeptRanges.cut`)."""
        return kv if self.kept is None else self.kept.cut(kv)


def key_of_row(row: Any) -> str:
    """The key of the entry a manifest row describes."""
    return entry_key(row.content_key, kept_of(row.kept))
