"""numba helpers of the compiled kernels (``storage/kv/kernels.py``,
``inference/rope/kernel.py``): the one way they are compiled, the bfloat16 rounding they share,
and the float32 operations numba does not spell (a fused multiply-add, bit casts).

numba's disk cache keys a kernel on its own file: the helpers here are inlined into kernels
of other files, so an edit here leaves those kernels' cached code stale until their files
change too (an installed release rewrites every file; a developer editing this file clears
``__pycache__``'s ``*.nbi`` / ``*.nbc`` or sets ``NUMBA_CACHE_DIR`` to a new folder)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


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
def bf16_bits(x: np.uint32) -> np.uint16:
    """float32 bits ``x`` (uint32) -> bfloat16 bits, rounded to nearest even as torch rounds
    (no NaN case, as :func:`round_bf16`)."""
    return np.uint16((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> 16)


@compiled(inline=True)
def round_bf16(u: np.ndarray, dst: np.ndarray) -> None:
    """float32 bits ``u`` (uint32) -> bfloat16 bits ``dst`` (uint16), rounded to nearest even
    as torch rounds. No NaN case: a dequantized value is a small integer times a float16 step
    plus a float16 minimum, never NaN (an infinity rounds to itself)."""
    for d in range(u.shape[0]):
        dst[d] = bf16_bits(u[d])


@intrinsic
def fma32(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` in float32 with one rounding (LLVM's ``fma``; a vfmadd on x86-64)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        fnty = ir.FunctionType(f32, [f32, f32, f32])
        fma = builder.module.declare_intrinsic("llvm.fma", [f32], fnty)
        return builder.call(fma, args)

    return sig, codegen


@intrinsic
def float_of_bits(typingctx: Any, bits: Any) -> Any:
    """The float32 whose bits are the uint32 ``bits``."""
    sig = types.float32(types.uint32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def bits_of_float(typingctx: Any, value: Any) -> Any:
    """The bits of the float32 ``value`` as a uint32."""
    sig = types.uint32(types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen
