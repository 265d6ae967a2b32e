"""Cartridges (CAS): one trainable KV prefix per document, trained by context distillation.

A cartridge ``Z`` is a tensor ``(layers, 2, kv_heads, p, head_dim)`` (the KV layout of
``storage/kv/layout.py``) held as an ``nn.Parameter``; the model is frozen and only ``Z`` gets
gradients. This module is the math: where a cartridge stands, how it is initialised, the student's
forward, the loss, and the mixed-visibility sampler. The training loop with the budget manager is
``training/budget.py``; serving is ``inference/methods/cartridge.py``.

Where a cartridge stands (positions)
------------------------------------
The student sees the project's RAG prompt (``inference/model/prompt.py``) with cartridges in the
context slot, and the teacher sees the same prompt with the document's tokens there::

    student:  C_p ⊕ Rot(Z_1; |p|) ⊕ Rot(Z_2; |p| + p_1) ⊕ ...  ⊕ query ⊕ answer
    teacher:  prefix_ids ⊕ doc_ids                              ⊕ query ⊕ answer

``C_p`` is the model's own KV of the prompt prefix (system message, start of the user turn,
``"Context:\\n"``), frozen; ``query`` is ``RagPrompt.query_ids(question)`` (question, end of the
user turn, assistant header). A cartridge is **stored with its keys at the canonical positions
0..p-1** and placed by ``inference.context.assemble.assemble_context`` (``KvSlice(Z,
old_start=0)``), which re-rotates the keys to contiguous positions after ``C_p``: exact RoPE
rotations (``inference/rope/__init__.py``), differentiable, so the parameter itself is position-free
and any cartridge can stand anywhere. Isolated training always places the own cartridge at ``|p|``;
mixed visibility places it at a random slot among distractors. Serving uses the same function, so
the structure trained on is the structure served. RoPE variants whose frequencies depend on the
sequence length (dynamic NTK, LongRoPE) are refused: a canonical position has no forward length.

Initialisation
--------------
``first_tokens``: the KV of the document's first ``p`` tokens encoded right after the prefix
(``inference.model.encode.document_kv``), rotated back to ``0..p-1``. With ``p`` = the document's
length the student's context *is* the teacher's, so student == teacher before training (the
plumbing oracle of ``tests/training/test_cartridges.py``). ``random_text``: the same for ``p``
random
non-special token ids. The first cartridge token is frozen (``freeze_first``: its gradient is
masked to zero), as the Cartridges paper freezes the attention-sink token. In this layout the
sequence's real sink is ``C_p``'s first token, which is frozen anyway; freezing ``Z[..., 0, :]``
keeps a stable document-initial token at the start of every cartridge.

Loss: top-k + rest bucket
-------------------------
The teacher's top-k (k = 20) log-probabilities per answer position are stored
(``TeacherAnswerRow``). The loss is the exact KL divergence between the teacher's and the
student's distributions **coarsened to k + 1 buckets**: the teacher's k ids, and "everything else"
with mass ``1 - Σ_top-k``. Nothing is renormalised, the student is pushed to put the teacher's
leftover mass outside the top-k as well, and the loss is 0 exactly when the student matches the
teacher on these buckets (>= 0 always)::

    KL = Σ_{i in top-k} t_i (log t_i - log s_i) + t_rest (log t_rest - log s_rest)

computed in float64 from float32 log-softmaxes, averaged over answer positions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from coinrag.inference.context.assemble import (
    KvSlice,
    assemble_cartridges,
    assemble_context,
    check_rope,
)
from coinrag.inference.model.encode import document_kv, to_dynamic_cache
from coinrag.inference.model.prompt import RagPrompt
from coinrag.inference.rope import ModelRope
from coinrag.schemas.keys import fingerprint
from coinrag.schemas.settings import CartridgeSettings, CartridgeTrainSettings, check_visibility
from coinrag.storage.cartridges import CartridgeMeta

INITS = ("first_tokens", "random_text")


# ---------------------------------------------------------------------------- identity


@dataclass(frozen=True)
class CartridgeSpec:
    """How a document's cartridge is made: its size and initialisation.

    ``p`` fixes the number of tokens; otherwise ``ratio`` is a compression ratio of the
    document's length: ``p = ceil(n_doc / ratio)`` (at least ``min_p``). ``p`` never exceeds
    the document's length with ``first_tokens`` (a longer cartridge would have no tokens to start
    from). E.g. ``CartridgeSpec(ratio=4).tokens_for(130) == 33``.
    """

    p: int | None = None
    ratio: float | None = 4.0
    init: str = "first_tokens"
    freeze_first: bool = True
    min_p: int = 2

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.p is None and (self.ratio is None or self.ratio < 1):
            raise ValueError(f"give p (tokens) or a compression ratio >= 1, got ratio={self.ratio}")
        if self.p is not None and self.p < 1:
            raise ValueError(f"p must be >= 1, got {self.p}")

    @classmethod
    def from_settings(cls, settings: CartridgeSettings) -> CartridgeSpec:
        s = settings
        return cls(p=s.p, ratio=s.ratio, init=s.init, freeze_first=s.freeze_first)

    def tokens_for(self, n_doc_tokens: int) -> int:
        if self.p is not None:
            p = self.p
        else:
            assert self.ratio is not None
            p = max(self.min_p, math.ceil(n_doc_tokens / self.ratio))
        if self.init == "first_tokens":
            p = min(p, n_doc_tokens)
        return max(1, p)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cartridge_fingerprint(
    model_fp: str, prefix_sha: str, teacher_fp: str, spec: CartridgeSpec, training: dict[str, Any]
) -> str:
    """Everything a cartridge's value depends on except its document: the model, the prompt it
    stands in, the teacher it was distilled from, its size/init, and the training settings
    (isolated and mixed-visibility cartridges of one document are different assets)."""
    return fingerprint(
        "cartridge",
        {
            "model_fp": model_fp,
            "prefix_sha": prefix_sha,
            "teacher_fp": teacher_fp,
            "spec": spec.to_dict(),
            "training": training,
            "positions": "canonical-0",
        },
    )


# ---------------------------------------------------------------------------- KV helpers


def to_canonical(kv: torch.Tensor, start: int, rope: ModelRope) -> torch.Tensor:
    """Move a block's keys from positions ``start..start+n-1`` to ``0..n-1`` (values as is)."""
    n = int(kv.shape[-2])
    # An empty prefix: the slice lands at 0..n-1.
    return assemble_context(kv[..., :0, :], [KvSlice(kv, start, start + n)], rope)


