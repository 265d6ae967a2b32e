"""KV codecs: how an entry's tensor becomes the values stored on disk, and back.

A codec is a subclass of :class:`KvCodec` registered by name (``class IdentityCodec(KvCodec,
name="none")``) and chosen with :func:`codec_named`; the layout names it (``KvLayout.kv_codec``,
the build setting ``kv_codec``). Its methods take the entry geometry ``g`` (a
``storage.kv.KvLayout``: ``layers``, ``kv_heads``, ``head_dim``, ``dtype``, ``block_tokens``).

- ``none`` (:class:`IdentityCodec`): entries stored as the model computed them, bit for bit
  (bfloat16 as its raw bits in ``uint16``, since Zarr 3 has no bfloat16; float32 / float16 as
  themselves), keys after RoPE at the positions of the chunk's forward.
- ``int8`` / ``int4`` (:class:`QuantizedCodec`): asymmetric uniform quantization within each
  stored block of ``block_tokens`` tokens, keys per channel (one step and minimum per layer,
  head and dim over the block's tokens), values per token (one per layer, head and token over
  ``head_dim``): KIVI's finding (per-token keys are 4x worse here: ``tests/benchmarks/
  bench_kv_codecs.py``). Keys are quantized *before RoPE* (KVQuant): the model side hands the
  store keys rotated back to position 0 (:attr:`KvCodec.keys_at_zero`; the contract:
  ``storage/kv/layout.py``), whose per-channel ranges are narrower than after RoPE (measured on
  SmolLM2: 8-10% lower attention-logit error, 20-25% lower next-token KL for int4).
- ``int2`` (``storage/kv/lowbit.py``, a :class:`QuantizedCodec` with 8-bit scales and clipped
  ranges, 64-token blocks): ~0.14 of the raw bfloat16 bytes.
- ``int2mix`` (``storage/kv/mixed.py``: ``int2``'s bytes, key channels in 4 / 2 / 0 bits by
  their range in each block, values per channel): ~0.14 of the raw bfloat16 bytes, answers kept
  on the FAQ questions where ``int2`` loses them.

Why no lossless (entropy) pass over the codes: a block's payload has a fixed size, so readers
compute where a block lies from token counts (``storage/kv/shard.py``); and the codes are close
to incompressible (SmolLM2, one 512-token chunk: order-0 entropy of int4 codes 3.73-3.95 bits of
4, of int2's 1.93-1.95 of 2; zstd over whole int2 payloads 0.1359 of raw bf16 against 0.1411,
over int4's 0.3198 against 0.3281), not worth variable-size blocks.

The store calls its codec at these points (``storage/kv/store.py``, ``shard.py``, ``reads.py``):

- writing: :meth:`KvCodec.view` (the entry as stored values; the identity codec returns a view,
  copied once by the shard encoder straight into the file buffer) and
  :meth:`KvCodec.write_blocks` (those values as inner-chunk payloads, in place in the file
  buffer); :meth:`KvCodec.encode` is the same values C-contiguous (checksums);
- the shard array Zarr sees: :meth:`KvCodec.array_shape`, :meth:`KvCodec.chunk_shape`,
  :meth:`KvCodec.dimension_names` (the quantized codecs describe a block as its payload bytes,
  so Zarr's own reader returns them, crc32c-checked, and this module dequantizes them);
- reading: :meth:`KvCodec.from_payloads` (inner chunks' payloads, as a ranged read fetches
  them, -> stored values as Zarr returns them), :meth:`KvCodec.decode` (stored values of whole
  blocks -> a tensor in the model dtype), :meth:`KvCodec.zarr_selection`.

Error bounds (tested against the float entry in ``tests/inference/test_kv_codecs.py``): with ``b``
bits
(``levels = 2**b - 1``), a group's minimum stored in float16 rounded down (``lo``) and its step
rounded up (``step = fp16↑((max - lo) / levels)``), every value is within ``step / 2`` of its
float value before rounding to the model dtype; over a layer, ``‖x̂ − x‖ / ‖x‖ <= sqrt(n / 2) /
levels`` (``n`` the group size: ``block_tokens`` for keys, ``head_dim`` for values; each group
holds its minimum and maximum, so ``‖x_g‖² >= range² / 2``), plus the model dtype's rounding.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from coinrag.schemas.registry import Registered, Registry
from coinrag.schemas.settings import KV_CODECS  # the setting's values: the names registered below
from coinrag.storage.kv.quantize import dequantize, quantize

# model dtype -> the numpy dtype its values are stored as (identity codec)
STORAGE_DTYPES = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AXES = ("slot", "layer", "kv", "head", "token", "dim")  # a shard array of the identity codec
BYTE_AXES = ("slot", "block", "byte")  # a shard array of a quantized codec


class KvGeometry(Protocol):
    """What a codec needs to know of an entry (``storage.kv.KvLayout`` has it)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int


