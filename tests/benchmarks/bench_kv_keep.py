"""What ``kv_keep = "nuggets"`` saves: KV bytes on disk per chunk token, whole chunks against
nugget spans only, on real builds (``flows.build.build_flow``, the packaged SmolLM2, MiniLM).

Per corpus (the bundled sample; Debian's ``python3.11-doc`` FAQ pages, ``infra/python_faq.py``,
``apt-get install -y python3.11-doc``) and extractor, one store is built twice: with ``kv_keep =
"chunks"``, then (the same store: chunks and LLM answers reused) with ``kv_keep = "nuggets"``,
whose KV is another ``kv_fp`` folder; both with the codec ``--kv-codec`` (``none``, ``int8``,
``int4``). Reported per variant:

- ``coverage``: chunk tokens inside at least one nugget / chunk tokens;
- ``chunks B/tok`` and ``nuggets B/tok``: bytes on disk of each ``STORE/kv/<kv_fp>/`` (shards,
  their indexes and metadata, the prefix ``C_p``) per chunk token, and ``/raw bf16``: the same
  over the raw bfloat16 bytes of one token's K and V (``layers x 2 x kv_heads x head_dim x 2``);
- ``saved``: 1 - nuggets bytes / chunks bytes;
- ``formula``: ``KvLayout.disk_bytes`` of the entries' stored token counts (what the writer
  produces, prefix aside) over the shards' real bytes: 1.000 means the projections below are
  exact;
- ``block-aligned``: what storing every block (``block_tokens``: the codec's) a kept range
  touches (instead of the kept tokens exactly) would put on disk, over the exact layout's
  blocks;
- lower coverage (``--coverages``): each chunk's nuggets taken in a random order (seeded) until
  they cover that share of its tokens, the shards such entries make projected with
  ``KvLayout.disk_bytes`` (e.g. an extractor like GPT-4o-mini's ~70% coverage), against the
  whole chunks' shards projected the same way (shards only: the prefix ``C_p`` aside).

Run alone (minutes: a KV forward per chunk and per variant; ``local`` decodes every chunk)::

    python tests/benchmarks/bench_kv_keep.py --corpora sample --extractors rules local
    python tests/benchmarks/bench_kv_keep.py --corpora sample --extractors rules --kv-codec int4
    python tests/benchmarks/bench_kv_keep.py --corpora faq --extractors rules \\
        --pages faq/gui faq/installed faq/windows faq/extending --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
_TMP = tempfile.mkdtemp(prefix="bench-kv-keep-")
os.environ.setdefault("PREFECT_HOME", str(Path(_TMP) / "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def faq_source(out: Path, pages: list[str] | None) -> Path:
    """The FAQ pages (only ``pages`` if given) as a JSONL source."""
    if not (out / "corpus.jsonl").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "infra" / "python_faq.py"), str(out)], check=True
        )
    docs = [json.loads(x) for x in (out / "corpus.jsonl").read_text().splitlines()]
    docs = [d for d in docs if d["id"].startswith("faq/") and (not pages or d["id"] in pages)]
    src = out / ("faq-" + "-".join(sorted(d["id"].split("/")[-1] for d in docs)) + ".jsonl")
    src.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return src


def kv_folders(store: Path) -> dict[str, Path]:
    """kv_keep -> its ``STORE/kv/<kv_fp>/`` folder."""
    from coinrag.storage.gc import kv_fps
    from coinrag.storage.kv import KvStore
    from coinrag.storage.store import Store

    st = Store.at(store)
    return {KvStore.open(st, fp).layout.keep: Path(store) / "kv" / fp for fp in kv_fps(st)}


def tree_bytes(path: Path, skip: str = "") -> int:
    """Bytes of the files under ``path`` (but those under a folder named ``skip``)."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files if not skip or skip not in p.parts)


