"""The compiled key rotation (``inference/rope/kernel.py``) against torch's tensor path
(``rotate._rotate``) and against float64: at most one unit in the last place of the keys'
dtype apart from torch (torch itself rounds the sum once where it vectorizes and twice in its
scalar loops), and as close to the exact rotation as torch is. Every rotation on the CPU without
a gradient goes through it, so the oracle tests (``test_rope_oracle.py``: the model's own keys
at the new positions) hold it too."""

from __future__ import annotations

import pytest
import torch

from coinrag.inference.rope import kernel
from coinrag.inference.rope.rotate import _rotate

HALF_ULPS = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}  # a unit in the last place / 2


def _angles(tokens: int, half: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(tokens, half, generator=g, dtype=torch.float64) * 2000.0
    return theta.cos().float(), theta.sin().float()


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between a and b (same sign assumed
    where both are non-zero)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    ia, ib = a.view(bits).long(), b.view(bits).long()
    same_sign = (a.sign() * b.sign()) >= 0
    return torch.where(same_sign, (ia - ib).abs(), torch.full_like(ia, 1 << 30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary", [64, 48])
def test_the_kernel_is_torchs_rotation_within_one_ulp(dtype, rotary) -> None:
    g = torch.Generator().manual_seed(1)
    ctx = (torch.randn(6, 2, 3, 40, 64, generator=g) * 3).to(dtype)
    keys = ctx[:, 0, :, 7:]  # a context's keys after its prefix: strided
    cos, sin = _angles(33, rotary // 2, 2)
    want = _rotate(keys, cos, sin, rotary)
    got = kernel.rotate_compiled(keys, cos, sin)
    apart = _ulps_apart(got, want)
    assert int(apart.max()) <= 1
    assert float((apart == 0).float().mean()) > 0.5  # mostly the same bits
    assert torch.equal(got[..., rotary:], keys[..., rotary:])  # past rotary_dim: copied
    exact = _rotate(keys.double(), cos.double(), sin.double(), rotary)
    err_kernel = (got.double() - exact).abs()
    err_torch = (want.double() - exact).abs()
    bound = exact.abs() * HALF_ULPS[dtype] * 2 + 1e-30
    assert bool((err_kernel <= torch.maximum(err_torch, bound)).all())


@pytest.mark.parametrize("shape", [(3, 20, 64), (5, 3, 20, 64), (2, 5, 3, 20, 64)])
def test_in_place_into_out_and_any_leading_dims(shape) -> None:
    keys = torch.randn(*shape).to(torch.bfloat16)
    cos, sin = _angles(20, 32, 3)
    fresh = kernel.rotate_compiled(keys, cos, sin)
    into = torch.empty_like(keys)
    assert kernel.rotate_compiled(keys, cos, sin, into) is into
    assert torch.equal(into, fresh)
    moved = keys.clone()
    kernel.rotate_compiled(moved, cos, sin, moved)
    assert torch.equal(moved, fresh)
    one = kernel.rotate_compiled(keys, cos[:1], sin[:1])  # one angle for every token
    assert torch.equal(
        one, kernel.rotate_compiled(keys, *(t[:1].expand(20, -1) for t in (cos, sin)))
    )


def test_what_the_kernel_leaves_to_the_tensor_path() -> None:
    keys = torch.randn(2, 3, 8, 64)
    assert kernel.applies(keys, None)
    assert not kernel.applies(keys.half(), None)
    assert not kernel.applies(keys.requires_grad_(), None)
    with torch.no_grad():
        assert kernel.applies(keys, None)
    assert not kernel.applies(torch.randn(8, 64), None)
    unmergeable = torch.randn(3, 2, 4, 8, 64).transpose(0, 1)
    assert not kernel.applies(unmergeable, None)
    assert not kernel.applies(torch.randn(2, 3, 8, 64), torch.randn(2, 3, 8, 64).bfloat16())
    assert not kernel.applies(torch.randn(2, 2, 3, 8, 64), torch.empty(2, 3, 3, 8, 64)[:, :2])
    assert not kernel.applies(torch.empty(2, 2, 3, 0, 8), None)  # nothing to rotate


def test_a_rotation_through_the_public_api_takes_either_path() -> None:
    """``rerotate_keys`` with an ``out`` the kernel cannot view, and with no tokens: the tensor
    path, as before the kernel."""
    from transformers import LlamaConfig

    from coinrag.inference.rope import RopeSpec, rerotate_keys

    spec = RopeSpec.from_config(LlamaConfig(hidden_size=64, num_attention_heads=4))
    keys = torch.randn(2, 2, 3, 5, 16)
    out = torch.empty(2, 3, 3, 5, 16)[:, :2]
    got = rerotate_keys(keys, [0] * 5, [7, 8, 9, 10, 11], spec, out=out)
    assert got is out
    assert torch.equal(out, rerotate_keys(keys, [0] * 5, [7, 8, 9, 10, 11], spec))
    none = torch.zeros(0, dtype=torch.long)
    empty = rerotate_keys(torch.empty(2, 2, 3, 0, 16), none, none, spec)
    assert empty.shape == (2, 2, 3, 0, 16)
