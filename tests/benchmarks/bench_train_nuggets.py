"""Nugget-aware fine-tuning throughput: seconds per optimizer step and peak memory, per mode.

Each configuration (``live``, ``frozen``, optionally with ``--lora``) runs in its own process,
so its peak resident memory (``ru_maxrss``) is its own. Steps are timed with the training
loop's ``on_step`` callback; the first step (lazy loading, allocator warm-up) is reported apart.

    python tests/benchmarks/bench_train_nuggets.py --store STORE --data qa.jsonl \\
        [--steps 4] [--batch-size 4] [--modes live frozen] [--lora] [--threads 1] [--json OUT]

The store must hold the data's documents (and, for ``frozen``, the KV of ``--model``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_one(args: argparse.Namespace, mode: str, lora: bool) -> dict:
    """Train ``args.steps`` steps in this process; return timings and peak RSS."""
    import torch

    from coinrag.schemas.settings import FinetuneSettings
    from coinrag.training.finetune import run_training
    from coinrag.training.job import TrainJob
    from coinrag.training.loop import RunControl

    torch.set_num_threads(args.threads)
    stamps: list[float] = []
    started = time.perf_counter()
    cfg = FinetuneSettings(
        mode=mode,
        lora=lora,
        batch_size=args.batch_size,
        max_steps=args.steps,
        checkpoint_every=10_000,
        raft_p=0.0,
    )
    with tempfile.TemporaryDirectory() as out:
        summary = run_training(
            TrainJob(args.store, args.data, out, model=args.model),
            cfg,
            RunControl(on_step=lambda step, loss: stamps.append(time.perf_counter())),
        )
    steps = [b - a for a, b in zip([started, *stamps[:-1]], stamps, strict=True)]
    later = steps[1:] or steps
    return {
        "mode": mode,
        "lora": lora,
        "batch_size": args.batch_size,
        "steps": len(steps),
        "first_step_s": steps[0] if steps else None,
        "s_per_step": sum(later) / len(later) if later else None,
        "steps_per_s": len(later) / sum(later) if later else None,
        "examples_per_s": args.batch_size * len(later) / sum(later) if later else None,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_loss": summary.get("final_loss"),
        "threads": args.threads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=["live", "frozen"])
    p.add_argument("--lora", action="store_true", help="also each mode with LoRA")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "mode,lora"
    args = p.parse_args()
    if args.child:
        mode, lora = args.child.split(",")
        print("RESULT " + json.dumps(run_one(args, mode, lora == "1")), flush=True)
        return

    results = []
    for mode in args.modes:
        for lora in [False, True] if args.lora else [False]:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", f"{mode},{int(lora)}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"{mode} lora={lora} failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    head = ("mode", "lora", "batch", "s/step", "ex/s", "first", "RSS MiB")
    print(f"{head[0]:<8} {head[1]:<5} " + " ".join(f"{h:>8}" for h in head[2:]))
    for r in results:
        print(
            f"{r['mode']:<8} {str(r['lora']):<5} {r['batch_size']:>8} {r['s_per_step']:>8.2f} "
            f"{r['examples_per_s']:>8.2f} {r['first_step_s']:>8.2f} {r['peak_rss_mib']:>8.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
