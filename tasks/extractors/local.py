"""Nugget extraction with a local causal LM under constrained decoding (backend ``"local"``).

A small model (default: the packaged SmolLM2-135M-Instruct) cannot be trusted to write JSON or to
copy text exactly, so it is never asked to: it is run greedily under a constraint that lets it
only copy runs of the passage's own tokens. The model only chooses where each span starts, where
it stops, and when the list ends; every candidate is verbatim by construction. The constraint
(the answer's format, words and tokens, clause heads, the budget of spans) is
``tasks/extractors/span_copy.py``.

Two drivers make the same greedy choices, ``batch_size`` passages at a time (left-padded), both
``inference/model/constrained.py``: ``driver="jump"`` (default) is a loop over one KV cache that
feeds every forced token (inside a word, between two places to stop) in the same forward pass
("jump-forward") and runs the model only where there is a choice; ``driver="generate"`` is
``model.generate`` with the constraint as a ``LogitsProcessor``, one forward pass per token (the
reference).
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from coinrag.inference.llm.client import CallRecord
from coinrag.inference.model.constrained import (
    GreedyChoice,
    PromptPrefix,
    decode_constrained,
    decode_with_generate,
)
from coinrag.schemas.keys import fingerprint, sha256_hex
from coinrag.schemas.settings import BuildSettings
from coinrag.tasks.extractors.base import (
    ExtractionRequest,
    ExtractionResult,
    Extractor,
    ResultFn,
    ResultReporter,
)
from coinrag.tasks.extractors.span_copy import (
    BOUNDARIES,
    SpanCopyMachine,
    SpecialIds,
    tokenize_passage,
)

log = logging.getLogger(__name__)

LOCAL_SYSTEM_PROMPT = (
    "You copy facts from a passage for a search index. List the passage's key facts, one per "
    'line, each line starting with "- ". Each fact is a short phrase or clause copied word for '
    "word from the passage."
)
LOCAL_USER_TEMPLATE = "Passage:\n{text}"
LOCAL_PROMPT_VERSION = (
    "pl-" + sha256_hex("local-prompt", LOCAL_SYSTEM_PROMPT, LOCAL_USER_TEMPLATE)[:12]
)
DECODING = "greedy-constrained-v2"  # bump when the constraint's rules change


def build_local_messages(text: str) -> list[dict[str, str]]:
    """Chat messages of the local prompt for one passage (the answer is the constrained list)."""
    return [
        {"role": "system", "content": LOCAL_SYSTEM_PROMPT},
        {"role": "user", "content": LOCAL_USER_TEMPLATE.format(text=text)},
    ]


# ---------------------------------------------------------------------------------------------
# The extractor


# how a batch is decoded: the same greedy choices; "generate" (transformers' loop) is the reference
_DRIVERS = ("jump", "generate")


def _single_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer encodes {text!r} as {len(ids)} tokens; need exactly 1")
    return int(ids[0])


@dataclass(frozen=True)
class SpanRules:
    """What a nugget span may be: ``min_words..max_words`` words; a span from a clause head at
    least ``min_head_words`` words (unless the clause is shorter); at most ``max(max_nuggets,
    ceil(spans_per_head * heads))`` per passage; ``boundaries`` (``"clause"`` or ``"word"``:
    where spans may start and stop by choice, see :func:`tokenize_passage`)."""

    min_words: int = 3
    max_words: int = 25
    min_head_words: int = 8
    spans_per_head: float = 1.5
    boundaries: str = "clause"

    def __post_init__(self) -> None:
        if not 1 <= self.min_words <= self.max_words:
            raise ValueError(
                f"need 1 <= min_words <= max_words, got {self.min_words}, {self.max_words}"
            )
        if self.min_head_words < 1 or self.spans_per_head < 1.0:
            raise ValueError(
                f"need min_head_words >= 1 and spans_per_head >= 1, got {self.min_head_words}, "
                f"{self.spans_per_head}"
            )
        if self.boundaries not in BOUNDARIES:
            raise ValueError(f"boundaries={self.boundaries!r}: expected one of {BOUNDARIES}")


class LocalConstrainedExtractor(Extractor, name="local"):
    """Verbatim nugget spans chosen by a local causal LM under constrained decoding.

    Options: ``model`` (a reference for ``inference.model.loading.load_model``; None = packaged
    SmolLM2-135M-Instruct; or an already loaded ``LoadedModel``), ``max_nuggets`` and
    ``spans`` (:class:`SpanRules`: at most ``max(max_nuggets, ceil(spans_per_head * heads))``
    spans per passage, ``heads`` its clauses with a place to start), ``device``, ``batch_size``
    (passages decoded together), ``driver`` (``"jump"`` or ``"generate"``; same output). The
    model is loaded on first use.

    One ``CallRecord`` per passage: ``tokens_in`` = prompt tokens, ``tokens_out`` = generated
    tokens (through end-of-turn), cost 0, ``latency_ms`` = the wall time of the call that served
    it divided by the passages in that call.
    """

    stage_answers = True
    prompt_version = LOCAL_PROMPT_VERSION

    def __init__(
        self,
        model: Any = None,
        *,
        max_nuggets: int = 8,
        spans: SpanRules = SpanRules(),
        device: str = "cpu",
        batch_size: int = 4,
        driver: str = "jump",
    ) -> None:
        if max_nuggets < 1 or batch_size < 1:
            raise ValueError(
                f"max_nuggets ({max_nuggets}) and batch_size ({batch_size}) must be >= 1"
            )
        if driver not in _DRIVERS:
            raise ValueError(f"driver={driver!r}: expected one of {sorted(_DRIVERS)}")
        self.model_ref = model
        self.max_nuggets = max_nuggets
        self.span_rules = spans
        self.min_words = spans.min_words
        self.max_words = spans.max_words
        self.min_head_words = spans.min_head_words
        self.spans_per_head = spans.spans_per_head
        self.boundaries = spans.boundaries
        self.device = device
        self.batch_size = batch_size
        self.driver = driver
        self._loaded: Any = None if model is None or isinstance(model, str | os.PathLike) else model
        self._prefix: PromptPrefix | None = None
        self._model_fp: str | None = None

    @classmethod
    def from_settings(
        cls, settings: BuildSettings, state_dir: str | None = None
    ) -> LocalConstrainedExtractor:
        """``model``, ``local_max_nuggets``, ``device``."""
        return cls(
            model=settings.model, max_nuggets=settings.local_max_nuggets, device=settings.device
        )

    @property
    def loaded(self) -> Any:
        """The ``LoadedModel`` (loaded on first access)."""
        if self._loaded is None:
            from coinrag.inference.model.loading import load_shared_model

            # Shared with the KV stage of the same build: one copy of the weights per process.
            ref = None if self.model_ref is None else str(self.model_ref)
            self._loaded = load_shared_model(ref, self.device)
        return self._loaded

    @property
    def model_fp(self) -> str:
        """The model's fingerprint, computed without loading the weights when not loaded yet.

        Same recipe as ``inference.model.loading.load_model`` (config, weights hash, dtype,
        tokenizer): asking which chunks are already extracted must not cost a model load.
        """
        if self._loaded is not None:
            return self._loaded.model_fp
        if self._model_fp is None:
            from coinrag.inference.model.loading import reference_model_fingerprint

            self._model_fp = reference_model_fingerprint(self.model_ref, self.device)
        return self._model_fp

    @property
    def llm_model(self) -> str:  # type: ignore[override]
        """``<model name>@<model_fp>``, e.g. ``smollm2@model-7c24d0836faf1727``."""
        ref = self.model_ref
        name = "smollm2" if ref is None else getattr(ref, "model_dir", ref)
        return f"{os.path.basename(str(name))}@{self.model_fp}"

    @property
    def fingerprint(self) -> str:
        return fingerprint(
            "extractor",
            {
                "backend": self.backend,
                "model_fp": self.model_fp,
                "prompt_version": LOCAL_PROMPT_VERSION,
                "min_words": self.min_words,
                "max_words": self.max_words,
                "max_nuggets": self.max_nuggets,
                "min_head_words": self.min_head_words,
                "spans_per_head": self.spans_per_head,
                "boundaries": self.boundaries,
                "decoding": DECODING,
            },
        )

    def _special(self) -> SpecialIds:
        tok = self.loaded.tokenizer
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        if eos is None or eos == tok.unk_token_id:
            eos = tok.eos_token_id
        return SpecialIds(_single_token(tok, "-"), _single_token(tok, "\n"), int(eos))

    def prompt_ids(self, text: str) -> list[int]:
        """Token ids of the chat prompt for one passage, ending with the assistant header."""
        tok = self.loaded.tokenizer
        prompt = tok.apply_chat_template(
            build_local_messages(text), add_generation_prompt=True, tokenize=False
        )
        return tok(prompt, add_special_tokens=False)["input_ids"]

    def _prompt_prefix(self) -> PromptPrefix:
        """The KV of the prompt part shared by every passage, computed once."""
        if self._prefix is None:
            a, b = self.prompt_ids("x"), self.prompt_ids("Zebra 1927 über")
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
            # one token less: the last shared token could merge with a passage's first characters
            self._prefix = PromptPrefix.compute(self.loaded.model, a[: max(n - 1, 0)])
        return self._prefix

    def budget(self, n_heads: int) -> int:
        """Spans a passage with ``n_heads`` clause heads may get: ``max_nuggets`` at least, and
        room for every head plus ``spans_per_head - 1`` spans of the model's choice per head.

        >>> ex = LocalConstrainedExtractor(max_nuggets=8)
        >>> ex.budget(3), ex.budget(20)
        (8, 30)
        """
        return max(self.max_nuggets, math.ceil(self.spans_per_head * n_heads - 1e-9))

    def machine(self, text: str) -> SpanCopyMachine:
        """A fresh constraint for one passage."""
        pt = tokenize_passage(text, self.loaded.tokenizer, self.min_words, self.boundaries)
        return SpanCopyMachine(
            pt,
            self._special(),
            self.budget(len(pt.heads)),
            self.min_words,
            self.max_words,
            self.min_head_words,
        )

    def spans(self, texts: Sequence[str]) -> list[list[str]]:
        """Candidates for each text (no ledger): verbatim substrings in document order."""
        reqs = [ExtractionRequest(str(i), t) for i, t in enumerate(texts)]
        return [r.candidates for r in self.extract(reqs)]

    def _run(self, texts: list[str]) -> tuple[list[SpanCopyMachine], list[int], float]:
        from coinrag.inference.rope import reset_rotary

        machines = [self.machine(t) for t in texts]
        prompts = [self.prompt_ids(t) for t in texts]
        t0 = time.perf_counter()
        tok, model = self.loaded.tokenizer, self.loaded.model
        reset_rotary(model)  # the model is shared with the KV stage: no grown dynamic-NTK state
        pad = tok.pad_token_id if tok.pad_token_id is not None else machines[0].special.eos
        if self.driver == "jump":
            prefix = self._prompt_prefix()
            decode_constrained(model, prompts, machines, GreedyChoice(), pad, prefix=prefix)
        else:
            decode_with_generate(model, prompts, machines, pad, machines[0].special.eos)
        return machines, [len(p) for p in prompts], time.perf_counter() - t0

    def extract(
        self, requests: Sequence[ExtractionRequest], on_result: ResultFn | None = None
    ) -> list[ExtractionResult]:
        """One result per request, in order. Passages are batched by similar length.

        A model that cannot be loaded raises (a setting to fix, not a bad chunk); a failure while
        decoding a batch is retried passage by passage and then recorded as ``failed``.
        """
        if requests:
            self.loaded  # noqa: B018 - load (or fail) once, before any chunk is attempted
        results: dict[int, ExtractionResult] = {}
        report = ResultReporter(on_result)
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].text))
        for b in range(0, len(order), self.batch_size):
            idx = order[b : b + self.batch_size]
            started = datetime.now(UTC)
            try:
                machines, n_in, wall = self._run([requests[i].text for i in idx])
            except Exception as exc:  # noqa: BLE001 - retry one by one, then record the failure
                if len(idx) > 1:
                    log.warning("local extraction batch failed (%s); retrying one by one", exc)
                    for i in idx:
                        results[i] = self._one(requests[i])
                else:
                    results[idx[0]] = self._failed(requests[idx[0]], started, exc)
            else:
                for i, m, p_len in zip(idx, machines, n_in, strict=True):
                    req = requests[i]
                    results[i] = ExtractionResult(
                        req.key,
                        "ok",
                        [req.text[s:e] for s, e in m.char_spans()],
                        calls=[self._record(req, started, p_len, m.n_generated, wall / len(idx))],
                    )
            for i in idx:
                report(results[i])
        return [results[i] for i in range(len(requests))]

    def _one(self, req: ExtractionRequest) -> ExtractionResult:
        started = datetime.now(UTC)
        try:
            (m,), (p_len,), wall = self._run([req.text])
        except Exception as exc:  # noqa: BLE001
            return self._failed(req, started, exc)
        cands = [req.text[s:e] for s, e in m.char_spans()]
        rec = self._record(req, started, p_len, m.n_generated, wall)
        return ExtractionResult(req.key, "ok", cands, calls=[rec])

    def _record(
        self, req: ExtractionRequest, started: datetime, n_in: int, n_out: int, wall_s: float
    ) -> CallRecord:
        return CallRecord(
            call_id=f"call-{uuid.uuid4().hex[:16]}",
            key=req.key,
            attempt=1,
            status="ok",
            tokens_in=n_in,
            tokens_out=n_out,
            cost_usd=0.0,
            latency_ms=wall_s * 1000.0,
            started_at=started,
        )

    def _failed(
        self, req: ExtractionRequest, started: datetime, exc: Exception
    ) -> ExtractionResult:
        error = f"{type(exc).__name__}: {exc}"
        rec = CallRecord(
            call_id=f"call-{uuid.uuid4().hex[:16]}",
            key=req.key,
            attempt=1,
            status="error",
            tokens_in=0,
            tokens_out=0,
            cost_usd=0.0,
            latency_ms=(datetime.now(UTC) - started).total_seconds() * 1000.0,
            started_at=started,
            error=error,
        )
        return ExtractionResult(req.key, "failed", error=error, calls=[rec])