def block_aligned_bytes(kv, rows) -> int:
    """Data bytes if each entry stored every block its kept ranges touch (whole blocks, the
    others absent) instead of the kept tokens back to back: per block its payload and crc32c."""
    from coinrag.storage.kv import KeptRanges

    block = kv.layout.block_tokens
    per_block = kv.layout.block_bytes + 4  # the codec's payload (codes and scales) + crc32c
    total = 0
    for row in rows:
        blocks = set()
        for s, e in KeptRanges.from_flat(row.kept).ranges:
            blocks.update(range(s // block, -(-e // block)))
        total += len(blocks) * per_block
    return total


def exact_data_bytes(kv, stored: list[int]) -> int:
    block = kv.layout.block_tokens
    return sum(-(-t // block) for t in stored) * (kv.layout.block_bytes + 4)


def lower_coverage(chunks, nuggets, target: float, seed: int = 0) -> tuple[list[int], float]:
    """Stored token counts (and the coverage) when each chunk keeps its nuggets, taken in a
    random order, until they cover ``target`` of its tokens."""
    from coinrag.storage.kv import KeptRanges

    by_chunk: dict[str, list[tuple[int, int]]] = {}
    for n in nuggets:
        by_chunk.setdefault(n.chunk_id, []).append((n.tok_start, n.tok_end))
    rng = random.Random(seed)
    stored, covered, total = [], 0, 0
    for c in chunks:
        spans = by_chunk.get(c.chunk_id, [])
        rng.shuffle(spans)
        kept: list[tuple[int, int]] = []
        for span in spans:
            if KeptRanges.of_spans(kept).stored >= target * c.n_tokens:
                break
            kept.append(span)
        n = KeptRanges.of_spans(kept).stored
        if n:
            stored.append(n)
        covered += n
        total += c.n_tokens
    return stored, covered / max(total, 1)


def measure(source: str, store: Path, extractor: str, settings: dict) -> dict:
    from coinrag.flows.build import build_flow
    from coinrag.schemas.tables import ChunkRow, NuggetRow
    from coinrag.storage.gc import kv_fps
    from coinrag.storage.kv import KeptRanges, KvStore
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_rows

    row: dict = {"extractor": extractor}
    t0 = time.perf_counter()
    base = {"extractor": extractor, **settings}
    build_flow(source, str(store), {**base, "kv_keep": "chunks"})
    row["build chunks s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    summary = build_flow(source, str(store), {**base, "kv_keep": "nuggets"})
    row["build nuggets s"] = time.perf_counter() - t0
    row["kv stage nuggets s"] = summary["stage_seconds"].get("kv", 0.0)
    st = Store.at(store)
    chunks = list({c.content_key: c for c in read_rows(st, ChunkRow)}.values())
    nuggets = read_rows(st, NuggetRow)
    tokens = sum(c.n_tokens for c in chunks)
    folders = kv_folders(store)
    kvs = {KvStore.open(st, fp).layout.keep: KvStore.open(st, fp) for fp in kv_fps(st)}
    kv = kvs["nuggets"]
    rows = list(kv.manifest().values())
    stored = [KeptRanges.from_flat(r.kept).stored for r in rows]
    lay = kv.layout
    raw_bf16 = lay.layers * 2 * lay.kv_heads * lay.head_dim * 2
    shard_bytes = tree_bytes(folders["nuggets"], skip="prefix") - len(
        (folders["nuggets"] / "zarr.json").read_bytes()
    )
    disk = {keep: tree_bytes(path) for keep, path in folders.items()}
    row.update(
        {
            "chunks": len(chunks),
            "chunk tokens": tokens,
            "nuggets": len(nuggets),
            "chunks without nuggets": summary["kv_nothing_kept"],
            "coverage": sum(stored) / tokens,
            "dtype": lay.dtype,
            "kv_codec": lay.kv_codec,
            "block_tokens": lay.block_tokens,
            "B/token (layout)": lay.token_bytes,
            "raw bf16 B/token": raw_bf16,
            "chunks B/tok": disk["chunks"] / tokens,
            "nuggets B/tok": disk["nuggets"] / tokens,
            "chunks /raw bf16": disk["chunks"] / tokens / raw_bf16,
            "nuggets /raw bf16": disk["nuggets"] / tokens / raw_bf16,
            "saved": 1 - disk["nuggets"] / disk["chunks"],
            "formula": lay.disk_bytes(stored) / shard_bytes,
            "block-aligned": (block_aligned_bytes(kv, rows) / exact_data_bytes(kv, stored)),
        }
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpora", nargs="+", default=["sample", "faq"])
    ap.add_argument("--extractors", nargs="+", default=["rules", "local"])
    ap.add_argument("--pages", nargs="*", default=None, help="FAQ pages (default: all faq/*)")
    ap.add_argument("--faq-dir", type=Path, default=Path(_TMP) / "faq")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument(
        "--kv-codec", default="none", help="none | int8 | int4 | int2 | int2mix (both stores)"
    )
    ap.add_argument("--coverages", nargs="*", type=float, default=[0.9, 0.7, 0.5, 0.3])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--out", type=Path, default=Path(_TMP), help="where the stores go")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    sources = {"sample": str(ROOT / "flows" / "sample" / "wiki_sample.jsonl")}
    if "faq" in args.corpora:
        args.faq_dir.mkdir(parents=True, exist_ok=True)
        sources["faq"] = str(faq_source(args.faq_dir, args.pages))
    settings = {
        "kv_dtype": args.kv_dtype,
        "kv_codec": args.kv_codec,
        "coverages": args.coverages,
    }
    rows = []
    for corpus in args.corpora:
        for extractor in args.extractors:
            store = args.out / f"{corpus}-{extractor}-{args.kv_codec}"
            build = {k: v for k, v in settings.items() if k != "coverages"}
            row = {"corpus": corpus, **measure(sources[corpus], store, extractor, build)}
            if settings["coverages"]:
                row.update(measure_lower(store, settings["coverages"]))
            rows.append(row)
            print(json.dumps(row, default=lambda v: round(v, 4)), flush=True)
    print()
    for row in rows:
        print(f"{row['corpus']} / {row['extractor']}:")
        for key, value in row.items():
            if key not in ("corpus", "extractor"):
                shown = f"{value:.3f}" if isinstance(value, float) else value
                print(f"  {key:28} {shown}")


def measure_lower(store: Path, coverages: list[float]) -> dict:
    """The lower-coverage projections of a built store (see the module doc)."""
    from coinrag.schemas.tables import ChunkRow, NuggetRow
    from coinrag.storage.gc import kv_fps
    from coinrag.storage.kv import KvStore
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_rows

    st = Store.at(store)
    chunks = list({c.content_key: c for c in read_rows(st, ChunkRow)}.values())
    nuggets = read_rows(st, NuggetRow)
    tokens = sum(c.n_tokens for c in chunks)
    lay = next(KvStore.open(st, fp).layout for fp in kv_fps(st))
    full = lay.disk_bytes([c.n_tokens for c in chunks])
    out = {}
    for target in coverages:
        kept, coverage = lower_coverage(chunks, nuggets, target)
        name = f"~{target:.0%} coverage ({coverage:.3f})"
        out[f"{name}: saved (shards)"] = 1 - lay.disk_bytes(kept) / full
        out[f"{name}: shards B/tok"] = lay.disk_bytes(kept) / tokens
    return out


if __name__ == "__main__":
    main()
