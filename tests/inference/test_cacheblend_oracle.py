"""CacheBlend (``inference/context/blend.py``) against transformers' own computation.

Three chunks encoded as the store encodes them (each after the prompt prefix), blended with a
query. The two ends of the recompute ratio are exact computations:

- ratio 1: every context token recomputed at every layer = standard RAG (one forward over
  ``prefix ⊕ chunks ⊕ query``);
- ratio 0, check layer 1: only layer 0 recomputed (fresh layer-0 K/V equal the re-rotated
  stored ones) = TurboRAG (the stored KV as it is, query prefilled after it).

Tolerance: max |Δ next-token logit| <= LOGIT_ATOL_FP32 = 2e-4, the bound of
``tests/inference/test_assembly_oracle.py`` (the same arithmetic in another order: a per-layer loop
over a
scattered cache vs one causal forward). Measured: 1.0-1.6e-7 on the tiny models (sdpa and
eager), 2.3e-5 on SmolLM2 (|logits| up to ~30). Each test also checks that TurboRAG and
standard RAG differ by far more (>= 1e-2), so the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from kv_oracle import cached_logits, greedy_after, max_abs, standard_logits, turbo_context
from store_fixtures import TINY_ARCHITECTURES, random_ids, tiny_model

from coinrag.inference.context.blend import (
    KeyDeviation,
    UnsupportedBlend,
    ValueDeviation,
    blend,
    check_blendable,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGIT_ATOL_FP32 = 2e-4
DEVIATIONS = {"k": KeyDeviation(), "v": ValueDeviation()}


class Case:
    """A model, a prompt prefix, three chunks and a query, with both references computed."""

    def __init__(self, model, vocab: int, lengths=(30, 25, 20), prefix_len=7, query_len=6):
        self.model = model
        self.prefix = random_ids(prefix_len, 1, vocab)
        self.chunks = [random_ids(n, 2 + i, vocab) for i, n in enumerate(lengths)]
        self.query = random_ids(query_len, 9, vocab)
        self.context_ids = [t for c in self.chunks for t in c]
        self.full = self.prefix + self.context_ids + self.query
        self.context = turbo_context(model, self.prefix, self.chunks, len(self.query))
        self.standard = standard_logits(model, self.full)
        self.turbo = cached_logits(model, self.context, self.query)
        assert max_abs(self.turbo, self.standard) >= 1e-2  # the references differ

    def blend(self, ratio: float, deviation: str = "k", **kwargs):
        return blend(
            self.model,
            self.context,
            self.context_ids,
            self.query,
            ratio=ratio,
            deviation=DEVIATIONS[deviation],
            **kwargs,
        )


@pytest.fixture(
    scope="module",
    params=[(a, i) for a in TINY_ARCHITECTURES for i in ("sdpa", "eager")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def tiny_case(request) -> Case:
    arch, attn = request.param
    # 4 layers: layers after the check layer must exist for the selection to matter
    return Case(tiny_model(arch, num_hidden_layers=4, attn_implementation=attn), 500)


@pytest.mark.parametrize("deviation", ["k", "v"])
def test_ratio_one_equals_standard_rag(tiny_case: Case, deviation: str) -> None:
    out = tiny_case.blend(1.0, deviation)
    assert max_abs(out.first_logits, tiny_case.standard) <= LOGIT_ATOL_FP32
    assert out.recomputed.tolist() == list(range(len(tiny_case.context_ids)))


@pytest.mark.parametrize("deviation", ["k", "v"])
def test_ratio_zero_equals_turborag(tiny_case: Case, deviation: str) -> None:
    out = tiny_case.blend(0.0, deviation)
    assert max_abs(out.first_logits, tiny_case.turbo) <= LOGIT_ATOL_FP32
    assert out.recomputed.numel() == 0


def test_decoding_after_a_full_blend_equals_decoding_the_standard_prompt(tiny_case: Case) -> None:
    """The cache a blend leaves is a valid cache of the whole prompt: greedy decoding from it
    equals greedy decoding after one forward over the standard prompt."""
    model = tiny_case.model
    out = tiny_case.blend(1.0)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([tiny_case.full]), use_cache=True)
    n = len(tiny_case.full)
    assert out.next_position == n
    got = greedy_after(model, out.cache, out.first_logits, n, 10)
    want = greedy_after(model, ref.past_key_values, ref.logits[0, -1], n, 10)
    assert got == want


def test_selection_count_and_the_exact_first_chunk(tiny_case: Case) -> None:
    """``int(n * ratio)`` context tokens are recomputed; the first chunk (encoded right after
    the prefix, where it sits) has exact stored KV, so it never deviates: its deviation is
    rounding (seen <= 1.1e-12) against >= 1e-2 for the later chunks."""
    n = len(tiny_case.context_ids)
    first = len(tiny_case.chunks[0])
    for deviation in ("k", "v"):
        out = tiny_case.blend(0.15, deviation)
        assert out.recomputed.numel() == int(n * 0.15)
        assert out.recomputed.min() >= first
        assert float(out.deviation[:first].max()) <= 1e-6 * float(out.deviation[first:].median())


def test_smollm2_ends_of_the_ratio() -> None:
    """The same two oracles on SmolLM2-135M (30 layers, |logits| up to ~30)."""
    from coinrag.inference.model.loading import load_shared_model

    loaded = load_shared_model(None)
    case = Case(loaded.model, 49152, lengths=(24, 20, 16), prefix_len=8, query_len=6)
    assert max_abs(case.blend(1.0, "k").first_logits, case.standard) <= LOGIT_ATOL_FP32
    assert max_abs(case.blend(0.0, "v").first_logits, case.turbo) <= LOGIT_ATOL_FP32


def test_refusals() -> None:
    config = tiny_model("qwen2", num_hidden_layers=4).config
    check_blendable(config, 0.15, 1)
    with pytest.raises(UnsupportedBlend, match="ratio"):
        check_blendable(config, 1.5, 1)
    with pytest.raises(UnsupportedBlend, match="check layer"):
        check_blendable(config, 0.15, 0)
    with pytest.raises(UnsupportedBlend, match="check layer"):
        check_blendable(config, 0.15, 4)
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(UnsupportedBlend, match="4D mask"):
        check_blendable(config, 0.15, 1)
    sliding = tiny_model(
        "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0
    ).config
    with pytest.raises(UnsupportedBlend, match="sliding"):
        check_blendable(sliding, 0.15, 1)
