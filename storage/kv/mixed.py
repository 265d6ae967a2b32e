"""The ``int2mix`` KV codec: 2 bits per value on average, spent where attention looks.

:class:`Int2MixCodec` stores what ``int2`` stores (``storage/kv/lowbit.py``: 64-token blocks,
keys before RoPE, each group's minimum and step in one byte on float16 units per block, layer,
head and half, ranges clipped where that lowers a group's squared error) with the bits placed
differently, at the same two bits of code per value:

- **keys in mixed precision by range**: per block, layer and head the channels are ranked by
  their range over the block's tokens (largest first, ties by channel); the widest quarter gets
  4-bit codes, the next half 2-bit codes, and the narrowest quarter no codes at all: those
  channels decode to their mean over the block (stored as the group's minimum, a multiple of
  ``lo_unit``, with a step of 0). A few wide channels carry most of ``q · k``: SmolLM2's keys
  quantized alone this way give a next-token KL of 0.035 against 0.21 for ``int2``'s uniform 2
  bits (10 FAQ questions, ``tests/benchmarks/RESULTS.md``), though their relative error is
  higher (0.16 against 0.15): the narrow channels' error barely moves the logits.
- **values per channel** over the block's tokens, 2-bit, as ``int2``'s keys (``int2`` quantizes
  them per token): half the next-token KL of values per token on SmolLM2 (0.022 against 0.048).

Which channels have which width is stored, two bits per key channel (a quarter of a byte), so a
block decodes alone. Per block, layer and head at ``head_dim`` 64: 2 bits of code per value,
one byte of minimum and one of step per key and value channel, 16 bytes of widths, 8 bytes of
units: 0.1421 of raw bfloat16 (``int2``: 0.1411; 0.1435 on disk for the 9 FAQ pages).

Measured on the 176 FAQ questions (``tests/benchmarks/RESULTS.md``, "KV at 2 bits with answers
kept"): coinrag's F1 0.1794 against 0.1806 for bf16 ``none`` (``int2``: 0.1639); turborag's
0.1033 against 0.1264 (its first token 5x closer to ``none``'s than ``int2``'s, KL 0.098
against 0.50, yet ``int2``'s turborag F1 is 0.1428: that F1 does not separate codecs here).

Error bounds (held by ``tests/inference/test_kv_codecs.py``, computed there from the float
entry alone): a coded group's squared error is at most ``n (step / 2)²`` with ``step`` its
width's step (``levels`` 15 or 3) widened by its head's units, as ``int2``'s; a mean-only
channel's at most ``n ((range + lo_unit) / 2)²`` (the mean minimizes the squared error, a
group's variance is at most ``(range / 2)²``, and the stored mean is within ``lo_unit / 2`` of
it), and never above ``‖x‖²`` plus that rounding: its relative error is at most 1.

E.g. a block's key channels with ranges ``[9, 0.1, 2, 0.5]`` (:func:`key_widths` of a
``head_dim`` of 4; the codec itself needs a multiple of 8): channel 0 gets 4 bits, channels 2
and 3 two bits, channel 1 its mean; widths stored ``[2, 0, 1, 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from coinrag.storage.kv.clip_kernel import search_clips
from coinrag.storage.kv.codecs import TORCH_DTYPES, KvGeometry, QuantizedCodec, _writable
from coinrag.storage.kv.lowbit import (
    CLIPS,
    LO_LEVELS,
    STEP_LEVELS,
    fine_lo,
)
from coinrag.storage.kv.quantize import fp16_up

# the payload sections kernels.int2mix_span reads, in the order it takes their offsets
_KERNEL_SECTIONS = ("k_codes4", "k_codes2", "v_codes", "k_widths", "k_z", "k_c", "v_z", "v_c")
WIDTH_LEVELS = (0, 3, 15)  # levels of a key channel of width 0 (mean), 1 (2 bits), 2 (4 bits)


def key_widths(keys: torch.Tensor, counts: tuple[int, int] | None = None) -> torch.Tensor:
    """Keys ``(k, L, H, B, D)`` -> each channel's width ``(k, L, H, D)`` uint8: 2 for the
    widest ``counts[0]`` channels by range over the block's tokens (default ``D / 4``), 1 for
    the next ``counts[1]`` (default ``D / 2``), 0 for the rest (ties: the lower channel
    first)."""
    d = keys.shape[-1]
    wide, mid = counts or (d // 4, d // 2)
    ranges = keys.amax(dim=3) - keys.amin(dim=3)
    order = torch.sort(ranges, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(d).expand_as(order).contiguous())
    widths = (rank < wide).to(torch.uint8) + (rank < wide + mid).to(torch.uint8)
    return widths


def quantize_mixed(
    x: torch.Tensor, widths: torch.Tensor, clips: tuple[float, ...] = CLIPS
) -> tuple[torch.Tensor, ...]:
    """Keys ``(k, L, H, B, D)`` float32, per channel over ``B``, each channel at its width
    (:func:`key_widths`): ``(codes, z, c, lo_unit, step_unit)`` as
    ``lowbit.quantize_fine_scales`` returns them (``codes`` uint8 ``(k, L, H, B, D)``, ``z``
    int8 and ``c`` uint8 ``(k, L, H, 1, D)``, the units float16 ``(k, L, H, 1, 1)``);
    ``x̂ = codes * (c * step_unit) + z * lo_unit``. A width-0 channel has codes 0, ``c = 0`` and
    ``z`` its mean rounded to the nearest multiple of ``lo_unit``."""
    dims = (3, 4)
    levels = torch.tensor(WIDTH_LEVELS, dtype=torch.float32)[widths.long()].unsqueeze(3)
    coded = levels > 0
    mn, mx = x.amin(dim=3, keepdim=True), x.amax(dim=3, keepdim=True)
    mean = x.mean(dim=3, keepdim=True)
    target = torch.where(coded, mn, mean)  # what each channel's z stands for
    lo_unit = fp16_up(target.abs().amax(dim=dims, keepdim=True) / LO_LEVELS)
    lo32 = lo_unit.to(torch.float32)
    safe_levels = torch.where(coded, levels, torch.ones_like(levels))
    s_max = torch.where(coded, (mx - fine_lo(mn, lo32) * lo32) / safe_levels, 0)
    step_unit = fp16_up(s_max.amax(dim=dims, keepdim=True) / STEP_LEVELS)
    step32 = step_unit.to(torch.float32)
    codes, z, c = search_clips(x, 3, (mn, mx), (lo32, step32), levels, clips)
    safe_lo = torch.where(lo32 > 0, lo32, torch.ones_like(lo32))
    z_mean = torch.round(mean / safe_lo).clamp_(-LO_LEVELS - 1, LO_LEVELS)
    z = torch.where(coded, z, z_mean)
    c = torch.where(coded, c, 0)
    codes = torch.where(coded, codes, 0)
    return codes.to(torch.uint8), z.to(torch.int8), c.to(torch.uint8), lo_unit, step_unit


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``(..., n)`` of ``bits`` (2 or 4) -> bytes ``(..., n * bits / 8)``, the
    first code in the low bits."""
    per = 8 // bits
    out = codes[..., 0::per].clone()
    for j in range(1, per):
        out |= codes[..., j::per] << (bits * j)
    return out


