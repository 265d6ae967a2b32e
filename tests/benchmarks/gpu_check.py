"""KV build throughput and coinrag / turborag / standard TTFT at 7B dims on a GPU, before and
after issue 37, side by side (issue 23's check, extended).

    python tests/benchmarks/gpu_check.py [--dry-run] [--device cuda] [--chunks 4]
        [--chunk-tokens 512] [--batch 16] [--fill-batch N] [--kv-batches 3] [--reps 10]
        [--before eager] [--after graphs] [--peak-tflops F] [--budget-s 330]

Random weights in a Qwen2-7B config (bf16; 28 layers, hidden 3584, 28 query / 4 KV heads),
made on the device (nothing downloaded). Then:

1. **KV build**, ``--kv-batches`` batches of chunks of ``--chunk-tokens`` tokens, each encoded
   after a 32-token prompt prefix (after one untimed batch): *before*, ``--batch`` chunks per
   forward and each batch's KV copied to host memory before the next forward
   (``encode.forward_after_prefix`` + ``.cpu()``, the stage until issue 37); *after*, batches
   of ``kv_pipeline.fill_batch_size`` chunks (what the device's free memory holds, or
   ``--fill-batch``) through ``kv_pipeline.BatchKvPipeline`` (the copy of batch i into pinned
   memory overlapped with the forward of batch i + 1). Tokens per second and MFU = matmul +
   attention FLOPs per second / the device's peak.
2. **TTFT** per method (coinrag reads 10 nugget slices of 24 tokens out of ``--chunks``
   retrieved chunks, turborag the whole chunks, standard prefills the whole prompt), the chunks'
   KV in pinned host memory (a warm store), mean and P99 over ``--reps`` after one warm-up
   (which compiles or captures), ``kv_load`` / ``assembly`` / ``prefill`` each synchronised,
   decode ms per token over 16 tokens, the prefill's MFU, in three variants:

   - *before*: the ``--before`` forward (eager), each slice copied to the device on its own,
     assembled there (what the check measured for issue 23);
   - *after*: the ``--after`` forward (graphs), the context gathered in one pinned host
     buffer (prefix and slices in place, keys re-rotated there) and copied once
     (``kv_transfer.host_buffer`` / ``to_device``: the served path, ``StoredKvContext.build``);
   - *resident*: the ``--after`` forward, the slices already on the device
     (``kv_resident_bytes``: every slice a hit), the context assembled and re-rotated there.

3. The tables side by side (markdown, for RESULTS.md) and the issue's goals (coinrag TTFT mean
   <= 8 ms, P99 <= 10 ms, decode <= 6 ms per token, KV build >= 45 % MFU), each met or missed.

``--dry-run``: a tiny random Qwen2 on the CPU in float32, small sizes: every step above end to
end in seconds (the graphs forward then runs its static-input step eagerly; nothing is pinned).
``--budget-s``: variants that would start after that many seconds are skipped (said so), so
``gpu_check.sh`` ends within its 8 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

QWEN2_7B = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=500,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0}
PREFIX, QUERY, NUGGETS, NUGGET_TOKENS, DECODE = 32, 25, 10, 24, 16
GOALS = {"ttft_mean": 8.0, "ttft_p99": 10.0, "decode": 6.0, "kv_mfu": 0.45}  # issue 37
VARIANTS = ("before", "after", "resident")
METHODS = ("coinrag", "turborag", "standard")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_tflops(device: str, given: float | None) -> float | None:
    if given:
        return given
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def forward_flops(config: Any, tokens: int, context: int, lm_head: bool) -> float:
    """Matmul FLOPs of ``tokens`` tokens attending to ``context`` earlier positions on
    average: 2 x the layers' weights (and the LM head's) per token, plus QK^T and PV."""
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * config.intermediate_size
    weights = layers * per_layer + (h * config.vocab_size if lm_head else 0)
    attention = 4 * layers * config.num_attention_heads * head_dim * context
    return tokens * (2 * weights + attention)


def make_model(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**(TINY if args.dry_run else QWEN2_7B))
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


# ---------------------------------------------------------------------------- KV build


def chunk_rows(vocab: int, n: int, tokens: int, seed: int) -> list[Any]:
    """``n`` chunk rows of ``tokens`` random token ids (what the pipeline reads of a chunk)."""
    from coinrag.schemas.tables import ChunkRow

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, tokens), generator=g).tolist()
    base = dict(doc_id="d", doc_version="dv", text="", char_start=0, char_end=0, tok_start=0)
    base |= dict(token_spans=[], text_hash="th", tokenizer_fp="tok", chunker_fp="c")
    base |= dict(run_id="r", code_version="v")
    return [
        ChunkRow(
            chunk_id=f"ch-{seed}-{i}",
            ordinal=i,
            n_tokens=tokens,
            tok_end=tokens,
            token_ids=row,
            content_key=f"ck-{seed}-{i}",
            **base,
        )
        for i, row in enumerate(ids)
    ]


def build_before(model: Any, args: argparse.Namespace, prefix_kv: torch.Tensor) -> float:
    """Seconds of ``--kv-batches`` batches of ``--batch`` chunks, each batch's KV copied to
    host memory before the next forward (after one untimed batch)."""
    from coinrag.inference.model.encode import cache_to_kv, forward_after_prefix

    vocab = model.config.vocab_size
    batches = [
        [c.token_ids for c in chunk_rows(vocab, args.batch, args.chunk_tokens, i)]
        for i in range(1 + args.kv_batches)
    ]
    kv = None
    for i, rows in enumerate(batches):
        if i == 1:
            sync(args.device)
            t0 = time.perf_counter()
        with torch.inference_mode():
            kv = cache_to_kv(forward_after_prefix(model, prefix_kv, rows), start=PREFIX).cpu()
        del kv
    sync(args.device)
    return time.perf_counter() - t0


def build_after(model: Any, args: argparse.Namespace, prefix_kv: torch.Tensor, batch: int):
    """Seconds of ``--kv-batches`` batches of ``batch`` chunks through the pipeline (after one
    untimed batch, which also allocates the pinned buffers)."""
    from coinrag.inference.model.kv_pipeline import BatchKvPipeline

    vocab = model.config.vocab_size
    pipeline = BatchKvPipeline(model, prefix_kv)
    for _ in pipeline.run([chunk_rows(vocab, batch, args.chunk_tokens, 100)]):
        pass
    batches = [chunk_rows(vocab, batch, args.chunk_tokens, 101 + i) for i in range(args.kv_batches)]
    sync(args.device)
    t0 = time.perf_counter()
    for _ in pipeline.run(batches):
        pass
    sync(args.device)
    return time.perf_counter() - t0


def kv_build(model: Any, args: argparse.Namespace, prefix_kv: torch.Tensor, peak) -> list[dict]:
    """The KV build before and after: one row each (tokens/s, MFU, chunks per forward)."""
    from coinrag.inference.model.kv_pipeline import device_free_bytes, fill_batch_size

    fill = args.fill_batch
    if fill is None:
        free = device_free_bytes(model)
        size = next(model.parameters()).element_size()
        fill = (
            args.batch
            if free is None
            else fill_batch_size(model.config, size, args.chunk_tokens, PREFIX, free)
        )
    rows = []
    for name, batch, run in (
        ("before", args.batch, lambda: build_before(model, args, prefix_kv)),
        ("after", fill, lambda: build_after(model, args, prefix_kv, fill)),
    ):
        seconds = run()
        tokens = batch * args.chunk_tokens * args.kv_batches
        flops = forward_flops(model.config, tokens, PREFIX + args.chunk_tokens // 2, False)
        mfu = flops / seconds / (peak * 1e12) if peak else None
        rows.append({"variant": name, "batch": batch, "per_s": tokens / seconds, "mfu": mfu})
        print(
            f"KV build {name:<6}: {tokens / seconds:,.0f} tokens/s, "
            f"MFU {f'{mfu:.1%}' if mfu is not None else 'n/a (unknown peak)'} "
            f"({batch} x {args.chunk_tokens}-token chunks per forward)",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------------------- TTFT


@dataclasses.dataclass
class Question:
    """What every TTFT variant answers: the prompt's pieces, the chunks' KV on the host (pinned
    on a GPU), each method's spans ``(chunk, start, end)`` and their KV on the device (the
    resident variant's hits)."""

    model: Any
    device: str
    prefix_kv: torch.Tensor  # (layers, 2, H, PREFIX, D) on the device
    prefix_host: torch.Tensor
    prefix_ids: list[int]
    chunk_ids: list[list[int]]
    query: list[int]
    host: list[torch.Tensor]  # per chunk (layers, 2, H, n, D)
    spans: dict[str, list[tuple[int, int, int]]]
    resident: dict[tuple[int, int, int], torch.Tensor]
    spec: Any  # RopeSpec


