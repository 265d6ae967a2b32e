"""Batched constrained decoding: one driver for every caller that lets a causal LM choose only
among the tokens a state machine allows (the local nugget extractor,
``tasks/extractors/local.py``; the local question generator,
``tasks/question_generators/local.py``).

A *constraint* is one row's state machine (:class:`Constraint`): ``forced()`` is the one token
that must come next, or None when the model chooses among ``allowed()`` (token ids, or a bool
mask ``(vocab,)``); ``advance(token)`` takes the token; ``done`` once it accepts nothing more
(a done constraint's ``forced()`` is its end token, and ``advance`` ignores what it gets);
``max_new_tokens()`` bounds the tokens it takes. A *choice* picks a row's token from its logits
``(vocab,)`` when nothing is forced: :class:`GreedyChoice` (argmax among the allowed tokens) or
:class:`SampledChoice` (temperature, top-k, repetition penalty, a per-row seeded generator).

:func:`decode_constrained` runs B prompts at once over one KV cache. The prompts are prefilled
left-padded as ``(B, max P)`` with the padding masked out and positions counting real tokens
only, so every row computes what it would compute alone; with a :class:`PromptPrefix` that every
prompt starts with, its cache is copied to the batch and only the rest is prefilled (the padding
then sits between the prefix and the rest). Two feedings:

- ``jump_forward=True`` (the extractor): after a row's choice, every token its constraint then
  forces is taken at once and the rows' runs are fed together as ``(B, k)``, each left-padded
  to the longest; the model runs only where there is a choice, and a row whose constraint is done
  leaves the batch (``cache.batch_select_indices``).
- ``jump_forward=False`` (the question generator, whose cached questions were sampled this way):
  one token per row per step, every row until all are done (a done row is fed its end token),
  as ``model.generate`` feeds a batch.

:func:`decode_with_generate` makes the same greedy choices through ``model.generate`` with the
constraints as a ``LogitsProcessor``, one forward pass per token: the reference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Constraint(Protocol):
    """One row's decoding constraint (module docstring)."""

    @property
    def done(self) -> bool: ...

    def forced(self) -> int | None: ...

    def allowed(self) -> list[int] | torch.Tensor: ...

    def advance(self, token: int) -> None: ...

    def max_new_tokens(self) -> int: ...


