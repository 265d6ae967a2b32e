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
from numba.core import cgutils
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


LANES = 16
"""float32 lanes of the vectors :func:`two_chain_product` works in (one AVX-512 register)."""


@intrinsic
def two_chain_product(typingctx: Any, c: Any, m: Any, out: Any) -> Any:
    """``out = c @ m`` for a head vector ``c`` ``(D,)`` and matrix ``m`` ``(D, D)``, float32,
    all C-contiguous, ``D`` a multiple of 16 (unchecked: the caller checks): each value is two
    ``fma`` chains, over ``i`` in ``[0, D/2)`` and in ``[D/2, D)`` in order from 0, added once at
    the end. Columns are taken 64 at a time (then 16): eight vector accumulators per step (two
    chains of four), held in registers, so the product runs at the CPU's ``fma`` throughput
    instead of through memory. Each lane is its own chain: the bits are those of the scalar
    loop of the same definition, on any vector width."""
    arrays = (c, m, out)
    if not all(isinstance(a, types.Array) and a.dtype == types.float32 for a in arrays):
        return None
    if (c.ndim, m.ndim, out.ndim) != (1, 2, 1) or any(a.layout != "C" for a in arrays):
        return None
    sig = types.void(c, m, out)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        typed = zip(signature.args, args, strict=True)
        cv, mv, ov = (context.make_array(t)(context, builder, a) for t, a in typed)
        dim = builder.extract_value(cv.shape, 0)
        i64 = dim.type
        wide = builder.sdiv(dim, ir.Constant(i64, 4 * LANES))  # tiles of 64 columns
        rest = builder.sdiv(builder.srem(dim, ir.Constant(i64, 4 * LANES)), ir.Constant(i64, LANES))
        ptrs = (cv.data, mv.data, ov.data)
        _product_tiles(builder, ptrs, dim, ir.Constant(i64, 0), wide, 4)
        _product_tiles(builder, ptrs, dim, builder.mul(wide, ir.Constant(i64, 4 * LANES)), rest, 1)
        return context.get_dummy_value()

    return sig, codegen


def _product_tiles(
    builder: Any, ptrs: tuple[Any, Any, Any], dim: Any, first: Any, tiles: Any, width: int
) -> None:
    """:func:`two_chain_product`'s columns from ``first``, ``tiles`` tiles of ``width`` vectors:
    per tile, two chains of ``width`` accumulators (allocas in the entry block, promoted to
    registers by LLVM) over ``i`` in the two halves, then their sum stored."""
    c_ptr, m_ptr, out_ptr = ptrs
    i64, i32 = dim.type, ir.IntType(32)
    vec = ir.VectorType(ir.FloatType(), LANES)
    fma = builder.module.declare_intrinsic(
        f"llvm.fma.v{LANES}f32", fnty=ir.FunctionType(vec, [vec, vec, vec])
    )
    half = builder.ashr(dim, ir.Constant(i64, 1))
    undefined = ir.Constant(vec, ir.Undefined)
    splat = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)
    accs = [cgutils.alloca_once(builder, vec) for _ in range(2 * width)]
    with cgutils.for_range(builder, tiles) as tile:
        col = builder.add(first, builder.mul(tile.index, ir.Constant(i64, width * LANES)))
        for acc in accs:
            builder.store(ir.Constant(vec, [0.0] * LANES), acc)
        with cgutils.for_range(builder, half) as step:
            for chain in range(2):
                row = step.index if chain == 0 else builder.add(step.index, half)
                x = builder.load(builder.gep(c_ptr, [row]))
                x = builder.insert_element(undefined, x, ir.Constant(i32, 0))
                x = builder.shuffle_vector(x, undefined, splat)
                base = builder.add(builder.mul(row, dim), col)
                for k in range(width):
                    at = builder.gep(m_ptr, [builder.add(base, ir.Constant(i64, k * LANES))])
                    v = builder.load(builder.bitcast(at, vec.as_pointer()), align=4)
                    acc = accs[chain * width + k]
                    builder.store(builder.call(fma, [x, v, builder.load(acc)]), acc)
        for k in range(width):
            total = builder.fadd(builder.load(accs[k]), builder.load(accs[width + k]))
            at = builder.gep(out_ptr, [builder.add(col, ir.Constant(i64, k * LANES))])
            builder.store(total, builder.bitcast(at, vec.as_pointer()), align=4)
