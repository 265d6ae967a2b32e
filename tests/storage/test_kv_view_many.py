"""A shard's entries coded together (``QuantizedCodec.view_many``, what ``writes.ShardStager``
calls) give each entry the payload its own ``view`` gives, bit for bit, for every quantized
codec, across batch boundaries and for entries of one block (nugget spans) and of many (whole
chunks); and a shard written that way reads back as its entries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coinrag.storage.kv import KvLayout
from coinrag.storage.kv.codecs import BATCH_TOKENS

CODECS = ["int8", "int4", "int2", "int2mix"]


def _entries(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    """bfloat16 KV ``(L, 2, H, n, D)`` = ``(3, 2, 2, n, 16)`` per length: channels of different
    scales, an offset channel, a few spikes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        x = torch.randn(3, 2, 2, n, 16, generator=g) * torch.rand(1, 1, 1, 1, 16, generator=g) * 3
        x[..., 5] += 4.0
        spikes = torch.rand(x.shape, generator=g) < 0.01
        out.append(torch.where(spikes, x * 20, x).to(torch.bfloat16))
    return out


@pytest.mark.parametrize("codec", CODECS)
def test_view_many_is_each_entrys_view_bit_for_bit(codec: str) -> None:
    layout = KvLayout("m", "p", 3, 2, 16, "bfloat16", kv_codec=codec)
    block = layout.block_tokens
    # nugget-sized entries until past a batch, a whole chunk, then more short ones
    lengths = [17, 24, 3, block, block + 1] * (BATCH_TOKENS // block // 3) + [512, 9, 40, 1]
    kvs = _entries(7, lengths)
    many = layout.codec.view_many(kvs, layout)
    assert len(many) == len(kvs)
    for kv, got in zip(kvs, many, strict=True):
        want = layout.codec.view(kv, layout)
        assert got.dtype == np.uint8 and got.shape == want.shape
        assert np.array_equal(got, want)
    decoded = layout.codec.decode(many[-2], layout)[:, :, :, :40].float()
    assert (decoded - kvs[-2].float()).abs().max() < kvs[-2].float().abs().max()


def test_the_identity_codec_views_each_entry_as_before() -> None:
    layout = KvLayout("m", "p", 3, 2, 16, "bfloat16")
    kvs = _entries(8, [17, 512])
    for kv, got in zip(kvs, layout.codec.view_many(kvs, layout), strict=True):
        assert np.array_equal(got, layout.codec.view(kv, layout))
