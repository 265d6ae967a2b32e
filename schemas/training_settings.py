"""The training pipelines' settings: the cartridge pipeline (``coinrag train cartridges``; the
module doc of ``schemas/settings.py`` introduces them): :class:`CartridgeSettings`, and the two
views of it the stages take, :class:`TeacherSettings` (``tasks/teacher.py``) and
:class:`CartridgeTrainSettings` (``training/budget.py``); :class:`KvLinkOptions`, the options
of ``coinrag train kvlink``; :class:`FinetuneSettings`, those of ``coinrag train nuggets``;
and :class:`RetrieverTrainSettings`, those of ``coinrag train
retriever``. Importable from ``schemas.settings`` as well."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

from coinrag.schemas.fields import setting

QUESTION_GENERATORS = ("openai", "local")  # self-study question generators
# Fine-tuning: who encodes the context (inference.context.builders.FINETUNE_CONTEXTS maps each to
# a class).
FINETUNE_MODES = ("live", "frozen")
# Compute dtypes of inference-only models loaded by reference and of embedder training: auto is
# bfloat16 where the device computes it natively (inference/model/kv_dtype.py), else float32.
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
# train retriever: when the adapted embedder replaces the store's
# (tasks/retrieval/retriever_guard.py)
ADOPT_WHEN = ("if-better", "always")

_View = TypeVar("_View", "TeacherSettings", "CartridgeTrainSettings")


@dataclass(frozen=True)
class TeacherSettings:
    """Self-study's teacher (``tasks/teacher.py``): greedy answers of at most
    ``max_new_tokens`` tokens, ``top_k`` log-probs per position; documents longer than
    ``max_doc_tokens`` are cut (the cartridge stands for the same cut)."""

    max_new_tokens: int = 48
    top_k: int = 20
    batch_size: int = 8
    max_doc_tokens: int = 2048

    def value_dict(self) -> dict[str, Any]:
        """What an answer depends on (part of the teacher fingerprint; not the batch size)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "top_k": self.top_k,
            "max_doc_tokens": self.max_doc_tokens,
            "decoding": "greedy-v1",
        }


def check_visibility(p_iso: float, k_min: int, k_max: int) -> None:
    """Raise ValueError unless ``0 <= p_iso <= 1`` and ``1 <= k_min <= k_max`` (CAS eq. 1:
    ``training.cartridges.Visibility``)."""
    if not 0.0 <= p_iso <= 1.0:
        raise ValueError(f"p_iso must be in [0, 1], got {p_iso}")
    if not 1 <= k_min <= k_max:
        raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")


@dataclass(frozen=True)
class CartridgeTrainSettings:
    """One training run of a cartridge pool (``training/budget.py``).

    Visibility (CAS eq. 1): with probability ``p_iso`` an example sees only its own cartridge,
    otherwise its own plus ``k ~ U{k_min..k_max}`` distractors (``p_iso = 1``: isolated).
    """

    lr: float = 2e-2  # the Cartridges paper's value
    p_iso: float = 1.0
    k_min: int = 1
    k_max: int = 3
    budget: int = 8  # B: cartridges on the device at once
    rotate_every: int = 16  # R: steps between rotations
    batch_size: int = 1  # examples per optimizer step
    train_distractors: bool = True
    checkpoint_every: int = 0  # 0: only at the end
    seed: int = 0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        check_visibility(self.p_iso, self.k_min, self.k_max)

    def value_dict(self) -> dict[str, Any]:
        """What the trained values depend on (part of the cartridge fingerprint)."""
        return {
            "lr": self.lr,
            "visibility": {"p_iso": self.p_iso, "k_min": self.k_min, "k_max": self.k_max},
            "budget": self.budget,
            "rotate_every": self.rotate_every,
            "batch_size": self.batch_size,
            "train_distractors": self.train_distractors,
            "seed": self.seed,
            "betas": list(self.betas),
            "eps": self.eps,
        }


