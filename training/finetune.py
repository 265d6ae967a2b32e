"""Nugget-aware fine-tuning: train the generator on the context it meets online.

For every QA example the online CoinRAG context is rebuilt exactly as inference builds it:
two-stage retrieval (top-``kc`` chunks, then the top-``k`` nuggets inside them), restricted to
the example's own documents (gold + distractors, HotpotQA style), then ``C_ctx = C_p ⊕
Rot(C_b1[s1:e1]; Δ1) ⊕ ...`` after the RAG prompt prefix, by the context builder serving uses
(``inference/context.py``). The loss is the cross-entropy of the short answer (plus EOS) given
``(C_ctx, q)``: the input is ``query_ids(question) + answer_ids + [eos]`` prefilled at positions
after ``C_ctx``, the labels are the answer tokens only (token mean over the effective batch).

RAFT noise: with probability ``raft_p`` (0.15) an example's gold evidence (nuggets of its gold
documents) is left out of the context, so the model also learns to answer (or not be misled)
when retrieval missed the bridge passage. The draw is a pure function of ``(seed, epoch,
example index)``: reproducible, and identical after a resume.

Modes
=====
- ``live`` (default): the model being trained encodes the prompt prefix and the retrieved
  chunks inside the step (``forward(prefix)``, then ``forward(chunk | C_p)`` batched, with grad),
  the nugget slices are cut from that cache and re-rotated with the same differentiable code
  inference uses. Gradients reach how chunks are encoded: the model learns to write KV whose
  *slices*, cut out of their passage and moved to new positions, still carry the fact.
- ``frozen``: ``C_p`` and the chunk KV are read from the KV store (computed by the base model),
  only the query/answer pass is trained.

The mode picks the context builder (``inference.context.FINETUNE_CONTEXTS``: ``live`` ->
``LiveKvContext``, ``frozen`` -> ``StoredKvContext``, the one serving reads with).

Why ``live`` is the default: the paper fine-tunes the generator on the structure it meets
online, and online the cache is always encoded by *the served model itself* (a new model gets a
KV rebuild: caches are tied to weights). Training in ``frozen`` mode optimises the model for KV
written by the *base* weights; after the update the stored caches are no longer what the new
model would write, so the served pair (new model, its own rebuilt cache) differs from the
trained pair (new model, base cache); the mismatch grows with the update. ``live`` trains exactly
the served pair. ``frozen`` is much cheaper (no chunk forward/backward: one short pass per
example) and is a fair approximation for small updates (lr 5e-6, one epoch); it also trains the
query side to read stale caches, which is what a store serves until its KV is rebuilt.

Hyperparameters (``schemas.settings.FinetuneSettings``) default to the paper's: 1 epoch, lr
5e-6, effective batch 16 (micro-batch 1 and gradient accumulation), max length 1024 (evidence
is truncated from the end to fit, examples whose query + answer alone do not fit are skipped;
both counted), kc=5, k=10, RAFT 0.15. Full fine-tuning or LoRA (peft; q/k/v/o projections;
merged for serving). fp32 on CPU, bf16 on accelerators. AdamW, gradient clipping 1.0, linear
warmup (3%) then linear decay.

Checkpoints (``OUT/checkpoints/step-NNNNNN``, every ``checkpoint_every`` optimizer steps,
written to a temporary folder and renamed; ``OUT/checkpoints/LATEST`` names the newest): the
trainable parameters (safetensors; LoRA: the adapters only), optimizer, scheduler, Python /
NumPy / torch RNG states, the data cursor (epoch, position in the epoch's order), the log so far
and the identity of the run (config, data hash, base model). A run started again with the same
identity resumes from the newest checkpoint and computes the same next loss (bit-equal on CPU).

Output: ``OUT`` is a transformers model folder (safetensors + tokenizer; LoRA merged), plus
``train_log.jsonl`` (one row per optimizer step: loss, lr, tokens, ...), ``loss.png`` and
``coinrag-training.json`` (lineage: base model fp, new model fp, data hash, config).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coinrag.inference.context import FINETUNE_CONTEXTS, ContextBuilder
from coinrag.inference.encode import causal_lm, to_dynamic_cache
from coinrag.inference.prompt import RagPrompt
from coinrag.inference.retrieve import Evidence, Retriever
from coinrag.inference.rope import reset_rotary
from coinrag.schemas.keys import canonical_json
from coinrag.schemas.qa import DataError, QAExample, load_examples
from coinrag.schemas.settings import FinetuneSettings
from coinrag.storage.cache import file_sha256
from coinrag.storage.kv import KvLayout
from coinrag.storage.store import Store

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
CHECKPOINT_FORMAT = 1

# The name users' log configurations know (it is the `train nuggets` command's), kept.
log = logging.getLogger("coinrag.train.nuggets")


class ResumeMismatch(RuntimeError):
    """A checkpoint exists in OUT but belongs to another run (config, data or base model)."""


# ------------------------------------------------------------------------------------------ data


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


# ------------------------------------------------------------------------------------- retrieval


def raft_drop(seed: int, epoch: int, index: int, p: float) -> bool:
    """Whether example ``index`` loses its gold evidence in ``epoch`` (probability ``p``)."""
    return random.Random(f"raft:{seed}:{epoch}:{index}").random() < p


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
    """Drop evidence from the end until ``prefix + evidence + tail <= max_length``."""
    out = list(evidence)
    total = n_prefix + sum(e.tok_end - e.tok_start for e in out) + n_tail
    truncated = False
    while out and total > max_length:
        e = out.pop()
        total -= e.tok_end - e.tok_start
        truncated = True
    return out, truncated


# ------------------------------------------------------------------------------------- the model


def answer_loss_sum(
    model: Any, ctx: torch.Tensor, total: int, query_ids: list[int], answer_ids: list[int]
) -> torch.Tensor:
    """Sum over the answer tokens of ``-log p(answer | C_ctx, query)``."""
    lm = causal_lm(model)
    dev = ctx.device
    ids = torch.tensor([query_ids + answer_ids], dtype=torch.long, device=dev)
    positions = torch.arange(total, total + ids.shape[1], device=dev)[None]
    cache = to_dynamic_cache(ctx, lm.config)
    reset_rotary(model)
    out = model(
        input_ids=ids,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=len(answer_ids) + 1,
    )
    logits = out.logits[0, :-1].float()  # the positions that predict the answer tokens
    labels = torch.tensor(answer_ids, dtype=torch.long, device=dev)
    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum")


class Objective:
    """What one training example costs: how its evidence is retrieved (:meth:`retrieve`), the
    loss summed over its answer tokens given that evidence (:meth:`loss_sum`), the tokens its
    context adds besides the evidence (:meth:`extra_tokens`) and which modules train
    (:meth:`train_mode`). :class:`NuggetObjective` is nugget fine-tuning;
    ``training/kvlink.py`` has KVLink's link tokens."""

    def retrieve(
        self, retriever: Retriever, question: str, cfg: FinetuneSettings, doc_ids: Any
    ) -> Any:
        """A ``RetrievalResult`` for ``question`` among ``doc_ids``' documents."""
        return retriever.two_stage(question, cfg.kc, cfg.k, doc_ids=doc_ids)

    def loss_sum(
        self, model: Any, builder: ContextBuilder, plan: Plan, evidence: list[Evidence]
    ) -> tuple[torch.Tensor, int]:
        """``(Σ -log p(answer token), context tokens after the prefix)``."""
        ctx, total = builder.build(evidence, len(plan.query_ids))
        loss = answer_loss_sum(model, ctx, total, plan.query_ids, plan.answer_ids)
        return loss, total - builder.prompt.n_prefix

    def extra_tokens(self, cfg: FinetuneSettings) -> int:
        return 0

    def train_mode(self, model: Any) -> None:
        model.train()


