"""Compiled clip search of the 2-bit codecs' encode (numba, one thread, no GIL held).

``int2`` and ``int2mix`` (``storage/kv/lowbit.py``, ``mixed.py``) try each group's range
clipped by 0, 10% and 20% at both ends and keep the candidate of least squared error. Done with
whole-tensor operations that is seven passes over the block's values per candidate: ~92 of the
~105 ms that ``int2mix`` spent encoding one 512-token chunk of SmolLM2 on one thread, against
``int4``'s whole encode of ~30 ms (``tests/benchmarks/RESULTS.md``, "Stop 45"). The encode runs
on the KV writer thread beside the model's forward, so its time is the build's.

:func:`search_clips` does the same search in two passes: the first reads each value once and
accumulates every candidate's error, the second writes the codes of the winner. Each candidate's
minimum, step and codes are computed with the float32 operations of the tensor path
(``tests/clip_reference.py``, the codecs' encode before the kernel: the same roundings, so
the same bits); only the order in which
a group's squared errors are summed differs (torch sums a column in a cascade, the kernel from
the first token to the last), so where two candidates' errors agree to float32 rounding either
may win. ``tests/inference/test_kv_clip_kernel.py`` holds the kernel to the tensor path: the
same codes and scales wherever the winner is clear, a winner within rounding of the best
elsewhere.
"""

from __future__ import annotations

import numpy as np
import torch

from coinrag.storage.jit import compiled
from coinrag.storage.kv.quantize import LO_LEVELS, STEP_LEVELS


@compiled(inline=True)
def _candidate(
    mn: np.float32,
    mx: np.float32,
    clip: np.float32,
    lo_unit: np.float32,
    step_unit: np.float32,
    levels: np.float32,
) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """One clip of one group: ``(z, c, lo, inv)`` float32 as ``lowbit.fine_lo`` and
    ``fine_step`` compute them (``lo = z * lo_unit``, ``inv = 1 / (c * step_unit)``, 1 where
    the step is 0)."""
    one = np.float32(1.0)
    cut = (mx - mn) * clip
    target = mn + cut
    z = np.float32(np.floor(target / (lo_unit if lo_unit > 0 else one)))
    if z * lo_unit > target:
        z -= one
    z = min(max(z, np.float32(-LO_LEVELS - 1)), np.float32(LO_LEVELS))
    lo = z * lo_unit
    s = (mx - cut - lo) / (levels if levels > 0 else one)
    c = np.float32(np.ceil(s / (step_unit if step_unit > 0 else one)))
    if c * step_unit < s:
        c += one
    c = min(max(c, np.float32(0.0)), np.float32(STEP_LEVELS))
    step = c * step_unit
    inv = one / (step if step > 0 else one)
    return z, c, lo, inv


