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
  over the same tokens at the same positions (``tests/test_rope_seq_len.py``);
- cartridges (:func:`assemble_cartridges`) are stored at canonical positions ``0..p_i-1`` and
  placed the same way, one after the other after ``C_p``.

The result is handed to the model as a ``transformers.DynamicCache`` (batch 1:
``inference.encode.to_dynamic_cache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coinrag.inference.rope import RopeSpec, UnsupportedRope, rerotate_keys


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
    spec: RopeSpec,
    *,
    new_seq_len: int | None = None,
) -> torch.Tensor:
    """Concatenate ``prefix_kv`` and the re-rotated slices at contiguous positions.

    Args:
        prefix_kv: ``(layers, 2, kv_heads, P, head_dim)``, encoded at positions ``0..P-1``.
        slices: in context order.
        spec: the model's RoPE.
        new_seq_len: length of the forward whose cache this stands for (dynamic / longrope
            only; defaults to the assembled length): with the query prefilled after the
            context, the context plus the query. Every key, ``C_p``'s included, gets the
            frequencies a forward of that length uses, as the model's own forward over the
            same tokens at the same positions gives them.

    Returns:
        ``(layers, 2, kv_heads, P + Σ n_i, head_dim)``, same dtype as ``prefix_kv``.

    >>> # two slices of 3 and 2 tokens after a 5-token prefix land at positions 5..7 and 8..9
    """
    n_prefix = prefix_kv.shape[-2]
    total = n_prefix + sum(s.tokens for s in slices)
    seq_len = new_seq_len or total
    parts = [prefix_kv]
    if spec.seq_len_dependent and not torch.equal(
        spec.inv_freq_for(n_prefix), spec.inv_freq_for(seq_len)
    ):
        # C_p was encoded in a forward of its own length; a forward of length seq_len uses
        # other frequencies (dynamic NTK above max_position_embeddings, longrope's long factors).
        parts = [_rotated(KvSlice(prefix_kv, 0, n_prefix), 0, spec, seq_len)]
    start = n_prefix
    for s in slices:
        moved = s.old_start != start or spec.seq_len_dependent or s.at_zero
        parts.append(_rotated(s, start, spec, seq_len) if moved else s.kv)
        start += s.tokens
    return torch.cat(parts, dim=-2)


def _rotated(s: KvSlice, start: int, spec: RopeSpec, seq_len: int) -> torch.Tensor:
    """``s.kv`` with its keys moved to positions ``start..`` of a forward of length ``seq_len``
    (from position 0 where ``s.at_zero``: the rotation is then RoPE itself, at ``seq_len``'s
    frequencies)."""
    old = torch.arange(s.old_start, s.old_start + s.tokens)
    if s.at_zero:
        old = torch.zeros(s.tokens, dtype=torch.long)
    new = torch.arange(start, start + s.tokens)
    keys = rerotate_keys(s.kv[:, 0], old, new, spec, old_seq_len=s.old_seq_len, new_seq_len=seq_len)
    return torch.stack([keys.to(s.kv.dtype), s.kv[:, 1]], dim=1)


# ---------------------------------------------------------------------------- cartridges


def check_rope(rope: RopeSpec) -> None:
    """Refuse RoPE variants whose rotation depends on the forward's length (cartridges are
    stored at canonical positions, which have no forward length)."""
    if rope.seq_len_dependent:
        raise UnsupportedRope(
            f"rope type {rope.rope_type!r} depends on the sequence length; cartridges are stored "
            "at canonical positions and can only be placed with position-independent RoPE"
        )


def assemble_cartridges(
    prefix: torch.Tensor, cartridges: Sequence[torch.Tensor], rope: RopeSpec
) -> torch.Tensor:
    """``C_p ⊕ Rot(Z_1) ⊕ Rot(Z_2) ⊕ ...`` at contiguous positions after the prefix.

    ``prefix``: ``(L, 2, H, |p|, D)``; each cartridge ``(L, 2, H, p_i, D)`` at canonical
    positions ``0..p_i-1`` (``training/cartridges.py``). Returns ``(L, 2, H, |p| + Σ p_i, D)``;
    differentiable w.r.t. the cartridges. Training and serving both place cartridges with it.
    """
    check_rope(rope)
    slices = [KvSlice(z, old_start=0, old_seq_len=int(z.shape[-2])) for z in cartridges]
    return assemble_context(prefix, slices, rope)
