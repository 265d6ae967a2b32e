"""Issue 13's table in one run: for each KV setting (dtype x codec), build a store with the
CLI, then ``coinrag eval`` it on the FAQ questions, and print one markdown row per setting.

    python tests/benchmarks/bench_kv_table.py [--work DIR] [--source CORPUS.jsonl]
        [--questions QUESTIONS.jsonl] [--subset 0] [--limit 176] [--threads 1]
        [--variants float32:none bfloat16:none bfloat16:int8 bfloat16:int4 bfloat16:int4:nuggets]
        [--methods coinrag standard] [--kc 4] [--k 10] [--json PATH]

A variant is ``DTYPE:CODEC[:KEEP]``, ``KEEP`` being ``chunks`` (default) or ``nuggets``
(``--kv-keep nuggets``: only the nugget spans' KV is stored; its store is
``WORK/store-<dtype>-<codec>-nuggets``). Corpus and questions default to the FAQ pages of
Debian's ``python3.11-doc`` and their 176 question / answer pairs (``infra/python_faq.py
WORK/faq --subset N``: the FAQ pages plus ``N`` other pages). Each setting gets its own store
``WORK/store-<dtype>-<codec>`` built from scratch (or, with ``--one-store``, all go into
``WORK/store``: the first build does every stage, later ones add their KV beside it and eval
reads it after ``coinrag.toml``'s ``kv_dtype`` / ``kv_codec`` / ``kv_keep`` are set to the
setting's) (``coinrag build SOURCE --extractor rules --kv-dtype D --kv-codec C``; a second run
with the same WORK reuses a built store and its eval results, and an eval's output folder an
interrupted run left), so every build's stage times
cover every stage. Both commands run as child processes with ``OMP_NUM_THREADS=--threads``;
their peak RSS is the child's (``os.wait4``: the process and the children it waited for, as
``/usr/bin/time``).

Columns:

- ``bytes/raw bf16``: bytes on disk of ``STORE/kv/<kv_fp>/`` (every file: shards, prompt
  prefix, manifest, metadata) over the stored chunk tokens (the KV manifest's), divided by the
  raw bfloat16 size of one token's KV (``layers x 2 x kv_heads x head_dim x 2`` bytes);
- ``KV tok/s``: chunk tokens the build computed (manifest rows of its run) / its ``kv`` stage
  wall seconds (the run's ``stage_seconds``: forward, encoding, writing);
- the build's wall seconds per stage (``ingest``, ``chunk``, ``extract``, ``recover``, ``kv``,
  ``embed_index``) and in all (the whole command, Prefect's temporary server included);
- F1 / EM / recall / TTFT mean and P99 (ms) per method, as ``coinrag eval`` wrote them in
  ``results.parquet`` at (``--kc``, ``--k``);
- peak RSS (MiB) of the build and of the eval;
- ``kv_load + assembly`` mean and P99 (ms) per KV method, from eval's per-question timings (one
  thread, ``--threads``);
- with ``--first-token``: the first-token agreement (argmax equal) and the mean KL divergence
  ``KL(p_ref || p)`` of the first-token distribution of each KV method against the reference
  setting (``--reference``, default the first variant; only the first token is decoded, on the
  same retrieved evidence), in process after the evals (``WORK/first-token-<setting>.pt`` keeps
  each setting's logits; a rerun reuses them).

Load on a shared machine skews times: the 1-minute load average is printed before and after
each command; compare the rows of one run side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

STAGES = ("ingest", "chunk", "extract", "recover", "kv", "embed_index")
COINRAG = str(Path(sys.executable).with_name("coinrag"))


def load() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def run_child(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run ``cmd`` (output to ``log``); its wall seconds, peak RSS (MiB) and loads around it.
    A non-zero exit raises with the log's tail."""
    before = load()
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"error: {' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return {
        "wall_s": round(wall, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),  # ru_maxrss: KiB on Linux
        "load_before": round(before, 2),
        "load_after": round(load(), 2),
    }


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def last_build(
    store_path: Path, dtype: str, codec: str, keep: str = "chunks"
) -> dict[str, Any] | None:
    """The counts (``stage_seconds`` among them) and fingerprints of the store's last
    completed build run with KV at ``dtype`` / ``codec`` / ``keep`` that computed KV (None if
    none)."""
    from coinrag.schemas.tables import RunRow
    from coinrag.storage.store import Store
    from coinrag.storage.tables import read_table

    if not (store_path / "coinrag.toml").is_file():
        return None
    rows = []
    for r in read_table(Store.at(store_path), RunRow).to_pylist():
        params = json.loads(r["parameters_json"] or "{}")
        counts = json.loads(r["counts_json"] or "{}")
        if (
            r["flow"] == "build"
            and r["status"] == "completed"
            and params.get("kv_dtype") == dtype
            and params.get("kv_codec", "none") == codec
            and params.get("kv_keep", "chunks") == keep
            and counts.get("kv_computed")
        ):
            rows.append(r)
    if not rows:
        return None
    last = max(rows, key=lambda r: r["ended_at"])
    return {
        "counts": json.loads(last["counts_json"]),
        "fingerprints": json.loads(last["fingerprints_json"]),
    }