def left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(B, max P)`` and attention mask ``(B, max P)`` (1 = real) of left-padded
    prompts. E.g. ``[[5, 6], [7]]``, pad 0 -> ids ``[[5, 6], [0, 7]]``, mask ``[[1, 1], [0, 1]]``.
    """
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


def _bool_mask(allowed: list[int] | torch.Tensor, vocab: int) -> torch.Tensor:
    if isinstance(allowed, torch.Tensor):
        return allowed
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[allowed] = True
    return mask


class GreedyChoice:
    """The allowed token with the highest logit (the first one on a tie)."""

    def choose(self, row: int, logits: torch.Tensor, machine: Constraint) -> int:
        allowed = machine.allowed()
        if isinstance(allowed, torch.Tensor):
            masked = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
            return int(masked.argmax())
        if len(allowed) == 1:
            return allowed[0]
        return allowed[int(logits[allowed].argmax())]


@dataclass
class SampledChoice:
    """Sampling among the allowed tokens: logits of tokens the row already generated are
    divided by ``repetition_penalty`` (multiplied when negative), the machine's
    ``logit_bonus(bonus)`` (``(vocab,)`` or None) is added, then softmax over the ``top_k`` best
    at ``temperature``, drawn with ``generators[row]`` (one per row: a row's tokens do not depend
    on the batch). Needs machines with ``generated`` (token ids so far) and ``logit_bonus``."""

    temperature: float
    top_k: int
    generators: Sequence[torch.Generator]
    repetition_penalty: float = 1.0
    bonus: float = 0.0

    def choose(self, row: int, logits: torch.Tensor, machine: Any) -> int:
        scores = logits.cpu()
        if self.repetition_penalty != 1.0 and machine.generated:
            seen = torch.tensor(sorted(set(machine.generated)))
            vals = scores[seen]
            scores = scores.clone()
            scores[seen] = torch.where(
                vals > 0, vals / self.repetition_penalty, vals * self.repetition_penalty
            )
        bonus = machine.logit_bonus(self.bonus)
        if bonus is not None:
            scores = scores + bonus
        allowed = _bool_mask(machine.allowed(), scores.shape[-1])
        scores = scores.masked_fill(~allowed, float("-inf")) / max(self.temperature, 1e-6)
        top = torch.topk(scores, min(self.top_k, int(torch.isfinite(scores).sum())))
        probs = torch.softmax(top.values, -1)
        return int(top.indices[torch.multinomial(probs, 1, generator=self.generators[row])])


@dataclass
class PromptPrefix:
    """The KV cache of the token ids every prompt starts with (system turn, ``"Passage:"``).

    ``cache`` holds ``ids`` for batch 1 (per layer ``(1, kv_heads, len(ids), head_dim)``);
    :func:`decode_constrained` copies it to the batch size instead of recomputing it.
    """

    ids: list[int]
    cache: Any = field(repr=False)

    @classmethod
    def compute(cls, model: Any, ids: list[int]) -> PromptPrefix:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids], device=model.device), past_key_values=cache)
        return cls(list(ids), cache)


def _last_logits(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
) -> torch.Tensor:
    """Float logits ``(B, vocab)`` of the last position after feeding ``ids`` ``(B, k)``."""
    device = model.device
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


def decode_constrained(
    model: Any,
    prompts: Sequence[Sequence[int]],
    machines: Sequence[Constraint],
    choice: GreedyChoice | SampledChoice,
    pad: int,
    *,
    prefix: PromptPrefix | None = None,
    jump_forward: bool = True,
    on_advance: Callable[[int], None] | None = None,
) -> None:
    """Decode ``prompts`` (B token-id lists) under ``machines`` (one per prompt; they hold the
    result), choosing with ``choice``; ``on_advance(i)`` after machine ``i`` took a token.

    Shapes: prefill ``(B, max P - len(prefix))``; each step feeds ``(B', k)`` (``B'`` rows still
    decoding, ``k`` = 1 without jump-forward, else the longest run of a chosen token and the
    tokens forced after it). Stops when every machine is done (at the latest after
    ``max(m.max_new_tokens())`` steps).
    """
    from transformers import DynamicCache

    b = len(prompts)
    if prefix is not None and all(list(p[: len(prefix.ids)]) == prefix.ids for p in prompts):
        start = len(prefix.ids)
        cache = copy.deepcopy(prefix.cache)
        cache.batch_repeat_interleave(b)
    else:
        start, cache = 0, DynamicCache(config=model.config)
    ids, mask = left_pad([p[start:] for p in prompts], pad)
    positions = start + (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P - start)
    if start:
        mask = torch.cat([torch.ones((b, start), dtype=torch.long), mask], dim=-1)
    n_real = mask.sum(-1)  # (B,) real tokens per row so far
    active = list(range(b))  # machine index of each cache row
    limit = max(m.max_new_tokens() for m in machines)
    with torch.inference_mode():
        logits = _last_logits(model, ids, mask, positions, cache)  # (B, vocab)
        for _ in range(limit):
            runs: list[list[int]] = []
            for row, i in enumerate(active):
                m = machines[i]
                token = m.forced()
                if token is None:
                    token = choice.choose(i, logits[row], m)
                run = [token]
                m.advance(token)
                if on_advance is not None:
                    on_advance(i)
                while jump_forward and not m.done and (token := m.forced()) is not None:
                    m.advance(token)
                    run.append(token)
                    if on_advance is not None:
                        on_advance(i)
                runs.append(run)
            if all(machines[i].done for i in active):
                return
            keep = [row for row, i in enumerate(active) if not machines[i].done]
            if jump_forward and len(keep) < len(active):
                sel = torch.tensor(keep, dtype=torch.long)
                cache.batch_select_indices(sel.to(model.device))
                mask, n_real = mask[sel], n_real[sel]
                active = [active[r] for r in keep]
                runs = [runs[r] for r in keep]
            step_ids, step_mask = left_pad(runs, pad)  # (B', k)
            step_pos = n_real[:, None] + (step_mask.cumsum(-1) - 1).clamp(min=0)  # (B', k)
            mask = torch.cat([mask, step_mask], dim=-1)  # (B', past + k)
            n_real = n_real + step_mask.sum(-1)
            logits = _last_logits(model, step_ids, mask, step_pos, cache)


def _constraint_processor(machines: Sequence[Constraint], prompt_len: int) -> Any:
    """A ``LogitsProcessor`` for ``generate`` that masks each row's scores to its machine's tokens.

    ``input_ids``: ``(B, P + t)`` (left-padded prompts and the ``t`` tokens generated so far);
    ``scores``: ``(B, vocab)``. The tokens appended since the previous call go to the machines.
    """
    from transformers import LogitsProcessor

    class ConstraintProcessor(LogitsProcessor):
        def __init__(self) -> None:
            self.seen = prompt_len

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            cur = input_ids.shape[1]
            for p in range(self.seen, cur):
                for row, m in enumerate(machines):
                    m.advance(int(input_ids[row, p]))
            self.seen = cur
            keep = torch.zeros_like(scores, dtype=torch.bool)
            for row, m in enumerate(machines):
                forced = m.forced()
                keep[row, [forced] if forced is not None else m.allowed()] = True
            return scores.masked_fill(~keep, float("-inf"))

    return ConstraintProcessor()


def decode_with_generate(
    model: Any, prompts: Sequence[Sequence[int]], machines: Sequence[Constraint], pad: int, eos: int
) -> None:
    """Greedy constrained decoding of B prompts in one ``model.generate`` call: the reference.

    ``prompts`` are fed left-padded as ``(B, max P)`` with a ``(B, max P)`` mask; the constraint
    is a ``LogitsProcessor``; ``eos`` ends a row. One forward pass per generated token.
    """
    from transformers import GenerationConfig, LogitsProcessorList

    ids, mask = left_pad(prompts, pad)
    config = GenerationConfig(
        max_new_tokens=max(m.max_new_tokens() for m in machines),
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    proc = _constraint_processor(machines, ids.shape[1])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            generation_config=config,
            logits_processor=LogitsProcessorList([proc]),
        )
    # feed the last sampled token (generate does not call the processor after it)
    for p in range(proc.seen, out.shape[1]):
        for row, m in enumerate(machines):
            m.advance(int(out[row, p]))
