"""KVLink's link tokens trained on a store (``coinrag train kvlink``), with the fine-tuning
machinery of ``training/finetune.py`` (plans, RAFT noise, evidence fitting, checkpoints and
resume, the step loop, the loss plot).

For every QA example: the top-``kc`` chunks among its own documents (as ``kvlink`` retrieves
at serving time), their **stored** KV (``StoredKvContext``, the base model's), ``n_link`` link
tokens after each chunk and ``query + answer`` prefilled in one forward over them
(``inference.link.link_forward``, the serving path); the loss is the answer's cross-entropy.
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
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from coinrag.inference.context import ContextBuilder, StoredKvContext
from coinrag.inference.link import (
    DEFAULT_MAX_DOCS,
    DEFAULT_N_LINK,
    LinkEmbeddings,
    link_forward,
    save_link_adapter,
)
from coinrag.inference.prompt import RagPrompt
from coinrag.inference.retrieve import Evidence, Retriever
from coinrag.schemas.qa import QAExample, load_examples
from coinrag.schemas.settings import FinetuneSettings
from coinrag.storage.store import Store
from coinrag.training.finetune import (
    Objective,
    Plan,
    _kv_identity,
    file_sha256,
    make_plans,
    plot_losses,
    train,
)

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
        labels = torch.tensor(answer, dtype=torch.long, device=out.logits.device)
        loss = torch.nn.functional.cross_entropy(out.logits[:-1], labels, reduction="sum")
        return loss, sum(s.tokens for s in slices) + self.n_link * len(slices)

    def extra_tokens(self, cfg: FinetuneSettings) -> int:
        return self.n_link * cfg.kc

    def train_mode(self, model: Any) -> None:
        model.eval()  # the base stays in eval mode (no dropout): its stored KV stays exact
        model["links"].train()


def run_kvlink_training(
    store_path: str | os.PathLike[str],
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    cfg: FinetuneSettings,
    *,
    n_link: int = DEFAULT_N_LINK,
    max_docs: int = DEFAULT_MAX_DOCS,
    model: str | None = None,
    embedder: str | None = None,
    logger: Any = None,
    on_step: Callable[[int, float], None] | None = None,
    resume: bool = True,
    examples: Sequence[QAExample] | None = None,
    lineage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train link tokens for the store's model (or ``model``) on the QA JSONL ``data``; write
    the adapter folder ``out``. Returns a summary with ``kvlink_fp`` and ``base_model_fp``."""
    from coinrag.inference.embedders import load_embedder
    from coinrag.inference.encode import pad_id
    from coinrag.inference.kv_dtype import resolve_kv_dtype
    from coinrag.inference.models import load_model
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.storage.index import LanceIndex

    cfg.validate()
    if cfg.kc > max_docs:
        raise ValueError(f"kc {cfg.kc} is more than the {max_docs} document slots (--max-docs)")
    logger = logger or log
    store = Store.at(store_path)
    settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    base_ref = model or settings.model
    examples = list(examples) if examples is not None else load_examples(data)
    data_sha = file_sha256(data)
    kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype
    loaded = load_model(base_ref, device=cfg.device, dtype=kv_dtype)
    loaded.model.requires_grad_(False)
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    retriever = Retriever(
        store,
        load_embedder(embedder or settings.embedder),
        LanceIndex.open(store),
        mode=settings.retrieval,
    )
    objective = KvLinkObjective(n_link)
    t0 = time.perf_counter()
    plans, counts = make_plans(examples, retriever, prompt, loaded.tokenizer, cfg, objective)
    prep_s = time.perf_counter() - t0
    base_model_fp, layout = _kv_identity(loaded, prompt, kv_dtype, settings.kv_codec)
    builder = StoredKvContext.for_finetuning(
        store, loaded.model, prompt, layout=layout, pad_id=pad_id(loaded.tokenizer)
    )
    torch.manual_seed(cfg.seed)
    links = LinkEmbeddings.for_model(loaded.model, max_docs=max_docs, n_link=n_link)
    trained = torch.nn.ModuleDict({"model": loaded.model, "links": links})
    identity = {
        "data_sha256": data_sha,
        "base_model_fp": base_model_fp,
        "objective": "kvlink",
        "scope": "links",
        "n_link": n_link,
        "max_docs": max_docs,
    }
    result = train(
        trained,
        builder,
        plans,
        cfg,
        out,
        identity=identity,
        counts=counts,
        logger=logger,
        on_step=on_step,
        resume=resume,
        objective=objective,
    )
    out_dir = Path(out)
    plot_losses(result.log, out_dir / "loss.png")
    summary: dict[str, Any] = {
        "adapter_dir": str(out_dir.resolve()),
        "base_model": str(loaded.model_dir),
        "base_model_fp": base_model_fp,
        "data": str(Path(data).resolve()),
        "data_sha256": data_sha,
        "config": cfg.to_dict(),
        "n_link": n_link,
        "max_docs": max_docs,
        "scope": "links",
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "first_loss": result.losses[0] if result.losses else None,
        "final_loss": result.losses[-1] if result.losses else None,
        "steps_per_s": round(result.steps_per_s, 4),
        "train_seconds": round(result.seconds, 3),
        "prepare_seconds": round(prep_s, 3),
        "trainable_params": result.trainable_params,
        "counts": result.counts,
        "log": str(out_dir / "train_log.jsonl"),
        "plot": str(out_dir / "loss.png"),
        **(lineage or {}),
    }
    info = save_link_adapter(out_dir, links, str(loaded.model_dir), base_model_fp, summary)
    summary["kvlink_fp"] = info.kvlink_fp
    shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    (out_dir / "coinrag-training.json").write_text(json.dumps(summary, indent=2, default=str))
    summary["losses"] = result.losses
    return summary
