"""Assembly of a context from stored KV slices (``inference.context.assemble.place_slices``), one
thread, SmolLM2's shapes (30 layers, 3 KV heads, head_dim 64, bf16), keys stored at position 0
(a quantized store) so every slice is rotated:

    python tests/benchmarks/bench_assembly.py [--reps 10]

Cases: turborag's 4 whole chunks of 512 tokens, coinrag's 10 nugget slices of 17 tokens, each
after a 32-token prefix. Prints the mean ms of each (two passes, to see the noise)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from coinrag.inference.context.assemble import KvSlice, place_slices  # noqa: E402
from coinrag.inference.model.loading import load_model  # noqa: E402
from coinrag.inference.rope import RopeSpec  # noqa: E402

LAYERS, HEADS, DIM, PREFIX = 30, 3, 64, 32


def kv(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, HEADS, tokens, DIM, generator=g).bfloat16()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = RopeSpec.from_config(load_model(None).model.config)
    prefix = kv(PREFIX, 0)
    for label, sizes in (("turborag 4 x 512", [512] * 4), ("coinrag 10 x 17", [17] * 10)):
        slices = [
            KvSlice(kv(n, i + 1), PREFIX, PREFIX + 512, at_zero=True) for i, n in enumerate(sizes)
        ]
        starts = [PREFIX + sum(sizes[:i]) for i in range(len(sizes))]
        place_slices(prefix, slices, starts, spec)  # warm
        for _ in range(2):
            t = time.perf_counter()
            for _ in range(args.reps):
                place_slices(prefix, slices, starts, spec)
            ms = (time.perf_counter() - t) / args.reps * 1000
            print(f"{label:<18} {ms:7.2f} ms")


if __name__ == "__main__":
    main()
