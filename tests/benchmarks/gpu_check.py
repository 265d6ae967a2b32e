"""KV build throughput and coinrag / turborag / standard TTFT at 7B dims on a GPU (issue 23).

    python tests/benchmarks/gpu_check.py [--dry-run] [--device cuda] [--forwards eager compiled]
        [--chunks 4] [--chunk-tokens 512] [--batch 16] [--reps 10] [--peak-tflops F]
        [--budget-s 330]

Random weights in a Qwen2-7B config (bf16; 28 layers, hidden 3584, 28 query / 4 KV heads),
made on the device (nothing downloaded). Then:

1. **KV build**: batches of ``--batch`` chunks of ``--chunk-tokens`` tokens, each encoded
   after a 32-token prompt prefix as the KV stage encodes them (``inference.model.encode.
   forward_after_prefix``), and the KV copied to host memory (what the stage stores): tokens
   per second, and MFU = matmul + attention FLOPs per second / the device's peak;
2. **TTFT** per method and forward (``inference/model/forward.py``: eager, compiled), as the methods
   compute it, on ``--chunks`` retrieved chunks whose KV sits in pinned host memory (a warm KV
   cache): ``kv_load`` (the needed KV to the device), ``assembly`` (re-rotation, ``inference.
   assemble.assemble_context``), ``prefill`` (the 25-token query after the context; for
   standard, the whole prompt), each synchronised; coinrag reads 10 nugget slices of 24 tokens
   out of the chunks; mean and P99 over ``--reps`` after one warm-up (compiled: the warm-up
   compiles); decode ms per token over 16 tokens; the prefill's MFU;
3. the table of TTFT per method (the paper's Table: method, context tokens, TTFT).

``--dry-run``: a tiny random Qwen2 on the CPU in float32, small sizes, eager only: checks the
script end to end anywhere in seconds. ``--budget-s``: phases that would start after that
many seconds are skipped (said so), so ``gpu_check.sh`` ends within its 8 minutes.
"""

from __future__ import annotations

import argparse
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
PREFIX, QUERY, NUGGETS, NUGGET_TOKENS = 32, 25, 10, 24


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


