"""The reference computations the KV-reuse oracle tests compare with (transformers' own model).

Chunks are encoded as the KV stage stores them (``tasks/kv.py``): one forward over ``prefix +
chunk``, keeping the chunk's part, so chunk token ``t`` sits at position ``|p| + t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from coinrag.inference.context.assemble import KvSlice, assemble_context
from coinrag.inference.model.encode import from_cache, to_dynamic_cache
from coinrag.inference.rope import RopeSpec


@torch.inference_mode()
def prefix_kv(model: Any, prefix: list[int]) -> torch.Tensor:
    """``C_p``: ``(layers, 2, H, |p|, D)``."""
    return from_cache(model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values)


@torch.inference_mode()
def chunk_kv(model: Any, prefix: list[int], chunk: list[int]) -> torch.Tensor:
    """A chunk's KV as the store holds it: ``(layers, 2, H, len(chunk), D)`` at ``|p|..``."""
    out = model(input_ids=torch.tensor([prefix + chunk]), use_cache=True)
    return from_cache(out.past_key_values)[..., len(prefix) :, :]


def turbo_context(
    model: Any, prefix: list[int], chunks: Sequence[list[int]], n_query: int = 0
) -> torch.Tensor:
    """TurboRAG's context: ``C_p`` and each stored chunk re-rotated to contiguous positions."""
    p = len(prefix)
    slices = [KvSlice(chunk_kv(model, prefix, c), p, p + len(c)) for c in chunks]
    total = p + sum(len(c) for c in chunks)
    spec = RopeSpec.from_config(model.config)
    return assemble_context(prefix_kv(model, prefix), slices, spec, new_seq_len=total + n_query)


@torch.inference_mode()
def standard_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """Next-token logits ``(vocab,)`` float32 of one forward over ``tokens``."""
    return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


@torch.inference_mode()
def cached_logits(model: Any, context: torch.Tensor, query: list[int]) -> torch.Tensor:
    """Next-token logits ``(vocab,)`` float32 of ``query`` prefilled after ``context``."""
    t = context.shape[-2]
    out = model(
        input_ids=torch.tensor([query]),
        position_ids=torch.arange(t, t + len(query))[None],
        past_key_values=to_dynamic_cache(context, model.config),
        use_cache=True,
    )
    return out.logits[0, -1].float()


@torch.inference_mode()
def greedy_after(model: Any, cache: Any, first_logits: torch.Tensor, position: int, n: int):
    """``n`` greedy tokens continuing ``cache`` (the next one at ``position``) from
    ``first_logits``, no EOS stop."""
    tokens, nxt = [], int(first_logits.argmax())
    for step in range(n):
        tokens.append(nxt)
        out = model(
            input_ids=torch.tensor([[nxt]]),
            position_ids=torch.tensor([[position + step]]),
            past_key_values=cache,
            use_cache=True,
        )
        nxt = int(out.logits[0, -1].argmax())
    return tokens


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())