def kv_measures(store_path: Path, kv_fp: str, kv_seconds: float, run_id: str) -> dict[str, Any]:
    """Bytes on disk of the KV folder, stored chunk tokens, bytes per token over raw bf16, and
    the tokens the build ``run_id`` computed per second of its KV stage (entries an earlier,
    interrupted build committed are reused, not computed)."""
    from coinrag.storage.kv import KvStore
    from coinrag.storage.store import Store

    kv = KvStore.open(Store.at(store_path), kv_fp)
    lay = kv.layout
    tokens = sum(row.tokens for row in kv.manifest().values())
    computed = sum(row.tokens for row in kv.manifest().values() if row.run_id == run_id)
    disk = dir_bytes(store_path / "kv" / kv_fp)
    raw_bf16 = lay.layers * 2 * lay.kv_heads * lay.head_dim * 2
    return {
        "kv_fp": kv_fp,
        "kv_entries": len(kv.manifest()),
        "kv_tokens": tokens,
        "kv_disk_bytes": disk,
        "raw_bf16_bytes_per_token": raw_bf16,
        "bytes_per_token": round(disk / tokens, 1),
        "bytes_over_raw_bf16": round(disk / tokens / raw_bf16, 4),
        "kv_tokens_computed": computed,
        "kv_tokens_per_s": round(computed / kv_seconds, 1) if kv_seconds else None,
    }


def set_kv_settings(store_path: Path, dtype: str, codec: str, keep: str = "chunks") -> None:
    """Point ``STORE/coinrag.toml`` at the KV of ``dtype`` / ``codec`` / ``keep`` (already built
    there)."""
    import re

    path = store_path / "coinrag.toml"
    text = path.read_text()
    for key, value in (("kv_dtype", dtype), ("kv_codec", codec), ("kv_keep", keep)):
        text, n = re.subn(rf'(?m)^{key} = ".*"$', f'{key} = "{value}"', text)
        assert n == 1, f"{path}: no single {key} line"
    path.write_text(text)


def eval_results(out: Path) -> dict[str, dict[str, Any]]:
    """``results.parquet`` of ``coinrag eval``: ``{method: row}``."""
    import pyarrow.parquet as pq

    return {r["method"]: r for r in pq.read_table(out / "results.parquet").to_pylist()}


