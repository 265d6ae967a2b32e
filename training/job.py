"""What every trainer on a store does around the step loop (``training/loop.py``): open the
store and its recorded settings, load the QA data and the base model, retrieve and tokenise
every example once (:class:`Prepared`), fingerprint the base model as the store computes KV,
then train, plot the losses and summarise the run. ``training/finetune.py`` (nugget
fine-tuning) and ``training/kvlink.py`` (KVLink's link tokens) differ only in their objective,
what trains and what they save.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coinrag.inference.context.builders import ContextBuilder
from coinrag.inference.model.encode import causal_lm
from coinrag.inference.model.prompt import RagPrompt
from coinrag.schemas.qa import QAExample, load_examples
from coinrag.schemas.settings import BuildSettings, FinetuneSettings
from coinrag.storage.cache import file_sha256
from coinrag.storage.kv import KvLayout
from coinrag.storage.store import Store
from coinrag.training.data import Plan, make_plans
from coinrag.training.loop import RunControl, TrainResult, plot_losses, train
from coinrag.training.objective import Objective


@dataclass
class TrainJob:
    """What a training run reads and writes: the built ``store``, the QA JSONL ``data``, the
    output folder ``out``; the base ``model`` and the ``embedder`` (None: the store's) and the
    ``examples`` when already loaded from ``data`` (None: loaded here)."""

    store: str | os.PathLike[str]
    data: str | os.PathLike[str]
    out: str | os.PathLike[str]
    model: str | None = None
    embedder: str | None = None
    examples: Sequence[QAExample] | None = None


@dataclass
class Prepared:
    """A job opened: its store and recorded settings, the data's sha256, the base model loaded
    (``LoadedModel``), its prompt, the plans and their counts, the seconds planning took and
    the store's KV dtype."""

    job: TrainJob
    store: Store
    settings: BuildSettings
    data_sha: str
    loaded: Any
    prompt: RagPrompt
    plans: list[Plan]
    counts: dict[str, int]
    prepare_s: float
    kv_dtype: str

    @classmethod
    def open(
        cls, job: TrainJob, cfg: FinetuneSettings, objective: Objective, *, at_kv_dtype: bool
    ) -> Prepared:
        """Open ``job``: the model computes in the store's ``kv_dtype`` when ``at_kv_dtype``
        (frozen, as serving computes), else in ``cfg.dtype``; plans as ``objective``
        retrieves."""
        from coinrag.inference.model.kv_dtype import resolve_kv_dtype
        from coinrag.inference.model.loading import load_model
        from coinrag.inference.retrieval.embedders import store_embedder_of
        from coinrag.inference.retrieval.retriever import Retriever
        from coinrag.schemas.settings import settings_from_toml
        from coinrag.storage.index.lance import LanceIndex

        store = Store.at(job.store)
        settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
        examples = list(job.examples) if job.examples is not None else load_examples(job.data)
        data_sha = file_sha256(job.data)
        kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype
        dtype = kv_dtype if at_kv_dtype else cfg.dtype
        loaded = load_model(job.model or settings.model, device=cfg.device, dtype=dtype)
        if at_kv_dtype:
            loaded.model.requires_grad_(False)
        prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
        emb = store_embedder_of(settings, job.embedder)
        retriever = Retriever(store, emb, LanceIndex.open(store), mode=settings.retrieval)
        t0 = time.perf_counter()
        plans, counts = make_plans(examples, retriever, prompt, loaded.tokenizer, cfg, objective)
        prepare_s = time.perf_counter() - t0
        return cls(
            job, store, settings, data_sha, loaded, prompt, plans, counts, prepare_s, kv_dtype
        )

    def kv_identity(self, kv_keep: str = "chunks") -> tuple[str, KvLayout]:
        """``(model_fp, layout)`` of the base model as this store computes KV (see
        :func:`kv_identity`), keeping what ``kv_keep`` keeps."""
        return kv_identity(self.loaded, self.prompt, self.kv_dtype, self.settings.kv_codec, kv_keep)

    def train(
        self,
        net: Any,
        builder: ContextBuilder,
        cfg: FinetuneSettings,
        identity: dict[str, Any],
        objective: Objective,
        control: RunControl,
    ) -> TrainResult:
        """Run the loop into ``job.out`` (counts: the plans' and the run's), plot the losses."""
        result = train(
            net,
            builder,
            self.plans,
            cfg,
            self.job.out,
            identity={"data_sha256": self.data_sha, **identity},
            objective=objective,
            control=control,
        )
        result.counts = {**self.counts, **result.counts}
        plot_losses(result.log, Path(self.job.out) / "loss.png")
        return result

    def summary(
        self, cfg: FinetuneSettings, result: TrainResult, base_model_fp: str
    ) -> dict[str, Any]:
        """The fields every training summary (``coinrag-training.json``) has."""
        out_dir = Path(self.job.out)
        return {
            "base_model": str(self.loaded.model_dir),
            "base_model_fp": base_model_fp,
            "data": str(Path(self.job.data).resolve()),
            "data_sha256": self.data_sha,
            "config": cfg.to_dict(),
            "steps": result.steps,
            "resumed_from": result.resumed_from,
            "first_loss": result.losses[0] if result.losses else None,
            "final_loss": result.losses[-1] if result.losses else None,
            "steps_per_s": round(result.steps_per_s, 4),
            "train_seconds": round(result.seconds, 3),
            "prepare_seconds": round(self.prepare_s, 3),
            "trainable_params": result.trainable_params,
            "counts": result.counts,
            "log": str(out_dir / "train_log.jsonl"),
            "plot": str(out_dir / "loss.png"),
        }


def kv_identity(
    loaded: Any,
    prompt: RagPrompt,
    kv_dtype: str,
    kv_codec: str = "none",
    kv_keep: str = "chunks",
) -> tuple[str, KvLayout]:
    """``(model_fp, layout)`` of ``loaded``'s weights as the store computes KV: at the store's
    ``kv_dtype``, which may differ from the dtype training computes in (stored entries are then
    cast when the context is assembled), stored with its ``kv_codec``, keeping what its
    ``kv_keep`` keeps (frozen mode reads only nugget slices, which a store of nugget spans
    holds)."""
    from coinrag.inference.model.encode import kv_layout
    from coinrag.inference.model.loading import model_fingerprint, weights_sha256

    model_fp = model_fingerprint(
        causal_lm(loaded.model).config,
        weights_sha256(loaded.model_dir),
        kv_dtype,
        loaded.tokenizer_fp,
    )
    layout = dataclasses.replace(
        kv_layout(loaded, prompt, kv_codec=kv_codec, keep=kv_keep),
        model_fp=model_fp,
        dtype=kv_dtype,
    )
    return model_fp, layout
