"""Query prefill and greedy decoding after a precomputed context cache, with timings.

``prefill_and_decode`` is the one place where the model continues from a context: every method
(standard, turborag, coinrag, cartridge) ends here, so their answers and timings compare.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coinrag.inference.rope import reset_rotary


@dataclass
class Generation:
    """Answer tokens and where the time went (milliseconds)."""

    token_ids: list[int]
    text: str
    prefill_ms: float  # query prefill up to the first token's logits (TTFT minus lookup work)
    decode_ms: float  # the remaining tokens
    first_logits: torch.Tensor | None = field(default=None, repr=False)  # (vocab,) float32


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(x) for x in source)
    return ids


@torch.inference_mode()
def prefill_and_decode(
    model: Any,
    tokenizer: Any,
    cache: Any | None,
    context_len: int,
    input_ids: Sequence[int],
    *,
    max_new_tokens: int = 32,
    keep_first_logits: bool = False,
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    """Prefill ``input_ids`` at positions ``context_len..`` after ``cache``; decode greedily.

    The prefill starts from a fresh rotary state (``inference.rope.reset_rotary``), so it is
    the forward a freshly loaded model computes, whatever this model object ran before; the
    decode steps then continue as transformers' own ``generate`` does.

    Args:
        cache: a transformers cache holding ``context_len`` tokens (mutated), or None. For
            dynamic / longrope RoPE its keys must carry the frequencies of a forward of length
            ``context_len + len(input_ids)`` (``assemble_context(new_seq_len=...)``).
        input_ids: the tokens to prefill (the query part; for standard RAG, everything).
        max_new_tokens: upper bound on generated tokens; stops early at an EOS token.
        on_token: called with each answer token id as soon as it is chosen (streaming; the
            EOS token is not an answer token). Its time counts in ``decode_ms``.
    """
    device = next(model.parameters()).device
    ids = torch.tensor([list(input_ids)], device=device)
    positions = torch.arange(context_len, context_len + ids.shape[1], device=device)[None]
    reset_rotary(model)  # a new sequence: no frequencies grown by an earlier query (dynamic NTK)
    t0 = time.perf_counter()
    out = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
    logits = out.logits[0, -1].float()
    next_id = int(torch.argmax(logits))
    t1 = time.perf_counter()
    first = logits.clone() if keep_first_logits else None
    eos = _eos_ids(model, tokenizer)
    generated: list[int] = []
    cache = out.past_key_values
    pos = context_len + ids.shape[1]
    while True:
        if next_id in eos:
            break
        generated.append(next_id)
        if on_token is not None:
            on_token(next_id)
        if len(generated) >= max_new_tokens:
            break
        step = model(
            input_ids=torch.tensor([[next_id]], device=device),
            position_ids=torch.tensor([[pos]], device=device),
            past_key_values=cache,
            use_cache=True,
        )
        cache = step.past_key_values
        pos += 1
        next_id = int(torch.argmax(step.logits[0, -1]))
    t2 = time.perf_counter()
    return Generation(
        token_ids=generated,
        text=tokenizer.decode(generated, skip_special_tokens=True).strip(),
        prefill_ms=(t1 - t0) * 1000,
        decode_ms=(t2 - t1) * 1000,
        first_logits=first,
    )