def question(model: Any, args: argparse.Namespace, prefix_kv: torch.Tensor) -> Question:
    from coinrag.inference.model.encode import cache_to_kv, forward_after_prefix
    from coinrag.inference.model.kv_transfer import host_buffer
    from coinrag.inference.rope import RopeSpec

    vocab, n, dev = model.config.vocab_size, args.chunk_tokens, args.device
    g = torch.Generator().manual_seed(1)
    prefix_ids = torch.randint(3, vocab, (PREFIX,), generator=g).tolist()
    chunk_ids = torch.randint(3, vocab, (args.chunks, n), generator=g).tolist()
    query = torch.randint(3, vocab, (QUERY,), generator=g).tolist()
    with torch.inference_mode():
        chunk_kv = cache_to_kv(forward_after_prefix(model, prefix_kv, chunk_ids), start=PREFIX)

    def pinned(kv: torch.Tensor) -> torch.Tensor:
        out = host_buffer(tuple(kv.shape), kv.dtype, dev)
        out.copy_(kv)
        return out

    nuggets = []
    for i in range(NUGGETS):
        s = int(torch.randint(0, n - NUGGET_TOKENS, (1,), generator=g))
        nuggets.append((i % args.chunks, s, s + NUGGET_TOKENS))
    host = [pinned(kv) for kv in chunk_kv]
    spans = {"coinrag": nuggets, "turborag": [(c, 0, n) for c in range(args.chunks)]}
    resident = {
        span: host[span[0]][..., span[1] : span[2], :].to(dev).clone()
        for method in spans.values()
        for span in method
    }
    spec = RopeSpec.from_config(model.config)
    return Question(
        model,
        dev,
        prefix_kv,
        pinned(prefix_kv),
        prefix_ids,
        chunk_ids,
        query,
        host,
        spans,
        resident,
        spec,
    )


