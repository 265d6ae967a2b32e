"""The ``int2`` KV codec: 2-bit codes with 8-bit scales, ~0.14 of the raw bfloat16 bytes.

:class:`Int2Codec` quantizes as ``int4`` does (``storage/kv/codecs.py``: asymmetric uniform
codes within each stored block, keys per channel over the block's tokens and before RoPE, values
per token over ``head_dim``), with 4 levels, in 64-token blocks, and stores each group's minimum
and step in one byte each instead of two float16s. At 2 bits the float16 scales alone would cost
0.25 of the codes (keys per channel over 64 tokens and values per token over a head of 64 each
add half a bit per value); the bytes are what ``du`` counts against a goal of 0.15 of raw bf16.

Scales are quantized twice (QLoRA's double quantization), per block, layer, head and half (keys,
values), on two float16 units stored beside them:

- ``lo_unit = fp16↑(max |min| / 127)``; a group's minimum is ``lo = z * lo_unit`` with the int8
  ``z = floor(min / lo_unit)``, so ``lo <= min`` and ``min - lo < lo_unit``;
- ``step_unit = fp16↑(max s / 255)`` with ``s = (max - lo) / 3``; its step is ``step = c *
  step_unit`` with the uint8 ``c = ceil(s / step_unit)``, so ``step >= s`` and ``step - s <
  step_unit``.

Each group's range is also tried clipped by 10% and 20% of it at both ends and the candidate
of least squared error kept (GPTQ/AWQ-style clipping: at 4 levels the min-max step wastes most
of the range on a few extremes; measured on SmolLM2's KV of one 512-token FAQ chunk, per-layer
relative error keys 0.202 -> 0.151, values 0.508 -> 0.376 on average; ``int4``: 0.028, 0.101).
The unclipped range is a candidate, so a group's squared error is never above ``n (step / 2)²``
with ``step < (max - min + lo_unit) / 3 + step_unit``: the int2 step of the group, widened by
1/127 of the largest minimum and 1/255 of the largest step among the groups of its head in that
block (the cost of one-byte scales: a group far smaller than the largest of its head and block,
say a value token 1000x smaller, has its minimum on that coarse grid); over a layer
``‖x̂ − x‖² <= Σ (step / 2)²`` (``tests/inference/test_kv_codecs.py`` holds it on real
models). Both products are exact in float32 (8-bit integers times float16), so every
reader dequantizes the same values.

E.g. SmolLM2-135M (30 layers, 3 KV heads, head dim 64) in 64-token blocks: 2 bits of code per
value, plus one byte of ``z`` and one of ``c`` per key channel (over 64 tokens) and per value
token (over 64 dims), plus 8 bytes of units per layer and head: 2.26 bits per value, 0.1411 of
raw bfloat16 (``int4``: 0.3281).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from coinrag.storage.kv.clip_kernel import search_clips
from coinrag.storage.kv.codecs import KvGeometry, QuantizedCodec
from coinrag.storage.kv.quantize import LO_LEVELS, STEP_LEVELS, fp16_up

CLIPS = (0.0, 0.1, 0.2)  # fractions of a group's range tried off each end


def fine_lo(target: torch.Tensor, lo_unit: torch.Tensor) -> torch.Tensor:
    """The largest ``z * lo_unit <= target`` with int8 ``z`` (clamped), as float32 ``z``."""
    safe = torch.where(lo_unit > 0, lo_unit, torch.ones_like(lo_unit))
    z = torch.floor(target / safe)
    return torch.where(z * lo_unit > target, z - 1, z).clamp_(-LO_LEVELS - 1, LO_LEVELS)


def fine_step(s: torch.Tensor, step_unit: torch.Tensor) -> torch.Tensor:
    """The smallest ``c * step_unit >= s`` with uint8 ``c`` (clamped), as float32 ``c``."""
    safe = torch.where(step_unit > 0, step_unit, torch.ones_like(step_unit))
    c = torch.ceil(s / safe)
    return torch.where(c * step_unit < s, c + 1, c).clamp_(0, STEP_LEVELS)


def quantize_fine_scales(
    x: torch.Tensor, dim: int, levels: int, clips: tuple[float, ...] = (0.0,)
) -> tuple[torch.Tensor, ...]:
    """Asymmetric uniform quantization of float32 ``x`` ``(k, L, H, B, D)`` over ``dim`` (3:
    a channel over the block's tokens; 4: a token over ``D``) with 8-bit scales on float16 units
    per ``(k, L, H)`` (module docstring): ``(codes, z, c, lo_unit, step_unit)``, ``codes``
    uint8 in ``0..levels``, ``z`` int8 and ``c`` uint8 shaped as the group minima, the units
    float16 ``(k, L, H, 1, 1)``; ``x̂ = codes * (c * step_unit) + z * lo_unit``.

    ``clips``: each group's range is tried clipped by each fraction ``a`` at both ends
    (``[min + a r, max - a r]``, ``r = max - min``) and the one of least squared error over the
    group kept; ``a = 0`` (the range itself: every value within half a step) is tried first and
    kept on ties, so a group's error is never above that of the unclipped quantization.

    E.g. one group ``[-1.0, 0.0, 2.0]`` at 2 bits (levels 3), no clipping: lo_unit = 1/127
    rounded up (0.007881), z = -127 (lo = -1.00091), step_unit = (2 + 1.00091) / 3 / 255
    rounded up, c = 255 (step = 1.00096): codes ``[0, 1, 3]``.
    """
    group_dims = (3, 4)
    mn, mx = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    lo_unit = fp16_up(mn.abs().amax(dim=group_dims, keepdim=True) / LO_LEVELS)
    lo32 = lo_unit.to(torch.float32)
    s_max = (mx - fine_lo(mn, lo32) * lo32) / levels  # the unclipped steps: the widest
    step_unit = fp16_up(s_max.amax(dim=group_dims, keepdim=True) / STEP_LEVELS)
    step32 = step_unit.to(torch.float32)
    codes, z, c = search_clips(x, dim, (mn, mx), (lo32, step32), torch.tensor(float(levels)), clips)
    return codes.to(torch.uint8), z.to(torch.int8), c.to(torch.uint8), lo_unit, step_unit


class Int2Codec(QuantizedCodec, name="int2"):
    """2-bit codes (4 levels), four per byte, with 8-bit scales on float16 units per block,
    layer, head and half; 64-token blocks: ~0.14 of the raw bfloat16 bytes.

    A block's payload (``B = block_tokens``), in this order:

    ============  ==================  =============================================
    section       shape               contents
    ============  ==================  =============================================
    key codes     (L, H, B, D / 4)    2 bits per value, dim ``4i + j`` in bits
                                      ``2j..2j+1`` of byte ``i``
    value codes   (L, H, B, D / 4)    the same
    key z         (L, H, D) int8      per channel: the minimum's multiple of lo_unit
    key c         (L, H, D) uint8     per channel: the step's multiple of step_unit
    value z       (L, H, B) int8      per token
    value c       (L, H, B) uint8     per token
    units         (L, H, 4) float16   key lo_unit, key step_unit, value lo_unit,
                                      value step_unit
    ============  ==================  =============================================
    """

    bits = 2
    default_block_tokens: ClassVar[int] = 64
    clips: ClassVar[tuple[float, ...]] = CLIPS

    def _scale_sections(self, g: KvGeometry) -> list[tuple[str, int]]:
        lh = g.layers * g.kv_heads
        return [
            ("k_z", lh * g.head_dim),
            ("k_c", lh * g.head_dim),
            ("v_z", lh * g.block_tokens),
            ("v_c", lh * g.block_tokens),
            ("units", lh * 4 * 2),
        ]

    def _quantize_halves(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        k_codes, k_z, k_c, k_lo_unit, k_step_unit = quantize_fine_scales(
            keys, 3, self.levels, self.clips
        )
        v_codes, v_z, v_c, v_lo_unit, v_step_unit = quantize_fine_scales(
            values, 4, self.levels, self.clips
        )
        units = torch.cat([k_lo_unit, k_step_unit, v_lo_unit, v_step_unit], dim=-1)  # (k,L,H,1,4)
        return [
            self._pack(k_codes),
            self._pack(v_codes),
            k_z.view(torch.uint8),
            k_c,
            v_z.view(torch.uint8),
            v_c,
            units.view(torch.uint8),
        ]

    def _scales(
        self, cut: dict[str, torch.Tensor], b0: int, b1: int, g: KvGeometry
    ) -> tuple[torch.Tensor, ...]:
        nb, lay, heads = b1 - b0, g.layers, g.kv_heads
        units = cut["units"][b0:b1].contiguous().view(torch.float16).to(torch.float32)
        units = units.reshape(nb, lay, heads, 1, 1, 4)
        key_shape, value_shape = (
            (nb, lay, heads, 1, g.head_dim),
            (nb, lay, heads, g.block_tokens, 1),
        )

        def scale(name: str, shape: tuple[int, ...], unit: int, signed: bool) -> torch.Tensor:
            raw = cut[name][b0:b1].contiguous()
            ints = raw.view(torch.int8) if signed else raw
            return ints.to(torch.float32).reshape(shape).mul_(units[..., unit])

        return (
            scale("k_z", key_shape, 0, True),
            scale("k_c", key_shape, 1, False),
            scale("v_z", value_shape, 2, True),
            scale("v_c", value_shape, 3, False),
        )

    def relative_error_bound(self, group: int) -> float:
        """The bound on ``‖x̂ − x‖ / ‖x‖`` over a layer for groups of ``group`` values where
        the 8-bit scales' units are negligible: ``sqrt(group / 2) / 3`` (no better than 1.0
        for ``group`` >= 18: at 2 bits the stated bound is the per-value one, ``step / 2``,
        module docstring; SmolLM2 measures 0.35-0.45, ``tests/inference/test_kv_lowbit.py``).
        """
        return ((group / 2) ** 0.5 * (1 + 2**-9) + 2**-8) / self.levels
