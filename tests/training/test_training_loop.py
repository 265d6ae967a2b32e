"""The fine-tuning loop's parts on their own (training/checkpoint.py, training/loop.py): resume
from a checkpoint of the same run, refusal of another run's, the step count."""

from __future__ import annotations

import logging

import pytest
import torch

from coinrag.schemas.qa import DataError
from coinrag.schemas.settings import FinetuneSettings
from coinrag.training.checkpoint import LoopState, ResumeMismatch, resume_or_start, save_checkpoint
from coinrag.training.loop import total_steps_for

log = logging.getLogger("test")


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    return model, opt, sched


def test_resume_restores_the_state_and_parameters_of_the_same_run(tmp_path):
    model, opt, sched = _trained()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    loop = LoopState(step=3, epoch=1, cursor=2, rows=[{"step": 3, "loss": 0.5}])
    loop.run_counts["truncated"] = 4
    ident = {"config": {"lr": 0.1}, "data_sha256": "abc"}
    save_checkpoint(tmp_path, 3, model, opt, sched, loop.trainer_state(ident))

    fresh = _trained(seed=1)
    got, resumed_from = resume_or_start(tmp_path, ident, 0, fresh, resume=True, logger=log)
    assert resumed_from == 3
    assert (got.step, got.epoch, got.cursor, got.rows) == (3, 1, 2, [{"step": 3, "loss": 0.5}])
    assert got.run_counts == {"raft_dropped": 0, "truncated": 4, "examples_seen": 0}
    assert torch.equal(fresh[0].weight, model.weight) and torch.equal(fresh[0].bias, model.bias)
    assert fresh[1].state_dict()["state"][0]["step"] == 1


def test_a_checkpoint_of_another_run_is_refused_and_resume_false_starts_over(tmp_path):
    model, opt, sched = _trained()
    save_checkpoint(tmp_path, 1, model, opt, sched, LoopState(step=1).trainer_state({"a": 1}))
    with pytest.raises(ResumeMismatch, match="another training run"):
        resume_or_start(tmp_path, {"a": 2}, 0, _trained(), resume=True, logger=log)
    got, resumed_from = resume_or_start(tmp_path, {"a": 2}, 0, _trained(), resume=False, logger=log)
    assert resumed_from is None and got == LoopState()
    assert not tmp_path.exists()  # resume=False deletes the old checkpoints


def test_total_steps_counts_epochs_and_caps_at_max_steps():
    assert total_steps_for(10, FinetuneSettings(batch_size=4, epochs=2)) == 6
    assert total_steps_for(10, FinetuneSettings(batch_size=4, epochs=2, max_steps=5)) == 5
    with pytest.raises(DataError, match="no usable training examples"):
        total_steps_for(0, FinetuneSettings())