def measure(variant: str, args: argparse.Namespace, source: Path, env: dict[str, str]) -> dict:
    dtype, codec, keep = (variant.split(":") + ["chunks"])[:3]
    if keep not in ("chunks", "nuggets"):
        raise SystemExit(f"error: variant {variant}: KEEP must be chunks or nuggets")
    name = f"{dtype}-{codec}" + ("-nuggets" if keep == "nuggets" else "")
    store = args.work / ("store" if args.one_store else f"store-{name}")
    result_path = args.work / f"result-{name}.json"
    if result_path.is_file():
        print(f"{name}: reusing {result_path}", flush=True)
        return json.loads(result_path.read_text())
    row: dict[str, Any] = {"variant": name, "kv_dtype": dtype, "kv_codec": codec, "kv_keep": keep}
    build_cmd = [
        COINRAG,
        "build",
        str(source),
        "--store",
        str(store),
        "--extractor",
        "rules",
        "--kv-dtype",
        dtype,
        "--kv-codec",
        codec,
        "--kv-keep",
        keep,
    ]
    built = last_build(store, dtype, codec, keep)
    if built is None:
        print(f"{name}: {' '.join(build_cmd)}", flush=True)
        row["build"] = run_child(build_cmd, env, args.work / f"build-{name}.log")
        built = last_build(store, dtype, codec, keep)
        assert built is not None, f"{store}: no completed build at {dtype} / {codec} / {keep}"
    else:  # built by an earlier run of this script (times from its run row)
        print(f"{name}: {store} already has a build at {dtype} / {codec}: reused", flush=True)
        row["build"] = {"wall_s": None, "peak_rss_mib": None, "load_before": None}
        row["build"] |= {"load_after": None}
    stages = built["counts"]["stage_seconds"]
    row["stage_seconds"] = {s: stages.get(s) for s in STAGES}
    kv_fp, run_id = built["fingerprints"]["kv_fp"], built["counts"]["run_id"]
    row |= kv_measures(store, kv_fp, stages.get("kv") or 0.0, run_id)
    row["chunks"] = built["counts"]["chunks"]
    if args.build_only:
        row["eval"] = {"wall_s": None, "peak_rss_mib": None, "load_before": None}
        row["eval"] |= {"load_after": None}
        row["results"] = {}
        result_path.write_text(json.dumps(row, indent=1, default=str))
        print(f"{name}: {json.dumps(row, default=str)}", flush=True)
        return row
    if args.one_store:  # the store's settings say which KV eval reads: this variant's
        set_kv_settings(store, dtype, codec, keep)
    out = args.work / f"eval-{name}"
    # a store of nugget spans cannot serve whole chunks: turborag is left out there
    methods = [m for m in args.methods if keep == "chunks" or m != "turborag"]
    eval_cmd = [
        COINRAG,
        "eval",
        str(args.questions),
        "--store",
        str(store),
        "--out",
        str(out),
        "--methods",
        *methods,
        "--kc",
        str(args.kc),
        "--k",
        str(args.k),
    ]
    if args.limit:
        eval_cmd += ["--limit", str(args.limit)]
    if (out / "results.parquet").is_file():  # an eval an interrupted run of this script left
        print(f"{name}: {out} already has an eval: reused", flush=True)
        row["eval"] = {"wall_s": None, "peak_rss_mib": None, "load_before": None}
        row["eval"] |= {"load_after": None}
    else:
        print(f"{name}: {' '.join(eval_cmd)}", flush=True)
        row["eval"] = run_child(eval_cmd, env, args.work / f"eval-{name}.log")
    row["results"] = eval_results(out)
    row["kv_load_ms"] = kv_load_ms(out)
    result_path.write_text(json.dumps(row, indent=1, default=str))
    print(f"{name}: {json.dumps(row, default=str)}", flush=True)
    return row


def kv_load_ms(out: Path) -> dict[str, dict[str, float]]:
    """``{method: {"mean": ms, "p99": ms}}`` of ``kv_load + assembly`` per question, from
    ``coinrag eval``'s per-question rows (methods without KV work: 0)."""
    import numpy as np
    import pyarrow.parquet as pq

    per_method: dict[str, list[float]] = {}
    table = pq.read_table(out / "per_question.parquet", columns=["method", "timings"])
    for r in table.to_pylist():
        t = dict(r["timings"])
        per_method.setdefault(r["method"], []).append(t["kv_load"] + t["assembly"])
    return {
        m: {"mean": float(np.mean(v)), "p99": float(np.percentile(v, 99))}
        for m, v in per_method.items()
    }


