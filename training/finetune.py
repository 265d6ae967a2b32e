"""Nugget-aware fine-tuning: train the generator on the context it meets online.

For every QA example the online CoinRAG context is rebuilt exactly as inference builds it:
two-stage retrieval (top-``kc`` chunks, then the top-``k`` nuggets inside them), restricted to
the example's own documents (gold + distractors, HotpotQA style), then ``C_ctx = C_p ⊕
Rot(C_b1[s1:e1]; Δ1) ⊕ ...`` after the RAG prompt prefix, by the context builder serving uses
(``inference/context/builders.py``). The loss is the cross-entropy of the short answer (plus EOS)
given ``(C_ctx, q)``: the input is ``query_ids(question) + answer_ids + [eos]`` prefilled at
positions after ``C_ctx``, the labels are the answer tokens only (token mean over the effective
batch).

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

The mode picks the context builder (``inference.context.builders.FINETUNE_CONTEXTS``: ``live`` ->
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

The modules, by job: ``training/data.py`` (plans, RAFT draws, evidence fitting),
``training/objective.py`` (the loss, LoRA), ``training/checkpoint.py`` (checkpoints, resume),
``training/loop.py`` (the step loop), ``training/job.py`` (store, data and model around the
loop, shared with ``training/kvlink.py``); this module runs them for nugget fine-tuning.

Output: ``OUT`` is a transformers model folder (safetensors + tokenizer; LoRA merged), plus
``train_log.jsonl`` (one row per optimizer step: loss, lr, tokens, ...), ``loss.png`` and
``coinrag-training.json`` (lineage: base model fp, new model fp, data hash, config).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from coinrag.inference.context.builders import FINETUNE_CONTEXTS
from coinrag.inference.model.encode import causal_lm
from coinrag.schemas.settings import FinetuneSettings
from coinrag.storage.cache import file_sha256  # noqa: F401  (the data hash; one for the tree)
from coinrag.training.job import Prepared, TrainJob
from coinrag.training.loop import RunControl
from coinrag.training.objective import NuggetObjective, attach_lora


def save_model(model: Any, tokenizer: Any, out_dir: str | Path, lora: bool) -> Any:
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


def run_training(
    job: TrainJob, cfg: FinetuneSettings, control: RunControl | None = None
) -> dict[str, Any]:
    """Train on a store whose documents are already built (see ``flows/train.py`` for the flow
    that builds them first). Returns a summary with ``model_fp`` and ``base_model_fp``.
    ``OUT/checkpoints`` is removed once the model is saved unless ``control.keep_checkpoints``."""
    from coinrag.inference.model.encode import pad_id
    from coinrag.inference.model.loading import model_fingerprint, weights_sha256

    cfg.validate()
    control = control or RunControl()
    objective = NuggetObjective()
    prep = Prepared.open(job, cfg, objective, at_kv_dtype=False)
    # Model fingerprints as this store computes KV (its kv_dtype): the base model's KV is what
    # frozen mode reads, and --rebuild-kv stores the new model's under the model_fp recorded here.
    base_model_fp, layout = prep.kv_identity(prep.settings.kv_keep)
    torch.manual_seed(cfg.seed)  # LoRA init
    net = attach_lora(prep.loaded.model, cfg) if cfg.lora else prep.loaded.model
    builder = FINETUNE_CONTEXTS[cfg.mode].for_finetuning(
        prep.store, net, prep.prompt, layout=layout, pad_id=pad_id(prep.loaded.tokenizer)
    )
    result = prep.train(net, builder, cfg, {"base_model_fp": base_model_fp}, objective, control)
    out_dir = Path(job.out)
    lm = save_model(net, prep.loaded.tokenizer, out_dir, cfg.lora)
    model_fp = model_fingerprint(
        lm.config, weights_sha256(out_dir), prep.kv_dtype, prep.loaded.tokenizer_fp
    )
    summary = {
        "model_dir": str(out_dir.resolve()),
        "model_fp": model_fp,
        **prep.summary(cfg, result, base_model_fp),
        **control.lineage,
    }
    (out_dir / "coinrag-training.json").write_text(json.dumps(summary, indent=2, default=str))
    if not control.keep_checkpoints:  # the model is saved: full-FT checkpoints ~12 B/parameter
        shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)
    summary["losses"] = result.losses
    return summary
