"""A KV store's key basis: the coordinates a basis codec (``int2basis``) quantizes keys in.

Per layer and key-value head, keys before RoPE (``k``, rows of ``head_dim`` ``D``) are coded as
``c = k @ forward`` and read back as ``k̂ = ĉ @ inverse``, with

- ``forward = diag(w) R``: ``w`` the RMS, per channel, of the queries that read the head (the
  pair energy ``q_c² + q_c'²`` of the two channels RoPE rotates together, over the tokens and
  the query heads of its group), so an error in coordinate space weighs what it moves in
  ``q · k``; ``R`` the principal axes (largest first) of the weighted keys ``w ⊙ k`` over the
  calibration tokens, so a few coordinates carry most of the keys' spread and the codec's
  widest codes go there;
- ``inverse = R^T diag(1 / w)``, ``forward @ inverse = I`` up to float32 rounding.

Measured on SmolLM2 (``tests/benchmarks/RESULTS.md``, issue 36): keys coded this way at
``int2mix``'s bits give a next-token KL 2.4x lower than in the plain channels.

The basis is computed once per KV store, from the store's first chunks (the KV stage, before
any entry is written: ``tasks/kv.py``), stored beside ``C_p`` (``basis_folder.py``) and shared
by every copy of the store's layout through its :class:`BasisSlot`. It is float32 ``(L, H, D,
D)`` twice: 2.9 MB for SmolLM2 (30 layers, 3 key-value heads, ``D`` 64).

E.g. ``D = 2``, one head, keys ``[[1, 0], [3, 0]]``, ``w = [2, 1]``: the weighted keys vary along
channel 0 only, ``R = I``, ``forward = diag(2, 1)``, ``c = [[2, 0], [6, 0]]``, ``inverse =
diag(0.5, 1)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from coinrag.storage.kv.errors import KvError


@dataclass(frozen=True, eq=False)
class KeyBasis:
    """``forward`` and ``inverse`` ``(L, H, D, D)`` float32: keys ``(..., L, H, T, D)`` to
    coordinates by ``@ forward`` and back by ``@ inverse`` (module docstring)."""

    forward: torch.Tensor
    inverse: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.forward.shape)
        if len(shape) != 4 or shape[-1] != shape[-2] or tuple(self.inverse.shape) != shape:
            raise ValueError(
                f"a key basis is two (L, H, D, D) matrices, got {shape} and "
                f"{tuple(self.inverse.shape)}"
            )
        if self.forward.dtype != torch.float32 or self.inverse.dtype != torch.float32:
            raise ValueError("a key basis is float32")

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)``."""
        layers, heads, dim, _ = self.forward.shape
        return layers, heads, dim

    def to_coordinates(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys ``(..., L, H, T, D)`` float32 -> their coordinates, the same shape."""
        return keys @ self.forward

    def from_coordinates(self, coordinates: torch.Tensor) -> torch.Tensor:
        """Coordinates ``(L, H, T, D)`` float32 -> keys, the same shape: each token's bits
        independent of the others decoded with it (``kernels.basis_rows``)."""
        from coinrag.storage.kv.kernels import basis_rows  # numba, imported where a decode needs it

        layers, heads, _, dim = coordinates.shape
        if (layers, heads, dim) != self.shape:
            raise ValueError(f"coordinates {tuple(coordinates.shape)} for a basis {self.shape}")
        source = coordinates.detach().to(torch.float32).contiguous()
        out = torch.empty_like(source)
        basis_rows(source.numpy(), self.inverse.numpy(), out.numpy())
        return out

    def condition(self) -> torch.Tensor:
        """``(L, H)``: ``‖inverse‖₂ ‖forward‖₂`` per layer and head (``max w / min w``): how
        much the round trip can widen a relative error made in coordinate space."""
        big = torch.linalg.matrix_norm(self.forward.double(), ord=2)
        return (big * torch.linalg.matrix_norm(self.inverse.double(), ord=2)).float()

    def sha256(self) -> str:
        """The sha256 of both matrices' bytes (little-endian float32, forward first)."""
        digest = hashlib.sha256()
        for matrix in (self.forward, self.inverse):
            digest.update(matrix.contiguous().numpy().astype("<f4").tobytes())
        return digest.hexdigest()


def calibrated_basis(query_rms: torch.Tensor, keys: Sequence[torch.Tensor]) -> KeyBasis:
    """The basis of queries' RMS ``(L, H, D)`` (channels no query reads get the smallest
    non-zero weight over the head, or 1 where none reads any) and calibration keys, each
    ``(L, H, T_i, D)`` before RoPE (module docstring); computed in float64."""
    if not keys:
        raise ValueError("a key basis needs calibration keys")
    w = query_rms.to(torch.float64)
    floor = torch.where(w > 0, w, torch.inf).amin(-1, keepdim=True)
    floor = torch.where(torch.isfinite(floor), floor, torch.ones_like(floor))
    w = torch.where(w > 0, w, floor)
    x = torch.cat([k.to(torch.float64) for k in keys], dim=2) * w.unsqueeze(2)
    x = x - x.mean(dim=2, keepdim=True)
    covariance = x.transpose(-1, -2) @ x / max(1, x.shape[2])
    _, vectors = torch.linalg.eigh(covariance)
    axes = vectors.flip(-1)  # columns, largest variance first
    forward = w.unsqueeze(-1) * axes
    inverse = axes.transpose(-1, -2) / w.unsqueeze(-2)
    return KeyBasis(forward.float().contiguous(), inverse.float().contiguous())


class BasisSlot:
    """Where a layout's key basis is found: set once its KV store has read or written it
    (:meth:`bind`: a loader called on first use), shared by every copy of the layout
    (``dataclasses.replace`` copies the reference)."""

    def __init__(self) -> None:
        self._basis: KeyBasis | None = None
        self._load: Callable[[], KeyBasis] | None = None

    def __getstate__(self) -> dict[str, object]:
        """Pickled (a layout sent to a worker) with the basis it holds, not the loader: the
        worker's KV store binds its own."""
        return {"_basis": self._basis, "_load": None}

    def bind(self, load: Callable[[], KeyBasis]) -> None:
        """Read the basis with ``load()`` when it is first asked for."""
        self._load = load

    def set(self, basis: KeyBasis) -> None:
        self._basis = basis

    def forget(self) -> None:
        """Drop the basis held (the next :meth:`get` loads it again)."""
        self._basis = None

    def get(self) -> KeyBasis:
        """The basis; :class:`KvError` where the store holds none yet."""
        if self._basis is None and self._load is not None:
            self._basis = self._load()
        if self._basis is None:
            raise KvError(
                "no key basis: this KV store's codec codes keys in a calibrated basis (the kv "
                "stage writes it before the first entry)"
            )
        return self._basis
