"""Embedder training under bfloat16 autocast (``training/retriever.py``, setting ``dtype``) and
the local question generator's model dtype (``local_dtype``): the bfloat16 step computes the
float32 step's cosines (within 0.01: bfloat16's 8-bit mantissa over a 6-layer encoder) and
loss, the saved
encoder stays float32, the resolved dtype is recorded, and a dtype outside the choices is
refused with its name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from coinrag.inference.model.kv_dtype import resolve_compute_dtype
from coinrag.inference.retrieval.embedders import LINEAGE_FILE, locate_embedder
from coinrag.schemas.training_settings import RetrieverTrainSettings
from coinrag.training.retriever import PairTrainer, finetune_embedder

PAGES = [
    "The with statement wraps a block with methods defined by a context manager.",
    "A generator function returns an iterator that yields values one at a time.",
    "Decorators wrap a function, modifying its behaviour without changing its code.",
    "The global interpreter lock lets one thread execute Python bytecode at a time.",
]
PAIRS = [
    SimpleNamespace(query=q, positive=PAGES[i], negative=PAGES[(i + 1) % len(PAGES)])
    for i, q in enumerate(
        [
            "how do context managers work",
            "what does yield do in a function",
            "how to wrap a function",
            "why do threads not run in parallel",
        ]
    )
]
SMALL = {"batch_size": 4, "query_max_length": 16, "passage_max_length": 32, "lr": 1e-4}


def _trainer(dtype: str) -> PairTrainer:
    cfg = RetrieverTrainSettings(**SMALL, dtype=dtype).validate()
    trainer = PairTrainer(locate_embedder(None), cfg, steps=1)
    assert trainer.dtype == dtype
    return trainer


def test_bfloat16_step_computes_the_float32_cosines_and_loss() -> None:
    """Cosines within 0.01 and the first loss (of the weights before the step) within 0.02 nats
    of float32's, both from the same base weights, dropout off (so only the dtype differs)."""
    passages = [p.positive for p in PAIRS] + [p.negative for p in PAIRS]
    f32, bf16 = _trainer("float32"), _trainer("bfloat16")
    f32.model.eval(), bf16.model.eval()
    with torch.no_grad():
        gap = (f32.cosines(PAIRS, passages) - bf16.cosines(PAIRS, passages)).abs().max()
    assert float(gap) <= 0.01
    loss32, loss16 = f32.step(PAIRS), bf16.step(PAIRS)
    assert loss32 > 0 and abs(loss16 - loss32) <= 0.02, (loss32, loss16)


def test_finetuned_encoder_is_saved_in_float32_with_its_dtype_recorded(tmp_path) -> None:
    from safetensors import safe_open

    cfg = RetrieverTrainSettings(**SMALL, dtype="bfloat16").validate()
    out = tmp_path / "adapted"
    summary = finetune_embedder(locate_embedder(None), 256, PAIRS * 2, out, cfg, {"run_id": "t"})
    assert summary["dtype"] == "bfloat16" and summary["steps"] == 2
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        dtypes = {weights.get_tensor(name).dtype for name in weights.keys()}
    assert dtypes == {torch.float32}
    lineage = json.loads((out / LINEAGE_FILE).read_text())
    assert lineage["training"]["dtype"] == "bfloat16" and lineage["settings"]["dtype"] == "bfloat16"


def test_a_dtype_outside_the_choices_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype 'float16' is not one of auto, float32, bfloat16"):
        RetrieverTrainSettings(dtype="float16").validate()
    with pytest.raises(ValueError, match="local_dtype 'half' is not one of"):
        resolve_compute_dtype("local_dtype", "half", "cpu")
    assert resolve_compute_dtype("dtype", "auto", "cpu") in ("float32", "bfloat16")


def test_local_generator_loads_its_model_at_its_dtype() -> None:
    from coinrag.schemas.training_settings import CartridgeSettings
    from coinrag.tasks.question_generators.local import LocalQuestionGenerator

    settings = CartridgeSettings(local_dtype="bfloat16")
    bf16 = LocalQuestionGenerator.from_settings(settings, None)
    f32 = LocalQuestionGenerator(None, dtype="float32")
    assert bf16.loaded.model.dtype == torch.bfloat16 and f32.loaded.model.dtype == torch.float32
    assert bf16.fingerprint != f32.fingerprint  # the dtype is in model_fp: no shared cache keys
    with pytest.raises(ValueError, match="local_dtype 'float64' is not one of"):
        _ = LocalQuestionGenerator(None, dtype="float64").loaded
