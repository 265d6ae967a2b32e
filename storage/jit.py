"""numba helpers of the compiled kernels (``storage/kv/kernels.py``): the one way they are
compiled, and the bfloat16 rounding they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit


def compiled(inline: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit`` without the GIL, cached on disk where numba finds a writable place (it
    refuses ``cache=True`` where it finds none: a read-only install with a read-only home)."""
    options: dict[str, Any] = {"nogil": True}
    if inline:
        options["inline"] = "always"

    def wrap(fn: Callable[..., Any]) -> Any:
        try:
            return njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return njit(cache=False, **options)(fn)

    return wrap


@compiled(inline=True)
def round_bf16(u: np.ndarray, dst: np.ndarray) -> None:
    """float32 bits ``u`` (uint32) -> bfloat16 bits ``dst`` (uint16), rounded to nearest even
    as torch rounds. No NaN case: a dequantized value is a small integer times a float16 step
    plus a float16 minimum, never NaN (an infinity rounds to itself)."""
    for d in range(u.shape[0]):
        x = u[d]
        dst[d] = np.uint16((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> 16)
