"""Small @triton.jit helpers shared by kernel families."""
import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Cast float32 ``x`` to ``dtype`` with round-to-nearest-even, identically on GPU and interpreter.

    The GPU rounds fp32 -> bf16 to nearest even, but Triton's interpreter (how CI runs kernels)
    truncates, even when asked for "rtne". For bf16 we therefore round on the bits ourselves: a few
    integer ops per element, free in the memory-bound kernels that use this.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        as_bf16 = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), as_bf16)  # keep NaN a NaN
    else:
        return x.to(dtype)
