"""Reader leases: the record a long-lived reader (``coinrag api``) keeps in the store so that
``coinrag gc`` leaves it the published versions it still reads.

One JSON file per reader under ``STORE/readers/`` (``storage/readers.py`` writes, renews, lists
and removes them). A lease names the ``[published]`` records (``coinrag.toml``) of every version
the reader holds: the one it serves and older ones that requests in flight still read. While a
lease is fresh (``expires_unix`` is in the future), ``gc`` keeps the LanceDB table versions and
the KV entries those records point to; a reader that dies stops renewing and its lease expires.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# Seconds a lease stays fresh after a renewal; readers renew every third of it.
READER_LEASE_TTL_S = 120.0


def published_index_versions(published: Mapping[str, Any] | None) -> dict[str, int]:
    """The LanceDB table versions a ``[published]`` record names (``index.versions``: table
    name -> version; ``storage/publish.py`` writes it); empty when it names none."""
    versions = ((published or {}).get("index") or {}).get("versions") or {}
    return {str(name): int(version) for name, version in versions.items()}


@dataclass(frozen=True)
class ReaderLease:
    """What one reader holds.

    ``reader``: its id (a uuid hex, the file's stem); ``host`` and ``pid``: where it runs (for
    people reading the file); ``expires_unix``: seconds since the epoch, the writer's clock,
    after which gc ignores the lease; ``versions``: the ``[published]`` records it reads (each
    with ``run_id`` and ``index.versions``: LanceDB table name -> version).
    """

    reader: str
    host: str
    pid: int
    expires_unix: float
    versions: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, default=str).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> ReaderLease:
        raw = json.loads(data)
        return cls(
            reader=str(raw["reader"]),
            host=str(raw.get("host", "")),
            pid=int(raw.get("pid", 0)),
            expires_unix=float(raw["expires_unix"]),
            versions=[v for v in raw.get("versions") or [] if isinstance(v, dict)],
        )

    def fresh(self, now_unix: float) -> bool:
        return self.expires_unix > now_unix

    def index_versions(self) -> list[dict[str, int]]:
        """Per held version, its LanceDB table versions (name -> version)."""
        return [v for v in map(published_index_versions, self.versions) if v]
