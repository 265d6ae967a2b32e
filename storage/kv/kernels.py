"""Compiled decode of the quantized KV codecs' picked tokens (numba, one thread, no GIL held).

A coinrag request reads ten ~17-token slices of four chunks. Decoding them with tensor
operations costs a dozen small operations per slice (unpack, gather, widen, multiply, add,
round into the context), each a pass over ~100k values and a dispatch: ``int2mix`` took
15-20 ms per request on one thread, ``int4`` 7-14 ms (``tests/benchmarks/RESULTS.md``). The
kernels here do it in one pass per token and head: each code is read from its byte, scaled in
float32 (``code * step + lo``, two roundings, as the tensor path: the same bits), rounded once
into the target (bfloat16: to nearest even, as torch rounds; float32: as it is). About half
the time: ``int2mix`` 9.1 against 17.3 ms, ``int4`` 8.5 against 12.3 in one process, and
``int2mix``'s kv_load in ``coinrag eval`` 8.6-11.5 against 18.1-21.0 ms
(``tests/benchmarks/RESULTS.md``, "Stop 43: the slice decode compiled").

- :func:`uniform_span`: ``int8`` / ``int4`` / ``int2`` (``storage/kv/codecs.py``,
  ``lowbit.py``): codes of ``bits`` bits, the first in a byte's low bits; keys per channel and
  values per token, from float32 tables the codec builds once per request.
- :func:`int2mix_span`: ``int2mix`` (``storage/kv/mixed.py``): each block's key channel widths,
  one-byte scales and float16 units turned into float32 tables inside the kernel, per block,
  layer and head.

Both write tokens ``[s, e)`` of one read (``raw``: its blocks' payloads ``(blocks,
payload_bytes)`` uint8, any row stride) into ``out[:, :, :, at : at + e - s, :]``, ``out`` the
target ``(L, 2, H, tokens, D)`` as :func:`target_of` gives it; given rotation tables
(:func:`rope_tables`), each key is rotated from position 0 to its place as it is written: the same
bits as the decode followed by the key rotation of ``inference/rope/kernel.py``, without a
second pass over the context. Held bit for bit against the
tensor path by ``tests/inference/test_kv_kernels.py``. :func:`check_span` guards every call
(the kernels index without bounds checks). Compiled once per machine and signature (numba's
cache beside this file, else the user's cache folder; where neither can be written, compiled
in each process): about 2.4 s per codec the first time, then loaded. The server's warm-up
query compiles them before its port opens.
"""

from __future__ import annotations

import numpy as np
import torch

from coinrag.storage.jit import LANES, bf16_bits, compiled, fma32, two_chain_product

Span = tuple[int, int, int, int, int]  # (first table row, s, e, at, block): a pick's tokens
Rope = tuple[np.ndarray, np.ndarray]  # cos, sin (tokens of the target, R / 2) float32; 0 rows: none
NO_ROPE: Rope = (np.zeros((0, 1), np.float32), np.zeros((0, 1), np.float32))
NO_BASIS = np.zeros((0, 0, 0, 0), np.float32)  # int2mix: keys stored as they are


def rope_tables(rope: Rope | None, out: np.ndarray) -> Rope:
    """``rope`` as the kernels take it (C-contiguous float32; :data:`NO_ROPE` for None), checked
    against the target ``out`` ``(L, 2, H, T, D)``: ``(T, R / 2)`` each, ``0 < R <= D``
    (ValueError otherwise, before anything is written)."""
    if rope is None:
        return NO_ROPE
    cos, sin = (np.ascontiguousarray(t, dtype=np.float32) for t in rope)
    tokens, dim = out.shape[3], out.shape[4]
    if (
        cos.ndim != 2
        or cos.shape != sin.shape
        or not (cos.shape[0] == tokens and 0 < 2 * cos.shape[1] <= dim)
    ):
        raise ValueError(f"rotation tables {cos.shape} and {sin.shape} for a target {out.shape}")
    return cos, sin


