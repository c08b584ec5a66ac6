"""A trivial kernel ``ember doctor`` compiles and runs to prove Triton works on this device."""
import torch
import triton
import triton.language as tl

from ember.kernels._cache_keys import settle_cache_keys


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)


def add_one_matches() -> bool:
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    _add_one[(1,)](x, 100, BLOCK=128)
    return bool(torch.equal(x.cpu(), torch.arange(1, 101, dtype=torch.float32)))


settle_cache_keys(globals())  # callees first: one cache key in every process (see _cache_keys)
