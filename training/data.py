"""The training data of fine-tuning: QA examples turned into :class:`Plan` s (tokenised and
retrieved once, model-independent), their RAFT noise, evidence fitting and the epoch order.

RAFT noise: with probability ``raft_p`` an example's gold evidence (nuggets of its gold
documents) is left out of the context. The draw (:func:`raft_drop`) and the epoch order
(:func:`epoch_order`) are pure functions of ``(seed, epoch, example index)``: reproducible, and
identical after a resume.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.retrieval.retriever import Evidence, Retriever
from coinrag.schemas.qa import QAExample
from coinrag.schemas.settings import FinetuneSettings

if TYPE_CHECKING:
    from coinrag.training.objective import Objective


def write_documents(examples: Sequence[QAExample], path: str | os.PathLike[str]) -> int:
    """Write the examples' inline documents (deduplicated) as a build-flow JSONL source.

    Returns the number of documents written (0: no example carries documents; no file written).
    """
    docs: dict[str, str] = {}
    for ex in examples:
        for doc_id, text in ex.documents:
            docs.setdefault(doc_id, text)
    if not docs:
        return 0
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for doc_id in sorted(docs):
            f.write(json.dumps({"id": doc_id, "text": docs[doc_id]}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return len(docs)


def raft_drop(seed: int, epoch: int, index: int, p: float) -> bool:
    """Whether example ``index`` loses its gold evidence in ``epoch`` (probability ``p``)."""
    return random.Random(f"raft:{seed}:{epoch}:{index}").random() < p


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order (a permutation of ``range(n)``) examples are visited in ``epoch``."""
    order = list(range(n))
    random.Random(f"order:{seed}:{epoch}").shuffle(order)
    return order


@dataclass
class Plan:
    """One example, tokenised and retrieved (model-independent, computed once)."""

    index: int
    query_ids: list[int]
    answer_ids: list[int]  # answer tokens + EOS: the labels
    evidence: list[Evidence]
    gold: list[bool]  # per evidence: from a gold document

    def context(self, drop_gold: bool) -> list[Evidence]:
        if not drop_gold:
            return list(self.evidence)
        return [e for e, g in zip(self.evidence, self.gold, strict=True) if not g]


def make_plans(
    examples: Sequence[QAExample],
    retriever: Retriever,
    prompt: RagPrompt,
    tokenizer: Any,
    cfg: FinetuneSettings,
    objective: Objective | None = None,
) -> tuple[list[Plan], dict[str, int]]:
    """Tokenise and retrieve every example (as ``objective`` retrieves: two-stage nuggets by
    default); skip those whose query + answer alone exceed ``max_length`` after the prefix.
    Returns the plans and counts."""
    from coinrag.training.objective import NuggetObjective

    objective = objective or NuggetObjective()
    eos = getattr(tokenizer, "eos_token_id", None)
    plans: list[Plan] = []
    counts = {"examples": len(examples), "skipped_too_long": 0, "no_evidence": 0}
    for i, ex in enumerate(examples):
        q = prompt.query_ids(ex.question)
        a = list(tokenizer(ex.answer, add_special_tokens=False)["input_ids"])
        if eos is not None:
            a.append(int(eos))
        if prompt.n_prefix + len(q) + len(a) > cfg.max_length:
            counts["skipped_too_long"] += 1
            continue
        ret = objective.retrieve(retriever, ex.question, cfg, ex.doc_ids)
        if not ret.evidence:
            counts["no_evidence"] += 1
        gold = set(ex.gold_doc_ids)
        plans.append(Plan(i, q, a, ret.evidence, [e.doc_id in gold for e in ret.evidence]))
    counts["usable"] = len(plans)
    return plans, counts


def fit_evidence(
    evidence: list[Evidence], n_prefix: int, n_tail: int, max_length: int
) -> tuple[list[Evidence], bool]:
    """Drop evidence from the end until ``prefix + evidence + tail <= max_length`` (tokens);
    returns the evidence kept and whether any was dropped."""
    out = list(evidence)
    total = n_prefix + sum(e.tok_end - e.tok_start for e in out) + n_tail
    truncated = False
    while out and total > max_length:
        e = out.pop()
        total -= e.tok_end - e.tok_start
        truncated = True
    return out, truncated