class NuggetObjective(Objective):
    """CoinRAG's: two-stage nuggets, ``C_ctx`` from the builder, answer cross-entropy."""


def attach_lora(model: Any, cfg: FinetuneSettings) -> Any:
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(LORA_TARGETS),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lcfg)


def trainable_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def lr_lambda_for(cfg: FinetuneSettings, total_steps: int) -> Callable[[int], float]:
    warmup = int(math.ceil(cfg.warmup_ratio * total_steps))

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return fn


# -------------------------------------------------------------------------------- checkpointing


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``step-NNNNNN`` atomically (temporary folder, rename), then point LATEST at it."""
    from safetensors.torch import save_file

    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step:06d}"
    tmp = ckpt_root / f".tmp-step-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors = {n: p.detach().contiguous().cpu() for n, p in trainable_parameters(model)}
    save_file(tensors, str(tmp / "trainable.safetensors"))
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": _rng_state(),
            **trainer_state,
        },
        tmp / "trainer.pt",
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    latest_tmp = ckpt_root / "LATEST.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, ckpt_root / "LATEST")
    steps = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    pointer = ckpt_root / "LATEST"
    if not pointer.is_file():
        return None
    path = ckpt_root / pointer.read_text().strip()
    return path if (path / "trainer.pt").is_file() else None


def load_checkpoint(path: Path, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors = load_file(str(path / "trainable.safetensors"))
    params = dict(trainable_parameters(model))
    if set(tensors) != set(params):
        raise ResumeMismatch(f"{path}: its parameters differ from the model's trainable ones")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name].to(p.device, p.dtype))
    state = torch.load(path / "trainer.pt", weights_only=False, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return state


# ---------------------------------------------------------------------------------- the trainer


class Killed(RuntimeError):
    """Raised by an ``on_step`` hook to simulate a killed run (tests)."""


@dataclass
class TrainResult:
    steps: int
    examples_seen: int
    losses: list[float]
    log: list[dict[str, Any]]
    counts: dict[str, int]
    resumed_from: int | None
    seconds: float
    steps_per_s: float
    trainable_params: int
    extra: dict[str, Any] = field(default_factory=dict)


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(f"order:{seed}:{epoch}").shuffle(order)
    return order


def train(
    model: Any,
    builder: ContextBuilder,
    plans: Sequence[Plan],
    cfg: FinetuneSettings,
    out_dir: str | os.PathLike[str],
    *,
    identity: dict[str, Any],
    counts: dict[str, int] | None = None,
    logger: Any = None,
    on_step: Callable[[int, float], None] | None = None,
    resume: bool = True,
    objective: Objective | None = None,
) -> TrainResult:
    """Optimise ``model``'s trainable parameters (already wrapped with LoRA if ``cfg.lora``)
    on ``plans``, with ``objective``'s loss (default: :class:`NuggetObjective`).

    ``identity`` (data hash, base model fp, ...) is stored in each checkpoint with the config; a
    checkpoint with another identity is refused (:class:`ResumeMismatch`). ``on_step(step,
    loss)`` is called after every optimizer step and its checkpoint (a test raises there to
    simulate a kill).
    """
    logger = logger or log
    objective = objective or NuggetObjective()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / "checkpoints"
    counts = dict(counts or {})
    ident = {"config": cfg.identity(), **identity}
    n = len(plans)
    if n == 0:
        raise DataError("no usable training examples (all skipped)")
    steps_per_epoch = math.ceil(n / cfg.batch_size)
    total_steps = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    params = [p for _, p in trainable_parameters(model)]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_for(cfg, total_steps))

    step, epoch, cursor = 0, 0, 0
    rows: list[dict[str, Any]] = []
    run_counts = {"raft_dropped": 0, "truncated": 0, "examples_seen": 0}
    resumed_from = None
    ckpt = latest_checkpoint(ckpt_root) if resume else None
    if ckpt is not None:
        state = torch.load(ckpt / "trainer.pt", weights_only=False, map_location="cpu")
        if canonical_json(state["identity"]) != canonical_json(ident):
            raise ResumeMismatch(
                f"{ckpt} belongs to another training run (config, data or base model differ); "
                "use another --out or delete its checkpoints"
            )
        state = load_checkpoint(ckpt, model, optimizer, scheduler)
        step, epoch, cursor = state["step"], state["epoch"], state["cursor"]
        rows = list(state["log"])
        run_counts = dict(state["run_counts"])
        resumed_from = step
        logger.info("resuming from %s (step %d, epoch %d, cursor %d)", ckpt, step, epoch, cursor)
    else:
        if not resume:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        torch.manual_seed(cfg.seed)

    log_path = out / "train_log.jsonl"
    log_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    objective.train_mode(model)
    t_start = time.perf_counter()
    first_step = step
    n_tail_extra = objective.extra_tokens(cfg)
    while step < total_steps:
        t0 = time.perf_counter()
        if cursor >= n:
            epoch, cursor = epoch + 1, 0
        order = epoch_order(n, cfg.seed, epoch)
        batch = [plans[i] for i in order[cursor : cursor + cfg.batch_size]]
        cursor += len(batch)
        n_tokens = sum(len(pl.answer_ids) for pl in batch)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        dropped = 0
        active = 0
        for pl in batch:
            drop = raft_drop(cfg.seed, epoch, pl.index, cfg.raft_p)
            dropped += int(drop)
            evidence, truncated = fit_evidence(
                pl.context(drop),
                builder.prompt.n_prefix,
                len(pl.query_ids) + len(pl.answer_ids) + n_tail_extra,
                cfg.max_length,
            )
            run_counts["truncated"] += int(truncated)
            loss, n_context = objective.loss_sum(model, builder, pl, evidence)
            active += n_context
            (loss / n_tokens).backward()
            loss_sum += float(loss.detach())
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        step += 1
        run_counts["raft_dropped"] += dropped
        run_counts["examples_seen"] += len(batch)
        row = {
            "step": step,
            "epoch": epoch,
            "loss": loss_sum / n_tokens,
            "lr": lr,
            "examples": len(batch),
            "answer_tokens": n_tokens,
            "context_tokens": active,
            "raft_dropped": dropped,
            "seconds": round(time.perf_counter() - t0, 4),
        }
        rows.append(row)
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        logger.info(
            "step %d/%d epoch %d loss %.4f lr %.3g (%d examples, %.2f s)",
            step,
            total_steps,
            epoch,
            row["loss"],
            lr,
            len(batch),
            row["seconds"],
        )
        if step % cfg.checkpoint_every == 0 or step == total_steps:
            save_checkpoint(
                ckpt_root,
                step,
                model,
                optimizer,
                scheduler,
                {
                    "identity": ident,
                    "step": step,
                    "epoch": epoch,
                    "cursor": cursor,
                    "log": rows,
                    "run_counts": run_counts,
                },
            )
        if on_step is not None:
            on_step(step, row["loss"])
    seconds = time.perf_counter() - t_start
    done = step - first_step
    counts.update(run_counts)
    return TrainResult(
        steps=step,
        examples_seen=run_counts["examples_seen"],
        losses=[r["loss"] for r in rows],
        log=rows,
        counts=counts,
        resumed_from=resumed_from,
        seconds=seconds,
        steps_per_s=done / seconds if seconds > 0 and done else 0.0,
        trainable_params=sum(p.numel() for p in params),
    )


def plot_losses(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """PNG of loss (and lr) per optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".", label="loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("answer cross-entropy")
    ax2 = ax.twinx()
    ax2.plot([r["step"] for r in rows], [r["lr"] for r in rows], color="grey", alpha=0.5)
    ax2.set_ylabel("lr")
    ax.set_title("nugget-aware fine-tuning")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_model(model: Any, tokenizer: Any, out_dir: str | os.PathLike[str], lora: bool) -> Any:
    """Merge LoRA (if any) and write safetensors + tokenizer into ``out_dir``; return the model."""
    if lora:
        model = model.merge_and_unload()
    lm = causal_lm(model)
    out = Path(out_dir)
    for old in out.iterdir():  # a previous save's weight files would enter the weights hash
        if old.is_file() and old.suffix in (".safetensors", ".bin", ".gguf"):
            old.unlink()
    lm.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return lm


