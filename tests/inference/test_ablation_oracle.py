"""Oracles for CoinRAG's ablation contexts (``inference/context/builders.py``), against
transformers' own forward on tiny random-weight Qwen2 / Llama-3 / Qwen3 (fp32):

- isolated encoding (``coinrag-isolated``): a nugget's tokens encoded alone after ``C_p`` by
  :func:`encode_after_prefix`, then the query, give the logits of one forward over
  ``prefix + nugget + query``; two nuggets of different lengths in one padded batch give the
  KV each gives alone;
- no alignment (``coinrag-noalign``): :class:`UnalignedContext` keeps each slice's keys as
  stored (bit for bit), and a slice that starts at its chunk's first token gives exactly
  CoinRAG's context.

Tolerance: max |Δ logit| <= 2e-4 (LOGIT_ATOL_FP32 of the other oracles); caches 1e-5 x max.
"""

from __future__ import annotations

import pytest
import torch
from kv_oracle import cached_logits, chunk_kv, max_abs, prefix_kv, standard_logits
from store_fixtures import TINY_ARCHITECTURES, random_ids, tiny_model

from coinrag.inference.context.assemble import KvSlice, assemble_context
from coinrag.inference.context.builders import UnalignedContext, encode_after_prefix
from coinrag.inference.rope import RopeSpec

LOGIT_ATOL_FP32 = 2e-4


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_isolated_nugget_equals_one_forward_over_prefix_nugget_query(arch: str) -> None:
    model = tiny_model(arch)
    prefix, nugget, query = random_ids(7, 1), random_ids(12, 2), random_ids(5, 3)
    c_p = prefix_kv(model, prefix)
    with torch.inference_mode():
        (kv,) = encode_after_prefix(model, c_p, [nugget])
    p = len(prefix)
    spec = RopeSpec.from_config(model.config)
    context = assemble_context(c_p, [KvSlice(kv, p, p + len(nugget))], spec)
    got = cached_logits(model, context, query)
    want = standard_logits(model, prefix + nugget + query)
    assert max_abs(got, want) <= LOGIT_ATOL_FP32
    # the ablation differs from CoinRAG's slice of the same tokens inside their chunk
    chunk = random_ids(20, 4) + nugget
    inside = chunk_kv(model, prefix, chunk)[..., 20:, :]
    assert max_abs(inside, kv) > 1e-3


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_isolated_nuggets_batched_equal_one_by_one(arch: str) -> None:
    model = tiny_model(arch)
    c_p = prefix_kv(model, random_ids(6, 1))
    rows = [random_ids(9, 2), random_ids(4, 3), random_ids(13, 5)]
    with torch.inference_mode():
        batched = encode_after_prefix(model, c_p, rows)
        alone = [encode_after_prefix(model, c_p, [r])[0] for r in rows]
    for b, a, r in zip(batched, alone, rows, strict=True):
        assert b.shape[-2] == len(r)
        assert max_abs(b, a) <= 1e-5 * float(a.abs().max())


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_noalign_keeps_stored_keys_and_equals_coinrag_for_a_slice_at_its_chunk_start(
    arch: str,
) -> None:
    model = tiny_model(arch)
    prefix = random_ids(7, 1)
    p = len(prefix)
    a, b = random_ids(20, 2), random_ids(16, 3)
    kv_a, kv_b = chunk_kv(model, prefix, a), chunk_kv(model, prefix, b)
    spec = RopeSpec.from_config(model.config)
    c_p = prefix_kv(model, prefix)
    first = KvSlice(kv_a[..., 0:6, :], p + 0, p + len(a))  # starts at its chunk's token 0
    later = KvSlice(kv_b[..., 5:11, :], p + 5, p + len(b))  # tokens 5..10 of chunk b
    unaligned = UnalignedContext.__new__(UnalignedContext)
    unaligned.spec = spec
    total = p + 12
    got = unaligned.place(c_p, [first, later], new_seq_len=total + 4)
    assert torch.equal(got[..., :p, :], c_p)
    assert torch.equal(got[..., p : p + 6, :], first.kv)  # position p + 0 either way
    assert torch.equal(got[..., p + 6 :, :], later.kv)  # keys stay at positions p + 5..
    aligned = assemble_context(c_p, [first, later], spec, new_seq_len=total + 4)
    assert torch.equal(aligned[..., : p + 6, :], got[..., : p + 6, :])
    assert max_abs(aligned[:, 0, ..., p + 6 :, :], got[:, 0, ..., p + 6 :, :]) > 1e-3