def runs(starts: list[int], lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])


def load_slices(q: Question, spans: list[tuple[int, int, int]]):
    """Before: each slice copied to the device on its own, assembled there."""
    from coinrag.inference.context.assemble import KvSlice, assemble_context

    n = q.host[0].shape[-2]
    sync(q.device)
    t0 = time.perf_counter()
    parts = [(q.host[c][..., s:e, :], PREFIX + s) for c, s, e in spans]
    moved = [(kv.to(q.device, non_blocking=True), start) for kv, start in parts]
    sync(q.device)
    t1 = time.perf_counter()
    slices = [KvSlice(kv, start, PREFIX + n) for kv, start in moved]
    total = PREFIX + sum(s.tokens for s in slices)
    ctx = assemble_context(q.prefix_kv, slices, q.spec, new_seq_len=total + QUERY)
    sync(q.device)
    return ctx, total, (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000


def load_gathered(q: Question, spans: list[tuple[int, int, int]]):
    """After: the served path: prefix and slices in one host buffer (pinned on a GPU), keys
    re-rotated there, one copy (StoredKvContext.build without kv_resident_bytes)."""
    from coinrag.inference.context.assemble import rotate_placed_keys
    from coinrag.inference.model.kv_transfer import host_buffer, to_device

    lengths = [e - s for _, s, e in spans]
    total = PREFIX + sum(lengths)
    sync(q.device)
    t0 = time.perf_counter()
    shape = (*q.prefix_host.shape[:3], total, q.prefix_host.shape[-1])
    ctx = host_buffer(shape, q.prefix_host.dtype, q.device)
    ctx[..., :PREFIX, :] = q.prefix_host
    at = PREFIX
    for (c, s, e), n in zip(spans, lengths, strict=True):
        ctx[..., at : at + n, :] = q.host[c][..., s:e, :]
        at += n
    t1 = time.perf_counter()
    new_starts = [PREFIX + sum(lengths[:i]) for i in range(len(lengths))]
    old, new = runs([PREFIX + s for _, s, _ in spans], lengths), runs(new_starts, lengths)
    rotate_placed_keys(ctx, PREFIX, old, new, q.spec)
    ctx = to_device(ctx, q.device, q.prefix_kv.dtype)
    sync(q.device)
    return ctx, total, (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000


def load_resident(q: Question, spans: list[tuple[int, int, int]]):
    """Resident: every slice already on the device; the context assembled and re-rotated
    there (StoredKvContext.build_resident, all hits)."""
    from coinrag.inference.context.assemble import rotate_placed_keys

    lengths = [e - s for _, s, e in spans]
    total = PREFIX + sum(lengths)
    sync(q.device)
    t0 = time.perf_counter()
    shape = (*q.prefix_kv.shape[:3], total, q.prefix_kv.shape[-1])
    ctx = torch.empty(shape, dtype=q.prefix_kv.dtype, device=q.device)
    ctx[..., :PREFIX, :] = q.prefix_kv
    at = PREFIX
    for span, n in zip(spans, lengths, strict=True):
        ctx[..., at : at + n, :] = q.resident[span]
        at += n
    t1 = time.perf_counter()
    new_starts = [PREFIX + sum(lengths[:i]) for i in range(len(lengths))]
    old, new = runs([PREFIX + s for _, s, _ in spans], lengths), runs(new_starts, lengths)
    rotate_placed_keys(ctx, PREFIX, old.to(q.device), new.to(q.device), q.spec)
    sync(q.device)
    return ctx, total, (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000


LOADERS = {"before": load_slices, "after": load_gathered, "resident": load_resident}


class NoEos:
    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def context_of(q: Question, method: str, variant: str):
    """``(ctx, total, ids, kv_load ms, assembly ms)`` of one question."""
    if method == "standard":
        ids = q.prefix_ids + [t for row in q.chunk_ids for t in row] + q.query
        return None, 0, ids, 0.0, 0.0
    ctx, total, load, assembly = LOADERS[variant](q, q.spans[method])
    return ctx, total, q.query, load, assembly


def measure(q: Question, args: argparse.Namespace, method: str, variant: str, peak) -> dict:
    """One row: TTFT mean and P99 over ``--reps`` after a warm-up, its parts, decode."""
    from coinrag.inference.model.generate import prefill_and_decode

    model = q.model
    t_warm = time.perf_counter()
    ctx, total, ids, _, _ = context_of(q, method, variant)
    with torch.inference_mode():
        prefill_and_decode(model, NoEos(), ctx, total, ids, max_new_tokens=DECODE)
    warm = time.perf_counter() - t_warm
    ttfts, prefills, loads, assemblies = [], [], [], []
    for _ in range(args.reps):
        ctx, total, ids, load, assembly = context_of(q, method, variant)
        with torch.inference_mode():
            gen = prefill_and_decode(model, NoEos(), ctx, total, ids, max_new_tokens=1)
        prefills.append(gen.prefill_ms)
        loads.append(load)
        assemblies.append(assembly)
        ttfts.append(load + assembly + gen.prefill_ms)
    ctx, total, ids, _, _ = context_of(q, method, variant)
    with torch.inference_mode():
        gen = prefill_and_decode(model, NoEos(), ctx, total, ids, max_new_tokens=DECODE)
    sync(args.device)
    flops = forward_flops(model.config, len(ids), total + len(ids) // 2, lm_head=False)
    mfu = flops / (statistics.mean(prefills) / 1000) / (peak * 1e12) if peak else None
    return {
        "method": method,
        "variant": variant,
        "context": total if method != "standard" else len(ids) - QUERY,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p99": pct(ttfts, 0.99),
        "kv_load": statistics.mean(loads),
        "assembly": statistics.mean(assemblies),
        "prefill": statistics.mean(prefills),
        "decode": gen.decode_ms / (DECODE - 1),
        "mfu": mfu,
        "warm": warm,
        "tokens": gen.token_ids,  # the greedy answer (DECODE tokens)
    }


def ttft(model: Any, args: argparse.Namespace, prefix_kv: torch.Tensor, peak, started):
    """Every method in every variant (standard: before and after only: it loads no KV)."""
    from coinrag.inference.model.forward import use_forward

    model.generation_config.eos_token_id = None
    q = question(model, args, prefix_kv)
    forwards = {"before": args.before, "after": args.after, "resident": args.after}
    print(f"\nTTFT (ms; forwards: before {args.before}, after {args.after})")
    rows = []
    for variant in VARIANTS:
        if time.perf_counter() - started > args.budget_s:
            print(f"TTFT {variant}: skipped (past --budget-s {args.budget_s})")
            continue
        forward = use_forward(model, forwards[variant])
        for method in METHODS:
            if method == "standard" and variant == "resident":
                continue
            rows.append(measure(q, args, method, variant, peak))
            r = rows[-1]
            print(
                f"  {method:<9} {variant:<8} ({type(forward).__name__}): TTFT "
                f"{r['ttft_mean']:.2f} / P99 {r['ttft_p99']:.2f}, kv_load {r['kv_load']:.2f}, "
                f"assembly {r['assembly']:.2f}, prefill {r['prefill']:.2f}, decode "
                f"{r['decode']:.2f} ms/token, warm-up {r['warm']:.1f} s",
                flush=True,
            )
    return rows


# ---------------------------------------------------------------------------- the tables


def cell(values: list[float | None], fmt: str) -> str:
    """``a / b / c`` of the variants' values (``-`` where a variant did not run)."""
    return " / ".join("-" if v is None else format(v, fmt) for v in values)


def tables(build: list[dict], rows: list[dict], args: argparse.Namespace) -> None:
    """The KV build and TTFT tables, before / after (/ resident) side by side, in markdown."""
    print("\n| KV build | chunks per forward | tokens/s | MFU |\n|---|---|---|---|")
    for r in build:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(f"| {r['variant']} | {r['batch']} | {r['per_s']:,.0f} | {mfu} |")
    columns = (
        ("TTFT mean", "ttft_mean", ".2f"),
        ("P99", "ttft_p99", ".2f"),
        ("kv_load", "kv_load", ".2f"),
        ("assembly", "assembly", ".2f"),
        ("prefill", "prefill", ".2f"),
        ("decode ms/token", "decode", ".2f"),
        ("warm-up s", "warm", ".1f"),
    )
    print(
        f"\nms, before ({args.before}, a copy per slice) / after ({args.after}, one pinned copy)"
        f" / resident ({args.after}, slices on the device)\n\n| method | context tokens | "
        + " | ".join(name for name, _, _ in columns)
        + " | prefill MFU |\n|"
        + "---|" * (len(columns) + 3)
    )
    for method in METHODS:
        by = {r["variant"]: r for r in rows if r["method"] == method}
        if not by:
            continue
        context = next(iter(by.values()))["context"]
        cells = [
            cell([by[v][key] if v in by else None for v in VARIANTS], f) for _, key, f in columns
        ]
        mfus = [
            by[v]["mfu"] * 100 if v in by and by[v]["mfu"] is not None else None for v in VARIANTS
        ]
        print(f"| {method} | {context:,} | " + " | ".join(cells) + f" | {cell(mfus, '.1f')} % |")


def same_answers(rows: list[dict]) -> None:
    """Whether each variant's greedy answer is the before variant's (eager, per-slice copies)."""
    print(f"\nGreedy answers ({DECODE} tokens) equal to before's:")
    for method in METHODS:
        by = {r["variant"]: r["tokens"] for r in rows if r["method"] == method}
        if "before" in by:
            same = [f"{v} {'yes' if by[v] == by['before'] else 'NO'}" for v in by if v != "before"]
            print(f"  {method}: {', '.join(same) or '-'}")


def goals(build: list[dict], rows: list[dict], dry_run: bool) -> None:
    """The issue's goals, each met or missed (coinrag: the better of after and resident)."""
    ours = [r for r in rows if r["method"] == "coinrag" and r["variant"] != "before"]
    after = [r for r in build if r["variant"] == "after"]
    checks = []
    if ours:
        best = min(ours, key=lambda r: r["ttft_mean"])
        checks += [
            (
                f"coinrag TTFT mean <= {GOALS['ttft_mean']} ms ({best['variant']})",
                best["ttft_mean"],
                best["ttft_mean"] <= GOALS["ttft_mean"],
            ),
            (
                f"coinrag TTFT P99 <= {GOALS['ttft_p99']} ms ({best['variant']})",
                best["ttft_p99"],
                best["ttft_p99"] <= GOALS["ttft_p99"],
            ),
            (
                f"decode <= {GOALS['decode']} ms/token",
                best["decode"],
                best["decode"] <= GOALS["decode"],
            ),
        ]
    if after and after[0]["mfu"] is not None:
        mfu = after[0]["mfu"]
        checks.append((f"KV build MFU >= {GOALS['kv_mfu']:.0%}", mfu, mfu >= GOALS["kv_mfu"]))
    print(
        "\nGoals (issue 37)"
        + (" (dry run: not the goals' model or device)" if dry_run else "")
        + ":"
    )
    for name, value, met in checks:
        print(f"  {name}: {value:.3g} -> {'met' if met else 'MISSED'}")
    if not checks:
        print("  none measurable here (no peak, or the TTFT variants were skipped)")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None, help="chunks per forward, before")
    parser.add_argument("--fill-batch", type=int, default=None, help="after (default: fill)")
    parser.add_argument("--kv-batches", type=int, default=3)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--before", default="eager", help="the forward before (eager)")
    parser.add_argument("--after", default="graphs", help="the forward after (graphs)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--budget-s", type=float, default=330.0)
    args = parser.parse_args(argv)
    dry = args.dry_run
    args.device = args.device or ("cpu" if dry else "cuda")
    args.chunk_tokens = args.chunk_tokens or (64 if dry else 512)
    args.batch = args.batch or (2 if dry else 16)
    args.fill_batch = args.fill_batch or (4 if dry else None)
    args.reps = args.reps or (2 if dry else 10)
    from coinrag.inference.model.forward import resolve_forward

    for kind in (args.before, args.after):
        try:  # a bad name fails before the model is made
            resolve_forward(kind, serving=True)
        except ValueError as exc:
            parser.error(str(exc))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run (tiny model on the CPU) here")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    started = time.perf_counter()
    from coinrag.inference.model.encode import compute_prefix_kv

    model = make_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = peak_tflops(args.device, args.peak_tflops)
    print(
        f"{'tiny Qwen2 (dry run)' if args.dry_run else 'Qwen2-7B config'}, random weights, "
        f"{n_params / 1e9:.2f} B parameters, {next(model.parameters()).dtype}, on {name} "
        f"(peak {peak or 'unknown'} TFLOPS); made in {time.perf_counter() - started:.1f} s"
    )
    prefix_ids = torch.randint(3, model.config.vocab_size, (PREFIX,)).tolist()
    prefix_kv = compute_prefix_kv(model, prefix_ids)
    build = kv_build(model, args, prefix_kv, peak)
    rows = ttft(model, args, prefix_kv, peak, started)
    tables(build, rows, args)
    same_answers(rows)
    goals(build, rows, args.dry_run)
    print(f"\ngpu_check done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
