"""The fast paths of assembly give the values of the plain ones bit for bit (RoPE acts on each
token alone): slices written straight into the result (``inference.context.assemble.
_placed_into_one``) against a rotation per slice and a concatenation, and the rotation one
layer at a time (``inference.rope.rotate._rotate_tiled``) against the whole tensor at once."""

from __future__ import annotations

import pytest
import torch
from store_fixtures import TINY_ARCHITECTURES, TINY_DIMS, tiny_config

from coinrag.inference.context.assemble import KvSlice, _rotated, place_slices, rotate_placed_keys
from coinrag.inference.rope import RopeSpec
from coinrag.inference.rope.rotate import _rotate, _rotate_tiled


def _kv(config, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = config.num_key_value_heads
    return torch.randn(config.num_hidden_layers, 2, heads, n, dim, generator=g).to(dtype)


@pytest.mark.parametrize("name", TINY_ARCHITECTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_written_into_the_result_equal_a_rotation_per_slice(name, dtype):
    config = tiny_config(name)
    spec = RopeSpec.from_config(config)
    prefix = _kv(config, 5, dtype, 0)
    slices = [
        KvSlice(_kv(config, 3, dtype, 1), old_start=12, old_seq_len=40),  # moved
        KvSlice(_kv(config, 4, dtype, 2), old_start=8, old_seq_len=40),  # stays (see starts)
        KvSlice(_kv(config, 2, dtype, 3), old_start=30, old_seq_len=40, at_zero=True),
        KvSlice(_kv(config, 6, dtype, 4), old_start=5, old_seq_len=40),  # moved back
    ]
    starts = [5, 8, 12, 20]  # a gap after the third slice (KVLink's link tokens)
    got = place_slices(prefix, slices, starts, spec)
    parts = [prefix]
    for s, start in zip(slices, starts, strict=True):
        moved = s.old_start != start or s.at_zero
        parts.append(_rotated(s, start, spec, 26) if moved else s.kv)
    want = torch.cat(parts, dim=-2)
    assert got.dtype == dtype and torch.equal(got, want)
    unmoved = [KvSlice(s.kv, start, 40) for s, start in zip(slices, starts, strict=True)]
    assert torch.equal(
        place_slices(prefix, unmoved, starts, spec),
        torch.cat([prefix, *[s.kv for s in unmoved]], dim=-2),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotation_layer_by_layer_equals_the_whole_at_once(dtype):
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(6, 3, 700, 64, generator=g).to(dtype)  # above the tile: the loop runs
    angles = torch.rand(700, 32, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    assert keys.numel() > 1 << 18
    assert torch.equal(_rotate_tiled(keys, cos, sin, 64), _rotate(keys, cos, sin, 64))
    c, s = cos[:, :24], sin[:, :24]  # a partial rotary dim: the tail kept as it is in both
    assert torch.equal(_rotate_tiled(keys, c, s, 48), _rotate(keys, c, s, 48))


@pytest.mark.parametrize("name", TINY_ARCHITECTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_rotated_in_place_at_once_equal_a_rotation_per_slice(name, dtype):
    """``rotate_placed_keys``: the slices written after ``C_p`` as stored, then every key moved
    in one rotation with per-token positions = ``place_slices`` (a rotation per slice)."""
    config = tiny_config(name)
    spec = RopeSpec.from_config(config)
    prefix = _kv(config, 5, dtype, 0)
    slices = [
        KvSlice(_kv(config, 3, dtype, 1), old_start=12, old_seq_len=40),
        KvSlice(_kv(config, 4, dtype, 2), old_start=8, old_seq_len=40),  # stays
        KvSlice(_kv(config, 2, dtype, 3), old_start=30, old_seq_len=40, at_zero=True),
        KvSlice(_kv(config, 6, dtype, 4), old_start=5, old_seq_len=40),
    ]
    starts = [5, 8, 12, 20]
    ctx = torch.cat([prefix, *[s.kv for s in slices]], dim=-2)
    old = torch.cat(
        [
            torch.zeros(s.tokens, dtype=torch.long)
            if s.at_zero
            else torch.arange(s.old_start, s.old_start + s.tokens)
            for s in slices
        ]
    )
    new = torch.cat([torch.arange(a, a + s.tokens) for s, a in zip(slices, starts, strict=True)])
    rotate_placed_keys(ctx, 5, old, new, spec)
    assert torch.equal(ctx, place_slices(prefix, slices, starts, spec))
    unmoved = ctx.clone()
    rotate_placed_keys(unmoved, 5, new, new, spec)  # nowhere to move: untouched
    assert torch.equal(unmoved, ctx)


def test_the_rotation_takes_several_small_layers_a_pass():
    """Small layers (10 nugget slices: 31,872 values a layer) go 8 layers a pass, the last
    pass shorter: the same bits as the whole tensor at once."""
    g = torch.Generator().manual_seed(6)
    keys = torch.randn(30, 3, 166, 64, generator=g).to(torch.bfloat16)
    angles = torch.rand(166, 32, generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    assert keys.numel() > 1 << 18 and (1 << 18) // keys[0].numel() == 8
    assert torch.equal(_rotate_tiled(keys, cos, sin, 64), _rotate(keys, cos, sin, 64))


@pytest.mark.parametrize("per_layer", [False, True], ids=["one-rope", "gemma3-per-layer"])
def test_keys_rotated_into_a_given_tensor_equal_a_new_one(per_layer):
    """``rotate_layers(..., out=)``: the result written into ``out``, or into the keys
    themselves (in place, as assembly does), is the new tensor's, bit for bit; one RoPE for
    all layers and Gemma 3's per-layer RoPE."""
    from transformers import Gemma3TextConfig

    from coinrag.inference.rope import LayerRopes, model_rope

    if per_layer:
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        }
        config = Gemma3TextConfig(
            **{**TINY_DIMS, "num_hidden_layers": 3},
            head_dim=16,
            vocab_size=128,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=rope,
        )
    else:
        config = tiny_config("qwen2")
    spec = model_rope(config)
    assert isinstance(spec, LayerRopes) == per_layer
    keys = _kv(config, 300, torch.bfloat16, 7)[:, 0]  # (layers, heads, 300, dim)
    old = torch.randint(0, 500, (300,))
    new = torch.arange(40, 340)
    want = spec.rotate_layers(keys, old, new)
    into = torch.empty_like(keys)
    assert spec.rotate_layers(keys, old, new, out=into) is into and torch.equal(into, want)
    in_place = keys.clone()
    spec.rotate_layers(in_place, old, new, out=in_place)
    assert torch.equal(in_place, want)