def first_token_logits(
    store: Path, methods: list[str], questions: list[str], kc: int, k: int
) -> dict[str, torch.Tensor]:
    """``{method: (questions, vocab) float32}``: the first-token logits of each method on
    ``store`` at its current KV settings (each answer decoded to its first token only)."""
    from coinrag.inference.methods.base import Turn
    from coinrag.inference.methods.engine import RagEngine
    from coinrag.inference.methods.kv_reuse import KvReuseMethod
    from coinrag.inference.model.generate import prefill_and_decode

    engine = RagEngine.open(str(store), max_new_tokens=1, methods=methods)
    out: dict[str, torch.Tensor] = {}
    try:
        for name in methods:
            rag = engine.method(name)
            assert isinstance(rag, KvReuseMethod), f"{name} reads no stored KV"
            rows = []
            for q in questions:
                found = rag.retrieve(q, kc, k)
                timings = {"retrieval": 0.0, "kv_load": 0.0, "assembly": 0.0}
                evidence = rag.retrieval.evidence(found)
                turn = Turn(q, found, kc, k, None, timings, evidence, found.mode)
                query_ids, ctx, total = rag.query_and_context(turn)  # what generate() prefills
                loaded = rag.loaded
                gen = prefill_and_decode(
                    loaded.model,
                    loaded.tokenizer,
                    ctx,
                    total,
                    query_ids,
                    max_new_tokens=1,
                    keep_first_logits=True,
                )
                rows.append(gen.first_logits.float())
            out[name] = torch.stack(rows)
    finally:
        engine.close()
    return out


def first_token_measures(
    rows: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, dict[str, dict[str, float]]]:
    """Per setting and KV method: first-token agreement and mean KL against the reference
    setting's logits (the same questions and evidence)."""
    questions = [json.loads(line)["question"] for line in args.questions.open()]
    questions = questions[: args.limit or None]
    kv_methods = [m for m in args.methods if m in ("coinrag", "turborag")]
    logits: dict[str, dict[str, torch.Tensor]] = {}
    store = args.work / "store"
    for r in rows:
        path = args.work / f"first-token-{r['variant']}.pt"
        if path.is_file():
            logits[r["variant"]] = torch.load(path)
            continue
        set_kv_settings(store, r["kv_dtype"], r["kv_codec"], r["kv_keep"])
        methods = kv_methods if r["kv_keep"] == "chunks" else ["coinrag"]
        logits[r["variant"]] = first_token_logits(store, methods, questions, args.kc, args.k)
        torch.save(logits[r["variant"]], path)
    ref = logits[args.reference or rows[0]["variant"]]
    measures: dict[str, dict[str, dict[str, float]]] = {}
    for variant, by_method in logits.items():
        for m, got in by_method.items():
            want = ref[m]
            lp_ref, lp = want.log_softmax(-1), got.log_softmax(-1)
            kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
            agree = (want.argmax(-1) == got.argmax(-1)).float()
            measures.setdefault(variant, {})[m] = {
                "agreement": float(agree.mean()),
                "kl_mean": float(kl.mean()),
                "kl_max": float(kl.max()),
            }
    return measures