@compiled()
def _search(
    x: np.ndarray,
    bounds: np.ndarray,
    levels: np.ndarray,
    units: np.ndarray,
    clips: np.ndarray,
    codes: np.ndarray,
    scales: np.ndarray,
) -> None:
    """``x`` ``(N, B, D)`` float32, groups along ``B`` for each ``(n, d)``; ``bounds`` ``(2, N,
    D)`` their min and max; ``levels`` ``(N, D)`` their top code; ``units`` ``(2, N)`` lo and
    step units; ``clips`` ``(C,)``. Writes ``codes`` ``(N, B, D)`` uint8 and ``scales`` ``(2, N,
    D)`` float32 (``z``, ``c``)."""
    n_groups, tokens, dim = x.shape
    n_clips = clips.shape[0]
    zero = np.float32(0.0)
    lo = np.empty((n_clips, dim), np.float32)
    inv = np.empty((n_clips, dim), np.float32)
    err = np.empty((n_clips, dim), np.float32)
    zs = np.empty((n_clips, dim), np.float32)
    cs = np.empty((n_clips, dim), np.float32)
    for n in range(n_groups):
        for j in range(n_clips):
            for d in range(dim):
                zs[j, d], cs[j, d], lo[j, d], inv[j, d] = _candidate(
                    bounds[0, n, d], bounds[1, n, d], clips[j], units[0, n], units[1, n],
                    levels[n, d],
                )  # fmt: skip
                err[j, d] = zero
        for b in range(tokens):
            for j in range(n_clips):
                for d in range(dim):
                    u = (x[n, b, d] - lo[j, d]) * inv[j, d]
                    q = min(max(np.float32(np.rint(u)), zero), levels[n, d])
                    err[j, d] += (u - q) * (u - q)
        for d in range(dim):
            best = 0
            for j in range(n_clips):
                step = cs[j, d] * units[1, n]
                err[j, d] *= step * step
                if j > 0 and err[j, d] < err[best, d]:
                    best = j
            lo[0, d], inv[0, d] = lo[best, d], inv[best, d]
            scales[0, n, d], scales[1, n, d] = zs[best, d], cs[best, d]
        for b in range(tokens):
            for d in range(dim):
                u = (x[n, b, d] - lo[0, d]) * inv[0, d]
                codes[n, b, d] = np.uint8(min(max(np.float32(np.rint(u)), zero), levels[n, d]))


def search_clips(
    x: torch.Tensor,
    dim: int,
    bounds: tuple[torch.Tensor, torch.Tensor],
    units: tuple[torch.Tensor, torch.Tensor],
    levels: torch.Tensor,
    clips: tuple[float, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clip search of ``tests/clip_reference.py`` compiled: for float32 ``x``
    ``(k, L, H, B, D)`` and groups over ``dim`` (3: a channel over the block's tokens; 4: a
    token over ``D``), the clipped range of least squared error of each group: ``(codes, z,
    c)``, codes uint8 ``0..levels`` shaped as ``x``, ``z`` and ``c`` float32 shaped as the
    groups (``x̂ = codes * c * step_unit + z * lo_unit``).

    ``bounds``: the groups' ``(min, max)`` (``x``'s shape with ``dim`` of size 1); ``units``:
    ``(lo_unit, step_unit)`` float32 ``(k, L, H, 1, 1)``; ``levels``: the top code, a float32
    tensor broadcasting to the groups (0: codes 0, the step's candidates computed over 1).
    """
    if dim not in (3, 4) or x.dim() != 5:
        raise ValueError(f"groups over dim {dim} of a {tuple(x.shape)} tensor")
    k, layers, heads = x.shape[:3]
    if dim == 4:  # a token over D: the same search with the two last axes swapped
        x = x.transpose(3, 4)
        bounds = (bounds[0].transpose(3, 4), bounds[1].transpose(3, 4))
        levels = levels.transpose(-1, -2) if levels.dim() >= 2 else levels
    lanes = x.shape[4]
    groups = (k, layers, heads, 1, lanes)
    n = k * layers * heads
    xs = x.contiguous().reshape(n, x.shape[3], lanes).numpy()
    bound = torch.stack([b.expand(groups) for b in bounds]).reshape(2, n, lanes)
    top = levels.to(torch.float32).expand(groups).reshape(n, lanes).contiguous()
    unit = torch.stack([u.to(torch.float32).expand(k, layers, heads, 1, 1) for u in units])
    codes = np.empty(xs.shape, np.uint8)
    scales = np.empty((2, n, lanes), np.float32)
    _search(
        xs,
        bound.contiguous().numpy(),
        top.numpy(),
        unit.reshape(2, n).contiguous().numpy(),
        np.asarray(clips, np.float32),
        codes,
        scales,
    )
    codes_t = torch.from_numpy(codes).reshape(k, layers, heads, -1, lanes)
    z, c = (torch.from_numpy(s).reshape(groups) for s in scales)
    if dim == 4:
        return codes_t.transpose(3, 4), z.transpose(3, 4), c.transpose(3, 4)
    return codes_t, z, c
