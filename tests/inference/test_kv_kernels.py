"""The compiled slice decode of the quantized KV codecs (``storage/kv/kernels.py``, issue 36):
bit for bit the tensor path's values, on SmolLM2's real KV and on synthetic entries with
outlier channels, from read-only reads (what a ranged read gives) into any strides of a
bfloat16 or float32 context; the rounding to bfloat16 is torch's for every float32 value but
NaN (ties, infinities, subnormals; a decode never makes a NaN); spans and targets the kernels
would read or write out of bounds, and corrupt ``int2mix`` widths, are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kv_codecs import DOCS, _synthetic

from coinrag.storage.jit import round_bf16
from coinrag.storage.kv import KvLayout, codec_named, kernels

QUANTIZED = ["int8", "int4", "int2", "int2mix"]


@pytest.fixture(scope="module")
def smollm2_keys_at_zero() -> torch.Tensor:
    """SmolLM2-135M's KV of the first 300 tokens of a FAQ text (bfloat16, its own forward),
    keys rotated to position 0: what the store quantizes. 300 tokens: a partial last block."""
    from coinrag.inference.model.encode import from_cache, keys_to_position_zero
    from coinrag.inference.model.loading import load_model
    from coinrag.inference.rope import RopeSpec

    torch.set_num_threads(1)
    loaded = load_model(None, dtype="bfloat16")
    ids = loaded.tokenizer(DOCS.read_text(encoding="utf-8"))["input_ids"][:300]
    with torch.inference_mode():
        out = loaded.model(input_ids=torch.tensor([ids]), use_cache=True)
    kv = from_cache(out.past_key_values)
    return keys_to_position_zero(kv, RopeSpec.from_config(loaded.model.config), 0)


def _read_only(stored: np.ndarray) -> np.ndarray:
    """Stored blocks as a ranged read returns them: a read-only view of rows (payload and crc)."""
    rows = np.zeros((stored.shape[0], stored.shape[1] + 4), dtype=np.uint8)
    rows[:, : stored.shape[1]] = stored
    view = rows[:, : stored.shape[1]]
    view.setflags(write=False)
    return view


def _spans(n: int, block: int) -> list[tuple[int, int]]:
    """Token ranges of an ``n``-token entry in ``block``-token blocks: a nugget inside a block,
    one across a block boundary, one token, whole blocks, the padded end, an empty pick."""
    padded = -(-n // block) * block
    return [
        (1, min(n, 1 + 17)),
        (block - 5, block + 12),
        (n // 2, n // 2 + 1),
        (0, min(padded, 2 * block)),
        (n - 3, padded),
        (7, 7),
    ]


def _paths(
    codec, reads: list[np.ndarray], layout: KvLayout, picks, out_of
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same picks decoded by the compiled path and by the tensor path, each into its own
    buffer from ``out_of()`` (a buffer and the view the picks go to)."""
    used = sorted({i for i, s, e, _ in picks if e > s})
    compiled_buffer, compiled_out = out_of()
    target = kernels.target_of(compiled_out)
    assert target is not None
    codec._decode_tokens_compiled(reads, used, layout, picks, *target)
    tensor_buffer, tensor_out = out_of()
    codec._decode_tokens_tensors(reads, used, layout, picks, tensor_out)
    return compiled_buffer, tensor_buffer


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