def quality_markdown(rows: list[dict[str, Any]], methods: list[str]) -> str:
    """Per setting: bytes, KV tokens/s, and per KV method F1, kv_load + assembly and the
    first-token agreement and KL against the reference."""
    kv_methods = [m for m in methods if m in ("coinrag", "turborag")]
    head = ["setting", "bytes/raw bf16", "KV tok/s"]
    for m in kv_methods:
        head += [f"{m} F1", f"{m} kv_load+asm mean / P99 ms", f"{m} 1st-token agree", f"{m} KL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            f"{r['kv_dtype']} {r['kv_codec']} {r.get('kv_keep', 'chunks')}",
            f"{r['bytes_over_raw_bf16']:.4f}",
            f"{r['kv_tokens_per_s']:.0f}",
        ]
        for m in kv_methods:
            res, load = r["results"].get(m), r.get("kv_load_ms", {}).get(m)
            first = r.get("first_token", {}).get(m)
            cells.append("-" if res is None else f"{res['f1']:.4f}")
            cells.append("-" if load is None else f"{load['mean']:.1f} / {load['p99']:.1f}")
            cells.append("-" if first is None else f"{first['agreement']:.3f}")
            cells.append("-" if first is None else f"{first['kl_mean']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], methods: list[str]) -> str:
    head = ["setting", "bytes/raw bf16", "B/token", "KV tok/s"]
    head += [f"{s} s" for s in STAGES] + ["build s", "build RSS MiB"]
    for m in methods:
        head += [f"{m} F1", f"{m} EM", f"{m} recall", f"{m} TTFT mean ms", f"{m} TTFT P99 ms"]
    head += ["eval RSS MiB", "load build/eval"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            f"{r['kv_dtype']} {r['kv_codec']} {r.get('kv_keep', 'chunks')}",
            f"{r['bytes_over_raw_bf16']:.4f}",
            f"{r['bytes_per_token']:.0f}",
            f"{r['kv_tokens_per_s']:.0f}",
        ]
        cells += [f"{r['stage_seconds'][s]:.1f}" for s in STAGES]
        wall = r["build"]["wall_s"]
        cells += ["-" if wall is None else f"{wall:.0f}", str(r["build"]["peak_rss_mib"])]
        for m in methods:
            res = r["results"].get(m)
            if res is None:
                cells += ["-"] * 5
                continue
            recall = "-" if res["recall"] is None else f"{res['recall']:.4f}"
            cells += [
                f"{res['f1']:.4f}",
                f"{res['em']:.4f}",
                recall,
                f"{res['ttft_mean_ms']:.1f}",
                f"{res['ttft_p99_ms']:.1f}",
            ]
        cells += [
            str(r["eval"]["peak_rss_mib"]),
            f"{r['build']['load_before']}-{r['build']['load_after']} / "
            f"{r['eval']['load_before']}-{r['eval']['load_after']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--source", type=Path, default=None, help="corpus (default: FAQ subset)")
    ap.add_argument("--questions", type=Path, default=None)
    ap.add_argument("--subset", type=int, default=0, help="other pages beside the FAQ pages")
    ap.add_argument("--limit", type=int, default=176, help="questions (0: all)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["float32:none", "bfloat16:none", "bfloat16:int8", "bfloat16:int4"],
        help="DTYPE:CODEC settings",
    )
    ap.add_argument("--methods", nargs="+", default=["coinrag", "standard"])
    ap.add_argument("--kc", type=int, default=4)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument(
        "--one-store",
        action="store_true",
        help="build every setting into one store WORK/store (a later setting adds its KV "
        "beside the others: chunks, nuggets and embeddings reused, so its stage times show "
        "the KV stage only)",
    )
    ap.add_argument("--build-only", action="store_true", help="no eval (its columns '-')")
    ap.add_argument(
        "--first-token",
        action="store_true",
        help="also the first-token agreement and KL of coinrag / turborag against --reference "
        "(needs --one-store)",
    )
    ap.add_argument("--reference", default=None, help="setting name, e.g. bfloat16-none")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.work = (args.work or Path(tempfile.mkdtemp(prefix="bench-kv-table-"))).resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.source is None or args.questions is None:
        data = args.work / "faq"
        if not (data / "questions.jsonl").is_file():
            subprocess.run(
                [
                    sys.executable,
                    str(REPO / "infra" / "python_faq.py"),
                    str(data),
                    "--subset",
                    str(args.subset),
                ],
                check=True,
            )
        args.source = args.source or data / "corpus_subset.jsonl"
        args.questions = args.questions or data / "questions.jsonl"
    env = dict(os.environ)
    threads = str(args.threads)
    env |= {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    env.setdefault("PREFECT_HOME", str(args.work / "prefect"))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    print(f"work {args.work}; cpus {os.cpu_count()}; threads {threads}; load {load():.2f}")
    rows = [measure(v, args, args.source, env) for v in args.variants]
    for r in rows:  # results of an earlier run of this script: kv_load from its eval
        out = args.work / f"eval-{r['variant']}"
        if "kv_load_ms" not in r and out.is_dir():
            r["kv_load_ms"] = kv_load_ms(out)
    if args.first_token:
        if not args.one_store:
            raise SystemExit("error: --first-token compares settings of one store: --one-store")
        torch.set_num_threads(args.threads)
        for variant, measures in first_token_measures(rows, args).items():
            next(r for r in rows if r["variant"] == variant)["first_token"] = measures
    table = markdown(rows, args.methods) + "\n\n" + quality_markdown(rows, args.methods)
    print(table)
    (args.work / "table.md").write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
