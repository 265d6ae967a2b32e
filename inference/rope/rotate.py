"""Re-rotation of cached RoPE keys to new positions (``inference/rope/__init__.py`` states the
method and its precision): :func:`rerotate_keys` (absolute old and new positions) and
:func:`shift_keys` (by a delta)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from coinrag.inference.rope.frequencies import UnsafeRerotation

if TYPE_CHECKING:
    from coinrag.inference.rope.spec import RopeSpec

_DELTA_CACHE_MAX = 4096


def _as_positions(positions: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    pos = torch.as_tensor(positions)
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise TypeError(f"{name} must be integer positions, got dtype {pos.dtype}")
    if pos.dim() != 1:
        raise ValueError(f"{name} must have shape (tokens,), got {tuple(pos.shape)}")
    pos = pos.to(device="cpu", dtype=torch.int64)
    if pos.numel() and int(pos.min()) < 0:
        raise ValueError(f"{name} must be >= 0")
    return pos


def _check_keys(keys: torch.Tensor, spec: RopeSpec) -> None:
    if keys.dim() < 3:
        raise ValueError(f"keys must be (..., kv_heads, tokens, head_dim), got {tuple(keys.shape)}")
    if keys.shape[-1] != spec.head_dim:
        raise ValueError(f"keys head_dim {keys.shape[-1]} != spec.head_dim {spec.head_dim}")


def _check_seq_len(seq_len: int | None, positions: torch.Tensor, name: str) -> None:
    if seq_len is not None and positions.numel() and int(seq_len) <= int(positions.max()):
        raise ValueError(
            f"{name}={seq_len} must exceed the largest position {int(positions.max())}"
        )


def _rotate(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Rotate ``keys`` (..., tokens, head_dim) by per-token angles given as float32 ``cos``/``sin``
    of shape (tokens, rotary_dim // 2); same as ``k * cos2 + rotate_half(k) * sin2`` with
    ``cos2 = cat(cos, cos)``. Computed in float32, returned in the keys' dtype; differentiable
    when ``keys`` requires grad."""
    k = keys.to(torch.float32)
    half = rotary_dim // 2
    cos = cos.to(k.device)
    sin = sin.to(k.device)
    x1 = k[..., :half]
    x2 = k[..., half:rotary_dim]
    if torch.is_grad_enabled() and k.requires_grad:  # differentiable path (training)
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin, k[..., rotary_dim:]]
        return torch.cat(parts, dim=-1).to(keys.dtype)
    out = torch.empty_like(k)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, -sin)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=out[..., half:rotary_dim]).addcmul_(x1, sin)  # x2 cos + x1 sin
    if rotary_dim < k.shape[-1]:
        out[..., rotary_dim:] = k[..., rotary_dim:]
    return out.to(keys.dtype)


_ROTATE_TILE = 1 << 18  # values per pass of _rotate_tiled: a float32 tile and its result in L2


