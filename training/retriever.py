"""Fine-tuning a mean-pooling encoder (the packaged MiniLM by default) on a store's own pairs.

Plain torch, no sentence-transformers: the encoder is transformers' ``AutoModel`` of the base
embedder's folder, pooled the way ``inference.retrieval.embedders`` pools it (mean over the
attention mask, L2-normalised). One step takes ``batch_size`` pairs ``(query, positive,
negative)`` (``tasks/retrieval/retriever_pairs.py``) and minimises InfoNCE: each query's ``scale *
cosine`` against all ``2 * batch_size`` passages of the step (its positive, the other queries'
positives: in-batch negatives, and every BM25 hard negative), the target its own positive::

    q: (B, dim), p: (2B, dim) = [positives; negatives]     logits = scale * q @ p.T   (B, 2B)
    loss = cross_entropy(logits, arange(B))

The forward and backward run under ``torch.autocast`` at the ``dtype`` setting (``auto``:
bfloat16 where the CPU computes it natively, about 1.6x the steps a minute of float32 on
this machine); the weights, their gradients and AdamW's state stay float32, so the saved
encoder is float32 either way.

Training stops after ``epochs`` passes or ``max_minutes`` of wall time, whichever is first (a
whole-corpus run on one CPU thread is budgeted; the time is checked between steps). The output
folder is a sentence-transformers style folder that ``load_embedder(OUT)`` reads (weights,
tokenizer, ``1_Pooling/config.json`` mean pooling, ``sentence_bert_config.json`` with the base's
``max_length``) and ``coinrag-embedder.json``: its lineage (base embedder fingerprint and
folder, store, run id, pairs and their sha256, settings, losses). Its fingerprint is the
embedder fingerprint of those weights (``weights_sha256``), so every vector it makes is keyed
apart from the base's.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coinrag.inference.retrieval.embedders import LINEAGE_FILE
from coinrag.schemas.training_settings import RetrieverTrainSettings


def pairs_sha256(pairs: Sequence[Any]) -> str:
    """sha256 of the pairs' texts, in order (what the lineage records)."""
    h = hashlib.sha256()
    for p in pairs:
        for text in (p.query, p.positive, p.negative):
            h.update(text.encode("utf-8"))
            h.update(b"\0")
    return h.hexdigest()


def mean_pool(hidden: Any, mask: Any) -> Any:
    """``(B, T, dim)`` hidden states, ``(B, T)`` mask -> ``(B, dim)`` unit vectors."""
    import torch

    weights = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


class PairTrainer:
    """The encoder, its tokenizer and optimiser, and the InfoNCE step (module docstring)."""

    def __init__(self, base_dir: Path, cfg: RetrieverTrainSettings, steps: int) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from coinrag.inference.model.kv_dtype import resolve_compute_dtype

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.dtype = resolve_compute_dtype("dtype", cfg.dtype, "cpu")  # float32 | bfloat16
        self.tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        self.model = AutoModel.from_pretrained(str(base_dir)).float().train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        warmup = max(1, int(cfg.warmup * steps))
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup)
        )

    def encode(self, texts: Sequence[str], max_length: int) -> Any:
        """``(len(texts), dim)`` float32 unit vectors, with gradients (pooled in float32 under
        autocast too)."""
        batch = self.tokenizer(
            list(texts), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        hidden = self.model(**batch, return_dict=True).last_hidden_state.float()
        return mean_pool(hidden, batch["attention_mask"])

    def cosines(self, pairs: Sequence[Any], passages: Sequence[str]) -> Any:
        """``(B, len(passages))`` float32 cosines of the pairs' queries to ``passages``, computed
        at the training dtype (autocast), with gradients."""
        import torch

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bfloat16"):
            q = self.encode([p.query for p in pairs], self.cfg.query_max_length)
            d = self.encode(passages, self.cfg.passage_max_length)
        return q @ d.T

    def step(self, pairs: Sequence[Any]) -> float:
        """One optimiser step on ``pairs``; returns the loss."""
        import torch

        passages = [p.positive for p in pairs] + [p.negative for p in pairs]
        logits = self.cfg.scale * self.cosines(pairs, passages)  # (B, 2B)
        logits = logits.masked_fill(own_passage_elsewhere(pairs, passages), float("-inf"))
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(pairs)))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.schedule.step()
        return float(loss.detach())

    def save(self, out: Path, max_length: int) -> None:
        """The folder ``load_embedder(out)`` reads (module docstring), without the lineage."""
        out.mkdir(parents=True, exist_ok=True)
        self.model.eval().save_pretrained(str(out), safe_serialization=True)
        self.tokenizer.save_pretrained(str(out))
        (out / "1_Pooling").mkdir(exist_ok=True)
        pooling = {"word_embedding_dimension": self.model.config.hidden_size}
        pooling |= {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
        (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
        config = {"max_seq_length": max_length, "do_lower_case": False}
        (out / "sentence_bert_config.json").write_text(json.dumps(config, indent=2))


def own_passage_elsewhere(pairs: Sequence[Any], passages: Sequence[str]) -> Any:
    """Bool ``(B, 2B)``: column ``j`` of row ``i`` holds pair ``i``'s own positive text but is
    not its target ``i`` (several questions asked about one chunk share their positive, and a
    heading's body can be another heading's): such a column is no negative, and left in, the
    row's loss could never fall below log 2. Masked out of the softmax.

    >>> from types import SimpleNamespace as P
    >>> own_passage_elsewhere([P(positive="a"), P(positive="a")], ["a", "a", "x", "y"]).tolist()
    [[False, True, False, False], [True, False, False, False]]
    """
    import torch

    n = len(pairs)
    mask = torch.tensor([[text == p.positive for text in passages] for p in pairs])
    mask[torch.arange(n), torch.arange(n)] = False
    return mask


def finetune_embedder(
    base_dir: Path,
    max_length: int,
    pairs: Sequence[Any],
    out: Path,
    cfg: RetrieverTrainSettings,
    lineage: dict[str, Any],
) -> dict[str, Any]:
    """Fine-tune the encoder of ``base_dir`` on ``pairs`` and write ``out`` (module docstring);
    ``lineage``: what the caller records of where it came from. Returns the training summary
    (steps, first and final loss, seconds, whether the time budget stopped it)."""
    if not pairs:
        raise ValueError(
            "no training pairs: the store has no headings, nuggets or generated questions to "
            "train on"
        )
    per_epoch = math.ceil(len(pairs) / cfg.batch_size)
    trainer = PairTrainer(base_dir, cfg, per_epoch * cfg.epochs)
    rng = random.Random(cfg.seed)
    order = list(pairs)
    losses: list[float] = []
    started = time.perf_counter()
    stopped_by_budget = False
    for _ in range(cfg.epochs):
        rng.shuffle(order)
        for start in range(0, len(order) - 1, cfg.batch_size):
            if time.perf_counter() - started > cfg.max_minutes * 60.0:
                stopped_by_budget = True
                break
            losses.append(trainer.step(order[start : start + cfg.batch_size]))
        if stopped_by_budget:
            break
    trainer.save(out, max_length)
    summary = {
        "steps": len(losses),
        "pairs": len(pairs),
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "train_seconds": round(time.perf_counter() - started, 1),
        "stopped_by_budget": stopped_by_budget,
        "dtype": trainer.dtype,
    }
    record = {
        **lineage,
        "pairs_sha256": pairs_sha256(pairs),
        "settings": cfg.to_dict(),
        "training": summary,
    }
    (out / LINEAGE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    return summary