def kv_build(model: Any, args: argparse.Namespace, prefix_kv: torch.Tensor, mfu_peak) -> None:
    from coinrag.inference.model.encode import cache_to_kv, forward_after_prefix

    vocab = model.config.vocab_size
    rows = torch.randint(3, vocab, (args.batch, args.chunk_tokens)).tolist()
    times = []
    for i in range(4):  # one warm-up batch, three timed
        sync(args.device)
        t = time.perf_counter()
        with torch.inference_mode():
            cache = forward_after_prefix(model, prefix_kv, rows)
            kv = cache_to_kv(cache, start=PREFIX).cpu()
        sync(args.device)
        if i:
            times.append(time.perf_counter() - t)
    del kv
    tokens = args.batch * args.chunk_tokens
    per_s = tokens / statistics.mean(times)
    flops = forward_flops(model.config, tokens, PREFIX + args.chunk_tokens // 2, lm_head=False)
    mfu = flops / statistics.mean(times) / (mfu_peak * 1e12) if mfu_peak else None
    print(
        f"KV build: {per_s:,.0f} tokens/s ({args.batch} x {args.chunk_tokens}-token chunks "
        f"per forward after a {PREFIX}-token prefix, KV to host memory)"
        + (f", MFU {mfu:.1%}" if mfu is not None else ", MFU n/a (unknown peak)")
    )


def ttft(model: Any, args: argparse.Namespace, prefix_kv: torch.Tensor, mfu_peak, started):
    from coinrag.inference.context.assemble import KvSlice, assemble_context
    from coinrag.inference.model.encode import cache_to_kv, forward_after_prefix
    from coinrag.inference.model.forward import use_forward
    from coinrag.inference.model.generate import prefill_and_decode
    from coinrag.inference.rope import RopeSpec

    class NoEos:
        eos_token_id = None

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return ""

    model.generation_config.eos_token_id = None
    spec = RopeSpec.from_config(model.config)
    vocab, n = model.config.vocab_size, args.chunk_tokens
    prefix_ids = torch.randint(3, vocab, (PREFIX,)).tolist()
    chunk_ids = torch.randint(3, vocab, (args.chunks, n)).tolist()
    query = torch.randint(3, vocab, (QUERY,)).tolist()
    with torch.inference_mode():
        chunk_kv = cache_to_kv(forward_after_prefix(model, prefix_kv, chunk_ids), start=PREFIX)
    host = [
        kv.cpu().pin_memory() if args.device.startswith("cuda") else kv.cpu() for kv in chunk_kv
    ]
    g = torch.Generator().manual_seed(1)
    spans = []
    for i in range(NUGGETS):
        c = i % args.chunks
        s = int(torch.randint(0, n - NUGGET_TOKENS, (1,), generator=g))
        spans.append((c, s, s + NUGGET_TOKENS))

    def context(method: str) -> tuple[torch.Tensor | None, int, list[int], dict[str, float]]:
        timing = {"kv_load": 0.0, "assembly": 0.0}
        if method == "standard":
            ids = prefix_ids + [t for row in chunk_ids for t in row] + query
            return None, 0, ids, timing
        sync(args.device)
        t0 = time.perf_counter()
        if method == "coinrag":
            parts = [(host[c][..., s:e, :], PREFIX + s) for c, s, e in spans]
        else:
            parts = [(kv, PREFIX) for kv in host]
        moved = [(kv.to(args.device, non_blocking=True), start) for kv, start in parts]
        sync(args.device)
        t1 = time.perf_counter()
        slices = [KvSlice(kv, start, PREFIX + n) for kv, start in moved]
        total = PREFIX + sum(s.tokens for s in slices)
        ctx = assemble_context(prefix_kv, slices, spec, new_seq_len=total + QUERY)
        sync(args.device)
        timing["kv_load"] = (t1 - t0) * 1000
        timing["assembly"] = (time.perf_counter() - t1) * 1000
        return ctx, total, query, timing

    print("\nTTFT (ms; mean over --reps after a warm-up; KV from pinned host memory)")
    print(
        "method    forward   context  TTFT mean    P99 | kv_load  assembly  prefill  prefill MFU"
        " | decode ms/tok  warm-up s",
        flush=True,
    )
    rows = []
    for kind in args.forwards:
        if time.perf_counter() - started > args.budget_s:
            print(f"TTFT with the {kind} forward: skipped (past --budget-s {args.budget_s})")
            continue
        use_forward(model, kind)
        for method in ("coinrag", "turborag", "standard"):
            t_warm = time.perf_counter()
            ctx, total, ids, _ = context(method)
            with torch.inference_mode():
                prefill_and_decode(model, NoEos(), ctx, total, ids, max_new_tokens=16)
            warm = time.perf_counter() - t_warm
            ttfts, prefills, loads, assemblies, decodes = [], [], [], [], []
            for _ in range(args.reps):
                ctx, total, ids, timing = context(method)
                with torch.inference_mode():
                    gen = prefill_and_decode(model, NoEos(), ctx, total, ids, max_new_tokens=1)
                prefills.append(gen.prefill_ms)
                loads.append(timing["kv_load"])
                assemblies.append(timing["assembly"])
                ttfts.append(timing["kv_load"] + timing["assembly"] + gen.prefill_ms)
            ctx, total, ids, _ = context(method)
            with torch.inference_mode():
                gen = prefill_and_decode(model, NoEos(), ctx, total, ids, max_new_tokens=16)
            sync(args.device)
            decodes.append(gen.decode_ms / 15)
            flops = forward_flops(model.config, len(ids), total + len(ids) // 2, lm_head=False)
            mfu = (
                flops / (statistics.mean(prefills) / 1000) / (mfu_peak * 1e12) if mfu_peak else None
            )
            rows.append(
                {
                    "method": method,
                    "forward": kind,
                    "context": total if method != "standard" else len(ids) - QUERY,
                    "ttft_mean": statistics.mean(ttfts),
                    "ttft_p99": pct(ttfts, 0.99),
                    "kv_load": statistics.mean(loads),
                    "assembly": statistics.mean(assemblies),
                    "prefill": statistics.mean(prefills),
                    "decode": statistics.mean(decodes),
                    "mfu": mfu,
                    "warm": warm,
                }
            )
            print(row_line(rows[-1]), flush=True)  # as it comes: a cut-off run keeps it
    return rows


def row_line(r: dict[str, Any]) -> str:
    """One row of the TTFT table."""
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    return (
        f"{r['method']:<9} {r['forward']:<8} {r['context']:>7} {r['ttft_mean']:>10.2f} "
        f"{r['ttft_p99']:>6.2f} | {r['kv_load']:>7.2f} {r['assembly']:>9.2f} "
        f"{r['prefill']:>8.2f} {mfu:>12} | {r['decode']:>13.2f} {r['warm']:>10.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--forwards", nargs="+", default=None)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--budget-s", type=float, default=330.0)
    args = parser.parse_args()
    dry = args.dry_run
    args.device = args.device or ("cpu" if dry else "cuda")
    args.forwards = args.forwards or (["eager"] if dry else ["eager", "compiled"])
    args.chunk_tokens = args.chunk_tokens or (64 if dry else 512)
    args.batch = args.batch or (2 if dry else 16)
    args.reps = args.reps or (2 if dry else 10)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run (tiny model on the CPU) here")
    started = time.perf_counter()
    from coinrag.inference.model.encode import compute_prefix_kv

    model = make_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    peak = peak_tflops(args.device, args.peak_tflops)
    print(
        f"{'tiny Qwen2 (dry run)' if dry else 'Qwen2-7B config'}, random weights, "
        f"{n_params / 1e9:.2f} B parameters, {next(model.parameters()).dtype}, on {name} "
        f"(peak {peak or 'unknown'} TFLOPS); made in {time.perf_counter() - started:.1f} s"
    )
    prefix_ids = torch.randint(3, model.config.vocab_size, (PREFIX,)).tolist()
    prefix_kv = compute_prefix_kv(model, prefix_ids)
    kv_build(model, args, prefix_kv, peak)
    ttft(model, args, prefix_kv, peak, started)
    print(f"\ngpu_check done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
