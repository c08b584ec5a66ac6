"""Compile ember's one-launch kernels for sm_90 (H100 / H200) on a machine without a GPU.

The interpreter runs these kernels on CPU, but it never lowers them: an error that only the compiler
sees (a global that is not a constexpr, an inline-PTX path the interpreter skips) would first show
on the GPU. This builds each case's real launch through Triton's JIT with the target forced to
sm_90 and ``warmup=True`` (compile, never launch), GPU-only switches (LD_POLL, PDL) on.

    PYTHONPATH=. python tests/ops/sm90_compile_check.py [CASE ...]   # one line per compiled kernel

Exit status 0: all compiled; 1: a compile error (a Triton error: the front end's, ptxas'; printed);
3: this Triton cannot be driven this way (its JIT internals differ, no ptxas: any other exception):
the caller skips.
"""
from __future__ import annotations

import os
import sys
import time
from unittest import mock

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("sm90_compile_check: run without TRITON_INTERPRET (kernels must be JIT functions)")

import torch  # noqa: E402

try:
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget
    from triton.errors import TritonError  # CompilationError, PTXASError: the kernel's own errors
    _run = jit.JITFunction.run
    _driver = jit.driver
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the Triton release
    print(f"SKIP: Triton's JIT cannot be driven without a GPU here ({e})")
    sys.exit(3)


def _compile_only(self, *args, grid, warmup, **kw):
    for name in ("LD_POLL", "PDL"):
        if name in self.arg_names:
            kw[name] = True
    t = time.time()
    k = _run(self, *args, grid=grid, warmup=True, **kw)
    print(f"compiled {self.fn.__name__}: {k.metadata.num_warps} warps, {len(k.asm['cubin'])} cubin bytes, "
          f"{time.time() - t:.1f} s", flush=True)
    return k


def _sample_topk_tagged():
    from ember.kernels import sampling as ks
    x = torch.randn(1, 128256)
    out = torch.empty(1, dtype=torch.int64)
    ks.sample_one_launch(x, out, 0.7, 50, 0.9, 0.0, torch.tensor([5]), torch.zeros(1, dtype=torch.int64))


def _softmax_waves():
    from ember.kernels import sampling as ks
    x = torch.randn(256, 128256)
    ks.softmax_waves(x, torch.empty_like(x), 1.0, False, ks.WAVES_DEFAULT, 8, 16)


def _moe_fp8_decode():
    """The batch-1 decode's MoE kernels at Qwen3-30B-A3B widths (8 experts: the count is not
    compiled in): router + add_rmsnorm in one launch, the fp8 block-scaled v2 expert GEMVs."""
    os.environ["EMBER_FORCE_TRITON"] = "1"
    import ember
    from ember import tuning
    from ember.kernels import moe as km
    E, H, I, K = 8, 2048, 768, 4
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    x, res = torch.randn(1, H, dtype=bf16), torch.randn(1, H, dtype=bf16)
    km.route_hidden(x, torch.randn(E, H, dtype=bf16), K, True,
                    add_norm=(res, torch.ones(H, dtype=bf16), 1e-6, torch.empty_like(x), torch.empty_like(x)))
    wgu, wd = torch.zeros(E, 2 * I, H, dtype=fp8), torch.zeros(E, H, I, dtype=fp8)
    gs, ds = torch.ones(E, 2 * I // 128, H // 128), torch.ones(E, H // 128, I // 128)
    with tuning.override("moe", {"t1": {"GEMV": "v2", "GEMV_FP8": "v2"}}):  # the GPU's fp8 choice
        ember.ops.moe_experts(x, wgu, wd, torch.full((1, K), 1.0 / K), torch.arange(K).view(1, K).int(),
                              gate_up_scale=gs, down_scale=ds)


def _pad_wide_rows():
    """The pad kernel's wide-row path, constant and reflect: [3, 1, 11, 195] bf16 cropped to 15-column
    rows (Triton 3.6 once failed it in TritonGPURemoveLayoutConversions) and an audio-like reflect."""
    from ember.kernels import pad as kp  # noqa: F401 - decorated as JIT before the interpreter switch
    os.environ["EMBER_FORCE_TRITON"] = "1"
    import ember
    ember.ops.pad(torch.zeros(3, 1, 11, 195, dtype=torch.bfloat16), (6, -186, 2, -4, 2, 2))
    ember.ops.pad(torch.zeros(2, 4, 4096, dtype=torch.bfloat16), (512, 512), mode="reflect")


CASES = {"sample_topk_tagged": _sample_topk_tagged, "softmax_waves": _softmax_waves, "moe_fp8_decode": _moe_fp8_decode,
         "pad_wide_rows": _pad_wide_rows}


def main(names: list[str]) -> int:
    drv = mock.MagicMock()
    drv.active.get_current_target.return_value = GPUTarget("cuda", 90, 32)
    drv.active.get_current_device.return_value = 0
    with mock.patch.object(jit, "driver", drv), mock.patch.object(jit.JITFunction, "run", _compile_only):
        for name in names or list(CASES):
            try:
                CASES[name]()
            except Exception as e:  # noqa: BLE001 - reported, then the status says which kind
                text = f"{type(e).__name__}: {e}"
                # an MLIR pass failure is the kernel's too (Triton raises it as a plain RuntimeError)
                kernel_error = isinstance(e, TritonError) or "PassManager::run failed" in str(e)
                if not kernel_error:  # the harness, not the kernel: a Triton it does not fit
                    print(f"SKIP: this Triton cannot be driven this way ({text[:300]})")
                    return 3
                cause = e.__cause__
                while cause is not None:  # the nested compile error names the failing line
                    text += f"\ncaused by {type(cause).__name__}: {cause}"
                    cause = cause.__cause__
                print(f"FAILED {name}: {text}")
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
