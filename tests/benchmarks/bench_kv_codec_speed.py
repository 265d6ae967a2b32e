"""The KV codecs side by side in one process (issue 36): build throughput, slice-read time,
per-layer error and how compressible the stored codes are, the codecs interleaved so that each
sees the same machine load (a shared machine's load moves a row-by-row table by 2-3x).

    python tests/benchmarks/bench_kv_codec_speed.py [--store STORE] [--codecs int4 int2]
        [--chunks 16] [--rounds 3] [--questions 60] [--threads 1]

- ``KV tok/s``: ``tasks.kv.kv_stage`` on the first ``--chunks`` 512-token chunks of three FAQ
  pages (SmolLM2-135M, bfloat16, batch 4, shard writes overlapped as in a build), each codec
  into a fresh store, the codecs alternated ``--rounds`` times; best and median. A codec with
  a key basis (``int2basis``) gets its store's basis written first (calibrated on the other
  FAQ pages' chunks, as a build's first run does once per store), so its rate is a build's
  after that; the calibration's own seconds are printed beside;
- per-layer ``‖x̂ − x‖ / ‖x‖`` of keys (at position 0, as stored) and values of one 512-token
  chunk (mean and worst layer; a key basis calibrated on the other FAQ pages' chunks), the
  order-0 entropy of the codes (bits per code) and the bytes of the payloads compressed by
  zstd (numcodecs, level 3, block by block) over raw bf16;
- with ``--store`` (a store holding those codecs' KV of whole chunks, e.g. ``bench_kv_table.py
  --one-store``'s): ``KvStore.read_slices`` of coinrag-like requests (10 slices of 17 tokens
  in 4 random chunks) per codec, alternated per question; mean and P99 ms; each codec twice:
  its compiled decode (``storage/kv/kernels.py``) and its tensor path (the decode before the
  kernels, forced by this script), so their ratio is measured in one process.
- ``--slices-only``: only the slice reads (no model loaded).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from coinrag.storage.kv import KvLayout, KvStore  # noqa: E402
from coinrag.storage.store import Store  # noqa: E402

FAQ = Path("/usr/share/doc/python3.11/html/_sources/faq")


def calibration_rows(loaded) -> list:
    """The chunks a key basis is calibrated on here: ``tasks.kv.calibration_chunks`` of the
    FAQ pages after the first three (those the throughput and errors are measured on)."""
    from coinrag.inference.model.loading import tokenizer_fingerprint
    from coinrag.tasks.chunk import chunk_document
    from coinrag.tasks.kv import KvOptions, calibration_chunks

    tok = loaded.tokenizer
    fp = tokenizer_fingerprint(tok)
    rows = []
    for page in sorted(FAQ.glob("*.rst.txt"))[3:]:
        text = page.read_text(encoding="utf-8")
        rows += chunk_document(tok, page.stem, "v", text, tokenizer_fp=fp, run_id="r")
    return calibration_chunks(rows, KvOptions(kv_codec="int2basis"))


def key_basis(loaded) -> tuple[object, float]:
    """A key basis calibrated on :func:`calibration_rows`, and the seconds that took."""
    from coinrag.inference.model.calibrate import calibrated_key_basis
    from coinrag.inference.model.prompt import RagPrompt

    rows = calibration_rows(loaded)
    t0 = time.perf_counter()
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    basis, _ = calibrated_key_basis(loaded.model, prompt, [r.token_ids for r in rows])
    return basis, time.perf_counter() - t0


def throughput(loaded, codecs: list[str], chunks: int, rounds: int) -> dict[str, list[float]]:
    from coinrag.inference.model.encode import kv_layout
    from coinrag.inference.model.loading import tokenizer_fingerprint
    from coinrag.inference.model.prompt import RagPrompt
    from coinrag.tasks.chunk import chunk_document
    from coinrag.tasks.kv import KvOptions, kv_stage

    tok = loaded.tokenizer
    text = "".join(p.read_text(encoding="utf-8") for p in sorted(FAQ.glob("*.rst.txt"))[:3])
    fp = tokenizer_fingerprint(tok)
    rows = chunk_document(tok, "d", "dv", text, tokenizer_fp=fp, chunk_size=512, run_id="r")
    rows = rows[:chunks]
    prompt = RagPrompt.for_tokenizer(tok)
    tokens = sum(r.n_tokens for r in rows)
    root = Path(tempfile.mkdtemp(prefix="bench-codec-speed-"))
    out: dict[str, list[float]] = {c: [] for c in codecs}
    basis = None
    if any(KvLayout("m", "p", 1, 1, 8, "bfloat16", kv_codec=c).codec.needs_basis for c in codecs):
        basis, secs = key_basis(loaded)
        print(f"key basis: calibrated on 24 chunks in {secs:.1f} s (once per store)")
    for r in range(rounds):
        for c in codecs:
            store = Store.at(root / f"{c}-{r}").init()
            layout = kv_layout(loaded, prompt, **KvOptions(kv_codec=c).layout_options("chunks"))
            if layout.codec.needs_basis:  # written once per store, before its first entry
                KvStore.create(store, layout).key_basis.write(basis, {"chunks": "bench"})
            t0 = time.perf_counter()
            kv_stage(store, rows, loaded, prompt, "run", KvOptions(batch_size=4, kv_codec=c))
            out[c].append(tokens / (time.perf_counter() - t0))
    return out


def entropy_bits(codes: torch.Tensor, levels: int) -> float:
    p = torch.bincount(codes.flatten().long(), minlength=levels + 1).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum())


def errors(loaded, codecs: list[str]) -> None:
    from numcodecs import Zstd

    from coinrag.inference.model.encode import from_cache, keys_to_position_zero
    from coinrag.inference.rope import RopeSpec

    ids = loaded.tokenizer((FAQ / "general.rst.txt").read_text(encoding="utf-8"))["input_ids"]
    with torch.inference_mode():
        out = loaded.model(input_ids=torch.tensor([ids[:512]]), use_cache=True)
    spec = RopeSpec.from_config(loaded.model.config)
    pre = keys_to_position_zero(from_cache(out.past_key_values), spec, 0)
    layers, _, heads, n, dim = pre.shape
    raw = n * layers * 2 * heads * dim * 2
    for name in codecs:
        lay = KvLayout("m", "p", layers, heads, dim, "bfloat16", kv_codec=name)
        codec = lay.codec
        if codec.needs_basis:
            lay.key_basis.set(key_basis(loaded)[0])
        stored = codec.encode(pre, lay)
        got = codec.decode(stored, lay)[:, :, :, :n].double()
        rel = (got - pre.double()).flatten(2).norm(dim=2) / pre.double().flatten(2).norm(dim=2)
        zstd = sum(len(Zstd(level=3).encode(np.ascontiguousarray(b))) for b in stored)
        line = f"{name}: bytes/raw bf16 {stored.nbytes / raw:.4f}, zstd {zstd / raw:.4f}"
        cut = codec._cut(torch.from_numpy(stored), lay) if hasattr(codec, "levels") else {}
        if "k_codes" in cut:  # int2mix's (int2basis's) key codes are in two widths: not counted
            shape = (stored.shape[0], layers, heads, lay.block_tokens, dim * codec.bits // 8)
            bits = [
                entropy_bits(codec._unpack(cut[s].reshape(shape), dim), codec.levels)
                for s in ("k_codes", "v_codes")
            ]
            line += f", code entropy K {bits[0]:.3f} V {bits[1]:.3f} bits of {codec.bits}"
        k, v = rel[:, 0], rel[:, 1]
        print(f"{line}; error K {k.mean():.3f} / {k.max():.3f}, V {v.mean():.3f} / {v.max():.3f}")


def slice_reads(store_path: Path, codecs: list[str], questions: int) -> None:
    from coinrag.storage.kv import kernels

    st = Store.at(store_path)
    stores = {}
    for d in sorted((Path(st.root) / "kv").glob("kv-*")):
        kv = KvStore.open(st, d.name)
        if kv.layout.keeps_chunks and kv.layout.kv_codec in codecs:
            stores[kv.layout.kv_codec] = kv
    first = next(iter(stores.values()))
    manifest = first.manifest()
    keys = sorted(manifest)
    rng = random.Random(0)
    compiled_target = kernels.target_of
    paths = {"compiled": compiled_target, "tensors": lambda out: None}
    times: dict[str, list[float]] = {f"{c} {p}": [] for c in stores for p in paths}
    for _ in range(questions):
        requests = []
        for i, ck in enumerate(rng.sample(keys, 4) * 3):
            if i == 10:
                break
            n = manifest[ck].tokens
            s = rng.randrange(0, max(1, n - 17))
            requests.append((ck, s, min(n, s + 17)))
        for c, kv in stores.items():
            for p, target_of in paths.items():
                kernels.target_of = target_of  # the tensor path: no compiled target
                try:
                    t0 = time.perf_counter()
                    kv.read_slices(requests)
                    times[f"{c} {p}"].append((time.perf_counter() - t0) * 1000)
                finally:
                    kernels.target_of = compiled_target
    for c, t in times.items():
        t = sorted(t[3:])
        print(f"{c}: read_slices mean {statistics.mean(t):.2f} ms, P99 {t[int(0.99 * len(t))]:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", type=Path, default=None)
    ap.add_argument("--codecs", nargs="+", default=["int4", "int2"])
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--questions", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--slices-only", action="store_true", help="only the slice reads (--store)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.slices_only:
        if args.store is None:
            ap.error("--slices-only needs --store")
        slice_reads(args.store, args.codecs, args.questions)
        return 0
    from coinrag.inference.model.loading import load_model

    loaded = load_model(None, dtype="bfloat16")
    errors(loaded, args.codecs)
    tput = throughput(loaded, args.codecs, args.chunks, args.rounds)
    for c, v in tput.items():
        print(f"{c}: KV tok/s best {max(v):.0f}, median {statistics.median(v):.0f} ({v})")
    if args.store is not None:
        slice_reads(args.store, args.codecs, args.questions)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
