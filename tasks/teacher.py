"""The teacher of self-study: the target model answers each question with the document in context.

The target model answers every question with the document in context, in the project's RAG
prompt (``prefix_ids + doc_ids + query_ids(question)``, ``inference/model/prompt.py``): greedy, at
most ``max_new_tokens`` tokens, ending with its EOS token when it stops. Per answer position the
teacher's top-k (k = 20) log-softmax values and ids are kept (``TeacherAnswerRow``), cached by
``(teacher_fp, context_hash, question_id)``. The document's KV is computed once and the questions
of a document are answered in batches (left-padded between the document and the question, with
the padding masked and positions kept contiguous).

Progress: :func:`teacher_stage` reports ``(questions done, questions)`` after every batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import pyarrow.compute as pc
import torch

from coinrag.inference.model.constrained import left_pad
from coinrag.inference.model.encode import full_cache
from coinrag.inference.model.generate import _eos_ids
from coinrag.inference.model.layers import AttentionLayers
from coinrag.inference.model.loading import LoadedModel
from coinrag.inference.model.prompt import RagPrompt
from coinrag.schemas.keys import CODE_VERSION, fingerprint, sha256_hex
from coinrag.schemas.settings import TeacherSettings
from coinrag.schemas.tables import DocumentRow, TeacherAnswerRow
from coinrag.storage.store import Store
from coinrag.storage.tables import append_rows, read_rows
from coinrag.tasks.questions import ProgressCounter, Question


def teacher_fingerprint(model_fp: str, prefix_sha: str, cfg: TeacherSettings) -> str:
    """What a teacher answer depends on besides the document and the question."""
    return fingerprint(
        "teacher", {"model_fp": model_fp, "prefix_sha": prefix_sha, **cfg.value_dict()}
    )


def doc_token_ids(tokenizer: Any, text: str, max_tokens: int) -> list[int]:
    """The document's token ids as the context slot holds them (no special tokens), cut."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens]


def context_hash(doc_ids: Sequence[int]) -> str:
    return "cx-" + sha256_hex("context", ",".join(str(int(t)) for t in doc_ids))[:24]


def answer_id(teacher_fp: str, ctx_hash: str, qid: str) -> str:
    return "ta-" + sha256_hex("teacher-answer", teacher_fp, ctx_hash, qid)[:24]


@dataclass(frozen=True, eq=False)
class TeacherOutput:
    answer_ids: list[int]
    topk_ids: torch.Tensor  # (n, k) int64
    topk_logprobs: torch.Tensor  # (n, k) float32


