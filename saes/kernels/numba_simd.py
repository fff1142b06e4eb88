"""Vector primitives for the numba selection scans, written as LLVM vector IR (numba intrinsics).

The selection kernels (``numba_kernels.row_topk``, ``row_above``, ``row_above_floor``) read every score of a row
once and do scalar work only where a score beats a running threshold. Their test of a block of 32 columns, written
as a numba loop (a count of ``score > thr`` over the block), compiled to ~0.5 ns an element on AVX-512 (LLVM unrolls
the 32 iterations and packs them back poorly), four times a flat loop over the row. :func:`above_mask` is that test
as one vector expression: 32 scores loaded, converted from bf16 bits where the row holds them, ``+ bias``, ``* scale``
and compared, the 32 outcomes as the bits of one uint32, so the caller visits only the columns that passed
(:func:`lowest_bit`). Every lane computes what the scalar ``numba_kernels._score`` computes (the same float32
operations in the same order, each rounded once: no fast-math, no fused multiply-add), so the bits are the scalar
comparisons' exactly.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

WIDTH = 32
"""Columns one :func:`above_mask` tests (the bits of a uint32)."""


def _contiguous(t, dtypes) -> bool:
    return isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype in dtypes


def vectorisable(row, bias, scale, thr) -> bool:
    """Whether :func:`above_mask` takes these numba types: a 1-D C-contiguous row of bf16 bits (uint16) or float32,
    a float32 1-D C-contiguous ``bias`` / ``scale`` or None (``scale`` also a float32: one for every column), and ``thr``
    a float32 or a float32 1-D C-contiguous array (one threshold per column)."""
    f32 = (types.float32,)
    return (_contiguous(row, (types.uint16, types.float32))
            and (isinstance(bias, types.NoneType) or _contiguous(bias, f32))
            and (isinstance(scale, types.NoneType) or scale == types.float32 or _contiguous(scale, f32))
            and (thr == types.float32 or _contiguous(thr, f32)))


def _load(context, builder, aty, value, c0, llty):
    """The WIDTH elements of the 1-D array ``value`` from index c0 as one vector (an unaligned load)."""
    data = context.make_array(aty)(context, builder, value).data
    ptr = builder.bitcast(builder.gep(data, [c0]), ir.VectorType(llty, WIDTH).as_pointer())
    return builder.load(ptr, align=aty.dtype.bitwidth // 8)


def _splat(builder, value):
    """The float32 ``value`` in every lane of a WIDTH vector."""
    f32, i32 = ir.FloatType(), ir.IntType(32)
    vty = ir.VectorType(f32, WIDTH)
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(i32, 0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(i32, WIDTH),
                                                                                  [0] * WIDTH))


@intrinsic
def above_mask(typingctx, row, c0, bias, scale, thr):
    """Bit u (u < WIDTH) set iff ``(f32(row[c0 + u]) + bias[c0 + u]) * scale[c0 + u] > t`` with t ``thr`` or
    ``thr[c0 + u]``; ``bias`` / ``scale`` None: that operation left out; ``scale`` a float32: it for every column.
    The caller ensures c0 + WIDTH <= len(row)."""
    if not (vectorisable(row, bias, scale, thr) and isinstance(c0, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        row_v, c0_v, bias_v, scale_v, thr_v = args
        row_t, c0_t, bias_t, scale_t, thr_t = signature.args
        c0_v = context.cast(builder, c0_v, c0_t, types.intp)
        f32, i32 = ir.FloatType(), ir.IntType(32)
        if row_t.dtype == types.uint16:  # bf16 bits: the high half of the float32 they are
            bits = builder.zext(_load(context, builder, row_t, row_v, c0_v, ir.IntType(16)), ir.VectorType(i32, WIDTH))
            bits = builder.shl(bits, ir.Constant(ir.VectorType(i32, WIDTH), [16] * WIDTH))
            v = builder.bitcast(bits, ir.VectorType(f32, WIDTH))
        else:
            v = _load(context, builder, row_t, row_v, c0_v, f32)
        if not isinstance(bias_t, types.NoneType):
            v = builder.fadd(v, _load(context, builder, bias_t, bias_v, c0_v, f32))
        if isinstance(scale_t, types.Array):
            v = builder.fmul(v, _load(context, builder, scale_t, scale_v, c0_v, f32))
        elif not isinstance(scale_t, types.NoneType):
            v = builder.fmul(v, _splat(builder, scale_v))
        t = _load(context, builder, thr_t, thr_v, c0_v, f32) if isinstance(thr_t, types.Array) else _splat(builder,
                                                                                                          thr_v)
        return builder.bitcast(builder.fcmp_ordered(">", v, t), i32)

    return types.uint32(row, c0, bias, scale, thr), codegen


@intrinsic
def lowest_bit(typingctx, mask):
    """The index of the lowest set bit of a nonzero integer (its count of trailing zeros), as an int64."""
    if not isinstance(mask, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))
        return builder.zext(low, ir.IntType(64)) if mask.bitwidth < 64 else low

    return types.int64(mask), codegen