@dataclass(frozen=True)
class CartridgeSettings:
    """Every knob of the cartridge pipeline, with its default (never secrets).

    The cartridge's size and initialisation are ``training.cartridges.CartridgeSpec
    .from_settings(s)``; the teacher's and the trainer's settings :meth:`teacher`, :meth:`train`.
    """

    model: str | None = None  # generation model reference (None: packaged SmolLM2)
    device: str = "cpu"
    # self-study
    generator: str | None = None  # openai | local (default: openai if OPENAI_API_KEY is set)
    llm_model: str = "gpt-4o-mini"
    base_url: str | None = None
    n_questions: int = 20
    n_calls: int | None = None  # default: 1 per document + 1 per chars_per_call characters
    chars_per_call: int = 2000
    seed: int = 0
    local_batch_size: int = 32
    local_dtype: str = "auto"  # COMPUTE_DTYPES: the local generator's model, loaded by reference
    # teacher
    max_new_tokens: int = 48
    top_k: int = 20
    max_doc_tokens: int = 2048
    teacher_batch_size: int = 8
    # cartridges
    p: int | None = None
    ratio: float | None = 4.0
    init: str = "first_tokens"
    freeze_first: bool = True
    # training
    lr: float = 2e-2
    p_iso: float = 0.5
    k_min: int = 1
    k_max: int = 3
    budget: int = 8
    rotate_every: int = 16
    batch_size: int = 1
    train_distractors: bool = True
    checkpoint_every: int = 50

    def resolved_generator(self) -> str:
        if self.generator is not None:
            if self.generator not in QUESTION_GENERATORS:
                raise ValueError(f"generator must be openai or local, got {self.generator!r}")
            return self.generator
        return "openai" if os.environ.get("OPENAI_API_KEY") else "local"

    def teacher(self) -> TeacherSettings:
        return self._view(TeacherSettings, batch_size=self.teacher_batch_size)

    def train(self) -> CartridgeTrainSettings:
        return self._view(CartridgeTrainSettings)

    def _view(self, cls: type[_View], **renamed: Any) -> _View:
        """The settings dataclass ``cls`` with every field of it this object has under the same
        name, then ``renamed`` (its fields held here under another name); the fields this
        object lacks keep ``cls``'s defaults (e.g. ``CartridgeTrainSettings.betas``)."""
        here = {f.name for f in fields(self)}
        same = {f.name: getattr(self, f.name) for f in fields(cls) if f.name in here}
        return cls(**{**same, **renamed})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KvLinkOptions:
    """The options of ``coinrag train kvlink`` (generated by ``flows/settings_options.py``):
    the adapter's shape (``n_link``, ``max_docs``, the base ``model``) and the training run's
    settings (:meth:`training`, read as ``FinetuneSettings`` with a frozen model)."""

    n_link: int = setting(5, "Link tokens after each chunk.", cli=True, min=1)
    max_docs: int = setting(
        16, "Document slots with their own links (bounds --kc).", cli=True, min=1
    )
    kc: int = setting(5, "Chunks per example (as kvlink serves).", cli=True, min=1)
    lr: float = setting(1e-3, "Learning rate of the link tokens.", cli=True, min=0.0)
    batch_size: int = setting(16, "Examples per optimizer step.", cli=True, min=1)
    epochs: int = setting(1, "Passes over the data.", cli=True, min=1)
    max_steps: int | None = setting(None, "Stop after N optimizer steps.", cli=True, min=1)
    checkpoint_every: int = setting(
        50, "Checkpoint every N steps (a killed run resumes).", cli=True, min=1
    )
    model: str | None = setting(None, "Base model (default: the store's); stays frozen.", cli=True)

    def training(self) -> dict[str, Any]:
        """The training run's settings (``FinetuneSettings`` fields)."""
        names = ("kc", "lr", "batch_size", "epochs", "max_steps", "checkpoint_every")
        return {name: getattr(self, name) for name in names}