@torch.no_grad()
def teacher_answers(
    model: Any,
    tokenizer: Any,
    prompt: RagPrompt,
    doc_ids: Sequence[int],
    questions: Sequence[str],
    cfg: TeacherSettings,
    on_batch: Callable[[int], None] | None = None,
) -> list[TeacherOutput]:
    """Greedy answers with top-k log-probs for questions about one document.

    The context ``prefix_ids + doc_ids`` (``T`` tokens) is encoded once; questions go in
    batches: query ids left-padded to ``(B, Q)`` *after* the context, padding masked out, real
    tokens at positions ``T..T+len-1``, so every row computes what a lone forward of
    ``prefix + doc + query`` computes. ``on_batch(n)`` after each batch of ``n`` questions.
    The caches keep every position of every layer (``inference.model.encode.full_cache``); a model
    with sliding-window layers answers one question at a time (no padding: its windows count
    cache slots, which padding would shift).
    """
    device = next(model.parameters()).device
    ctx = list(prompt.prefix_ids) + list(doc_ids)
    out0 = model(
        input_ids=torch.tensor([ctx], device=device), past_key_values=full_cache(), use_cache=True
    )
    decoder = _BatchDecoder(
        model=model,
        device=device,
        context=[(lay.keys, lay.values) for lay in out0.past_key_values.layers],
        t=len(ctx),
        eos=_eos_ids(model, tokenizer),
        cfg=cfg,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(decoder.eos)
    results: list[TeacherOutput] = []
    batch_size = 1 if AttentionLayers.from_config(model.config).sliding else cfg.batch_size
    for s in range(0, len(questions), batch_size):
        qs = [prompt.query_ids(q) for q in questions[s : s + batch_size]]
        results += decoder.answer(qs, pad)
        if on_batch is not None:
            on_batch(len(qs))
    return results


@dataclass(frozen=True, eq=False)
class _BatchDecoder:
    """Greedy decoding of batches of queries after one encoded context of ``t`` tokens whose
    per-layer ``(keys, values)`` (each ``(1, H, t, D)``) are ``context``."""

    model: Any
    device: torch.device
    context: list[tuple[torch.Tensor, torch.Tensor]]
    t: int
    eos: set[int]
    cfg: TeacherSettings

    def answer(self, qs: list[list[int]], pad: int) -> list[TeacherOutput]:
        """Answers to the query ids ``qs`` (one batch of ``B``), left-padded with ``pad``."""
        b = len(qs)
        ids, qmask = left_pad(qs, pad)  # (B, Q): the padding sits between context and query
        mask = torch.cat([torch.ones((b, self.t), dtype=torch.long), qmask], dim=1)  # (B, T + Q)
        pos = self.t + (qmask.cumsum(-1) - 1).clamp(min=0)  # real tokens at T..T+len-1
        out = self._forward(ids, mask, pos, self._batch_cache(b))
        return self._decode(out, mask, pos[:, -1].clone())

    def _batch_cache(self, b: int) -> Any:
        """A cache holding the context once per row of a batch of ``b``."""
        cache = full_cache()
        for i, (k, v) in enumerate(self.context):
            cache.update(
                k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous(), i
            )
        return cache

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> Any:
        return self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device),
            past_key_values=cache,
            use_cache=True,
        )

    def _decode(self, out: Any, mask: torch.Tensor, last: torch.Tensor) -> list[TeacherOutput]:
        """Greedy steps from the prefill's ``out`` until every row ends with EOS or
        ``max_new_tokens``; ``last`` (B,) the position of each row's last token."""
        cfg, eos = self.cfg, self.eos
        b = mask.shape[0]
        answers: list[list[int]] = [[] for _ in range(b)]
        tk_ids: list[list[torch.Tensor]] = [[] for _ in range(b)]
        tk_lp: list[list[torch.Tensor]] = [[] for _ in range(b)]
        done = [False] * b
        for step in range(cfg.max_new_tokens):
            logp = out.logits[:, -1].float().log_softmax(-1).cpu()
            top = torch.topk(logp, cfg.top_k, dim=-1)
            nxt = logp.argmax(-1)
            for r in range(b):
                if done[r]:
                    continue
                tok = int(nxt[r])
                answers[r].append(tok)
                tk_ids[r].append(top.indices[r])
                tk_lp[r].append(top.values[r])
                done[r] = tok in eos
            if all(done) or step == cfg.max_new_tokens - 1:
                break
            feed = torch.tensor([min(eos) if done[r] else int(nxt[r]) for r in range(b)])
            mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], dim=1)
            last = last + 1
            out = self._forward(feed[:, None], mask, last[:, None], out.past_key_values)
        return [
            TeacherOutput(
                answers[r],
                torch.stack(tk_ids[r]).to(torch.int64),
                torch.stack(tk_lp[r]).to(torch.float32),
            )
            for r in range(b)
        ]


@dataclass
class TeacherCounts:
    questions: int = 0
    cached: int = 0
    answered: int = 0
    answer_tokens: int = 0
    ended_eos: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _DocWork:
    """One document's context and its questions still to answer (``(answer_id, question)``)."""

    doc: DocumentRow
    ids: list[int]
    context_hash: str
    todo: list[tuple[str, Question]]


def teacher_stage(
    store: Store,
    loaded: LoadedModel,
    prompt: RagPrompt,
    docs: dict[str, DocumentRow],
    questions: Sequence[Question],
    cfg: TeacherSettings,
    *,
    run_id: str,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[TeacherAnswerRow], TeacherCounts]:
    """Answer (or reuse the answers to) ``questions`` with ``loaded``'s model; return one row
    per question.

    ``docs``: doc_id -> the document version the questions are about (its text is the context).
    Answers are written per document (a killed run loses at most one document's answers).
    ``progress(answered, to answer)`` after every batch of questions (cached ones not counted).
    """
    t0 = time.perf_counter()
    run = _TeacherRun(store, loaded, prompt, cfg, run_id, TeacherCounts(questions=len(questions)))
    work = run.plan(docs, questions)
    on_batch = ProgressCounter(progress, sum(len(w.todo) for w in work))
    for w in work:
        if w.todo:
            run.answer(w, on_batch)
    run.counts.seconds = time.perf_counter() - t0
    return [run.rows[q.question_id] for q in questions], run.counts