@pytest.mark.heavy  # 16 cases on a 300-token forward: ~45 s with numba's cache cold
@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("block", [16, 64])
def test_compiled_decode_equals_the_tensor_path_on_smollm2(
    smollm2_keys_at_zero, name, dtype, block
) -> None:
    """SmolLM2's real KV: every pick of two reads, back to back after a 3-token prefix in a
    larger context buffer (strided views), the same bits by both paths, nothing written
    outside the picks."""
    pre = smollm2_keys_at_zero.to(getattr(torch, dtype))
    layers, _, heads, n, dim = pre.shape
    layout = KvLayout("m", "p", layers, heads, dim, dtype, block, 4, name)
    codec = codec_named(name)
    reads = [
        _read_only(codec.encode(pre, layout)),
        _read_only(codec.encode(pre[:, :, :, : n // 3], layout)),
    ]
    picks, at = [], 3
    for i, entry_tokens in ((0, n), (1, n // 3)):
        for s, e in _spans(entry_tokens, block):
            if e <= -(-entry_tokens // block) * block:
                picks.append((i, s, e, at))
                at += max(0, e - s)
    total = at + 2

    def out_of() -> tuple[torch.Tensor, torch.Tensor]:
        buffer = torch.full((layers, 2, heads, total, dim), 7.0, dtype=pre.dtype)
        return buffer, buffer

    compiled, tensors = _paths(codec, reads, layout, picks, out_of)
    assert torch.equal(_bits(compiled), _bits(tensors))
    assert (compiled[..., :3, :] == 7.0).all() and (compiled[..., at:, :] == 7.0).all()
    decoded = codec.decode(reads[0], layout)
    i, s, e, a = picks[0]
    assert torch.equal(_bits(compiled[..., a : a + e - s, :]), _bits(decoded[..., s:e, :]))
    assert not torch.equal(compiled[..., a : a + e - s, :], pre[..., s:e, :])  # lossy: can fail


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_decode_into_a_transposed_context(name, dtype) -> None:
    """A target whose head_dim is not its last-stride axis (any strides, as ``decode_tokens``
    promises): both paths write the same bits; synthetic entries with an outlier key channel
    and a large value dim (``test_kv_codecs._synthetic``), head_dim 8."""
    codec = codec_named(name)
    layout = KvLayout("m", "p", 3, 2, 8, str(dtype).removeprefix("torch."), 16, 4, name)
    reads = [_read_only(codec.encode(_synthetic(n, dtype, seed=n), layout)) for n in (37, 70)]
    picks = [(1, 20, 66, 0), (0, 3, 30, 46), (1, 0, 5, 73), (0, 36, 37, 78)]

    def out_of() -> tuple[torch.Tensor, torch.Tensor]:
        buffer = torch.full((3, 2, 2, 8, 90), -1.0, dtype=dtype)  # (L, 2, H, D, T)
        return buffer, buffer.transpose(-1, -2)

    compiled, tensors = _paths(codec, reads, layout, picks, out_of)
    assert torch.equal(_bits(compiled), _bits(tensors))
    assert (compiled[..., 79:] == -1.0).all()


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary", [8, 4])
def test_a_decode_that_rotates_equals_the_decode_then_the_rotation(name, dtype, rotary) -> None:
    """``decode_tokens(..., rope)`` rotates each key as it places it: the same bits as the
    decode followed by the key rotation (``inference/rope/kernel.py``) of the placed keys,
    partial rotary too (dims past ``rotary`` not rotated); values untouched. Tables too short
    for the target are refused before anything is written."""
    from coinrag.inference.rope.kernel import rotate_compiled

    codec = codec_named(name)
    layout = KvLayout("m", "p", 3, 2, 8, str(dtype).removeprefix("torch."), 16, 4, name)
    reads = [_read_only(codec.encode(_synthetic(n, dtype, seed=n), layout)) for n in (37, 70)]
    picks = [(1, 20, 66, 0), (0, 3, 30, 46), (1, 0, 5, 73), (0, 36, 37, 78)]
    theta = torch.rand(79, rotary // 2, generator=torch.Generator().manual_seed(5)) * 500
    rope = (theta.cos().numpy(), theta.sin().numpy())
    fused = torch.zeros((3, 2, 2, 79, 8), dtype=dtype)
    assert codec.decode_tokens(reads, layout, picks, fused, rope) is True
    plain = torch.zeros_like(fused)
    assert codec.decode_tokens(reads, layout, picks, plain) is False
    assert torch.equal(_bits(fused[:, 1]), _bits(plain[:, 1]))
    assert not torch.equal(fused[:, 0], plain[:, 0])
    rotate_compiled(plain[:, 0], theta.cos(), theta.sin(), plain[:, 0])
    assert torch.equal(_bits(fused), _bits(plain))
    short = (rope[0][:78], rope[1][:78])
    untouched = torch.zeros_like(fused)
    with pytest.raises(ValueError, match="rotation tables"):
        codec.decode_tokens(reads, layout, picks, untouched, short)
    assert not untouched.any()


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_float16_context_is_decoded_by_the_tensor_path(name) -> None:
    """float16 has no compiled target: ``decode_tokens`` writes what ``decode`` gives."""
    codec = codec_named(name)
    layout = KvLayout("m", "p", 3, 2, 8, "float16", 16, 4, name)
    read = codec.encode(_synthetic(37, torch.float16), layout)
    out = torch.zeros((3, 2, 2, 20, 8), dtype=torch.float16)
    assert kernels.target_of(out) is None
    codec.decode_tokens([read], layout, [(0, 10, 30, 0)], out)
    assert torch.equal(out, codec.decode(read, layout)[..., 10:30, :])


def test_the_bfloat16_rounding_is_torchs_for_every_bit_pattern_class() -> None:
    """Every float32 upper half but the NaNs (sign, exponent, 7 mantissa bits: every exponent,
    subnormals and infinities included) with lower halves below, at and above the tie, and the
    tie's neighbours: the kernels' rounding gives torch's bfloat16 bits (a dequantized value is
    never NaN: the kernels do not handle it)."""
    upper = np.arange(2**16, dtype=np.uint32) << np.uint32(16)
    lower = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    bits = (upper[:, None] | lower[None, :]).reshape(-1)
    values = bits.view(np.float32)
    bits, values = bits[~np.isnan(values)], values[~np.isnan(values)]
    got = np.empty(values.shape, dtype=np.uint16)
    round_bf16(bits, got)
    want = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    assert np.array_equal(got, want.view(np.uint16))
    assert len(got) > 6 * 65_000 and (got == 0x7F80).any()  # +inf, from float32 max rounded up


@pytest.mark.parametrize("name", QUANTIZED)
def test_spans_and_targets_out_of_bounds_are_refused(name) -> None:
    """What the kernels would read or write out of bounds (they index unchecked): a span past
    the read's blocks, a target too short or of another geometry; nothing written."""
    codec = codec_named(name)
    layout = KvLayout("m", "p", 3, 2, 8, "bfloat16", 16, 4, name)
    read = codec.encode(_synthetic(37, torch.bfloat16), layout)  # 3 blocks of 16
    out = torch.full((3, 2, 2, 20, 8), 7.0, dtype=torch.bfloat16)
    for picks, target in (
        ([(0, 40, 50, 0)], out),  # tokens 40-50: a 4th block the read does not hold
        ([(0, 0, 16, 10)], out),  # 16 tokens at 10 of a 20-token target
        ([(0, 0, 4, 0)], torch.zeros((3, 2, 2, 20, 16), dtype=torch.bfloat16)),  # head_dim 16
        ([(0, 0, 4, 0)], torch.zeros((2, 2, 2, 20, 8), dtype=torch.bfloat16)),  # 2 layers
    ):
        with pytest.raises(ValueError, match="KV t"):
            codec.decode_tokens([read], layout, picks, target)
    assert (out == 7.0).all()


def test_int2mix_blocks_with_corrupt_key_widths_are_refused() -> None:
    """Widths other than a quarter 4-bit and a half 2-bit would index past a token's codes (a
    block whose crc32c holds never has them: the encoder writes these counts)."""
    codec = codec_named("int2mix")
    layout = KvLayout("m", "p", 3, 2, 8, "bfloat16", 16, 4, "int2mix")
    read = codec.encode(_synthetic(37, torch.bfloat16), layout).copy()
    at = codec._section_offsets(layout)["k_widths"]
    read[:, at : at + 3 * 2 * 8 // 4] = 0xAA  # every key channel 4-bit
    out = torch.zeros((3, 2, 2, 8, 8), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="key widths"):
        codec.decode_tokens([read], layout, [(0, 2, 10, 0)], out)
