"""``coinrag verify``: check every stored KV entry of a store without building anything.

Read-only (no write lock: it runs beside queries and builds). Each KV store under ``STORE/kv/``
is checked at a ``storage.kv`` level (``crc32c`` by default: every block of every entry and every
shard index; ``stat``; ``sha256``), and its prompt-prefix KV too. What fails is reported with the
chunk and document that use it; ``coinrag build`` with the store's settings recomputes exactly
those entries (``tasks/kv.py``), which the report's last line says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from coinrag.schemas.tables import ChunkRow
from coinrag.storage.gc import kv_fps
from coinrag.storage.kv import KvStore
from coinrag.storage.store import Store
from coinrag.storage.tables import read_table


@dataclass(frozen=True)
class CorruptEntry:
    """One stored entry (or a prefix or key basis: ``content_key`` ``"prefix"`` or ``"basis"``)
    that failed its check."""

    kv_fp: str
    content_key: str
    problem: str  # the reason and the location
    chunk_id: str = ""  # a chunk with that content ("" if no chunk row has it)
    doc_id: str = ""


@dataclass
class VerifyReport:
    level: str
    kv_stores: int = 0
    entries: int = 0
    logical_bytes: int = 0
    seconds: float = 0.0
    corrupt: list[CorruptEntry] = field(default_factory=list)


def verify_store(store: str, level: str = "crc32c") -> VerifyReport:
    """Check every KV entry (and prefix, and key basis) of ``store`` at ``level``; raises
    FileNotFoundError when ``store`` is not a coinrag store and ValueError for an unknown
    level."""
    st = Store.at(store)
    if not st.exists():
        raise FileNotFoundError(f"{st} is not a coinrag store (run coinrag build first)")
    report = VerifyReport(level=level)
    started = time.perf_counter()
    chunks: dict[str, tuple[str, str]] | None = None
    for kv_fp in kv_fps(st):
        kv = KvStore.open(st, kv_fp)
        manifest = kv.manifest(refresh=True)
        report.kv_stores += 1
        report.entries += len(manifest)
        report.logical_bytes += sum(row.bytes for row in manifest.values())
        problems = kv.entry_problems(manifest, level)
        prefix = kv.corrupt_prefix()
        if prefix is not None:
            report.corrupt.append(CorruptEntry(kv_fp, "prefix", f"{prefix} ({kv_fp}/prefix)"))
        basis = kv.key_basis.problem()  # int2basis: the keys' basis, rebuilt with every entry
        if basis is not None:
            report.corrupt.append(CorruptEntry(kv_fp, "basis", f"{basis} ({kv_fp}/basis)"))
        if problems and chunks is None:
            chunks = _chunks_by_content(st)
        for key, problem in sorted(problems.items(), key=lambda item: item[1]):
            ck = manifest[key].content_key  # the key holds the kept ranges' digest too
            chunk_id, doc_id = (chunks or {}).get(ck, ("", ""))
            report.corrupt.append(CorruptEntry(kv_fp, ck, problem, chunk_id, doc_id))
    report.seconds = time.perf_counter() - started
    return report


def _chunks_by_content(store: Store) -> dict[str, tuple[str, str]]:
    """content_key -> (chunk_id, doc_id) of one chunk that has it."""
    table = read_table(store, ChunkRow, columns=["content_key", "chunk_id", "doc_id"])
    out: dict[str, tuple[str, str]] = {}
    for ck, chunk_id, doc_id in zip(
        *(table.column(c).to_pylist() for c in ("content_key", "chunk_id", "doc_id")),
        strict=True,
    ):
        out.setdefault(ck, (chunk_id, doc_id))
    return out