@dataclass
class _TeacherRun:
    """One run of the teacher stage: its fingerprint, the rows it has (cached or new) by
    question id, and its counts."""

    store: Store
    loaded: LoadedModel
    prompt: RagPrompt
    cfg: TeacherSettings
    run_id: str
    counts: TeacherCounts
    rows: dict[str, TeacherAnswerRow] = field(default_factory=dict)

    @cached_property
    def tfp(self) -> str:
        """The teacher fingerprint (``teacher_fingerprint``)."""
        return teacher_fingerprint(self.loaded.model_fp, self.prompt.prefix_sha, self.cfg)

    def plan(self, docs: dict[str, DocumentRow], questions: Sequence[Question]) -> list[_DocWork]:
        """Per document (by id), its context and the questions without a stored answer of
        this teacher; the stored answers are taken (and counted as cached)."""
        have = {
            r.answer_id: r
            for r in read_rows(
                self.store, TeacherAnswerRow, filter=pc.field("teacher_fp") == self.tfp
            )
        }
        by_doc: dict[str, list[Question]] = {}
        for q in questions:
            by_doc.setdefault(q.doc_id, []).append(q)
        work = []
        for doc_id in sorted(by_doc):
            doc = docs[doc_id]
            ids = doc_token_ids(self.loaded.tokenizer, doc.text, self.cfg.max_doc_tokens)
            cx = context_hash(ids)
            todo = []
            for q in by_doc[doc_id]:
                aid = answer_id(self.tfp, cx, q.question_id)
                if aid in have:
                    self.rows[q.question_id] = have[aid]
                    self.counts.cached += 1
                else:
                    todo.append((aid, q))
            work.append(_DocWork(doc, ids, cx, todo))
        return work

    def answer(self, w: _DocWork, on_batch: Callable[[int], None]) -> None:
        """Answer one document's questions, count and write them."""
        model, tokenizer = self.loaded.model, self.loaded.tokenizer
        texts = [q.text for _, q in w.todo]
        outs = teacher_answers(model, tokenizer, self.prompt, w.ids, texts, self.cfg, on_batch)
        eos = _eos_ids(model, tokenizer)
        new = []
        for (aid, q), o in zip(w.todo, outs, strict=True):
            row = self._row(w, aid, q, o)
            new.append(row)
            self.rows[q.question_id] = row
            self.counts.answered += 1
            self.counts.answer_tokens += len(o.answer_ids)
            self.counts.ended_eos += bool(o.answer_ids) and o.answer_ids[-1] in eos
        append_rows(self.store, new, self.run_id, "teacher")

    def _row(self, w: _DocWork, aid: str, q: Question, o: TeacherOutput) -> TeacherAnswerRow:
        tokenizer = self.loaded.tokenizer
        return TeacherAnswerRow(
            answer_id=aid,
            question_id=q.question_id,
            doc_id=w.doc.doc_id,
            doc_version=w.doc.doc_version,
            context_hash=w.context_hash,
            teacher_fp=self.tfp,
            model_fp=self.loaded.model_fp,
            answer_ids=list(o.answer_ids),
            answer_text=tokenizer.decode(o.answer_ids, skip_special_tokens=True).strip(),
            top_k=self.cfg.top_k,
            topk_ids=o.topk_ids.reshape(-1).tolist(),
            topk_logprobs=o.topk_logprobs.reshape(-1).tolist(),
            run_id=self.run_id,
            code_version=CODE_VERSION,
        )


def topk_tensors(row: TeacherAnswerRow) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids (n, k) int64, topk_logprobs (n, k) float32)`` of a stored answer."""
    n, k = len(row.answer_ids), row.top_k
    ids = torch.tensor(row.topk_ids, dtype=torch.int64).reshape(n, k)
    lp = torch.tensor(row.topk_logprobs, dtype=torch.float32).reshape(n, k)
    return ids, lp
