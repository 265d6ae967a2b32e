"""The reference of the 2-bit codecs' compiled clip search (``storage/kv/clip_kernel.py``): the
same search by whole-tensor operations, as the codecs ran it before the kernel (stop 45), kept
here for ``tests/inference/test_kv_clip_kernel.py`` to hold the kernel to (as
``recover_reference.py`` is for the span recovery)."""

from __future__ import annotations

import torch

from coinrag.storage.kv.lowbit import fine_lo, fine_step


def search_clips_tensor(
    x: torch.Tensor,
    dim: int,
    bounds: tuple[torch.Tensor, torch.Tensor],
    units: tuple[torch.Tensor, torch.Tensor],
    levels: torch.Tensor,
    clips: tuple[float, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped range of least squared error for each group of float32 ``x`` over ``dim``:
    ``(codes, z, c)`` float32 (codes ``0..levels``, ``x̂ = codes * c * step + z * lo``).

    ``bounds``: the groups' ``(min, max)``; ``units``: ``(lo, step)`` float32 (the units of
    ``z`` and ``c``); ``levels``: the top code, a tensor broadcasting to the groups (a group
    of 0 levels gets codes 0). Each clip fraction ``a`` of ``clips`` (``[min + a r, max - a
    r]``) is tried in order and a later one kept only where its error is smaller (ties keep
    the earlier), all in place (7 passes over ``x`` per clip)."""
    (mn, mx), (lo32, step32) = bounds, units
    divisor = torch.where(levels > 0, levels, torch.ones_like(levels))
    best: tuple[torch.Tensor, ...] = ()
    u, q = torch.empty_like(x), torch.empty_like(x)
    for a in clips:
        cut = (mx - mn) * a
        z = fine_lo(mn + cut, lo32)
        lo = z * lo32
        c = fine_step((mx - cut - lo) / divisor, step32)
        step = c * step32
        inv = 1 / torch.where(step > 0, step, torch.ones_like(step))
        torch.sub(x, lo, out=u).mul_(inv)  # the codes before rounding
        torch.round(u, out=q).clamp_(torch.zeros_like(levels), levels)
        err = u.sub_(q).square_().sum(dim=dim, keepdim=True).mul_(step.square())
        if best:
            better = err < best[0]
            err, z, c = (
                torch.where(better, n, o) for n, o in zip((err, z, c), best[:3], strict=True)
            )
            codes = torch.where(better, q, best[3])
        else:
            codes, q = q, torch.empty_like(x)
        best = (err, z, c, codes)
    _, z, c, codes = best
    return codes, z, c