# ------------------------------------------------------------------------------------ end to end


def _kv_identity(
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
    import dataclasses

    from coinrag.inference.encode import kv_layout
    from coinrag.inference.models import model_fingerprint, weights_sha256

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


def run_training(
    store_path: str | os.PathLike[str],
    data: str | os.PathLike[str],
    out: str | os.PathLike[str],
    cfg: FinetuneSettings,
    *,
    model: str | None = None,
    embedder: str | None = None,
    logger: Any = None,
    on_step: Callable[[int, float], None] | None = None,
    resume: bool = True,
    examples: Sequence[QAExample] | None = None,
    keep_checkpoints: bool = False,
) -> dict[str, Any]:
    """Train on a store whose documents are already built (see ``flows/train.py`` for the flow
    that builds them first). Returns a summary with ``model_fp`` and ``base_model_fp``.
    ``OUT/checkpoints`` is removed once the model is saved unless ``keep_checkpoints``."""
    from coinrag.inference.embedders import load_embedder
    from coinrag.inference.encode import pad_id
    from coinrag.inference.kv_dtype import resolve_kv_dtype
    from coinrag.inference.models import load_model, model_fingerprint, weights_sha256
    from coinrag.schemas.settings import settings_from_toml
    from coinrag.storage.index import LanceIndex

    cfg.validate()
    logger = logger or log
    store = Store.at(store_path)
    settings = settings_from_toml(store.read_toml(), store.uri(store.settings_path))
    base_ref = model or settings.model
    examples = list(examples) if examples is not None else load_examples(data)
    data_sha = file_sha256(data)
    loaded = load_model(base_ref, device=cfg.device, dtype=cfg.dtype)
    prompt = RagPrompt.for_tokenizer(loaded.tokenizer)
    emb = load_embedder(embedder or settings.embedder)
    retriever = Retriever(store, emb, LanceIndex.open(store), mode=settings.retrieval)
    t0 = time.perf_counter()
    plans, counts = make_plans(examples, retriever, prompt, loaded.tokenizer, cfg)
    prep_s = time.perf_counter() - t0
    # Model fingerprints as this store computes KV (its kv_dtype): the base model's KV is what
    # frozen mode reads, and --rebuild-kv stores the new model's under the model_fp recorded here.
    kv_dtype = resolve_kv_dtype(settings.kv_dtype, settings.device).dtype
    base_model_fp, layout = _kv_identity(
        loaded, prompt, kv_dtype, settings.kv_codec, settings.kv_keep
    )
    torch.manual_seed(cfg.seed)  # LoRA init
    net = attach_lora(loaded.model, cfg) if cfg.lora else loaded.model
    builder = FINETUNE_CONTEXTS[cfg.mode].for_finetuning(
        store, net, prompt, layout=layout, pad_id=pad_id(loaded.tokenizer)
    )
    identity = {"data_sha256": data_sha, "base_model_fp": base_model_fp}
    result = train(
        net,
        builder,
        plans,
        cfg,
        out,
        identity=identity,
        counts=counts,
        logger=logger,
        on_step=on_step,
        resume=resume,
    )
    out_dir = Path(out)
    plot_losses(result.log, out_dir / "loss.png")
    lm = save_model(net, loaded.tokenizer, out_dir, cfg.lora)
    model_fp = model_fingerprint(lm.config, weights_sha256(out_dir), kv_dtype, loaded.tokenizer_fp)
    summary = {
        "model_dir": str(out_dir.resolve()),
        "model_fp": model_fp,
        "base_model": str(loaded.model_dir),
        "base_model_fp": base_model_fp,
        "data": str(Path(data).resolve()),
        "data_sha256": data_sha,
        "config": cfg.to_dict(),
        "steps": result.steps,
        "resumed_from": result.resumed_from,
        "final_loss": result.losses[-1] if result.losses else None,
        "first_loss": result.losses[0] if result.losses else None,
        "steps_per_s": round(result.steps_per_s, 4),
        "train_seconds": round(result.seconds, 3),
        "prepare_seconds": round(prep_s, 3),
        "trainable_params": result.trainable_params,
        "counts": result.counts,
        "log": str(out_dir / "train_log.jsonl"),
        "plot": str(out_dir / "loss.png"),
    }
    (out_dir / "coinrag-training.json").write_text(json.dumps(summary, indent=2, default=str))
    if not keep_checkpoints:  # the model is saved: full-FT checkpoints are ~12 B per parameter
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    summary["losses"] = result.losses
    return summary
