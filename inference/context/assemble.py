"""Prefix assembly: ``C_ctx = C_p ⊕ Rot(C_b1[s1:e1]; Δ1) ⊕ ... ⊕ Rot(C_bk[sk:ek]; Δk)``.

The KV layout (in memory, after RoPE, on disk, after re-rotation) is stated once, in
``storage/kv/layout.py``; what assembly adds:

- a chunk's block was computed once, right after the RAG prompt prefix ``p``, so its token ``i``
  sits at position ``|p| + i``; a nugget slice ``[s, e)`` of it starts at ``|p| + s``. A
  quantized store holds keys rotated back to position 0 instead (``KvLayout.keys_at_zero``,
  ``KvSlice.at_zero``): they are rotated to their new positions, one rotation either way;
- the assembled context puts the slices after ``C_p`` in the order given, at contiguous
  positions: slice ``i`` starts at ``Δ_i = |p| + Σ_{j<i} (e_j - s_j)``. Only keys are rotated:
  values do not depend on position;
- RoPE whose frequencies depend on the forward's length (dynamic, longrope): every key, ``C_p``'s
  included, gets the frequencies of the forward the context stands for (``new_seq_len``: the
  context plus the query prefilled after it), i.e. the layer-0 keys of the model's own forward
  over the same tokens at the same positions (``tests/inference/test_rope_seq_len.py``);
- cartridges (:func:`assemble_cartridges`) are stored at canonical positions ``0..p_i-1`` and
  placed the same way, one after the other after ``C_p``;
- per-layer RoPE (Gemma 3): each layer's keys are rotated with that layer's RoPE (the local
  base in sliding layers, the global base and scaling in full ones: ``inference.rope.
  model_rope``);
- sliding-window layers (``inference.model.layers``): ``C_ctx`` holds every position in every
  layer; handed to the model through ``to_dynamic_cache(ctx, config)`` a sliding layer of
  window ``W`` keeps its last ``W - 1`` positions, as transformers' sliding cache does after
  one forward over the same context, so the query at position ``T`` attends in that layer to
  positions ``T - W + 1 .. T``: the end of the last slices, never an earlier one. A slice's
  sliding-layer K/V stay those of its chunk's own forward (``inference/model/encode.py``: each
  token's window ended inside ``prefix + chunk``), the same relocation approximation as in full
  layers.

The result is handed to the model as a ``transformers.DynamicCache`` (batch 1:
``inference.model.encode.to_dynamic_cache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coinrag.inference.rope import ModelRope, UnsupportedRope


@dataclass(frozen=True)
class KvSlice:
    """A contiguous run of cached tokens and where it was encoded.

    ``kv``: ``(layers, 2, kv_heads, n, head_dim)``; ``old_start``: position of its first token
    in the forward that computed it; ``old_seq_len``: that forward's length (``|p| + chunk
    tokens``; needed only by seq-len dependent RoPE such as dynamic NTK). ``at_zero``: its keys
    were rotated back to position 0 (a quantized store: ``KvLayout.keys_at_zero``), so they are
    rotated to their new positions instead of moved from ``old_start``.
    """

    kv: torch.Tensor
    old_start: int
    old_seq_len: int
    at_zero: bool = False

    @property
    def tokens(self) -> int:
        return int(self.kv.shape[-2])


def assemble_context(
    prefix_kv: torch.Tensor,
    slices: Sequence[KvSlice],
    spec: ModelRope,
    *,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """Concatenate ``prefix_kv`` and the re-rotated slices at contiguous positions.

    Args:
        prefix_kv: ``(layers, 2, kv_heads, P, head_dim)``, encoded at positions ``0..P-1``.
        slices: in context order.
        spec: the model's RoPE (``inference.rope.model_rope``: one for every layer, or each
            layer's own).
        new_seq_len: length of the forward whose cache this stands for (dynamic / longrope
            only; defaults to the assembled length): with the query prefilled after the
            context, the context plus the query. Every key, ``C_p``'s included, gets the
            frequencies a forward of that length uses, as the model's own forward over the
            same tokens at the same positions gives them.

    Returns:
        ``(layers, 2, kv_heads, P + Σ n_i, head_dim)``, same dtype as ``prefix_kv``.

    >>> # two slices of 3 and 2 tokens after a 5-token prefix land at positions 5..7 and 8..9
    """
    starts, start = [], prefix_kv.shape[-2]
    for s in slices:
        starts.append(start)
        start += s.tokens
    return place_slices(prefix_kv, slices, starts, spec, new_seq_len=new_seq_len)


def place_slices(
    prefix_kv: torch.Tensor,
    slices: Sequence[KvSlice],
    starts: Sequence[int],
    spec: ModelRope,
    *,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """``C_p`` followed by each slice re-rotated to start at ``starts[i]`` (gaps allowed).

    :func:`assemble_context` with chosen positions: KVLink leaves gaps for its link tokens
    after each document. The result is in slice order, ``(layers, 2, kv_heads, P + Σ n_i,
    head_dim)``; slice ``i``'s keys sit at positions ``starts[i] .. starts[i] + n_i - 1``.
    ``new_seq_len`` defaults to the end of the last slice (or ``P``).
    """
    n_prefix = prefix_kv.shape[-2]
    ends = [start + s.tokens for s, start in zip(slices, starts, strict=True)]
    seq_len = new_seq_len or max([n_prefix, *ends])
    parts = [prefix_kv]
    if not spec.same_frequencies(n_prefix, seq_len):
        # C_p was encoded in a forward of its own length; a forward of length seq_len uses
        # other frequencies (dynamic NTK above max_position_embeddings, longrope's long factors).
        parts = [_rotated(KvSlice(prefix_kv, 0, n_prefix), 0, spec, seq_len)]
    differentiable = parts[0].requires_grad or any(s.kv.requires_grad for s in slices)
    if not spec.seq_len_dependent and not differentiable:
        return _placed_into_one(parts[0], slices, starts, spec)
    for s, start in zip(slices, starts, strict=True):
        moved = s.old_start != start or spec.seq_len_dependent or s.at_zero
        parts.append(_rotated(s, start, spec, seq_len) if moved else s.kv)
    return torch.cat(parts, dim=-2)


def _placed_into_one(
    prefix_kv: torch.Tensor, slices: Sequence[KvSlice], starts: Sequence[int], spec: ModelRope
) -> torch.Tensor:
    """:func:`place_slices` for position-independent RoPE and KV that needs no gradient:
    each slice's values and its rotated keys written once into the result (no per-slice
    stack, no final concatenation); the same values bit for bit
    (``tests/inference/test_assemble_batched.py``)."""
    n_prefix = prefix_kv.shape[-2]
    layers, _, heads, _, dim = prefix_kv.shape
    total = n_prefix + sum(s.tokens for s in slices)
    out = prefix_kv.new_empty((layers, 2, heads, total, dim))
    out[..., :n_prefix, :] = prefix_kv
    at = n_prefix
    for s, start in zip(slices, starts, strict=True):
        end = at + s.tokens
        out[:, 1, :, at:end] = s.kv[:, 1]
        if s.old_start != start or s.at_zero:
            if s.at_zero:
                old = torch.zeros(s.tokens, dtype=torch.long)
            else:
                old = torch.arange(s.old_start, s.old_start + s.tokens)
            new = torch.arange(start, start + s.tokens)
            out[:, 0, :, at:end] = spec.rotate_layers(s.kv[:, 0], old, new)
        else:
            out[:, 0, :, at:end] = s.kv[:, 0]
        at = end
    return out


def rotate_placed_keys(
    ctx: torch.Tensor,
    n_prefix: int,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    spec: ModelRope,
) -> None:
    """Move the keys of ``ctx[:, 0, :, n_prefix:]`` (the slices after ``C_p``, written there as
    stored) from ``old_positions`` to ``new_positions`` (both ``(T - n_prefix,)`` integer
    positions; 0 for keys stored at position 0), in place, in one rotation with per-token
    angles: the same values bit for bit as :func:`place_slices`' rotation of each slice
    (``tests/inference/test_assemble_batched.py``). ``ctx``: ``(layers, 2, kv_heads, T,
    head_dim)``. Position-independent RoPE only (ValueError otherwise: the frequencies of
    dynamic / longrope RoPE depend on lengths this does not know)."""
    if spec.seq_len_dependent:
        raise ValueError(f"rope type {spec.rope_type!r} depends on the forward's length")
    if ctx.shape[-2] == n_prefix or torch.equal(old_positions, new_positions):
        return
    keys = ctx[:, 0, :, n_prefix:]
    spec.rotate_layers(keys, old_positions, new_positions, out=keys)


def _rotated(s: KvSlice, start: int, spec: ModelRope, seq_len: int) -> torch.Tensor:
    """``s.kv`` with its keys moved to positions ``start..`` of a forward of length ``seq_len``
    (from position 0 where ``s.at_zero``: the rotation is then RoPE itself, at ``seq_len``'s
    frequencies)."""
    old = torch.arange(s.old_start, s.old_start + s.tokens)
    if s.at_zero:
        old = torch.zeros(s.tokens, dtype=torch.long)
    new = torch.arange(start, start + s.tokens)
    keys = spec.rotate_layers(s.kv[:, 0], old, new, old_seq_len=s.old_seq_len, new_seq_len=seq_len)
    return torch.stack([keys.to(s.kv.dtype), s.kv[:, 1]], dim=1)


# ---------------------------------------------------------------------------- cartridges


def check_rope(rope: ModelRope) -> None:
    """Refuse RoPE variants whose rotation depends on the forward's length (cartridges are
    stored at canonical positions, which have no forward length)."""
    if rope.seq_len_dependent:
        raise UnsupportedRope(
            f"rope type {rope.rope_type!r} depends on the sequence length; cartridges are stored "
            "at canonical positions and can only be placed with position-independent RoPE"
        )


def assemble_cartridges(
    prefix: torch.Tensor, cartridges: Sequence[torch.Tensor], rope: ModelRope
) -> torch.Tensor:
    """``C_p ⊕ Rot(Z_1) ⊕ Rot(Z_2) ⊕ ...`` at contiguous positions after the prefix.

    ``prefix``: ``(L, 2, H, |p|, D)``; each cartridge ``(L, 2, H, p_i, D)`` at canonical
    positions ``0..p_i-1`` (``training/cartridges.py``). Returns ``(L, 2, H, |p| + Σ p_i, D)``;
    differentiable w.r.t. the cartridges. Training and serving both place cartridges with it.
    """
    check_rope(rope)
    slices = [KvSlice(z, old_start=0, old_seq_len=int(z.shape[-2])) for z in cartridges]
    return assemble_context(prefix, slices, rope)
