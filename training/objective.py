"""What one fine-tuning example costs (:class:`Objective`) and which parameters train (LoRA).

The nugget objective's loss is the cross-entropy of the short answer (plus EOS) given
``(C_ctx, q)``: the input is ``query_ids(question) + answer_ids + [eos]`` prefilled at positions
after ``C_ctx``, the labels are the answer tokens only. ``training/kvlink.py`` has KVLink's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from coinrag.inference.context.builders import ContextBuilder
from coinrag.inference.model.encode import causal_lm, to_dynamic_cache
from coinrag.inference.retrieval.retriever import Evidence, Retriever
from coinrag.inference.rope import reset_rotary
from coinrag.schemas.settings import FinetuneSettings

if TYPE_CHECKING:
    from coinrag.training.data import Plan

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def answer_loss_sum(
    model: Any, ctx: torch.Tensor, total: int, query_ids: list[int], answer_ids: list[int]
) -> torch.Tensor:
    """Sum over the answer tokens of ``-log p(answer | C_ctx, query)`` (a scalar, nats);
    ``ctx`` is the context KV of ``total`` tokens, the query starts at position ``total``."""
    lm = causal_lm(model)
    dev = ctx.device
    ids = torch.tensor([query_ids + answer_ids], dtype=torch.long, device=dev)
    positions = torch.arange(total, total + ids.shape[1], device=dev)[None]
    cache = to_dynamic_cache(ctx, lm.config)
    reset_rotary(model)
    out = model(
        input_ids=ids,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=len(answer_ids) + 1,
    )
    return answer_cross_entropy(out.logits[0].float(), answer_ids)


def answer_cross_entropy(logits: torch.Tensor, answer_ids: list[int]) -> torch.Tensor:
    """Summed cross-entropy of ``answer_ids`` given ``logits`` ``(len(answer_ids) + 1,
    vocab)``: the last ``len(answer_ids) + 1`` positions, each predicting the next token (in
    the logits' own dtype)."""
    labels = torch.tensor(answer_ids, dtype=torch.long, device=logits.device)
    return torch.nn.functional.cross_entropy(logits[:-1], labels, reduction="sum")


class Objective:
    """What one training example costs: how its evidence is retrieved (:meth:`retrieve`), the
    loss summed over its answer tokens given that evidence (:meth:`loss_sum`), the tokens its
    context adds besides the evidence (:meth:`extra_tokens`) and which modules train
    (:meth:`train_mode`). :class:`NuggetObjective` is nugget fine-tuning;
    ``training/kvlink.py`` has KVLink's link tokens."""

    def retrieve(
        self, retriever: Retriever, question: str, cfg: FinetuneSettings, doc_ids: Any
    ) -> Any:
        """A ``RetrievalResult`` for ``question`` among ``doc_ids``' documents."""
        return retriever.two_stage(question, cfg.kc, cfg.k, doc_ids=doc_ids)

    def loss_sum(
        self, model: Any, builder: ContextBuilder, plan: Plan, evidence: list[Evidence]
    ) -> tuple[torch.Tensor, int]:
        """``(Σ -log p(answer token), context tokens after the prefix)``."""
        ctx, total = builder.build(evidence, len(plan.query_ids))
        loss = answer_loss_sum(model, ctx, total, plan.query_ids, plan.answer_ids)
        return loss, total - builder.prompt.n_prefix

    def extra_tokens(self, cfg: FinetuneSettings) -> int:
        """Context tokens besides the evidence, counted when fitting ``max_length``."""
        return 0

    def train_mode(self, model: Any) -> None:
        model.train()


class NuggetObjective(Objective):
    """CoinRAG's: two-stage nuggets, ``C_ctx`` from the builder, answer cross-entropy."""


def attach_lora(model: Any, cfg: FinetuneSettings) -> Any:
    """``model`` wrapped with LoRA adapters (peft) on the q/k/v/o projections."""
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(LORA_TARGETS),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lcfg)


def trainable_parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every parameter that requires a gradient."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
