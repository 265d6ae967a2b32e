"""Where a question's embedding goes: the default embedder's forward in float32, with bf16
and with float16 weights (transformers' forward, and the lean forward the half-precision
question copy runs: ``inference/retrieval/lean_encoder.py``), and with int8 dynamic
quantization, side by side in one run on one thread.

For each variant: median and p90 ms of ``embed one question`` (tokenizer + forward + mean
pooling + L2 normalisation) over the question file, and the smallest cosine of its vectors to
the float32 ones (what the index holds: a variant far from 1 would move the ranking). Runnable
alone::

    OMP_NUM_THREADS=1 python tests/benchmarks/bench_query_embedding.py \\
        --questions infra/python_natural_questions.jsonl [--repeat 2] [--embedder minilm mpnet]

``--embedder`` (``minilm``, the default; ``mpnet``; a folder; several are timed side by side,
their passes alternated) times other encoders; the lean variants run only for the encoders it
takes (``lean_encoder_of``: plain BERT, MPNet).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from coinrag.inference.retrieval.embedders import load_embedder
from coinrag.inference.retrieval.lean_encoder import LeanEncoder, lean_encoder_of


def _vector(model: torch.nn.Module | LeanEncoder, tokenizer, question: str) -> np.ndarray:
    """The normalised mean-pooled vector ``(dim,)`` of one question (float32)."""
    enc = tokenizer([question], return_tensors="pt")
    with torch.inference_mode():
        if isinstance(model, LeanEncoder):
            hidden = model(enc["input_ids"], enc["attention_mask"], enc.get("token_type_ids"))
            hidden = hidden.float()
        else:
            hidden = model(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)[0].numpy()


def _timed(fn: Callable[[str], np.ndarray], questions: list[str], repeat: int) -> list[float]:
    """Milliseconds of each call, ``repeat`` passes over the questions (after one warm-up)."""
    fn(questions[0])
    out = []
    for _ in range(repeat):
        for q in questions:
            t0 = time.perf_counter()
            fn(q)
            out.append((time.perf_counter() - t0) * 1000)
    return out


def _variants(embedder) -> dict[str, torch.nn.Module | LeanEncoder]:
    """``embedder``'s question encoders: float32, bf16 / fp16 weights (and their lean forward
    where there is one), int8 dynamic quantization."""
    fp32 = embedder._flag.model.eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    fp16 = copy.deepcopy(fp32).to(torch.float16)
    variants = {
        "float32": fp32,
        "bf16 weights": bf16,
        "bf16 lean": lean_encoder_of(bf16),
        "fp16 weights": fp16,
        "fp16 lean": lean_encoder_of(fp16),
        "int8 dynamic": torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(fp32), {torch.nn.Linear}, dtype=torch.qint8
        ),
    }
    return {name: model for name, model in variants.items() if model is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", required=True, help="JSONL with a 'question' field")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--embedder", nargs="+", default=["minilm"], help="minilm (default) | mpnet | a folder"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    with open(args.questions, encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()]
    runs = {}  # (embedder, variant) -> (model, tokenizer, float32 vectors)
    for ref in args.embedder:
        embedder = load_embedder(ref)
        tokenizer = embedder.tokenizer
        variants = _variants(embedder)
        reference = np.stack([_vector(variants["float32"], tokenizer, q) for q in questions])
        for name, model in variants.items():
            runs[(embedder.name, name)] = (model, tokenizer, reference)
    print(f"{len(questions)} questions, one thread, {args.repeat} passes")
    print(f"{'embedder':<18} {'variant':<14} {'median ms':>10} {'p90 ms':>8} {'min cosine':>11}")
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for _ in range(args.repeat):  # passes alternated: every variant sees the same load
        for key, (model, tokenizer, _) in runs.items():
            times[key] += _timed(lambda q, m=model, t=tokenizer: _vector(m, t, q), questions, 1)
    for (name, variant), (model, tokenizer, reference) in runs.items():
        ms = times[(name, variant)]
        vectors = np.stack([_vector(model, tokenizer, q) for q in questions])
        cosine = float((vectors * reference).sum(1).min())
        print(
            f"{name:<18} {variant:<14} {np.median(ms):>10.2f} {np.percentile(ms, 90):>8.2f} "
            f"{cosine:>11.6f}"
        )


if __name__ == "__main__":
    main()
