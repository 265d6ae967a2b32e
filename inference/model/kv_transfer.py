"""A question's KV onto the model's device: gathered in one host buffer and copied once; on a
GPU the buffer is pinned and the copy does not wait, and the KV of hot slices may stay
resident on the device.

The served context is built in host memory (``inference/context/builders.py``: ``C_p`` and
each nugget slice decoded straight into its place, the keys re-rotated in place) and then
moved to the model's device. On a CPU that move is what it always was (``to(device,
dtype)``). On a CUDA device (RESULTS.md, "GPU check": one slow copy of 10 small slices made
coinrag's P99 79 ms):

- :func:`host_buffer` gives the gather buffer in pinned memory (torch's caching host
  allocator reuses it once its copy is done), so :func:`to_device` copies the whole context
  once, ``non_blocking``, and casts it on the device (a cast on the host would copy it into
  pageable memory first);
- :class:`ResidentKv`: stored KV slices (keyed by content_key and token range, as stored:
  before re-rotation) kept on the device, least recently used dropped first, at most
  ``kv_resident_bytes`` (``schemas/settings.py``; 0, the default: none kept). The builder
  then reads only the slices it lacks, copies them once, and assembles and re-rotates the
  context on the device.

E.g. a question of 10 slices of 24 tokens at Qwen2-7B dims in bfloat16 (57,344 bytes per
token): 13.8 MB gathered and copied once; with ``kv_resident_bytes = 1e9`` the last 726 such
slices stay on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch

_RESIDENT: dict[str, int] = {"bytes": 0}  # set_resident_kv_bytes: the process's budget


def set_resident_kv_bytes(budget: int) -> None:
    """The ``kv_resident_bytes`` setting of this process (reading processes: ``coinrag api``,
    ``eval``, ``query``): device bytes each KV reader may keep resident."""
    if budget < 0:
        raise ValueError(f"kv_resident_bytes must be >= 0 (0: none), got {budget}")
    _RESIDENT["bytes"] = int(budget)


def resident_kv_bytes() -> int:
    """The process's ``kv_resident_bytes`` (:func:`set_resident_kv_bytes`; 0 unless set)."""
    return _RESIDENT["bytes"]


def on_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """An empty host tensor of ``shape`` a question's KV is gathered in before it moves to
    ``device``: pinned where ``device`` is a CUDA device, plain (as always) otherwise."""
    return torch.empty(shape, dtype=dtype, pin_memory=on_cuda(device))


def to_device(host: torch.Tensor, device: Any, dtype: torch.dtype) -> torch.Tensor:
    """``host`` on ``device`` in ``dtype``: from pinned memory one non-blocking copy, then the
    cast on the device (later work on the device's stream waits for the copy); otherwise
    ``host.to(device, dtype=dtype)``, as before this module."""
    if host.is_pinned() and on_cuda(device):
        return host.to(device, non_blocking=True).to(dtype)
    return host.to(device, dtype=dtype)


class ResidentKv:
    """Device copies of stored KV slices, most recently used last, at most ``budget`` bytes
    in all (a slice larger than the budget is not kept). ``hits`` / ``misses`` count
    :meth:`get`.

    E.g. budget 100 bytes, slices a (40), b (40) kept, ``get(a)``, then c (40) put: b, the
    least recently used, is dropped."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.bytes = 0
        self.hits = self.misses = 0
        self._slices: OrderedDict[Hashable, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._slices)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slices

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The slice kept under ``key`` (now the most recently used), or None."""
        found = self._slices.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._slices.move_to_end(key)
        return found

    def put(self, key: Hashable, kv: torch.Tensor) -> None:
        """Keep ``kv`` under ``key`` (its own storage: pass a tensor no other one shares),
        dropping the least recently used slices until it fits."""
        size = kv.numel() * kv.element_size()
        if size > self.budget or key in self._slices:
            return
        while self.bytes + size > self.budget:
            _, dropped = self._slices.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()
        self._slices[key] = kv
        self.bytes += size
