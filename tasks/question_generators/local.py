"""Questions from a local causal LM (backend ``local``): sampled under the JSON-array skeleton
(``skeleton.py``) by ``inference.model.constrained.decode_constrained``, each call with a generator
seeded from its call key. The output always parses; usability is measured by the same filter
as the OpenAI path (``accept.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import torch

from coinrag.inference.llm.client import CallRecord, new_call_id
from coinrag.inference.model.constrained import SampledChoice, decode_constrained
from coinrag.schemas.settings import CartridgeSettings
from coinrag.tasks.question_generators.accept import MalformedQuestions, parse_questions
from coinrag.tasks.question_generators.base import (
    QuestionGenerator,
    QuestionRequest,
    QuestionResult,
    QuestionsDone,
)
from coinrag.tasks.question_generators.prompt import build_local_messages
from coinrag.tasks.question_generators.skeleton import SkeletonMachine, skeleton_vocab

log = logging.getLogger(__name__)


def _question_progress(
    machines: Sequence[SkeletonMachine], progress: QuestionsDone | None
) -> Callable[[int], None] | None:
    """``on_advance`` for the decoder: ``progress(1)`` each time a row closes a question."""
    if progress is None:
        return None
    closed = [0] * len(machines)

    def advanced(row: int) -> None:
        if machines[row].questions > closed[row]:
            closed[row] = machines[row].questions
            progress(1)

    return advanced


@dataclass(frozen=True)
class QuestionSampling:
    """How a question's tokens are sampled (``SampledChoice``): ``temperature``, ``top_k``,
    ``repetition_penalty``, and ``close_boost``: the logit bonus of the closing tokens per
    question token beyond ``min_question_tokens`` (``SkeletonMachine.close_boost``)."""

    temperature: float = 0.7
    top_k: int = 50
    repetition_penalty: float = 1.3
    close_boost: float = 0.4


@dataclass(eq=False)
class LocalQuestionGenerator(QuestionGenerator, name="local"):
    """Questions from a local causal LM under the JSON-array skeleton constraint (module doc).

    ``model``: a reference for ``inference.model.loading.load_model`` (None: packaged SmolLM2),
    loaded at ``dtype`` (``auto``: bfloat16 where ``device`` computes it natively, else float32;
    the dtype is in ``model_fp``, hence in the fingerprint), or a loaded ``LoadedModel`` (its own
    dtype). Calls are run ``batch_size`` at a time; each samples with a generator seeded from its
    call key, so a call's questions do not depend on the batch.
    """

    model: Any = None
    _: KW_ONLY
    n_questions: int = 20
    min_question_tokens: int = 4
    max_question_tokens: int = 24
    sampling: QuestionSampling = QuestionSampling()
    batch_size: int = 32
    device: str = "cpu"
    dtype: str = "auto"

    def __post_init__(self) -> None:
        self._loaded = None if self.model is None or isinstance(self.model, str) else self.model

    @classmethod
    def from_settings(
        cls, settings: CartridgeSettings, loaded: Any = None
    ) -> LocalQuestionGenerator:
        """The generator ``settings`` describe, on the already loaded target model."""
        return cls(
            loaded,
            n_questions=settings.n_questions,
            batch_size=settings.local_batch_size,
            device=settings.device,
            dtype=settings.local_dtype,
        )

    @property
    def loaded(self) -> Any:
        if self._loaded is None:
            from coinrag.inference.model.kv_dtype import resolve_compute_dtype
            from coinrag.inference.model.loading import load_model

            dtype = resolve_compute_dtype("local_dtype", self.dtype, self.device)
            self._loaded = load_model(self.model, device=self.device, dtype=dtype)
        return self._loaded

    @property
    def llm_model(self) -> str:
        return f"local@{self.loaded.model_fp}"

    def fingerprint_fields(self) -> dict[str, Any]:
        return {
            "model_fp": self.loaded.model_fp,
            "n": self.n_questions,
            "min_question_tokens": self.min_question_tokens,
            "max_question_tokens": self.max_question_tokens,
            **asdict(self.sampling),  # temperature, top_k, repetition_penalty, close_boost
            "decoding": "json-skeleton-v2",
        }

    def prompt_ids(self, req: QuestionRequest) -> list[int]:
        tok = self.loaded.tokenizer
        text = tok.apply_chat_template(
            build_local_messages(req.text, req.seed_type, self.n_questions),
            add_generation_prompt=True,
            tokenize=False,
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def generate(
        self, requests: Sequence[QuestionRequest], progress: QuestionsDone | None = None
    ) -> list[QuestionResult]:
        """One result per request, in order (prompts of similar length batched together);
        ``progress(1)`` each time a question is written, then the rest of a call's questions
        when it fails or ends early."""
        tok = self.loaded.tokenizer
        sv = skeleton_vocab(tok)
        pad = tok.pad_token_id if tok.pad_token_id is not None else sv.eos
        results: dict[int, QuestionResult] = {}
        prompts = [self.prompt_ids(r) for r in requests]
        order = sorted(range(len(requests)), key=lambda i: len(prompts[i]))
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            machines = [
                SkeletonMachine(
                    sv, self.n_questions, self.min_question_tokens, self.max_question_tokens
                )
                for _ in idx
            ]
            gens = [
                torch.Generator().manual_seed(int(requests[i].key[-12:], 16) % 2**62) for i in idx
            ]
            s = self.sampling
            choice = SampledChoice(
                s.temperature, s.top_k, gens, s.repetition_penalty, s.close_boost
            )
            started, t0 = datetime.now(UTC), time.perf_counter()
            try:
                # one token per step, every row to the end: how the cached questions were
                # sampled (the generator's fingerprint says "json-skeleton-v2")
                decode_constrained(
                    self.loaded.model,
                    [prompts[i] for i in idx],
                    machines,
                    choice,
                    pad,
                    jump_forward=False,
                    on_advance=_question_progress(machines, progress),
                )
                error = None
            except Exception as exc:  # noqa: BLE001 - recorded as failed calls
                error = f"{type(exc).__name__}: {exc}"
                log.warning("local question generation failed: %s", error)
            wall_ms = (time.perf_counter() - t0) * 1000.0 / len(idx)
            for i, m in zip(idx, machines, strict=True):
                req = requests[i]
                n_out = len(m.generated)
                if error is not None:
                    status, items, reason = "failed", [], None
                else:
                    text = tok.decode([t for t in m.generated if t != sv.eos])
                    try:
                        status, items, reason = "ok", parse_questions(text), None
                    except MalformedQuestions as exc:  # never expected: the skeleton parses
                        status, items, error, reason = "malformed", [], str(exc), exc.reason
                rec = CallRecord(
                    call_id=new_call_id(),
                    key=req.key,
                    attempt=1,
                    status="ok"
                    if status == "ok"
                    else ("malformed" if status == "malformed" else "error"),
                    tokens_in=len(prompts[i]),
                    tokens_out=n_out,
                    cost_usd=0.0,
                    latency_ms=wall_ms,
                    started_at=started,
                    error=error,
                )
                results[i] = QuestionResult(req.key, status, items, error, [rec], reason)
            if progress is not None:  # questions a failed batch never wrote
                rest = sum(max(self.n_questions - m.questions, 0) for m in machines)
                if rest:
                    progress(rest)
        return [results[i] for i in range(len(requests))]