def _unpacked_bytes(bits: int) -> torch.Tensor:
    """``(256, 8 / bits)`` uint8: each byte's codes, the first in the low bits."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    return (
        (torch.arange(256, dtype=torch.uint8).unsqueeze(-1) >> shifts) & (2**bits - 1)
    ).contiguous()


_UNPACKED = {bits: _unpacked_bytes(bits) for bits in (2, 4)}


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`, as uint8 ``(..., n)``: each byte's codes looked up
    in a 256-row table (1.4x the speed of shifting and masking a slice's bytes on this CPU)."""
    codes = _UNPACKED[bits].index_select(0, packed.reshape(-1).to(torch.int32))
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


class Int2MixCodec(QuantizedCodec, name="int2mix"):
    """2 bits of code per value in 64-token blocks: keys in mixed precision by range (a
    quarter of the channels 4-bit, half 2-bit, a quarter their mean), values 2-bit per channel;
    ~0.142 of the raw bfloat16 bytes at ``head_dim`` 64.

    A block's payload (``B = block_tokens``, ``D = head_dim``, a multiple of 8), in order:

    ============  ==================  =============================================
    section       shape               contents
    ============  ==================  =============================================
    key codes 4   (L, H, B, D / 8)    the 4-bit channels' codes in channel order,
                                      two per byte (the first in the low nibble)
    key codes 2   (L, H, B, D / 8)    the 2-bit channels' codes, four per byte
    value codes   (L, H, B, D / 4)    2 bits per value, four per byte
    key widths    (L, H, D / 4)       2 bits per channel: 0 mean, 1 2-bit, 2 4-bit
    key z, c      (L, H, D) x 2       int8 minimum (mean), uint8 step per channel
    value z, c    (L, H, D) x 2       the same for value channels
    units         (L, H, 4) float16   key lo_unit, key step_unit, value lo_unit,
                                      value step_unit
    ============  ==================  =============================================
    """

    bits = 2
    default_block_tokens: ClassVar[int] = 64
    _TABLES = ("k_widths", "k_z", "k_c", "v_z", "v_c", "units")  # per block, layer and head
    _table_block_axis: ClassVar[int] = 2  # _block_tables' tensors are (L, H, blocks, 1, D)

    def key_counts(self, dim: int) -> tuple[int, int]:
        """How many key channels of a head of ``dim`` get 4-bit and 2-bit codes (the rest
        their mean): a quarter and a half."""
        return dim // 4, dim // 2

    def _code_bytes(self, g: KvGeometry) -> int:
        if g.head_dim % 8:
            raise ValueError(
                f"kv_codec {self.name} needs a head_dim that is a multiple of 8, got "
                f"{g.head_dim}; use int2 or int4 for this model"
            )
        return g.layers * g.kv_heads * g.block_tokens * g.head_dim // 4

    def _sections(self, g: KvGeometry) -> list[tuple[str, int]]:
        lh, dim = g.layers * g.kv_heads, g.head_dim
        codes = self._code_bytes(g)
        wide, mid = self.key_counts(dim)
        tokens = lh * g.block_tokens
        return [
            ("k_codes4", tokens * wide // 2),
            ("k_codes2", tokens * mid // 4),
            ("v_codes", codes),
            ("k_widths", lh * dim // 4),
            ("k_z", lh * dim),
            ("k_c", lh * dim),
            ("v_z", lh * dim),
            ("v_c", lh * dim),
            ("units", lh * 4 * 2),
        ]

    def _quantize_halves(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        from coinrag.storage.kv.lowbit import quantize_fine_scales

        wide, mid = self.key_counts(keys.shape[-1])
        widths = key_widths(keys, (wide, mid))
        k_codes, k_z, k_c, k_lo_unit, k_step_unit = quantize_mixed(keys, widths)
        v_codes, v_z, v_c, v_lo_unit, v_step_unit = quantize_fine_scales(values, 3, 3, CLIPS)
        order = torch.sort(widths, dim=-1, descending=True, stable=True).indices
        ranked = k_codes.gather(-1, order.unsqueeze(3).expand_as(k_codes))
        units = torch.cat([k_lo_unit, k_step_unit, v_lo_unit, v_step_unit], dim=-1)
        return [
            pack_bits(ranked[..., :wide], 4),
            pack_bits(ranked[..., wide : wide + mid], 2),
            pack_bits(v_codes, 2),
            pack_bits(widths, 2),
            k_z.view(torch.uint8),
            k_c,
            v_z.view(torch.uint8),
            v_c,
            units.view(torch.uint8),
        ]

    # ------------------------------------------------------------------ decode

    def _block_tables(
        self, cut: dict[str, torch.Tensor], b0: int, b1: int, g: KvGeometry
    ) -> tuple[torch.Tensor, ...]:
        """Blocks ``b0..b1``'s float32 key ``lo``, ``step``, value ``lo``, ``step``, each
        ``(L, H, nb, 1, D)``, and where each key channel's code lies among the block's ranked
        codes (4-bit ones, then 2-bit ones, then a zero for the mean-only channels)
        ``(L, H, nb, 1, D)`` int64."""
        nb, lay, heads, dim = b1 - b0, g.layers, g.kv_heads, g.head_dim
        units = cut["units"][b0:b1].contiguous().view(torch.float16).to(torch.float32)
        units = units.reshape(nb, lay, heads, 1, 1, 4).permute(1, 2, 0, 3, 4, 5)

        def scale(name: str, unit: int, signed: bool) -> torch.Tensor:
            raw = cut[name][b0:b1].reshape(nb, lay, heads, 1, dim).permute(1, 2, 0, 3, 4)
            ints = raw.contiguous().view(torch.int8) if signed else raw
            return ints.to(torch.float32).mul_(units[..., unit])

        widths = unpack_bits(cut["k_widths"][b0:b1].reshape(nb, lay, heads, 1, dim // 4), 2)
        widths = widths.permute(1, 2, 0, 3, 4).to(torch.int64)
        wide, mid = widths == 2, widths == 1
        n_wide, n_mid = self.key_counts(dim)
        # a channel's rank among its width's channels (channel order), offset to its section
        pos = torch.where(wide, wide.cumsum(-1) - 1, mid.cumsum(-1) - 1 + n_wide)
        pos = torch.where(wide | mid, pos, n_wide + n_mid)  # mean-only: a zero code
        return (
            scale("k_z", 0, True),
            scale("k_c", 1, False),
            scale("v_z", 2, True),
            scale("v_c", 3, False),
            pos,
        )

    def _dequantize_tokens(
        self,
        cut: dict[str, torch.Tensor],
        s: int,
        e: int,
        g: KvGeometry,
        tables: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 keys and values ``(L, H, e - s, D)``: :meth:`_dequantize_coded`, the keys
        through :meth:`_keys`."""
        coded, values = self._dequantize_coded(cut, s, e, g, tables)
        return self._keys(coded, g), values

    def _keys(self, coded: torch.Tensor, g: KvGeometry) -> torch.Tensor:
        """Keys ``(L, H, n, D)`` float32 from their dequantized codes: as they are."""
        return coded

    def _dequantize_coded(
        self,
        cut: dict[str, torch.Tensor],
        s: int,
        e: int,
        g: KvGeometry,
        tables: tuple[torch.Tensor, ...] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 keys (as coded) and values ``(L, H, e - s, D)`` of tokens ``[s, e)`` of the
        blocks in ``cut``, from the blocks that hold them only: (nearly) whole blocks dequantized as
        blocks, then cut; a short span (a nugget) block by block, only its tokens' codes
        unpacked. The same float32 products either way (``codes * step + lo``). ``tables``:
        :meth:`_block_tables` of every block of ``cut`` where the caller has them."""
        block = g.block_tokens
        b0, b1 = s // block, -(-e // block)
        if b1 - b0 > 1 and 4 * (b1 - b0) * block > 5 * (e - s):  # a short span over blocks
            parts = [
                self._dequantize_coded(cut, max(s, b * block), min(e, (b + 1) * block), g, tables)
                for b in range(b0, b1)
            ]
            return tuple(torch.cat(halves, dim=2) for halves in zip(*parts, strict=True))
        lay, heads, dim, nb = g.layers, g.kv_heads, g.head_dim, b1 - b0
        first = b0 * block
        # one block: only tokens [s, e) unpacked; whole blocks: every token, cut at the end
        t0, t1 = (s - first, e - first) if nb == 1 else (0, block)

        def section(name: str, bits: int, count: int) -> torch.Tensor:
            raw = cut[name][b0:b1].reshape(nb, lay, heads, block, count * bits // 8)
            return unpack_bits(raw[:, :, :, t0:t1].permute(1, 2, 0, 3, 4), bits)

        if tables is None:
            k_lo, k_step, v_lo, v_step, pos = self._block_tables(cut, b0, b1, g)
        else:
            k_lo, k_step, v_lo, v_step, pos = (t[:, :, b0:b1] for t in tables)
        n_wide, n_mid = self.key_counts(dim)
        ranked = section("k_codes4", 4, n_wide)  # (L, H, nb, t, n_wide)
        zero = torch.zeros((*ranked.shape[:-1], dim - n_wide - n_mid), dtype=torch.uint8)
        ranked = torch.cat([ranked, section("k_codes2", 2, n_mid), zero], dim=-1)
        keys = ranked.gather(-1, pos.expand(*ranked.shape[:-1], dim)).to(torch.float32)
        values = section("v_codes", 2, dim).to(torch.float32)
        n = nb * (t1 - t0)
        keys = keys.mul_(k_step).add_(k_lo).reshape(lay, heads, n, dim)
        values = values.mul_(v_step).add_(v_lo).reshape(lay, heads, n, dim)
        if nb > 1:
            return keys[:, :, s - first : e - first], values[:, :, s - first : e - first]
        return keys, values

    def decode(self, stored: np.ndarray, g: KvGeometry) -> torch.Tensor:
        """Blocks' payloads ``(k, payload_bytes)`` -> ``(L, 2, H, k * B, D)`` in ``g.dtype``,
        keys at position 0 (before RoPE)."""
        raw = torch.from_numpy(_writable(stored))
        n = raw.shape[0] * g.block_tokens
        keys, values = self._dequantize_tokens(self._cut(raw, g), 0, n, g)
        out = torch.empty((g.layers, 2, g.kv_heads, n, g.head_dim), dtype=TORCH_DTYPES[g.dtype])
        out[:, 0].copy_(keys)
        out[:, 1].copy_(values)
        return out

    def _decode_tokens_compiled(
        self,
        reads: Sequence[np.ndarray],
        used: list[int],
        g: KvGeometry,
        picks: Sequence[tuple[int, int, int, int]],
        target: np.ndarray,
        bf16: bool,
        rope: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """The picks by :func:`kernels.int2mix_span` into ``target``, which builds each touched
        block's tables itself; only the float16 units are widened here, once per read. Keys
        rotated by ``rope`` (:meth:`QuantizedCodec.decode_tokens`)."""
        from coinrag.storage.kv import kernels  # numba, imported where a decode needs it

        at = self._section_offsets(g)
        offsets = [at[name] for name in _KERNEL_SECTIONS]
        sections = np.array([*offsets, *self.key_counts(g.head_dim)], dtype=np.int64)
        lay, heads = g.layers, g.kv_heads
        units_at = at["units"]
        units = {
            i: np.ascontiguousarray(reads[i][:, units_at : units_at + lay * heads * 8])
            .view(np.float16)
            .astype(np.float32)
            .reshape(-1, lay, heads, 4)
            for i in used
        }
        angles = kernels.rope_tables(rope, target)
        inverse = self._inverse(g)
        for i, s, e, to in picks:
            if e > s:
                span = (0, s, e, to, g.block_tokens)
                kernels.int2mix_span(
                    reads[i], sections, units[i], span, target, bf16, angles, inverse
                )

    def _inverse(self, g: KvGeometry) -> np.ndarray | None:
        """The compiled decode's key basis: none (``int2mix`` stores keys as they are)."""
        return None

    def _table_sections(self, g: KvGeometry) -> list[str]:
        return list(self._TABLES)

    def _read_tables(
        self, cut: dict[str, torch.Tensor], blocks: int, g: KvGeometry
    ) -> tuple[torch.Tensor, ...]:
        """:meth:`_block_tables` (scales and code places) of every block of ``cut``."""
        return self._block_tables(cut, 0, blocks, g)

    def relative_error_bound(self, group: int) -> float:
        """The bound on ``‖x̂ − x‖ / ‖x‖`` over a layer for groups of ``group`` values, for a
        ``head_dim`` up to 256 (Gemma's): the larger of ``int2``'s (``sqrt(group / 2) / 3``,
        widened for the units) and 1 (a mean-only channel's squared error is at most its
        squared norm: the mean minimizes it), plus the rounding of the means to ``lo_unit``
        (``n (lo_unit / 2)²`` per mean-only channel, ``m`` of them, a quarter of ``head_dim``
        for ``int2mix``, against a head whose norm is at least the ``max |min or mean| = 127
        lo_unit`` the unit is taken from: ``sqrt(group * m / 4) / 127`` at ``head_dim`` 256).

        E.g. 64-token blocks: 1.890 + 0.252 = 2.142 (at 2 bits nothing better than 1 is stated;
        SmolLM2 measures keys 0.164, values 0.317, ``tests/inference/test_kv_mixed.py``)."""
        int2 = ((group / 2) ** 0.5 * (1 + 2**-9) + 2**-8) / 3
        mean_only = 256 - sum(self.key_counts(256))
        return max(int2, 1.0) + (group * mean_only / 4) ** 0.5 / 127


class Int2BasisCodec(Int2MixCodec, name="int2basis"):
    """``int2mix``'s payload with the keys coded in the store's calibrated key basis
    (``storage/kv/basis.py``: coordinates ``k @ forward``, weighted by the queries that read
    them and turned onto the keys' principal axes) and in other widths (:meth:`key_counts`: at
    ``head_dim`` 64, 20 coordinates 4-bit, 24 2-bit, 20 their mean); values as ``int2mix``. The
    same bytes per block, plus the basis once per store (float32 ``2 L H D²``: 2.9 MB for
    SmolLM2).

    Why: in the plain channels a key's spread is shared by many channels, so ``int2mix``'s
    widest codes cover only part of it; on the principal axes of the query-weighted keys a
    quarter of the coordinates holds most of it. Emulated on the 9 FAQ pages' store (SmolLM2,
    30 questions, ``tests/benchmarks/RESULTS.md``): keys alone next-token KL 0.030 in the
    channels, 0.013 in the basis.

    Decoding: the coordinates are dequantized in float32 as ``int2mix``'s keys, then turned
    back (``@ inverse`` in float32, each value summed in a fixed order, two ``fma`` chains:
    ``kernels.basis_rows``, so a token's bits do not depend on the tokens decoded with it)
    and rounded once to the model dtype; the compiled decode does it per token as it places
    it, then rotates it by RoPE as for ``int2mix``.
    """

    needs_basis = True

    def key_counts(self, dim: int) -> tuple[int, int]:
        """``5 D / 16`` 4-bit key channels (rounded to an even count), ``D - 2`` that many
        2-bit ones and the rest their mean (at ``D`` 64: 20, 24, 20): in the basis the spread
        sits in fewer coordinates, and spending more bits on them lowers the next-token KL
        (SmolLM2, 30 FAQ questions: 0.033 against 0.039 at ``int2mix``'s 16, 32, 16;
        ``tests/benchmarks/RESULTS.md``). The same 2 bits per value on average."""
        wide = 2 * round(5 * dim / 32)
        return wide, dim - 2 * wide

    def view(self, kv: torch.Tensor, g: KvGeometry) -> np.ndarray:
        """Quantize ``kv`` ``(L, 2, H, n, D)`` (keys at position 0) with its keys turned into
        the basis of ``g.key_basis`` first."""
        x = kv.detach().to("cpu", torch.float32)
        coded = torch.stack([g.key_basis.get().to_coordinates(x[:, 0]), x[:, 1]], dim=1)
        return super().view(coded, g)

    def _keys(self, coded: torch.Tensor, g: KvGeometry) -> torch.Tensor:
        """Keys ``(L, H, n, D)`` float32 turned back from their coordinates in the basis."""
        return g.key_basis.get().from_coordinates(coded)

    def _inverse(self, g: KvGeometry) -> np.ndarray | None:
        """The compiled decode's key basis: each key turned back as it is decoded, before
        RoPE, the same bits as :meth:`_dequantize_tokens`' (``kernels.basis_rows``)."""
        return g.key_basis.get().inverse.numpy()

    def relative_error_bound_in_basis(self, group: int, condition: float) -> float:
        """The bound on a layer's keys' ``‖k̂ − k‖ / ‖k‖``: ``int2mix``'s bound in coordinate
        space (:meth:`relative_error_bound`) times the basis's ``condition`` (the largest of
        the layer's heads, :meth:`KeyBasis.condition`), since ``‖(ĉ − c) inverse‖ <=
        ‖inverse‖ ‖ĉ − c‖`` and ``‖c‖ <= ‖forward‖ ‖k‖``; plus float32's rounding of the
        product. Values: :meth:`relative_error_bound`, as ``int2mix``."""
        return self.relative_error_bound(group) * condition * (1 + 2**-16)
