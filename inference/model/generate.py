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

from coinrag.inference.model.forward import ForwardRun, forward_for
from coinrag.inference.rope import reset_rotary
from coinrag.schemas.settings import DEFAULT_QUERY


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
    max_new_tokens: int = DEFAULT_QUERY.max_new_tokens,
    keep_first_logits: bool = False,
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    """Prefill ``input_ids`` at positions ``context_len..`` after ``cache``; decode greedily.

    The model runs with its forward (``inference.model.forward.forward_for``: a preallocated KV
    buffer the model's layers write into, compiled where ``use_forward`` set it; only the last
    query position's logits are computed). The prefill starts from a fresh rotary state
    (``inference.rope.reset_rotary``), so it is the forward a freshly loaded model computes,
    whatever this model object ran before; the decode steps then continue as transformers' own
    ``generate`` does.

    Args:
        cache: the context: a KV tensor ``(layers, 2, kv_heads, context_len, head_dim)`` (as
            assembled: copied once into the forward's buffer), a transformers cache holding
            ``context_len`` tokens (may be mutated), or None. For dynamic / longrope RoPE its
            keys must carry the frequencies of a forward of length ``context_len +
            len(input_ids)`` (``assemble_context(new_seq_len=...)``).
        input_ids: the tokens to prefill (the query part; for standard RAG, everything).
        max_new_tokens: upper bound on generated tokens; stops early at an EOS token.
        on_token: called with each answer token id as soon as it is chosen (streaming; the
            EOS token is not an answer token). Its time counts in ``decode_ms``.
    """
    reset_rotary(model)  # a new sequence: no frequencies grown by an earlier query (dynamic NTK)
    t0 = time.perf_counter()
    run = forward_for(model).begin(cache, context_len, len(input_ids), max_new_tokens)
    logits = run.prefill(input_ids)
    if logits.is_cuda:  # the logits exist when the kernels have run (TTFT on a GPU)
        torch.cuda.synchronize(logits.device)
    prefill_ms = (time.perf_counter() - t0) * 1000
    return _decode(
        run,
        model,
        tokenizer,
        logits,
        prefill_ms=prefill_ms,
        max_new_tokens=max_new_tokens,
        keep_first_logits=keep_first_logits,
        on_token=on_token,
    )


@dataclass(frozen=True, eq=False)
class Prefilled:
    """What a prefill done outside :func:`prefill_and_decode` left for decoding (CacheBlend and
    KVLink prefill their own way)."""

    cache: Any  # a transformers cache or a KV tensor, ready for position ``next_position``
    first_logits: torch.Tensor  # (vocab,) logits of the prefill's last position
    next_position: int  # position of the first answer token
    prefill_ms: float  # what the prefill took (recorded as is)


@torch.inference_mode()
def decode_greedy(
    model: Any,
    tokenizer: Any,
    prefilled: Prefilled,
    *,
    max_new_tokens: int = DEFAULT_QUERY.max_new_tokens,
    keep_first_logits: bool = False,
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    """Greedy decoding after a prefill of the caller's own (``prefilled``): it continues as
    :func:`prefill_and_decode` does, with the model's forward; options as there."""
    t1 = time.perf_counter()
    run = forward_for(model).begin(prefilled.cache, prefilled.next_position, 0, max_new_tokens)
    gen = _decode(
        run,
        model,
        tokenizer,
        prefilled.first_logits,
        prefill_ms=prefilled.prefill_ms,
        max_new_tokens=max_new_tokens,
        keep_first_logits=keep_first_logits,
        on_token=on_token,
    )
    gen.decode_ms = (time.perf_counter() - t1) * 1000  # the context's copy into the buffer too
    return gen


def _decode(
    run: ForwardRun,
    model: Any,
    tokenizer: Any,
    first_logits: torch.Tensor,
    *,
    prefill_ms: float,
    max_new_tokens: int,
    keep_first_logits: bool,
    on_token: Callable[[int], None] | None,
) -> Generation:
    """Greedy tokens from ``first_logits`` on, each step through ``run``."""
    t1 = time.perf_counter()
    next_id = int(torch.argmax(first_logits))
    first = first_logits.clone() if keep_first_logits else None
    eos = _eos_ids(model, tokenizer)
    generated: list[int] = []
    while True:
        if next_id in eos:
            break
        generated.append(next_id)
        if on_token is not None:
            on_token(next_id)
        if len(generated) >= max_new_tokens:
            break
        next_id = int(torch.argmax(run.step(next_id)))
    t2 = time.perf_counter()
    return Generation(
        token_ids=generated,
        text=tokenizer.decode(generated, skip_special_tokens=True).strip(),
        prefill_ms=prefill_ms,
        decode_ms=(t2 - t1) * 1000,
        first_logits=first,
    )