def random_text_ids(tokenizer: Any, n: int, generator: torch.Generator) -> list[int]:
    """``n`` token ids drawn uniformly from the non-special vocabulary."""
    vocab = len(tokenizer)
    special = set(int(i) for i in tokenizer.all_special_ids)
    out: list[int] = []
    while len(out) < n:
        for t in torch.randint(0, vocab, (n,), generator=generator).tolist():
            if t not in special and len(out) < n:
                out.append(int(t))
    return out


def init_cartridge(
    model: Any,
    prompt: RagPrompt,
    rope: ModelRope,
    doc_ids: Sequence[int],
    p: int,
    init: str = "first_tokens",
    *,
    seed: int = 0,
) -> torch.Tensor:
    """A new cartridge ``(layers, 2, kv_heads, p, head_dim)`` at canonical positions, on CPU,
    in the model's dtype. ``first_tokens``: KV of ``doc_ids[:p]`` after the prefix;
    ``random_text``: KV of ``p`` random token ids (seeded by ``seed``)."""
    check_rope(rope)
    if init == "first_tokens":
        if p > len(doc_ids):
            raise ValueError(f"p={p} exceeds the document's {len(doc_ids)} tokens")
        ids = list(doc_ids[:p])
    elif init == "random_text":
        ids = random_text_ids(prompt.tokenizer, p, torch.Generator().manual_seed(seed))
    else:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    kv = document_kv(model, prompt, ids)
    return to_canonical(kv, prompt.n_prefix, rope).detach().to("cpu").contiguous()


class Cartridge(torch.nn.Module):
    """A trainable cartridge: ``kv`` ``(layers, 2, kv_heads, p, head_dim)``, canonical positions.

    With ``freeze_first`` the gradient of token 0 (every layer, K and V) is masked to zero by a
    hook, so no optimizer ever moves it.
    """

    def __init__(self, meta: CartridgeMeta, kv: torch.Tensor, freeze_first: bool = True) -> None:
        super().__init__()
        self.meta = meta
        self.freeze_first = freeze_first
        self.kv = torch.nn.Parameter(kv.detach().clone())
        if freeze_first:
            self.kv.register_hook(_mask_first_token)

    @property
    def cartridge_id(self) -> str:
        return self.meta.cartridge_id

    @property
    def p(self) -> int:
        return int(self.kv.shape[-2])