class KvCodec(Registered):
    """How KV tensors ``(layers, 2, kv_heads, tokens, head_dim)`` are stored; one subclass per
    codec, registered by its ``name`` in ``KvCodec.registry``."""

    registry: ClassVar[Registry[KvCodec]] = Registry("KV codec", KV_CODECS)
    keys_at_zero: ClassVar[bool] = False  # stored keys rotated back to position 0 (before RoPE)
    default_block_tokens: ClassVar[int] = 4  # tokens per stored block of new shards
    lossless: ClassVar[bool] = True
    needs_basis: ClassVar[bool] = False  # keys coded in the store's key basis (basis.py)

    # ------------------------------------------------------------------ the shard array

    def storage_dtype(self, dtype: str) -> np.dtype:
        """The numpy dtype of the stored array for entries of model dtype ``dtype``."""
        raise NotImplementedError

    def payload_bytes(self, g: KvGeometry) -> int:
        """Bytes of one inner chunk's payload (one block of ``g.block_tokens`` tokens, every
        layer and head; without its crc32c)."""
        raise NotImplementedError

    def array_shape(self, g: KvGeometry, slots: int, width: int) -> tuple[int, ...]:
        """Shape of a shard array of ``slots`` entries, ``width`` tokens wide (a multiple of
        ``g.block_tokens``)."""
        raise NotImplementedError

    def chunk_shape(self, g: KvGeometry) -> tuple[int, ...]:
        """Shape of one inner chunk (one slot, one block) of that array."""
        raise NotImplementedError

    def dimension_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def width_of(self, shape: tuple[int, ...], block: int) -> int:
        """The token width of a shard array of ``shape`` (blocks of ``block`` tokens)."""
        raise NotImplementedError

    def zarr_selection(self, slot: int, t0: int, t1: int, block: int) -> tuple[Any, ...]:
        """The selection of tokens ``[t0, t1)`` (block-aligned) of ``slot`` in the array."""
        raise NotImplementedError

    # ------------------------------------------------------------------ values

    def view(self, kv: torch.Tensor, g: KvGeometry) -> np.ndarray:
        """``kv`` ``(layers, 2, kv_heads, n, head_dim)`` as stored values (a view where
        possible; strides kept)."""
        raise NotImplementedError

    def encode(self, kv: torch.Tensor, g: KvGeometry) -> np.ndarray:
        """``kv`` as the C-contiguous stored array (its sha256 is the manifest's checksum)."""
        return np.ascontiguousarray(self.view(kv, g))

    def block_count(self, stored: np.ndarray, g: KvGeometry) -> int:
        """Inner chunks of one entry's stored values."""
        raise NotImplementedError

    def write_blocks(
        self, stored: np.ndarray, g: KvGeometry, out: np.ndarray, start: int, row: int
    ) -> None:
        """Write the entry's ``block_count`` payloads into the uint8 buffer ``out``: payload
        ``j`` at ``out[start + j * row:][:payload_bytes]`` (``row``: payload + crc32c)."""
        raise NotImplementedError

    def from_payloads(self, payloads: np.ndarray, g: KvGeometry) -> np.ndarray:
        """``k`` consecutive blocks' payloads ``(k, payload_bytes)`` uint8 -> their stored
        values, as Zarr returns that block range of one slot."""
        raise NotImplementedError

    def decode(self, stored: np.ndarray, g: KvGeometry) -> torch.Tensor:
        """Stored values (any strides) -> ``(layers, 2, kv_heads, tokens, head_dim)`` in the
        model dtype ``g.dtype`` (quantized codecs: every token of the blocks given)."""
        raise NotImplementedError

    def decode_tokens(
        self,
        reads: Sequence[np.ndarray],
        g: KvGeometry,
        picks: Sequence[tuple[int, int, int, int]],
        out: torch.Tensor,
        rope: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> bool:
        """Write, for each pick ``(read, s, e, at)``, tokens ``[s, e)`` of what :meth:`decode`
        gives for ``reads[read]`` (its token axis) into ``out[..., at : at + e - s, :]``;
        ``out``: ``(layers, 2, kv_heads, tokens, head_dim)`` in ``g.dtype``, any strides (an
        assembled context, say): the same values as ``decode(reads[read], g)[..., s:e, :]``.
        Codecs that can decode some tokens alone override it. ``rope`` (cos, sin ``(tokens, R /
        2)`` of ``out``'s tokens): True where the keys were rotated by it, else False (here)."""
        decoded: dict[int, torch.Tensor] = {}
        for i, s, e, at in picks:
            if i not in decoded:
                decoded[i] = self.decode(reads[i], g)
            out[..., at : at + e - s, :].copy_(decoded[i][..., s:e, :])
        return False

    def trim(self, stored: np.ndarray, tokens: int, g: KvGeometry) -> np.ndarray:
        """Stored values of whole blocks from token 0 -> those of an entry of ``tokens`` tokens
        (what its sha256 covers)."""
        raise NotImplementedError

    def stored_bytes(self, tokens: int, g: KvGeometry) -> int:
        """Bytes of an entry of ``tokens`` tokens as stored (its blocks' payloads; the identity
        codec: tokens x bytes per token, its last block's padding not counted)."""
        raise NotImplementedError


class IdentityCodec(KvCodec, name="none"):
    """Entries stored as computed, bit for bit (bfloat16 as ``uint16`` bits), keys after RoPE."""

    def storage_dtype(self, dtype: str) -> np.dtype:
        return STORAGE_DTYPES[dtype]

    def payload_bytes(self, g: KvGeometry) -> int:
        itemsize = STORAGE_DTYPES[g.dtype].itemsize
        return g.layers * 2 * g.kv_heads * g.block_tokens * g.head_dim * itemsize

    def array_shape(self, g: KvGeometry, slots: int, width: int) -> tuple[int, ...]:
        return (slots, g.layers, 2, g.kv_heads, width, g.head_dim)

    def chunk_shape(self, g: KvGeometry) -> tuple[int, ...]:
        return (1, g.layers, 2, g.kv_heads, g.block_tokens, g.head_dim)

    def dimension_names(self) -> tuple[str, ...]:
        return AXES

    def width_of(self, shape: tuple[int, ...], block: int) -> int:
        return shape[4]

    def zarr_selection(self, slot: int, t0: int, t1: int, block: int) -> tuple[Any, ...]:
        return (slot, slice(None), slice(None), slice(None), slice(t0, t1))

    def view(self, kv: torch.Tensor, g: KvGeometry | None = None) -> np.ndarray:
        t = kv.detach().to("cpu")
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        return t.numpy()

    def block_count(self, stored: np.ndarray, g: KvGeometry) -> int:
        return -(-int(stored.shape[3]) // g.block_tokens)

    def write_blocks(
        self, stored: np.ndarray, g: KvGeometry, out: np.ndarray, start: int, row: int
    ) -> None:
        layers, _, heads, n, dim = stored.shape
        block = g.block_tokens
        item = stored.dtype.itemsize
        k = self.block_count(stored, g)
        inner = (2 * heads * block * dim * item, heads * block * dim * item, block * dim * item)
        # The entry's k inner chunks, in place in the file buffer: (k, L, 2, H, block, D).
        chunks = np.ndarray(
            (k, layers, 2, heads, block, dim),
            dtype=stored.dtype,
            buffer=out,
            offset=start,
            strides=(row, *inner, dim * item, item),
        )
        dst = chunks.transpose(1, 2, 3, 0, 4, 5)  # (L, 2, H, k, block, D)
        full = n // block
        if full:
            dst[:, :, :, :full] = stored[:, :, :, : full * block].reshape(
                layers, 2, heads, full, block, dim
            )
        if n > full * block:
            dst[:, :, :, full, : n - full * block] = stored[:, :, :, full * block :]
            dst[:, :, :, full, n - full * block :] = 0

    def from_payloads(self, payloads: np.ndarray, g: KvGeometry) -> np.ndarray:
        k = payloads.shape[0]
        block = g.block_tokens
        if payloads.strides[1] != 1:
            payloads = np.ascontiguousarray(payloads)
        values = payloads.view(STORAGE_DTYPES[g.dtype])  # rows may be apart (crc32c between)
        values = values.reshape(k, g.layers, 2, g.kv_heads, block, g.head_dim)
        out = values.transpose(1, 2, 3, 0, 4, 5)  # (L, 2, H, k, block, D)
        return out.reshape(g.layers, 2, g.kv_heads, k * block, g.head_dim)  # one copy

    def decode(self, stored: np.ndarray, g: KvGeometry) -> torch.Tensor:
        array = _writable(stored)  # a copy only where not contiguous or read-only
        if g.dtype == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)

    def trim(self, stored: np.ndarray, tokens: int, g: KvGeometry) -> np.ndarray:
        return stored[:, :, :, :tokens]

    def stored_bytes(self, tokens: int, g: KvGeometry) -> int:
        per_token = g.layers * 2 * g.kv_heads * g.head_dim * STORAGE_DTYPES[g.dtype].itemsize
        return tokens * per_token


def _writable(array: np.ndarray) -> np.ndarray:
    """``array`` C-contiguous and writable (torch shares its memory), copied only if needed."""
    array = np.ascontiguousarray(array)
    return array if array.flags.writeable else array.copy()


# ---------------------------------------------------------------------------- quantized


class QuantizedCodec(KvCodec):
    """``bits``-bit asymmetric quantization within each block: keys per channel (over the
    block's tokens), values per token (over ``head_dim``); keys stored before RoPE.

    A block's payload (one inner chunk, ``B = block_tokens``; little-endian), in this order:

    ============  ==================  =============================================
    section       shape               contents
    ============  ==================  =============================================
    key codes     (L, H, B, D)        ``bits`` per value (int4: two per byte, the
                                      even dim in the low nibble)
    value codes   (L, H, B, D)        the same
    key lo        (L, H, D) float16   per channel: the minimum, rounded down
    key step      (L, H, D) float16   per channel: (max - lo) / levels, rounded up
    value lo      (L, H, B) float16   per token
    value step    (L, H, B) float16   per token
    ============  ==================  =============================================

    A block is self-contained (decodable alone, by a ranged read) and has its crc32c. The last
    block of an entry is padded with copies of the entry's last token (so padding never widens
    a channel's range); padded tokens decode to values that are never served. The stored
    values of an entry are its blocks' payloads, ``(blocks, payload_bytes)`` uint8; a shard
    array is ``(slots, width / B, payload_bytes)`` uint8 with one block per inner chunk.
    """

    bits: ClassVar[int]
    keys_at_zero = True
    default_block_tokens = 16
    lossless = False
    _table_block_axis: ClassVar[int] = 0  # the blocks' axis of :meth:`_read_tables`' tensors

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    def _code_bytes(self, g: KvGeometry) -> int:
        return g.layers * g.kv_heads * g.block_tokens * g.head_dim * self.bits // 8

    def _sections(self, g: KvGeometry) -> list[tuple[str, int]]:
        """A block's payload sections ``(name, bytes)`` in order: the codes, then the scales."""
        codes = self._code_bytes(g)
        return [("k_codes", codes), ("v_codes", codes), *self._scale_sections(g)]

    def _scale_sections(self, g: KvGeometry) -> list[tuple[str, int]]:
        """The scales' sections: a float16 minimum and step per key channel and value token."""
        lh = g.layers * g.kv_heads
        return [
            ("k_lo", lh * g.head_dim * 2),
            ("k_step", lh * g.head_dim * 2),
            ("v_lo", lh * g.block_tokens * 2),
            ("v_step", lh * g.block_tokens * 2),
        ]

    def _quantize_halves(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """Float32 keys and values ``(k, L, H, B, D)`` -> the payload's sections in order
        (:meth:`_sections`), each ``(k, ...)``: keys per channel (over ``B``), values per
        token (over ``D``)."""
        k_codes, k_lo, k_step = quantize(keys, 3, self.levels)
        v_codes, v_lo, v_step = quantize(values, 4, self.levels)
        scales = [k_lo, k_step, v_lo, v_step]
        return [self._pack(k_codes), self._pack(v_codes), *(s.view(torch.uint8) for s in scales)]

    def _scales(
        self, cut: dict[str, torch.Tensor], b0: int, b1: int, g: KvGeometry
    ) -> tuple[torch.Tensor, ...]:
        """Blocks ``b0..b1``'s scales as float32: key ``lo`` and ``step`` ``(nb, L, H, 1, D)``,
        value ``lo`` and ``step`` ``(nb, L, H, B, 1)``."""
        nb, lay, heads = b1 - b0, g.layers, g.kv_heads

        def f32(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            half = cut[name][b0:b1].contiguous().view(torch.float16)
            return half.to(torch.float32).reshape(shape)

        key_shape, value_shape = (
            (nb, lay, heads, 1, g.head_dim),
            (nb, lay, heads, g.block_tokens, 1),
        )
        return (
            f32("k_lo", key_shape),
            f32("k_step", key_shape),
            f32("v_lo", value_shape),
            f32("v_step", value_shape),
        )

    def storage_dtype(self, dtype: str) -> np.dtype:
        return np.dtype("u1")

    def payload_bytes(self, g: KvGeometry) -> int:
        return sum(n for _, n in self._sections(g))

    def array_shape(self, g: KvGeometry, slots: int, width: int) -> tuple[int, ...]:
        return (slots, width // g.block_tokens, self.payload_bytes(g))

    def chunk_shape(self, g: KvGeometry) -> tuple[int, ...]:
        return (1, 1, self.payload_bytes(g))

    def dimension_names(self) -> tuple[str, ...]:
        return BYTE_AXES

    def width_of(self, shape: tuple[int, ...], block: int) -> int:
        return shape[1] * block

    def zarr_selection(self, slot: int, t0: int, t1: int, block: int) -> tuple[Any, ...]:
        return (slot, slice(t0 // block, -(-t1 // block)))

    def trim(self, stored: np.ndarray, tokens: int, g: KvGeometry) -> np.ndarray:
        return stored[: max(1, -(-tokens // g.block_tokens))]

    def stored_bytes(self, tokens: int, g: KvGeometry) -> int:
        return max(1, -(-tokens // g.block_tokens)) * self.payload_bytes(g)

    def block_count(self, stored: np.ndarray, g: KvGeometry) -> int:
        return int(stored.shape[0])

    # ------------------------------------------------------------------ encode

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes ``(..., D)`` -> bytes: int8 as they are, int4 two per byte, int2
        four."""
        if self.bits == 8:
            return codes
        if self.bits == 2:  # four per byte, the first dim in the low bits
            return (
                codes[..., 0::4]
                | (codes[..., 1::4] << 2)
                | (codes[..., 2::4] << 4)
                | (codes[..., 3::4] << 6)
            )
        return codes[..., 0::2] | (codes[..., 1::2] << 4)

    def _unpack(self, packed: torch.Tensor, dim: int) -> torch.Tensor:
        """Stored code bytes ``(..., dim * bits / 8)`` -> the codes as float32 ``(..., dim)``
        (int4: the even dim from the low nibble)."""
        if self.bits == 8:
            return packed.to(torch.float32)
        if self.bits == 2:
            shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
            codes = (packed.unsqueeze(-1) >> shifts) & 3  # (..., dim / 4, 4)
            return codes.reshape(*packed.shape[:-1], dim).to(torch.float32)
        # each byte widened to a 16-bit word holding its low nibble in the low byte and its
        # high nibble in the high byte: read as bytes (little-endian), the codes in order;
        # contiguous operations only (strided writes of each nibble took 1.5x as long)
        if sys.byteorder != "little":  # the word trick below reads the low byte first
            out = torch.empty((*packed.shape[:-1], dim), dtype=torch.float32)
            out[..., 0::2] = packed & 0x0F
            out[..., 1::2] = packed >> 4
            return out
        word = packed.to(torch.int16)
        word = (word & 0x0F) | ((word >> 4) << 8)
        return word.view(torch.uint8).to(torch.float32)

    def view(self, kv: torch.Tensor, g: KvGeometry) -> np.ndarray:
        """Quantize ``kv`` (keys already rotated to position 0) into its blocks' payloads
        ``(blocks, payload_bytes)`` uint8."""
        x = kv.detach().to("cpu", torch.float32)
        layers, _, heads, n, dim = x.shape
        block = g.block_tokens
        k = max(1, -(-n // block))
        if k * block > n:  # pad with copies of the last token: ranges unchanged
            last = x[:, :, :, n - 1 : n].expand(layers, 2, heads, k * block - n, dim)
            x = torch.cat([x, last], dim=3)
        x = x.reshape(layers, 2, heads, k, block, dim).permute(3, 1, 0, 2, 4, 5)
        parts = self._quantize_halves(x[:, 0], x[:, 1])  # keys, values (k, L, H, B, D)
        payload = torch.cat([p.reshape(k, -1) for p in parts], dim=1)
        return payload.numpy()

    def encode(self, kv: torch.Tensor, g: KvGeometry) -> np.ndarray:
        return self.view(kv, g)  # already a new C-contiguous array

    def write_blocks(
        self, stored: np.ndarray, g: KvGeometry, out: np.ndarray, start: int, row: int
    ) -> None:
        k, payload = stored.shape
        rows = np.ndarray((k, payload), dtype=np.uint8, buffer=out, offset=start, strides=(row, 1))
        rows[...] = stored

    # ------------------------------------------------------------------ decode

    def from_payloads(self, payloads: np.ndarray, g: KvGeometry) -> np.ndarray:
        return np.asarray(payloads, dtype=np.uint8).reshape(-1, self.payload_bytes(g))

    def decode(self, stored: np.ndarray, g: KvGeometry) -> torch.Tensor:
        """Blocks' payloads ``(k, payload_bytes)`` -> ``(L, 2, H, k * B, D)`` in ``g.dtype``,
        keys at position 0 (before RoPE)."""
        raw = torch.from_numpy(_writable(stored))
        k = raw.shape[0]
        lay, heads, block, dim = g.layers, g.kv_heads, g.block_tokens, g.head_dim
        cut = self._cut(raw, g)
        k_lo, k_step, v_lo, v_step = self._scales(cut, 0, k, g)
        code_shape = (k, lay, heads, block, dim * self.bits // 8)
        # each half dequantized in float32, then written once, permuted and rounded, into the
        # result (the rounding of float32 to the model dtype as before, one pass fewer each)
        out = torch.empty((lay, 2, heads, k, block, dim), dtype=TORCH_DTYPES[g.dtype])
        keys = dequantize(self._unpack(cut["k_codes"].reshape(code_shape), dim), k_lo, k_step)
        out[:, 0].copy_(keys.permute(1, 2, 0, 3, 4))
        values = dequantize(self._unpack(cut["v_codes"].reshape(code_shape), dim), v_lo, v_step)
        out[:, 1].copy_(values.permute(1, 2, 0, 3, 4))
        return out.view(lay, 2, heads, k * block, dim)

    def decode_tokens(
        self,
        reads: Sequence[np.ndarray],
        g: KvGeometry,
        picks: Sequence[tuple[int, int, int, int]],
        out: torch.Tensor,
        rope: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> bool:
        """:meth:`KvCodec.decode_tokens` dequantizing only the picked tokens (a nugget of 24
        tokens in 16-token blocks touches 32-48 tokens :meth:`decode` would dequantize), bit for
        bit :meth:`decode`'s values (``tests/inference/test_kv_codecs.py``,
        ``test_kv_kernels.py``): compiled (``storage/kv/kernels.py``, one pass per token) into a
        bfloat16 or float32 ``out`` on the CPU (keys rotated by ``rope`` if given), by tensor
        operations otherwise (not rotated)."""
        used = sorted({i for i, s, e, _ in picks if e > s})
        from coinrag.storage.kv import kernels  # numba, imported where a decode needs it

        target = kernels.target_of(out)
        if target is None:
            if used:
                self._decode_tokens_tensors(reads, used, g, picks, out)
            return False
        if used:
            self._decode_tokens_compiled(reads, used, g, picks, *target, rope)
        return rope is not None

    def _joined_tables(
        self, reads: Sequence[np.ndarray], used: list[int], g: KvGeometry
    ) -> tuple[dict[int, int], tuple[torch.Tensor, ...]]:
        """:meth:`_read_tables` of every block of the ``used`` reads, built once for a request
        (a coinrag request: ten 17-token slices): each used read's first row in them, and the
        tables."""
        at, size = self._section_offsets(g), dict(self._sections(g))
        sizes = [int(reads[i].shape[0]) for i in used]
        first = dict(zip(used, itertools.accumulate(sizes, initial=0), strict=False))
        joined = {  # only the tables' bytes copied, not whole payloads
            name: torch.from_numpy(
                np.concatenate([reads[i][:, at[name] : at[name] + size[name]] for i in used])
            )
            for name in self._table_sections(g)
        }
        return first, self._read_tables(joined, sum(sizes), g)

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
        """The picks by :func:`kernels.uniform_span` into ``target`` (:func:`kernels.target_of`),
        from the request's tables (:meth:`_joined_tables`, as float32 arrays: key tables
        ``(blocks, L, H, D)``, value tables ``(blocks, L, H, B)``), keys rotated by ``rope``."""
        first, tables = self._joined_tables(reads, used, g)
        rows = sum(int(reads[i].shape[0]) for i in used)
        lay, heads, dim, block = g.layers, g.kv_heads, g.head_dim, g.block_tokens
        k_lo, k_step = (t.reshape(rows, lay, heads, dim).numpy() for t in tables[:2])
        v_lo, v_step = (t.reshape(rows, lay, heads, block).numpy() for t in tables[2:])
        from coinrag.storage.kv import kernels

        at = self._section_offsets(g)
        offsets, tables = (at["k_codes"], at["v_codes"]), (k_lo, k_step, v_lo, v_step)
        angles = kernels.rope_tables(rope, target)
        for i, s, e, to in (p for p in picks if p[2] > p[1]):
            span = (first[i], s, e, to, block)
            kernels.uniform_span(reads[i], offsets, self.bits, tables, span, target, bf16, angles)

    def _section_offsets(self, g: KvGeometry) -> dict[str, int]:
        """Each payload section's first byte (:meth:`_sections`' order)."""
        names = [name for name, _ in self._sections(g)]
        starts = itertools.accumulate((n for _, n in self._sections(g)), initial=0)
        return dict(zip(names, starts, strict=False))

    def _decode_tokens_tensors(
        self,
        reads: Sequence[np.ndarray],
        used: list[int],
        g: KvGeometry,
        picks: Sequence[tuple[int, int, int, int]],
        out: torch.Tensor,
    ) -> None:
        """The picks by tensor operations (:meth:`_dequantize_tokens`, each half in float32
        written once into ``out``), every pick taking its read's rows of the request's tables
        (:meth:`_joined_tables`)."""
        first, tables = self._joined_tables(reads, used, g)
        cuts = {i: self._cut(torch.from_numpy(_writable(reads[i])), g) for i in used}
        axis = self._table_block_axis
        for i, s, e, at in picks:
            if e <= s:
                continue
            size = int(reads[i].shape[0])
            mine = tuple(t.narrow(axis, first[i], size) for t in tables)
            keys, values = self._dequantize_tokens(cuts[i], s, e, g, mine)
            out[:, 0, :, at : at + e - s].copy_(keys)
            out[:, 1, :, at : at + e - s].copy_(values)

    def _table_sections(self, g: KvGeometry) -> list[str]:
        """The payload sections :meth:`_read_tables` reads: the scales'."""
        return [name for name, _ in self._scale_sections(g)]

    def _read_tables(
        self, cut: dict[str, torch.Tensor], blocks: int, g: KvGeometry
    ) -> tuple[torch.Tensor, ...]:
        """What decoding a block's tokens needs besides their codes, for every one of the
        ``blocks`` blocks of ``cut`` (:meth:`_table_sections` only): :meth:`_scales`."""
        return self._scales(cut, 0, blocks, g)

    def _dequantize_tokens(
        self,
        cut: dict[str, torch.Tensor],
        s: int,
        e: int,
        g: KvGeometry,
        scales: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 keys and values ``(L, H, e - s, D)`` of tokens ``[s, e)`` of the blocks in
        ``cut`` (:meth:`_cut`), from the blocks that hold them only; ``scales``:
        :meth:`_read_tables` of every block of ``cut``."""
        lay, heads, block, dim = g.layers, g.kv_heads, g.block_tokens, g.head_dim
        b0, b1 = s // block, -(-e // block)
        nb, first = b1 - b0, b0 * block

        def tokens(name: str, per_token: int) -> torch.Tensor:
            """Section ``name`` of blocks b0..b1 as ``(L, H, e - s, per_token)``."""
            part = cut[name][b0:b1].reshape(nb, lay, heads, block, per_token)
            part = part.permute(1, 2, 0, 3, 4).reshape(lay, heads, nb * block, per_token)
            return part[:, :, s - first : e - first]

        def per_token(scale: torch.Tensor) -> torch.Tensor:
            """A value scale ``(nb, L, H, B, 1)`` -> ``(L, H, e - s, 1)``."""
            scale = scale.permute(1, 2, 0, 3, 4).reshape(lay, heads, nb * block, 1)
            return scale[:, :, s - first : e - first]

        width = dim * self.bits // 8
        # scales widened to float32 per block (widening float16 is slow on a CPU)
        k_lo, k_step, v_lo, v_step = (t[b0:b1] for t in scales)
        k_lo, k_step = k_lo.permute(1, 2, 0, 3, 4), k_step.permute(1, 2, 0, 3, 4)  # (L,H,nb,1,D)
        if 4 * nb * block <= 5 * (e - s):  # (nearly) whole blocks: dequantized as blocks,
            # each scale broadcast over its block's tokens (whole chunks: 0.7x the time)
            codes = cut["k_codes"][b0:b1].reshape(nb, lay, heads, block, width)
            keys = dequantize(self._unpack(codes.permute(1, 2, 0, 3, 4), dim), k_lo, k_step)
            keys = keys.reshape(lay, heads, nb * block, dim)[:, :, s - first : e - first]
        else:  # a short span in its blocks (a nugget): each scale spread to its tokens only
            token_block = torch.arange(s - first, e - first) // block
            keys = dequantize(
                self._unpack(tokens("k_codes", width), dim),
                k_lo[..., 0, :].index_select(2, token_block),
                k_step[..., 0, :].index_select(2, token_block),
            )
        values = dequantize(
            self._unpack(tokens("v_codes", width), dim), per_token(v_lo), per_token(v_step)
        )
        return keys, values

    def _cut(self, raw: torch.Tensor, g: KvGeometry) -> dict[str, torch.Tensor]:
        """Blocks' payloads ``(k, payload_bytes)`` -> each section's bytes ``(k, n)``."""
        at = self._section_offsets(g)
        return {name: raw[:, at[name] : at[name] + n] for name, n in self._sections(g)}

    def relative_error_bound(self, group: int) -> float:
        """The bound on ``‖x̂ − x‖ / ‖x‖`` over a layer for groups of ``group`` values (before
        the model dtype's rounding): ``sqrt(group / 2) / levels``, widened for float16's
        rounding of the step (up, < 2**-10 relative) and of the minimum (down, < 2**-10 of it).

        E.g. int4 values over ``head_dim`` 64: ``sqrt(32) / 15`` = 0.377 (SmolLM2 measures
        0.10 on average, 0.145 in its worst layer); int8 keys over 16-token blocks: 0.011."""
        return ((group / 2) ** 0.5 * (1 + 2**-9) + 2**-8) / self.levels


class Int8Codec(QuantizedCodec, name="int8"):
    """8-bit codes (256 levels): ~0.58 of the raw bfloat16 bytes with 16-token blocks."""

    bits = 8


class Int4Codec(QuantizedCodec, name="int4"):
    """4-bit codes (16 levels), two per byte: ~0.33 of the raw bfloat16 bytes (16-token blocks)."""

    bits = 4


def codec_named(name: str) -> KvCodec:
    """The codec registered as ``name`` (ValueError naming the known ones otherwise)."""
    return KvCodec.registry[name]()


_IDENTITY = IdentityCodec()


def storage_view(kv: torch.Tensor) -> np.ndarray:
    """A KV tensor as a numpy view in the stored dtype of the identity codec (bfloat16 ->
    uint16 bits), no copy on CPU; strides kept (not necessarily contiguous)."""
    return _IDENTITY.view(kv)


def to_storage(kv: torch.Tensor) -> np.ndarray:
    """A KV tensor as the C-contiguous numpy array the identity codec stores."""
    return np.ascontiguousarray(_IDENTITY.view(kv))


def from_storage(array: np.ndarray, dtype: str) -> torch.Tensor:
    """The inverse of :func:`to_storage` (a copy only where the array is not contiguous)."""
    array = np.ascontiguousarray(array)
    if dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def entry_checksum(stored: np.ndarray) -> str:
    """sha256 of an entry's stored bytes (C-contiguous)."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(stored)).cast("B")).hexdigest()