def _rotate_tiled(
    keys: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`_rotate` without autograd, a few leading indices (layers) at a time when ``keys``
    is large, about :data:`_ROTATE_TILE` values a pass: the float32 copy and the products of a
    tile stay in the core's cache instead of streaming the whole tensor through memory four
    times (a 512-token chunk of SmolLM2's 30 layers: 4.6-5.4 against 8.0-9.2 ms on one core,
    a layer a pass), and a small tensor takes few passes (10 nugget slices: 4, not 30).
    Elementwise, so the same values bit for bit. ``out``: where to write the result (``keys``
    itself too: each tile is read whole before it is written), else a new tensor. On the CPU
    without a gradient to keep, the compiled kernel instead (``inference/rope/kernel.py``: one
    pass, the same values up to one float32 rounding)."""
    from coinrag.inference.rope import kernel  # numba loads on the first rotation

    if kernel.applies(keys, out):
        return kernel.rotate_compiled(keys, cos, sin, out)
    if keys.dim() < 4 or keys.numel() <= _ROTATE_TILE or keys.requires_grad:
        rotated = _rotate(keys, cos, sin, rotary_dim)
        return rotated if out is None else out.copy_(rotated)
    out = torch.empty_like(keys) if out is None else out
    per_layer = keys[0].numel()
    step = max(1, _ROTATE_TILE // per_layer)
    for i in range(0, keys.shape[0], step):
        out[i : i + step] = _rotate(keys[i : i + step], cos, sin, rotary_dim)
    return out


def rerotate_keys(
    keys: torch.Tensor,
    old_positions: torch.Tensor | Sequence[int],
    new_positions: torch.Tensor | Sequence[int],
    spec: RopeSpec,
    *,
    old_seq_len: int | None = None,
    new_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Move cached (post-RoPE) keys from ``old_positions`` to ``new_positions``.

    Args:
        keys: ``(..., kv_heads, tokens, head_dim)``, any leading dims (batch, layers, ...),
            any float dtype, any device; as transformers caches them (after RoPE, including
            ``attention_scaling``).
        old_positions: ``(tokens,)`` integer positions the keys were encoded at.
        new_positions: ``(tokens,)`` integer target positions.
        spec: the model's :class:`RopeSpec`.
        old_seq_len: dynamic / longrope only: length of the forward that produced the cache,
            i.e. its largest position id + 1 (e.g. ``offset + chunk_len`` for a chunk encoded
            at ``offset``), not just the slice's. Ignored for the other types.
        new_seq_len: dynamic / longrope only: length of the forward whose keys are to be
            reproduced (largest position id + 1 there). Ignored for the other types.
        out: where to write the result (same shape and dtype; ``keys`` itself moves them in
            place; no autograd), else a new tensor.

    Returns:
        ``out`` or a new tensor of the same shape and dtype as ``keys``: the keys the model
        computes for the same tokens at ``new_positions`` (up to float32 rounding). Only the
        RoPE rotation is changed; ``attention_scaling`` is not applied again.

    Rope types:
        default, linear, yarn, llama3: frequencies are position independent; exact.
        longrope: exact. The frequency set (short or long factors) is chosen per forward from
            its length exactly as transformers does (long when length >
            ``original_max_position_embeddings``); ``attention_scaling`` is the same for both.
        dynamic (NTK): handled exactly, given the lengths: the frequencies are those of a
            forward of length ``old_seq_len`` / ``new_seq_len`` computed by transformers' own
            dynamic init function; keys are un-rotated at the old and rotated at the new
            frequencies. Both lengths are required (:class:`UnsafeRerotation` otherwise),
            because the same positions get different frequencies depending on how long the
            forward was. Caveat (transformers' own behaviour): a rotary module that an earlier,
            longer forward has grown keeps the grown frequencies for lengths in
            ``(max_position_embeddings, grown]``; this reproduces a fresh module, which is
            what coinrag's forwards run with (:func:`reset_rotary` before each sequence).

    Raises:
        UnsafeRerotation: dynamic / longrope without ``old_seq_len`` and ``new_seq_len``.
        ValueError: shape mismatches, negative positions, a seq_len not above its positions.
        TypeError: non-integer positions.
    """
    _check_keys(keys, spec)
    old = _as_positions(old_positions, "old_positions")
    new = _as_positions(new_positions, "new_positions")
    tokens = keys.shape[-2]
    if old.numel() != tokens or new.numel() != tokens:
        raise ValueError(
            f"positions must have shape ({tokens},) to match keys; got "
            f"{tuple(old.shape)} and {tuple(new.shape)}"
        )
    if spec.seq_len_dependent and (old_seq_len is None or new_seq_len is None):
        raise UnsafeRerotation(
            f"rope type {spec.rope_type!r}: frequencies depend on the forward's sequence length; "
            "pass old_seq_len (largest position id + 1 of the forward that built the cache) and "
            "new_seq_len (same for the forward being reproduced)"
        )
    _check_seq_len(old_seq_len, old, "old_seq_len")
    _check_seq_len(new_seq_len, new, "new_seq_len")
    cos, sin = rotation_cos_sin(spec, old, new, old_seq_len, new_seq_len)
    return _rotate_tiled(keys, cos, sin, spec.rotary_dim, out)


def rotation_cos_sin(
    spec: RopeSpec,
    old: torch.Tensor,
    new: torch.Tensor,
    old_seq_len: int | None = None,
    new_seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``(tokens, rotary_dim / 2)`` float32 of the rotation :func:`rerotate_keys`
    applies from ``old`` to ``new`` (``(tokens,)`` int64 positions, checked by the caller):
    the absolute angles formed as transformers forms them (a float32 product), their
    difference in float64."""
    f_old = spec.inv_freq_for(old_seq_len)
    f_new = spec.inv_freq_for(new_seq_len)
    a_old = old.to(torch.float32)[:, None] * f_old
    a_new = new.to(torch.float32)[:, None] * f_new
    theta = a_new.to(torch.float64) - a_old.to(torch.float64)
    return theta.cos().to(torch.float32), theta.sin().to(torch.float32)


def _delta_cos_sin(spec: RopeSpec, delta: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    key = ("delta", delta, inv_freq.data_ptr())
    cached = spec._cache.get(key)
    if cached is None:
        theta = float(delta) * inv_freq.to(torch.float64)
        cached = (theta.cos().to(torch.float32), theta.sin().to(torch.float32))
        if len(spec._cache) >= _DELTA_CACHE_MAX:
            spec._cache.clear()
        spec._cache[key] = cached
    return cached


def shift_keys(
    keys: torch.Tensor,
    delta: int,
    spec: RopeSpec,
    *,
    old_start: int | None = None,
    old_seq_len: int | None = None,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """Move a contiguous slice of cached keys by a constant ``delta`` positions.

    Args:
        keys: ``(..., kv_heads, tokens, head_dim)`` post-RoPE keys of a contiguous slice.
        delta: ``new_start - old_start`` (may be negative).
        spec: the model's :class:`RopeSpec`.
        old_start: position of the slice's first token when it was encoded. Given, this is
            ``rerotate_keys`` with ``old = old_start + arange(tokens)``, ``new = old + delta``:
            exact, including the model's float32 rounding of the absolute angles
            (recommended). Omitted, it is a pure rotation by ``delta * inv_freq`` (cos/sin
            cached per delta), which differs from a fresh prefill by up to
            ``~max(position) * 2**-24`` rad per pair.
        old_seq_len, new_seq_len: as in :func:`rerotate_keys` (dynamic / longrope only).

    Returns:
        Tensor of the same shape and dtype as ``keys``.

    Raises:
        UnsafeRerotation: dynamic / longrope without both seq lens, or without ``old_start``
            when the old and new forwards use different frequencies (then the rotation is not
            a function of ``delta`` alone).
    """
    _check_keys(keys, spec)
    tokens = keys.shape[-2]
    if old_start is not None:
        old = torch.arange(old_start, old_start + tokens, dtype=torch.int64)
        return rerotate_keys(
            keys, old, old + int(delta), spec, old_seq_len=old_seq_len, new_seq_len=new_seq_len
        )
    if spec.seq_len_dependent and (old_seq_len is None or new_seq_len is None):
        raise UnsafeRerotation(
            f"rope type {spec.rope_type!r}: pass old_seq_len and new_seq_len (and old_start)"
        )
    f_old = spec.inv_freq_for(old_seq_len)
    f_new = spec.inv_freq_for(new_seq_len)
    if f_old is not f_new and not torch.equal(f_old, f_new):
        raise UnsafeRerotation(
            f"rope type {spec.rope_type!r}: the forwards of length {old_seq_len} and {new_seq_len} "
            "use different frequencies, so the rotation depends on absolute positions; "
            "pass old_start"
        )
    cos, sin = _delta_cos_sin(spec, int(delta), f_old)
    return _rotate(keys, cos[None, :], sin[None, :], spec.rotary_dim)