def _mask_first_token(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[..., 0, :] = 0
    return grad


# ---------------------------------------------------------------------------- student and loss


def student_logprobs(
    model: Any, context: torch.Tensor, query_ids: Sequence[int], answer_ids: Sequence[int]
) -> torch.Tensor:
    """Log-softmax ``(n_answer, vocab)`` (float32) of the student predicting each answer token.

    ``context``: ``(L, 2, H, T, D)`` (prefix + cartridges), given to the model as a
    ``DynamicCache`` built from it (so gradients reach the cartridges); the model reads
    ``query_ids + answer_ids[:-1]`` at positions ``T..`` and row ``j`` of the result predicts
    ``answer_ids[j]``.
    """
    n = len(answer_ids)
    if n == 0:
        raise ValueError("empty answer")
    device = next(model.parameters()).device
    ids = list(query_ids) + list(answer_ids[:-1])
    t0 = int(context.shape[-2])
    cache = to_dynamic_cache(context, model.config)
    out = model(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.arange(t0, t0 + len(ids), device=device)[None],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=n,
    )
    return out.logits[0, -n:].float().log_softmax(-1)


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(a))`` for ``a <= 0``, stable (a clamped to <= -1e-9: an empty rest)."""
    a = a.clamp(max=-1e-9)
    return torch.where(a > -math.log(2), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def topk_kl(
    student_logp: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor
) -> torch.Tensor:
    """Per-position KL(teacher || student) over the teacher's top-k ids plus a rest bucket.

    ``student_logp``: ``(n, vocab)`` log-softmax; ``topk_ids`` ``(n, k)`` int64;
    ``topk_logprobs`` ``(n, k)`` the teacher's log-softmax at those ids. Returns ``(n,)``
    float64, >= 0 (up to rounding), 0 when the student's buckets equal the teacher's.
    """
    s = student_logp.gather(-1, topk_ids.to(student_logp.device)).double()
    t = topk_logprobs.to(s.device).double()
    s_rest = _log1mexp(torch.logsumexp(s, dim=-1))
    t_rest = _log1mexp(torch.logsumexp(t, dim=-1))
    head = (t.exp() * (t - s)).sum(-1)
    return head + t_rest.exp() * (t_rest - s_rest)


@dataclass(frozen=True, eq=False)
class Example:
    """One distillation example: the question (as query ids) and the teacher's answer."""

    example_id: str  # the teacher answer's id
    cartridge_id: str  # the cartridge of the document the teacher saw
    query_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    topk_ids: torch.Tensor = field(repr=False)  # (n_answer, k) int64
    topk_logprobs: torch.Tensor = field(repr=False)  # (n_answer, k) float32


def example_loss(
    model: Any,
    prefix: torch.Tensor,
    rope: ModelRope,
    visible: Sequence[torch.Tensor],
    example: Example,
) -> torch.Tensor:
    """Mean per-position bucket KL of one example with ``visible`` cartridges (in order)."""
    context = assemble_cartridges(prefix, visible, rope)
    logp = student_logprobs(model, context, example.query_ids, example.answer_ids)
    return topk_kl(logp, example.topk_ids, example.topk_logprobs).mean()


# ---------------------------------------------------------------------------- mixed visibility


@dataclass(frozen=True)
class Visibility:
    """Which cartridges an example sees (CAS eq. 1).

    With probability ``p_iso`` only its own; otherwise its own plus ``k ~ U{k_min..k_max}``
    distractors drawn without replacement from the pool (fewer if the pool is smaller), in a
    random order. ``p_iso = 1`` is isolated training. One ``rng.random()`` is always drawn first,
    so the stream of decisions does not depend on the pool.
    """

    p_iso: float = 1.0
    k_min: int = 1
    k_max: int = 3

    def __post_init__(self) -> None:
        check_visibility(self.p_iso, self.k_min, self.k_max)

    @classmethod
    def from_settings(cls, settings: CartridgeTrainSettings) -> Visibility:
        return cls(settings.p_iso, settings.k_min, settings.k_max)

    def sample(self, own: str, pool: Sequence[str], rng: random.Random) -> list[str]:
        """Cartridge ids in context order; ``own`` is among them exactly once."""
        others = sorted(c for c in set(pool) if c != own)
        if rng.random() < self.p_iso or not others:
            return [own]
        k = rng.randint(self.k_min, self.k_max)
        chosen = [own, *rng.sample(others, min(k, len(others)))]
        rng.shuffle(chosen)
        return chosen

    def to_dict(self) -> dict[str, Any]:
        return {"p_iso": self.p_iso, "k_min": self.k_min, "k_max": self.k_max}


# ---------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_kl(
    model: Any,
    prefix: torch.Tensor,
    rope: ModelRope,
    cartridges: dict[str, torch.Tensor],
    examples: Sequence[Example],
    order: Sequence[str] | None = None,
) -> float:
    """Mean per-position bucket KL over ``examples``.

    ``order`` None: each example sees only its own cartridge (oracle). Otherwise every example
    sees the cartridges ``order`` (ids, in that order; its own must be among them).
    """
    total, count = 0.0, 0
    for ex in examples:
        ids = [ex.cartridge_id] if order is None else list(order)
        context = assemble_cartridges(prefix, [cartridges[c] for c in ids], rope)
        logp = student_logprobs(model, context, ex.query_ids, ex.answer_ids)
        kl = topk_kl(logp, ex.topk_ids, ex.topk_logprobs)
        total += float(kl.sum())
        count += kl.numel()
    return total / max(count, 1)
