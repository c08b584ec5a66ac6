"""Small helpers shared by kernel families: @triton.jit math, and the arrival counters of the
"last program to arrive finishes the work" kernels."""
import torch
import triton
import triton.language as tl

# Arrival counters, per (purpose, device, stream): zero between launches (the program that arrives
# last resets its slot), so no memset launch per call. If the first use is during CUDA-graph
# capture, the buffer comes from the graph's pool and its zeroing is captured too (harmless: the
# counters are all zero again at every replay). Per stream, so that two streams never share slots.
_COUNTERS: dict = {}
_RETIRED: list = []


def arrival_counters(purpose: str, device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters for ``purpose`` on the current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (purpose, str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:  # a captured graph may still use it: never free it
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    return buf


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