@dataclass(frozen=True)
class RetrieverTrainSettings:
    """``coinrag train retriever`` (``training/retriever.py``): fine-tune the store's embedder
    on its own pairs (``tasks/retrieval/retriever_pairs.py``) with in-batch and BM25 hard negatives
    (InfoNCE over ``scale`` times the cosines), AdamW at ``lr`` with a linear warm-up over the
    first ``warmup`` of the steps; at most ``max_pairs`` pairs, ``epochs`` passes, and never
    past ``max_minutes`` of training (the one-thread budget of a whole-corpus run)."""

    max_pairs: int = setting(3000, "Training pairs at most (a seeded sample).", cli=True, min=1)
    batch_size: int = setting(32, "Pairs per optimizer step.", cli=True, min=2)
    epochs: int = setting(1, "Passes over the pairs.", cli=True, min=1)
    lr: float = setting(3e-5, "Learning rate (AdamW).", cli=True, min=0.0)
    warmup: float = setting(0.1, "Share of the steps of linear warm-up.", cli=True, min=0.0)
    scale: float = setting(20.0, "Logit scale of the cosines (InfoNCE).", cli=True, min=0.0)
    query_max_length: int = setting(48, "Word pieces kept of a query.", cli=True, min=4)
    passage_max_length: int = setting(256, "Word pieces kept of a passage.", cli=True, min=8)
    max_minutes: float = setting(
        6.0, "Stop training after this many minutes (the time budget).", cli=True, min=0.0
    )
    dtype: str = setting(
        "auto",
        "Compute dtype of the training forward and backward (autocast; weights and optimizer "
        "stay float32): auto (bfloat16 where the device computes it natively), float32 or "
        "bfloat16.",
        cli=True,
        choices=COMPUTE_DTYPES,
    )
    seed: int = setting(0, "Seed of the pair sample and the batches.", cli=True)
    adopt: str = setting(
        "if-better",
        "When the adapted embedder replaces the store's: if-better (its MRR on held-out "
        "questions at least the store's embedder's, judged before re-embedding) or always.",
        cli=True,
        choices=ADOPT_WHEN,
    )
    guard_pages: int = setting(
        25,
        "Held-out pages the if-better judgment asks about (and as many distractors).",
        cli=True,
        min=1,
    )
    # the command's --generated N and --generator (flows/cli/train.py)
    generated_chunks: int = setting(
        0, "Also train on the question generator's questions about this many chunks.", min=0
    )
    generator: str | None = None  # local | openai (None: openai with OPENAI_API_KEY, else local)

    def validate(self) -> RetrieverTrainSettings:
        if self.generator not in (None, *QUESTION_GENERATORS) or self.generated_chunks < 0:
            raise ValueError(
                f"generator must be one of {', '.join(QUESTION_GENERATORS)} and "
                f"generated_chunks >= 0, got {self.generator!r}, {self.generated_chunks}"
            )
        if self.max_pairs < 1 or self.batch_size < 2 or self.epochs < 1:
            raise ValueError(
                f"need max_pairs >= 1, batch_size >= 2 and epochs >= 1, got {self.max_pairs}, "
                f"{self.batch_size}, {self.epochs}"
            )
        if self.lr <= 0 or self.max_minutes <= 0:
            raise ValueError(f"lr and max_minutes must be > 0, got {self.lr}, {self.max_minutes}")
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        if self.adopt not in ADOPT_WHEN or self.guard_pages < 1:
            raise ValueError(
                f"adopt must be one of {', '.join(ADOPT_WHEN)} and guard_pages >= 1, got "
                f"{self.adopt!r}, {self.guard_pages}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- fine-tuning


@dataclass
class FinetuneSettings:
    """Everything that decides what nugget-aware fine-tuning computes (the paper's values as
    defaults; ``training/finetune.py``). The fields marked ``cli=True`` are options of
    ``coinrag train nuggets`` (generated from here)."""

    mode: str = setting("live", "live (default) | frozen", cli=True)  # FINETUNE_MODES
    lora: bool = setting(False, "Train LoRA adapters (merged).", cli=True)
    epochs: int = 1
    lr: float = 5e-6
    batch_size: int = 16  # effective batch: examples per optimizer step (gradient accumulation)
    max_length: int = 1024  # prefix + context + query + answer tokens
    kc: int = 5
    k: int = 10
    raft_p: float = 0.15
    seed: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_ratio: float = 0.03
    schedule: str = "linear"  # linear (warmup, then decay to 0) | constant (after warmup)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    checkpoint_every: int = 50  # optimizer steps
    max_steps: int | None = setting(None, "Stop after N optimizer steps.", cli=True, min=1)
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 elsewhere

    def validate(self) -> FinetuneSettings:
        if self.mode not in FINETUNE_MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(FINETUNE_MODES)}")
        if not 0.0 <= self.raft_p <= 1.0:
            raise ValueError(f"raft_p {self.raft_p} is outside [0, 1]")
        if self.schedule not in ("linear", "constant"):
            raise ValueError(f"schedule {self.schedule!r} is not linear or constant")
        for name in ("epochs", "batch_size", "max_length", "kc", "k", "checkpoint_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if self.lr <= 0:
            raise ValueError("lr must be > 0")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint (checkpoint_every may change)."""
        d = self.to_dict()
        d.pop("checkpoint_every")
        return d