@compiled(inline=True)
def _rotated_key(kf: np.ndarray, ku: np.ndarray, rope: Rope, tok: int, bf16: bool) -> None:
    """The decoded key head vector ``kf`` (float32; ``ku`` its bits) rotated from position 0 by
    target token ``tok``'s angles, as the key rotation (``inference/rope/kernel.py``) rotates
    it once placed: rounded to bfloat16 first where the target is bfloat16, then each pair
    ``(x1, x2)`` of the rotary dims to ``(fma(x2, -sin, x1 cos), fma(x1, sin, x2 cos))``: the
    same bits as a decode followed by that rotation."""
    cos, sin = rope
    if bf16:
        for d in range(ku.shape[0]):
            ku[d] = np.uint32(bf16_bits(ku[d])) << np.uint32(16)
    half = cos.shape[1]
    for i in range(half):
        c = cos[tok, i]
        s = sin[tok, i]
        x1 = kf[i]
        x2 = kf[half + i]
        kf[i] = fma32(x2, -s, x1 * c)
        kf[half + i] = fma32(x1, s, x2 * c)


def check_span(raw: np.ndarray, span: Span, out: np.ndarray, geometry: tuple[int, ...]) -> None:
    """ValueError unless tokens ``[s, e)`` of ``span = (first, s, e, at, block)`` lie in
    ``raw``'s ``block``-token blocks and ``[at, at + e - s)`` in ``out``'s token axis, and
    ``out`` is ``(L, 2, H, tokens, D)`` with ``geometry = (L, H, D)``: what the kernels would
    otherwise read or write out of bounds."""
    _, s, e, at, block = span
    layers, heads, dim = geometry
    shape = out.shape
    if out.ndim != 5 or (shape[0], shape[1], shape[2], shape[4]) != (layers, 2, heads, dim):
        raise ValueError(f"KV target of shape {shape}, want ({layers}, 2, {heads}, *, {dim})")
    fits = -(-e // block) <= raw.shape[0] and at + e - s <= shape[3]
    if not (0 <= s <= e and 0 <= at and fits):
        raise ValueError(
            f"KV tokens [{s}, {e}) of a read of {raw.shape[0]} {block}-token blocks into tokens "
            f"[{at}, {at + e - s}) of a target of {shape[3]}"
        )


def target_of(out: torch.Tensor) -> tuple[np.ndarray, bool] | None:
    """``out`` (any strides, on the CPU) as the kernels write it: ``(array, bf16)`` with
    bfloat16 as its raw bits (uint16) and ``bf16`` True, float32 as itself; None for another
    dtype or device (the codec's tensor path decodes those)."""
    if out.device.type != "cpu":
        return None
    if out.dtype == torch.bfloat16:
        return out.view(torch.int16).numpy().view(np.uint16), True
    if out.dtype == torch.float32:
        return out.numpy(), False
    return None


@compiled(inline=True)
def _uniform(
    raw: np.ndarray,
    offsets: tuple[int, int],
    tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    span: Span,
    out: np.ndarray,
    bf16: bool,
    bits: int,
    rope: Rope,
) -> None:
    """:func:`uniform_span`'s loop, inlined into one kernel per code width (``bits`` a
    constant there, so that a byte's unpacking is unrolled)."""
    k_at, v_at = offsets
    k_lo, k_step, v_lo, v_step = tables
    first, s, e, at, block = span
    per = 8 // bits
    mask = (1 << bits) - 1
    layers, _, heads, _, dim = out.shape
    width = dim // per
    kf = np.empty(dim, np.float32)
    vf = np.empty(dim, np.float32)
    ku = kf.view(np.uint32)
    vu = vf.view(np.uint32)
    for b in range(s // block, (e + block - 1) // block):
        row = raw[b]
        tb = first + b
        for lay in range(layers):
            for h in range(heads):
                lh = lay * heads + h
                klo = k_lo[tb, lay, h]
                kst = k_step[tb, lay, h]
                for tt in range(max(s, b * block) - b * block, min(e, (b + 1) * block) - b * block):
                    kb = k_at + (lh * block + tt) * width
                    vb = v_at + (lh * block + tt) * width
                    vlo = v_lo[tb, lay, h, tt]
                    vst = v_step[tb, lay, h, tt]
                    for j in range(width):  # byte j: dims j * per .. j * per + per - 1
                        kx = np.uint32(row[kb + j])
                        vx = np.uint32(row[vb + j])
                        for m in range(per):
                            d = j * per + m
                            kf[d] = np.float32((kx >> (bits * m)) & mask) * kst[d] + klo[d]
                            vf[d] = np.float32((vx >> (bits * m)) & mask) * vst + vlo
                    tok = at + b * block + tt - s
                    if rope[0].shape[0]:
                        _rotated_key(kf, ku, rope, tok, bf16)
                    if bf16:  # in the loop itself: behind one more call it took twice the time
                        for d in range(dim):
                            out[lay, 0, h, tok, d] = bf16_bits(ku[d])
                            out[lay, 1, h, tok, d] = bf16_bits(vu[d])
                    else:
                        out[lay, 0, h, tok, :] = kf
                        out[lay, 1, h, tok, :] = vf


@compiled()
def _uniform8(
    raw: np.ndarray,
    offsets: tuple,
    tables: tuple,
    span: Span,
    out: np.ndarray,
    bf16: bool,
    rope: Rope,
) -> None:
    _uniform(raw, offsets, tables, span, out, bf16, 8, rope)


@compiled()
def _uniform4(
    raw: np.ndarray,
    offsets: tuple,
    tables: tuple,
    span: Span,
    out: np.ndarray,
    bf16: bool,
    rope: Rope,
) -> None:
    _uniform(raw, offsets, tables, span, out, bf16, 4, rope)


@compiled()
def _uniform2(
    raw: np.ndarray,
    offsets: tuple,
    tables: tuple,
    span: Span,
    out: np.ndarray,
    bf16: bool,
    rope: Rope,
) -> None:
    _uniform(raw, offsets, tables, span, out, bf16, 2, rope)


_UNIFORM = {8: _uniform8, 4: _uniform4, 2: _uniform2}


def uniform_span(
    raw: np.ndarray,
    offsets: tuple[int, int],
    bits: int,
    tables: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    span: Span,
    out: np.ndarray,
    bf16: bool,
    rope: Rope = NO_ROPE,
) -> None:
    """Tokens ``[s, e)`` of ``raw`` (a quantized codec's blocks, key codes at byte
    ``offsets[0]`` of a payload, value codes at ``offsets[1]``, each ``(L, H, B, D * bits /
    8)``, the first code of a byte in its low bits) into ``out``'s tokens from ``at``, ``span =
    (first, s, e, at, block)``. ``tables`` (float32, row ``first + b`` for the read's block
    ``b``): key ``lo`` and ``step`` ``(blocks, L, H, D)`` per channel, value ``lo`` and
    ``step`` ``(blocks, L, H, B)`` per token; ``out`` and ``bf16``: :func:`target_of`'s;
    ``rope`` (:func:`rope_tables`, checked there): keys rotated from position 0 as they are
    placed, by the angles of their row in ``out``'s token axis. Checked first
    (:func:`check_span`)."""
    check_span(raw, span, out, tables[0].shape[1:])
    _UNIFORM[bits](raw, offsets, tables, span, out, bf16, rope)


@compiled(inline=True)
def _signed(byte: np.uint8) -> np.float32:
    """A stored int8 (as its uint8 byte) as float32."""
    z = np.int64(byte)
    return np.float32(z - 256 if z > 127 else z)


@compiled(inline=True)
def _int2mix_tables(
    row: np.ndarray,
    sections: np.ndarray,
    lh: int,
    units: np.ndarray,
    place: np.ndarray,
    scales: np.ndarray,
) -> None:
    """One block's tables for layer-head ``lh`` (``units``: its four float32 units): each key
    channel's ``place`` among a token's ranked codes (the ``sections[8]`` 4-bit ones in
    channel order, then the ``sections[9]`` 2-bit ones, then a zero for the mean-only
    channels: the codec's order), and ``(4, D)`` float32 key ``lo``, key ``step``, value
    ``lo``, value ``step`` into ``scales`` (``z * lo_unit``, ``c * step_unit``: exact in
    float32). ValueError for widths other than the encoder's counts."""
    dim = place.shape[0]
    q = dim // 4
    n_wide, n_mid = sections[8], sections[9]
    kw, kz, kc, vz, vc = sections[3], sections[4], sections[5], sections[6], sections[7]
    wide = 0
    mid = 0
    for d in range(dim):
        w = (row[kw + lh * q + d // 4] >> (2 * (d % 4))) & 3
        if w == 2:
            place[d] = min(wide, n_wide)  # past the count: refused below, never read
            wide += 1
        elif w == 1:
            place[d] = n_wide + min(mid, n_mid)
            mid += 1
        else:
            place[d] = n_wide + n_mid
        scales[0, d] = _signed(row[kz + lh * dim + d]) * units[0]
        scales[1, d] = np.float32(row[kc + lh * dim + d]) * units[1]
        scales[2, d] = _signed(row[vz + lh * dim + d]) * units[2]
        scales[3, d] = np.float32(row[vc + lh * dim + d]) * units[3]
    if wide != n_wide or mid != n_mid:  # the encoder's counts; others would index past codes
        raise ValueError("int2mix block whose key widths are not the codec's counts")


@compiled(inline=True)
def _int2mix_token(
    row: np.ndarray,
    starts: tuple[int, int, int],
    place: np.ndarray,
    scales: np.ndarray,
    ranked: np.ndarray,
    kf: np.ndarray,
    vf: np.ndarray,
    counts: tuple[int, int],
) -> None:
    """One token's float32 key and value head vectors into ``kf`` and ``vf`` ``(D,)``, its codes at
    ``starts`` (the bytes of its ``counts[0]`` 4-bit keys, ``counts[1]`` 2-bit keys, values),
    ``ranked``: a ``(counts[0] + counts[1] + 1,)`` uint8 row whose last entry is 0."""
    dim = place.shape[0]
    q = dim // 4
    n_wide, n_mid = counts
    b4, b2, bv = starts
    for j in range(n_wide // 2):
        x = row[b4 + j]
        ranked[2 * j] = x & 15
        ranked[2 * j + 1] = x >> 4
    for j in range(n_mid // 4):
        y = row[b2 + j]
        ranked[n_wide + 4 * j] = y & 3
        ranked[n_wide + 4 * j + 1] = (y >> 2) & 3
        ranked[n_wide + 4 * j + 2] = (y >> 4) & 3
        ranked[n_wide + 4 * j + 3] = y >> 6
    for d in range(dim):
        kf[d] = np.float32(ranked[place[d]]) * scales[1, d] + scales[0, d]
    for j in range(q):
        y = row[bv + j]
        for m in range(4):
            d = 4 * j + m
            vf[d] = np.float32((y >> (2 * m)) & 3) * scales[3, d] + scales[2, d]


@compiled(inline=True)
def _key_product(c: np.ndarray, m: np.ndarray, kb: np.ndarray) -> None:
    """``kb = c @ m`` for one head vector ``c`` ``(D,)`` and matrix ``m`` ``(D, D)``, float32:
    each value two ``fma`` chains, over ``i`` in ``[0, D/2)`` and in ``[D/2, D)`` in order from
    0, added at the end, whatever else is decoded. Vectorized with the accumulators in
    registers (``jit.two_chain_product``) where ``D`` is a multiple of 16 (every head size of
    the model matrix but the tiny configs'), else the same sums by a scalar loop."""
    dim = c.shape[0]
    if dim % LANES == 0:
        two_chain_product(c, m, kb)
        return
    half = dim // 2
    for j in range(dim):
        low = np.float32(0.0)
        high = np.float32(0.0)
        for i in range(half):
            low = fma32(c[i], m[i, j], low)
            high = fma32(c[half + i], m[half + i, j], high)
        kb[j] = low + high


@compiled(inline=True)
def _from_basis(kf: np.ndarray, m: np.ndarray, kb: np.ndarray) -> None:
    """A key from its coordinates ``kf`` in a key basis, ``kf @ m`` (``m``: the head's
    ``inverse``), written back into ``kf``: :func:`_key_product`, as :func:`basis_rows`
    computes it, so both give the same bits."""
    _key_product(kf, m, kb)
    for j in range(kf.shape[0]):
        kf[j] = kb[j]


@compiled()
def _int2mix(
    raw: np.ndarray,
    sections: np.ndarray,
    units: np.ndarray,
    span: Span,
    out: np.ndarray,
    bf16: bool,
    rope: Rope,
    inverse: np.ndarray,
) -> None:
    """:func:`int2mix_span`'s loop: per touched block, layer and head its tables, then each
    token's codes (its key turned back from the basis where ``inverse`` has rows)."""
    _, s, e, at, block = span
    layers, _, heads, _, dim = out.shape
    q = dim // 4
    n_wide, n_mid = sections[8], sections[9]
    counts = (n_wide, n_mid)
    place = np.empty(dim, np.int64)
    ranked = np.zeros(n_wide + n_mid + 1, np.uint8)  # the last stays 0: a mean-only code
    scales = np.empty((4, dim), np.float32)
    kf = np.empty(dim, np.float32)
    vf = np.empty(dim, np.float32)
    kb = np.empty(dim, np.float32)
    ku = kf.view(np.uint32)
    vu = vf.view(np.uint32)
    for b in range(s // block, (e + block - 1) // block):
        row = raw[b]
        for lay in range(layers):
            for h in range(heads):
                lh = lay * heads + h
                _int2mix_tables(row, sections, lh, units[b, lay, h], place, scales)
                for tt in range(max(s, b * block) - b * block, min(e, (b + 1) * block) - b * block):
                    token = lh * block + tt
                    starts = (
                        sections[0] + token * (n_wide // 2),
                        sections[1] + token * (n_mid // 4),
                        sections[2] + token * q,
                    )
                    _int2mix_token(row, starts, place, scales, ranked, kf, vf, counts)
                    if inverse.shape[0]:
                        _from_basis(kf, inverse[lay, h], kb)
                    tok = at + b * block + tt - s
                    if rope[0].shape[0]:
                        _rotated_key(kf, ku, rope, tok, bf16)
                    if bf16:  # in the loop itself: behind one more call it took twice the time
                        for d in range(dim):
                            out[lay, 0, h, tok, d] = bf16_bits(ku[d])
                            out[lay, 1, h, tok, d] = bf16_bits(vu[d])
                    else:
                        out[lay, 0, h, tok, :] = kf
                        out[lay, 1, h, tok, :] = vf


def int2mix_span(
    raw: np.ndarray,
    sections: np.ndarray,
    units: np.ndarray,
    span: Span,
    out: np.ndarray,
    bf16: bool,
    rope: Rope = NO_ROPE,
    inverse: np.ndarray | None = None,
) -> None:
    """Tokens ``[s, e)`` of ``raw`` (``int2mix`` or ``int2basis`` blocks) into ``out``'s
    tokens from ``at``,
    ``span = (first, s, e, at, block)`` (``first`` unused: the tables are built here).
    ``sections``: the byte offsets in a payload of its key codes 4, key codes 2, value codes,
    key widths, key z, key c, value z and value c (``Int2MixCodec._sections``' order), then
    the codec's counts of 4-bit and 2-bit key channels per head (``key_counts``);
    ``units`` ``(blocks, L, H, 4)`` float32: each block's float16 units widened; ``out`` and
    ``bf16``: :func:`target_of`'s; ``rope``: as :func:`uniform_span`'s, applied after the
    basis; ``inverse``: ``int2basis``'s ``(L, H, D, D)`` float32 (``KeyBasis.inverse``), keys
    turned back from their coordinates as :func:`basis_rows` turns them (None: ``int2mix``).
    Checked first (:func:`check_span`)."""
    layers, heads = units.shape[1:3]
    dim = int(sections[5] - sections[4]) // (layers * heads)  # key z: one byte per channel
    check_span(raw, span, out, (layers, heads, dim))
    wide, mid = int(sections[8]), int(sections[9])
    if wide % 2 or mid % 4 or wide + mid > dim:
        raise ValueError(f"int2mix key counts {wide}, {mid} for head_dim {dim}")
    if inverse is None:
        inverse = NO_BASIS
    elif inverse.shape != (layers, heads, dim, dim) or inverse.dtype != np.float32:
        raise ValueError(f"a key basis {inverse.shape} {inverse.dtype} for {(layers, heads, dim)}")
    _int2mix(raw, sections, units, span, out, bf16, rope, np.ascontiguousarray(inverse))


@compiled()
def basis_rows(coordinates: np.ndarray, inverse: np.ndarray, out: np.ndarray) -> None:
    """Keys from their coordinates in a key basis (``storage/kv/basis.py``): ``out[l, h, t] =
    coordinates[l, h, t] @ inverse[l, h]``, all C-contiguous float32, ``coordinates`` and
    ``out`` ``(L, H, T, D)``, ``inverse`` ``(L, H, D, D)``. Each output value is summed in a
    fixed order (two ``fma`` chains, :func:`_key_product`), whatever ``T``: a token's bits do
    not depend on which tokens are decoded with it (a BLAS product's do: its blocking follows
    the shape, and a one-row product takes another path). About 1.6 ms for coinrag's ~180
    tokens at SmolLM2's dims (90 heads of 64) on one thread of this CPU, where torch's float32
    ``matmul`` takes 1.3-2.1 (one chain a value through memory, before: 3.0-3.3)."""
    layers, heads, tokens, dim = coordinates.shape
    for lay in range(layers):
        for h in range(heads):
            m = inverse[lay, h]
            for t in range(tokens):
                _key_product(coordinates[lay, h, t], m, out[lay, h, t])
