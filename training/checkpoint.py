"""Checkpoints of a fine-tuning run and resuming from them.

``OUT/checkpoints/step-NNNNNN`` (every ``checkpoint_every`` optimizer steps, written to a
temporary folder and renamed; ``OUT/checkpoints/LATEST`` names the newest) holds the trainable
parameters (safetensors; LoRA: the adapters only), optimizer, scheduler, Python / NumPy / torch
RNG states, the data cursor (epoch, position in the epoch's order), the log so far and the
identity of the run (config, data hash, base model). A run started again with the same identity
resumes from the newest checkpoint and computes the same next loss (bit-equal on CPU).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coinrag.schemas.keys import canonical_json
from coinrag.training.objective import trainable_parameters

CHECKPOINT_FORMAT = 1


class ResumeMismatch(RuntimeError):
    """A checkpoint exists in OUT but belongs to another run (config, data or base model)."""


@dataclass
class LoopState:
    """Where a run stands: optimizer steps done, the data cursor (``epoch`` and position
    ``cursor`` in its order), the log rows so far and the run's counters."""

    step: int = 0
    epoch: int = 0
    cursor: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    run_counts: dict[str, int] = field(
        default_factory=lambda: {"raft_dropped": 0, "truncated": 0, "examples_seen": 0}
    )

    def trainer_state(self, identity: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint stores of it (with the run's identity)."""
        return {
            "identity": identity,
            "step": self.step,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "log": self.rows,
            "run_counts": self.run_counts,
        }


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
    """The checkpoint ``LATEST`` names, if it is complete; else None."""
    pointer = ckpt_root / "LATEST"
    if not pointer.is_file():
        return None
    path = ckpt_root / pointer.read_text().strip()
    return path if (path / "trainer.pt").is_file() else None


def load_checkpoint(path: Path, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Restore parameters, optimizer, scheduler and RNG states from ``path``; return its state."""
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


def resume_or_start(
    ckpt_root: Path,
    identity: dict[str, Any],
    seed: int,
    trained: tuple[Any, Any, Any],
    *,
    resume: bool,
    logger: Any,
) -> tuple[LoopState, int | None]:
    """The state to continue from: the newest checkpoint of this ``identity`` (restored into
    ``trained = (model, optimizer, scheduler)``) when ``resume``, else a fresh start seeded by
    ``seed`` (``resume=False`` deletes old checkpoints). Returns the state and the step resumed
    from (None: fresh). A checkpoint of another identity raises :class:`ResumeMismatch`."""
    ckpt = latest_checkpoint(ckpt_root) if resume else None
    if ckpt is None:
        if not resume:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        return LoopState(), None
    state = torch.load(ckpt / "trainer.pt", weights_only=False, map_location="cpu")
    if canonical_json(state["identity"]) != canonical_json(identity):
        raise ResumeMismatch(
            f"{ckpt} belongs to another training run (config, data or base model differ); "
            "use another --out or delete its checkpoints"
        )
    state = load_checkpoint(ckpt, *trained)
    loop = LoopState(
        state["step"],
        state["epoch"],
        state["cursor"],
        list(state["log"]),
        dict(state["run_counts"]),
    )
    logger.info(
        "resuming from %s (step %d, epoch %d, cursor %d)",
        ckpt,
        loop.step,
        loop.epoch,
        loop.cursor,
    )
    return loop, loop.step
