"""The two views of :class:`CartridgeSettings` (``schemas/training_settings.py``): each carries
the pipeline's values under its own field names, the rest at the view's defaults."""

from __future__ import annotations

from coinrag.schemas.training_settings import (
    CartridgeSettings,
    CartridgeTrainSettings,
    TeacherSettings,
)


def test_teacher_view_takes_the_teacher_batch_size_not_the_training_one() -> None:
    s = CartridgeSettings(max_new_tokens=7, top_k=3, max_doc_tokens=99, teacher_batch_size=2)
    assert s.teacher() == TeacherSettings(
        max_new_tokens=7, top_k=3, batch_size=2, max_doc_tokens=99
    )
    assert CartridgeSettings(batch_size=5).teacher().batch_size == 8


def test_train_view_carries_every_training_value_and_keeps_its_own_defaults() -> None:
    s = CartridgeSettings(
        lr=0.5,
        p_iso=0.25,
        k_min=2,
        k_max=4,
        budget=3,
        rotate_every=5,
        batch_size=6,
        train_distractors=False,
        checkpoint_every=7,
        seed=11,
    )
    train = s.train()
    assert (train.lr, train.p_iso, train.k_min, train.k_max, train.budget) == (0.5, 0.25, 2, 4, 3)
    assert (train.rotate_every, train.batch_size, train.checkpoint_every) == (5, 6, 7)
    assert (train.train_distractors, train.seed) == (False, 11)
    assert (train.betas, train.eps) == (CartridgeTrainSettings.betas, CartridgeTrainSettings.eps)
