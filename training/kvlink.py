"""KVLink's link tokens trained on a store (``coinrag train kvlink``), with the fine-tuning
machinery (``training/job.py``: store, data, model, plans; ``training/loop.py``: RAFT noise,
evidence fitting, checkpoints and resume, the step loop, the loss plot); only the objective
(:class:`KvLinkObjective`), what trains and what is saved are its own.

For every QA example: the top-``kc`` chunks among its own documents (as ``kvlink`` retrieves
at serving time), their **stored** KV (``StoredKvContext``, the base model's), ``n_link`` link
tokens after each chunk and ``query + answer`` prefilled in one forward over them
(``inference.context.link.link_forward``, the serving path); the loss is the answer's cross-entropy.
Only the link embeddings train (scope ``links``): the base model stays frozen and in eval
mode, so the store's chunk KV stays valid bit for bit and training equals serving exactly.
The model computes in the store's ``kv_dtype`` (the dtype serving uses). The paper's full
fine-tuning (links + all weights, lr 5e-6) needs an accelerator and a KV rebuild; not here.

Output ``OUT/``: ``link_embeddings.safetensors`` and ``kvlink.json`` (n_link, max_docs, the
base model and its ``model_fp``, the new ``kvlink_fp``, the training lineage), plus
``train_log.jsonl`` and ``loss.png``. ``coinrag query --method kvlink --model OUT`` serves it.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from coinrag.inference.context.builders import ContextBuilder, StoredKvContext
from coinrag.inference.context.link import (
    DEFAULT_MAX_DOCS,
    DEFAULT_N_LINK,
    LinkEmbeddings,
    link_forward,
    save_link_adapter,
)
from coinrag.inference.retrieval.retriever import Evidence, Retriever
from coinrag.schemas.settings import FinetuneSettings
from coinrag.training.data import Plan
from coinrag.training.job import Prepared, TrainJob
from coinrag.training.loop import RunControl
from coinrag.training.objective import Objective, answer_cross_entropy

DEFAULT_LINK_LR = 1e-3  # prompt-tuning scale: only a few embeddings train

log = logging.getLogger("coinrag.train.kvlink")


class KvLinkObjective(Objective):
    """Whole chunks, their stored KV with trained links after each, answer cross-entropy.
    The model trained is ``ModuleDict({"model": frozen base, "links": LinkEmbeddings})``."""

    def __init__(self, n_link: int) -> None:
        self.n_link = n_link

    def retrieve(
        self, retriever: Retriever, question: str, cfg: FinetuneSettings, doc_ids: Any
    ) -> Any:
        return retriever.chunks_only(question, cfg.kc, doc_ids=doc_ids)

    def loss_sum(
        self, model: Any, builder: ContextBuilder, plan: Plan, evidence: list[Evidence]
    ) -> tuple[torch.Tensor, int]:
        net, links = model["model"], model["links"]
        prefix_kv, slices = builder.load(evidence)
        dtype = next(net.parameters()).dtype
        prefix_kv = prefix_kv.to(builder.device, dtype=dtype)
        slices = [replace(s, kv=s.kv.to(builder.device, dtype=dtype)) for s in slices]
        answer = plan.answer_ids
        out = link_forward(
            net,
            links,
            prefix_kv,
            slices,
            plan.query_ids + answer,
            builder.spec,
            logits_to_keep=len(answer) + 1,
        )
        loss = answer_cross_entropy(out.logits, answer)
        return loss, sum(s.tokens for s in slices) + self.n_link * len(slices)

    def extra_tokens(self, cfg: FinetuneSettings) -> int:
        return self.n_link * cfg.kc

    def train_mode(self, model: Any) -> None:
        model.eval()  # the base stays in eval mode (no dropout): its stored KV stays exact
        model["links"].train()


def run_kvlink_training(
    job: TrainJob,
    cfg: FinetuneSettings,
    *,
    n_link: int = DEFAULT_N_LINK,
    max_docs: int = DEFAULT_MAX_DOCS,
    control: RunControl | None = None,
) -> dict[str, Any]:
    """Train link tokens for the store's model (or ``job.model``) on the QA JSONL
    ``job.data``; write the adapter folder ``job.out``. Returns a summary with ``kvlink_fp``
    and ``base_model_fp`` (plus ``control.lineage``)."""
    from coinrag.inference.model.encode import pad_id

    cfg.validate()
    if cfg.kc > max_docs:
        raise ValueError(f"kc {cfg.kc} is more than the {max_docs} document slots (--max-docs)")
    control = control or RunControl()
    control = replace(control, logger=control.logger or log)
    objective = KvLinkObjective(n_link)
    prep = Prepared.open(job, cfg, objective, at_kv_dtype=True)
    base_model_fp, layout = prep.kv_identity()
    model = prep.loaded.model
    builder = StoredKvContext.for_finetuning(
        prep.store, model, prep.prompt, layout=layout, pad_id=pad_id(prep.loaded.tokenizer)
    )
    torch.manual_seed(cfg.seed)
    links = LinkEmbeddings.for_model(model, max_docs=max_docs, n_link=n_link)
    trained = torch.nn.ModuleDict({"model": model, "links": links})
    link = {"n_link": n_link, "max_docs": max_docs}
    identity = {"base_model_fp": base_model_fp, "objective": "kvlink", "scope": "links", **link}
    result = prep.train(trained, builder, cfg, identity, objective, control)
    out_dir = Path(job.out)
    summary: dict[str, Any] = {
        "adapter_dir": str(out_dir.resolve()),
        **prep.summary(cfg, result, base_model_fp),
        **link,
        "scope": "links",
        **control.lineage,
    }
    base = str(prep.loaded.model_dir)
    info = save_link_adapter(out_dir, links, base, base_model_fp, summary)
    summary["kvlink_fp"] = info.kvlink_fp
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    (out_dir / "coinrag-training.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["losses"] = result.losses
    return summary
