"""The compiled clip search of the 2-bit codecs' encode (``storage/kv/clip_kernel.py``) against
its tensor path (``tests/clip_reference.py``, the reference): each candidate computed to the
same bits, the same winner wherever two candidates' errors differ by more than float32
rounding, and the whole encode of both 2-bit codecs unchanged where that holds.

The data: Gaussian groups with heavy-tailed outliers, channel offsets, constant groups, an
all-zero head (units 0) and groups of 0 levels (``int2mix``'s mean channels), over both group
axes (a key channel over a block's tokens, a value token over ``head_dim``).
"""

from __future__ import annotations

import pytest
import torch
from clip_reference import search_clips_tensor

from coinrag.storage.kv.clip_kernel import search_clips
from coinrag.storage.kv.lowbit import CLIPS, fine_lo
from coinrag.storage.kv.mixed import WIDTH_LEVELS, key_widths
from coinrag.storage.kv.quantize import LO_LEVELS, STEP_LEVELS, fp16_up

TIE = 1e-5  # relative: float32 sums of 64 squares in two orders differ by a few ulps


def _blocks(seed: int) -> torch.Tensor:
    """``(k, L, H, B, D)`` = ``(3, 4, 2, 64, 64)`` float32 with the cases of the module
    docstring."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 2, 64, 64, generator=g)
    x *= torch.rand(1, 1, 1, 1, 64, generator=g) * 4  # channel scales
    x[..., 7] += 11.0  # an offset channel
    spikes = torch.rand(x.shape, generator=g) < 0.01
    x = torch.where(spikes, x * 25, x)  # heavy tails
    x[0, 1, 0, :, 3] = 0.75  # a constant key channel
    x[1, 2, 0, 5, :] = -2.0  # a constant value token
    x[2, 3, 1] = 0.0  # a head of zeros: units 0
    return x


def _units(x: torch.Tensor, dim: int, levels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(bounds, units)`` as ``lowbit.quantize_fine_scales`` derives them."""
    mn, mx = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    lo_unit = fp16_up(mn.abs().amax(dim=(3, 4), keepdim=True) / LO_LEVELS).float()
    divisor = torch.where(levels > 0, levels, torch.ones_like(levels))
    s_max = (mx - fine_lo(mn, lo_unit) * lo_unit) / divisor
    step_unit = fp16_up(s_max.amax(dim=(3, 4), keepdim=True) / STEP_LEVELS).float()
    return (mn, mx), (lo_unit, step_unit)


def _levels(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Keys (dim 3): ``int2mix``'s per-channel levels (4 bits, 2 bits, mean); values: 3."""
    if dim == 4:
        return torch.tensor(3.0)
    table = torch.tensor(WIDTH_LEVELS, dtype=torch.float32)
    return table[key_widths(x).long()].unsqueeze(3)


def _errors(x: torch.Tensor, dim: int, found: tuple[torch.Tensor, ...], units) -> torch.Tensor:
    """Each group's squared error in float64."""
    codes, z, c = found
    lo_unit, step_unit = (u.double() for u in units)
    x_hat = codes.double() * (c.double() * step_unit) + z.double() * lo_unit
    return (x_hat - x.double()).pow(2).sum(dim=dim, keepdim=True)


@pytest.mark.parametrize("dim", [3, 4])
@pytest.mark.parametrize("clip", CLIPS)
def test_each_candidate_alone_is_the_tensor_paths_to_the_bit(dim: int, clip: float) -> None:
    x = _blocks(1)
    levels = _levels(x, dim)
    bounds, units = _units(x, dim, levels)
    want = search_clips_tensor(x, dim, bounds, units, levels, (clip,))
    got = search_clips(x, dim, bounds, units, levels, (clip,))
    assert got[0].dtype == torch.uint8 and got[0].shape == x.shape
    assert torch.equal(got[0].float(), want[0])
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


@pytest.mark.parametrize("dim", [3, 4])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_search_keeps_the_tensor_paths_winner_but_for_ties(dim: int, seed: int) -> None:
    """Where the two disagree on a group's clip, the two winners' errors are equal to float32
    rounding; everywhere else codes, minimum and step are the same bits. Groups of 0 levels
    (codes 0) tie between clips of one minimum whatever their step (the codec stores their
    step as 0), so the share that differs is counted over coded groups."""
    x = _blocks(seed)
    levels = _levels(x, dim)
    bounds, units = _units(x, dim, levels)
    want = search_clips_tensor(x, dim, bounds, units, levels, CLIPS)
    got = search_clips(x, dim, bounds, units, levels, CLIPS)
    differs = (got[1] != want[1]) | (got[2] != want[2])
    err_got, err_want = _errors(x, dim, got, units), _errors(x, dim, want, units)
    coded = (levels > 0).expand_as(differs)
    assert differs[coded].float().mean() < 0.01
    gap = (err_got - err_want).abs()[differs]
    assert (gap <= TIE * err_want[differs]).all(), gap.max()
    same = (~differs).expand_as(x)
    assert torch.equal(got[0][same].float(), want[0][same])
    assert (err_got <= err_want * (1 + TIE)).all()


def test_the_clipped_search_beats_the_unclipped_range_and_keeps_its_bound() -> None:
    """Over Gaussian value tokens the kept candidates lower the squared error by over 20% and
    never raise a group's (the unclipped range is a candidate)."""
    x = _blocks(3)
    levels = torch.tensor(3.0)
    bounds, units = _units(x, 4, levels)
    plain = _errors(x, 4, search_clips(x, 4, bounds, units, levels, (0.0,)), units)
    clipped = _errors(x, 4, search_clips(x, 4, bounds, units, levels, CLIPS), units)
    assert (clipped <= plain * (1 + TIE)).all()
    assert clipped.sum() < 0.8 * plain.sum()


def test_groups_of_zero_levels_get_code_0_and_bad_axes_are_refused() -> None:
    x = _blocks(4)
    levels = torch.zeros(3, 4, 2, 1, 64)
    bounds, units = _units(x, 3, levels)
    codes, _, _ = search_clips(x, 3, bounds, units, levels, CLIPS)
    assert int(codes.max()) == 0
    with pytest.raises(ValueError, match="groups over dim 2"):
        search_clips(x, 2, bounds, units, levels, CLIPS)
