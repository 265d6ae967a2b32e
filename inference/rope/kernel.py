"""Compiled re-rotation of keys on the CPU (numba, one thread, no GIL held).

:func:`~coinrag.inference.rope.rotate.rerotate_keys` rotates a coinrag context's keys (30
layers, 3 heads, ~170 slice tokens, head dim 64 for SmolLM2: a million bfloat16 values) with
tensor operations: widen to float32, two products and two fused multiply-adds, round back,
copy into place: about five passes over the values, 1.8 ms on one core with the caches warm
and 2.8-3.5 ms in ``coinrag eval`` (``tests/benchmarks/RESULTS.md``, "Stop 44"). The kernel
here does it in one pass per key vector: each pair ``(x1, x2) = (k[i], k[i + r/2])`` of the
rotary dims becomes ``(fma(x2, -sin, x1 cos), fma(x1, sin, x2 cos))`` in float32, the dims past
``rotary_dim`` are copied, and a bfloat16 result is rounded to nearest even, once.

Precision: torch's CPU kernels compute the same expression with a fused multiply-add where
they vectorize and a separate multiply and add in their scalar loops, so the two differ by at
most one float32 rounding of the sum before the result is rounded to the keys' dtype: at most
one unit in the last place of a bfloat16 key, mostly none (held by
``tests/inference/test_rope_kernel.py``); both equal the model's own keys at the new positions
within the bounds of ``tests/inference/test_rope_oracle.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from coinrag.storage.jit import bf16_bits, bits_of_float, compiled, float_of_bits, fma32


@compiled(inline=True)
def _widened(raw: Any, bf16: bool) -> Any:
    """A stored key value as float32 (bfloat16: its uint16 bits shifted up)."""
    if bf16:
        return float_of_bits(np.uint32(raw) << np.uint32(16))
    return np.float32(raw)


@compiled(inline=True)
def _narrowed(value: Any, bf16: bool) -> Any:
    """A float32 as stored: bfloat16 bits rounded to nearest even as torch rounds (no NaN case:
    a rotated finite key is finite), or float32 itself."""
    if bf16:
        return bf16_bits(bits_of_float(value))
    return value


@compiled()
def _rotate_rows(
    src: np.ndarray, dst: np.ndarray, cos: np.ndarray, sin: np.ndarray, bf16: bool
) -> None:
    """Each key vector ``src[a, b, t]`` rotated by token ``t``'s angles into ``dst[a, b, t]``
    (``src`` and ``dst`` ``(A, B, T, D)``, any strides, may be the same array; bfloat16 as its
    uint16 bits where ``bf16``, else float32; ``cos``, ``sin`` ``(T, R / 2)`` float32)."""
    outer, inner, tokens, dim = src.shape
    half = cos.shape[1]
    for a in range(outer):
        for b in range(inner):
            for t in range(tokens):
                for i in range(half):
                    c = cos[t, i]
                    s = sin[t, i]
                    x1 = _widened(src[a, b, t, i], bf16)
                    x2 = _widened(src[a, b, t, half + i], bf16)
                    dst[a, b, t, i] = _narrowed(fma32(x2, -s, x1 * c), bf16)
                    dst[a, b, t, half + i] = _narrowed(fma32(x1, s, x2 * c), bf16)
                for d in range(2 * half, dim):  # past the rotary dims: as they are
                    dst[a, b, t, d] = src[a, b, t, d]


def _as_rows(keys: torch.Tensor) -> np.ndarray | None:
    """``keys`` ``(..., T, D)`` as a 4-d numpy view ``(A, B, T, D)`` (bfloat16 as uint16 bits),
    or None where no view has that shape (leading dims that cannot be merged)."""
    if keys.dim() == 3:
        keys = keys.unsqueeze(0)
    elif keys.dim() > 4:
        merged = keys.view(-1, *keys.shape[-3:]) if _mergeable(keys) else None
        if merged is None:
            return None
        keys = merged
    if keys.dtype == torch.bfloat16:
        return keys.view(torch.int16).numpy().view(np.uint16)
    return keys.numpy()


def _mergeable(keys: torch.Tensor) -> bool:
    """Whether the dims before the last three merge into one without a copy."""
    lead = keys.dim() - 3
    return all(keys.stride(i) == keys.stride(i + 1) * keys.shape[i + 1] for i in range(lead - 1))


def applies(keys: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether :func:`rotate_compiled` takes ``keys`` (and ``out``): on the CPU, bfloat16 or
    float32, no gradient to keep, 3 or more dims, ``out`` (if given) of the same shape and
    dtype. Others keep the tensor path."""
    if keys.device.type != "cpu" or keys.dtype not in (torch.bfloat16, torch.float32):
        return False
    if keys.requires_grad and torch.is_grad_enabled():
        return False
    if keys.dim() < 3 or keys.numel() == 0 or (keys.dim() > 4 and not _mergeable(keys)):
        return False
    if out is None:
        return True
    if out.dim() > 4 and not _mergeable(out):
        return False
    return out.shape == keys.shape and out.dtype == keys.dtype and out.device.type == "cpu"


def rotate_compiled(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``keys`` ``(..., T, D)`` rotated by per-token angles, ``cos`` and ``sin`` ``(T, R / 2)``
    float32 (``R``: the rotary dims, the first of each head), into ``out`` (``keys`` itself
    too) or a new tensor; where :func:`applies`. Same values as ``rotate._rotate`` up to one
    float32 rounding of each rotated value (module docstring)."""
    target = torch.empty_like(keys) if out is None else out
    src, dst = _as_rows(keys), _as_rows(target)
    if src is None or dst is None:
        raise ValueError(f"keys of shape {tuple(keys.shape)} and strides {keys.stride()}")
    tokens = keys.shape[-2]
    if cos.shape != sin.shape or not 0 < 2 * cos.shape[-1] <= keys.shape[-1]:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} for keys {keys.shape}")
    c = np.ascontiguousarray(cos.detach().to("cpu", torch.float32).expand(tokens, -1).numpy())
    s = np.ascontiguousarray(sin.detach().to("cpu", torch.float32).expand(tokens, -1).numpy())
    _rotate_rows(src, dst, c, s, keys.dtype == torch.bfloat16)
    return target
