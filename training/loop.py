"""The fine-tuning step loop: AdamW (gradient clipping, linear warmup then linear decay or
constant), micro-batch 1 with gradient accumulation over ``batch_size`` examples (token mean
over the effective batch), RAFT noise and evidence fitting per example, one log row and (every
``checkpoint_every`` steps) one checkpoint per optimizer step.

Output in ``OUT``: ``train_log.jsonl`` (one row per optimizer step: loss, lr, tokens, ...),
``checkpoints/`` (``training/checkpoint.py``) and, from :func:`plot_losses`, ``loss.png``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coinrag.inference.context.builders import ContextBuilder
from coinrag.schemas.qa import DataError
from coinrag.schemas.settings import FinetuneSettings
from coinrag.training.checkpoint import LoopState, resume_or_start, save_checkpoint
from coinrag.training.data import Plan, epoch_order, fit_evidence, raft_drop
from coinrag.training.objective import NuggetObjective, Objective, trainable_parameters

# The name users' log configurations know (it is the `train nuggets` command's), kept.
log = logging.getLogger("coinrag.train.nuggets")


class Killed(RuntimeError):
    """Raised by an ``on_step`` hook to simulate a killed run (tests)."""


@dataclass
class RunControl:
    """How a training run is driven, besides what it trains: ``logger`` (default: the
    trainer's), ``on_step(step, loss)`` called after every optimizer step and its checkpoint (a
    test raises :class:`Killed` there), ``resume`` from the newest checkpoint of the same run,
    ``keep_checkpoints`` once the model is saved, and ``lineage``: fields added to the summary."""

    logger: Any = None
    on_step: Callable[[int, float], None] | None = None
    resume: bool = True
    keep_checkpoints: bool = False
    lineage: dict[str, Any] = field(default_factory=dict)


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


def lr_lambda_for(cfg: FinetuneSettings, total_steps: int) -> Callable[[int], float]:
    """The lr factor per optimizer step: linear warmup (``warmup_ratio``), then linear decay
    to 0 at ``total_steps`` or constant (``schedule``)."""
    warmup = int(math.ceil(cfg.warmup_ratio * total_steps))

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return fn


def total_steps_for(n: int, cfg: FinetuneSettings) -> int:
    """Optimizer steps of a run over ``n`` usable examples (epochs, capped by ``max_steps``)."""
    if n == 0:
        raise DataError("no usable training examples (all skipped)")
    total = cfg.epochs * math.ceil(n / cfg.batch_size)
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


@dataclass
class _Step:
    """One optimizer step's moving parts."""

    model: Any
    builder: ContextBuilder
    objective: Objective
    cfg: FinetuneSettings
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any

    def run(self, plans: Sequence[Plan], loop: LoopState) -> dict[str, Any]:
        """Take the next batch of ``plans``, accumulate its gradients, step; return its row."""
        cfg = self.cfg
        t0 = time.perf_counter()
        if loop.cursor >= len(plans):
            loop.epoch, loop.cursor = loop.epoch + 1, 0
        order = epoch_order(len(plans), cfg.seed, loop.epoch)
        batch = [plans[i] for i in order[loop.cursor : loop.cursor + cfg.batch_size]]
        loop.cursor += len(batch)
        n_tokens = sum(len(pl.answer_ids) for pl in batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, dropped, active = 0.0, 0, 0
        n_tail_extra = self.objective.extra_tokens(cfg)
        for pl in batch:
            drop = raft_drop(cfg.seed, loop.epoch, pl.index, cfg.raft_p)
            dropped += int(drop)
            evidence, truncated = fit_evidence(
                pl.context(drop),
                self.builder.prompt.n_prefix,
                len(pl.query_ids) + len(pl.answer_ids) + n_tail_extra,
                cfg.max_length,
            )
            loop.run_counts["truncated"] += int(truncated)
            loss, n_context = self.objective.loss_sum(self.model, self.builder, pl, evidence)
            active += n_context
            (loss / n_tokens).backward()
            loss_sum += float(loss.detach())
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        loop.step += 1
        loop.run_counts["raft_dropped"] += dropped
        loop.run_counts["examples_seen"] += len(batch)
        return {
            "step": loop.step,
            "epoch": loop.epoch,
            "loss": loss_sum / n_tokens,
            "lr": lr,
            "examples": len(batch),
            "answer_tokens": n_tokens,
            "context_tokens": active,
            "raft_dropped": dropped,
            "seconds": round(time.perf_counter() - t0, 4),
        }


def train(
    model: Any,
    builder: ContextBuilder,
    plans: Sequence[Plan],
    cfg: FinetuneSettings,
    out_dir: str | os.PathLike[str],
    *,
    identity: dict[str, Any],
    objective: Objective | None = None,
    control: RunControl | None = None,
) -> TrainResult:
    """Optimise ``model``'s trainable parameters (already wrapped with LoRA if ``cfg.lora``)
    on ``plans``, with ``objective``'s loss (default: :class:`NuggetObjective`).

    ``identity`` (data hash, base model fp, ...) is stored in each checkpoint with the config; a
    checkpoint with another identity is refused (``ResumeMismatch``). The result's ``counts``
    are the run's (RAFT-dropped, truncated, examples seen).
    """
    control = control or RunControl()
    logger = control.logger or log
    objective = objective or NuggetObjective()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_root = out / "checkpoints"
    ident = {"config": cfg.identity(), **identity}
    total_steps = total_steps_for(len(plans), cfg)
    params = [p for _, p in trainable_parameters(model)]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999), eps=1e-8
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda_for(cfg, total_steps))
    loop, resumed_from = resume_or_start(
        ckpt_root,
        ident,
        cfg.seed,
        (model, optimizer, scheduler),
        resume=control.resume,
        logger=logger,
    )
    log_path = out / "train_log.jsonl"
    log_path.write_text("".join(json.dumps(r) + "\n" for r in loop.rows))
    objective.train_mode(model)
    stepper = _Step(model, builder, objective, cfg, params, optimizer, scheduler)
    t_start = time.perf_counter()
    first_step = loop.step
    while loop.step < total_steps:
        row = stepper.run(plans, loop)
        loop.rows.append(row)
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        logger.info(
            "step %d/%d epoch %d loss %.4f lr %.3g (%d examples, %.2f s)",
            loop.step,
            total_steps,
            loop.epoch,
            row["loss"],
            row["lr"],
            row["examples"],
            row["seconds"],
        )
        if loop.step % cfg.checkpoint_every == 0 or loop.step == total_steps:
            state = loop.trainer_state(ident)
            save_checkpoint(ckpt_root, loop.step, model, optimizer, scheduler, state)
        if control.on_step is not None:
            control.on_step(loop.step, row["loss"])
    seconds = time.perf_counter() - t_start
    done = loop.step - first_step
    return TrainResult(
        steps=loop.step,
        examples_seen=loop.run_counts["examples_seen"],
        losses=[r["loss"] for r in loop.rows],
        log=loop.rows,
        counts=dict(loop.run_counts),
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
