"""Asymmetric uniform quantization, the arithmetic of the quantized KV codecs
(``storage/kv/codecs.py``, ``lowbit.py``, ``mixed.py``): float32 groups to codes and float16
scales, and back; float16 rounded down or up so that a stored scale never narrows a range."""

from __future__ import annotations

import torch

_F16_INF = torch.tensor(float("inf"), dtype=torch.float16)
# one-byte scales (``lowbit.py``): |z| <= 127 of int8 (z >= -128), the minimum's grid
LO_LEVELS = 127
STEP_LEVELS = 255  # c <= 255 of uint8: the step's grid


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` -> the largest float16 <= x (ValueError where none is finite)."""
    y = x.to(torch.float16)
    above = y.to(torch.float32) > x
    y = torch.where(above, torch.nextafter(y, -_F16_INF), y)
    if not torch.isfinite(y).all():
        raise ValueError(
            "KV values outside the float16 range (|x| > 65504): the int8/int4 KV codecs store "
            "their scales in float16; build this model with kv_codec = none"
        )
    return y


def fp16_up(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` >= 0 -> the smallest float16 >= x."""
    y = x.to(torch.float16)
    below = y.to(torch.float32) < x
    y = torch.where(below, torch.nextafter(y, _F16_INF), y)
    if not torch.isfinite(y).all():
        raise ValueError(
            "KV value ranges beyond float16 (> 65504): the int8/int4 KV codecs store their "
            "scales in float16; build this model with kv_codec = none"
        )
    return y


def quantize(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric uniform quantization of float32 ``x`` over ``dim``: ``(codes, lo, step)``
    with ``codes`` uint8 in ``0..levels`` and float16 ``lo`` (the group's minimum rounded down)
    and ``step`` (``(max - lo) / levels`` rounded up), so ``codes * step + lo`` is within
    ``step / 2`` of ``x``.

    E.g. ``[0.0, 0.5, 1.0]`` at 2 bits (levels 3): lo 0, step 0.33350 (1/3 rounded up to
    float16), codes ``[0, 1, 3]``: 0.5 / 0.3335 = 1.4993 rounds to 1, so 0.5 decodes to 0.3335,
    within step / 2 of it; 1.0 decodes to 1.0005.
    """
    lo = _fp16_down(x.amin(dim=dim, keepdim=True))
    lo32 = lo.to(torch.float32)
    step = fp16_up((x.amax(dim=dim, keepdim=True) - lo32) / levels)
    step32 = step.to(torch.float32)
    safe = torch.where(step32 > 0, step32, torch.ones_like(step32))
    codes = torch.round((x - lo32) / safe).clamp_(0, levels).to(torch.uint8)
    return codes, lo, step


def dequantize(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """float32 ``codes * step + lo`` (broadcast; float32 ``codes`` are overwritten)."""
    return codes.to(torch.float32).mul_(step.to(torch.float32)).add_(lo.to(torch.float32))
