"""Prices of the OpenAI models the extractors call, in USD per 1M tokens, and the cost of a call.

Two price lists per model: the list price of the chat completions endpoint and the Batch API
price (half of it). A dated snapshot is priced like its alias where the prices are the same.

A model that is not in :data:`PRICES` costs **0.0**: that is the case of an OpenAI-compatible
local server (vLLM, llama.cpp, Ollama...) serving its own model names, which is free. Check
:func:`is_priced` if a zero cost would hide a missing price.

>>> round(call_cost("gpt-4o-mini", 1_000_000, 1_000_000, batch=False), 6)
0.75
>>> round(call_cost("gpt-4o-mini", 1_000_000, 1_000_000, batch=True), 6)
0.375
>>> call_cost("my-local-model", 1000, 1000, batch=False)
0.0
"""

from __future__ import annotations

from dataclasses import dataclass

_PER = 1_000_000  # prices are per 1M tokens


@dataclass(frozen=True)
class ModelPrice:
    """USD per 1M tokens: list (chat completions) and Batch API prices."""

    input: float
    output: float
    batch_input: float
    batch_output: float


_GPT_4O_MINI = ModelPrice(input=0.15, output=0.60, batch_input=0.075, batch_output=0.30)
_GPT_4O = ModelPrice(input=2.50, output=10.00, batch_input=1.25, batch_output=5.00)

PRICES: dict[str, ModelPrice] = {
    "gpt-4o-mini": _GPT_4O_MINI,
    "gpt-4o-mini-2024-07-18": _GPT_4O_MINI,
    "gpt-4o": _GPT_4O,
    "gpt-4o-2024-08-06": _GPT_4O,
    "gpt-4o-2024-11-20": _GPT_4O,
}


def price_of(model: str) -> ModelPrice | None:
    """The price of ``model``, or ``None`` when it is not in :data:`PRICES`."""
    return PRICES.get(model)


def is_priced(model: str) -> bool:
    """Whether ``model`` has a price; an unknown model is costed at 0.0."""
    return model in PRICES


def call_cost(model: str, tokens_in: int, tokens_out: int, batch: bool = False) -> float:
    """Cost in USD of one call: ``tokens_in`` prompt and ``tokens_out`` completion tokens.

    ``batch`` selects the Batch API prices. Unknown models (e.g. an OpenAI-compatible local
    server) cost 0.0.
    """
    price = PRICES.get(model)
    if price is None:
        return 0.0
    if batch:
        return (tokens_in * price.batch_input + tokens_out * price.batch_output) / _PER
    return (tokens_in * price.input + tokens_out * price.output) / _PER
