"""The attention inputs' kernels alone at the training shape (GPU only): a sweep of the launch configurations of
model/qkv_kernels.py's kernels (the forward launched directly, the backward through its two functions, bf16 and
FP8); then model.layers.qkv_prep compiled by inductor from torch
ops against QKVPrep on the kernels, compiled, forward and forward + backward.

    python -m bench.qkv_kernels --out bench/results/qkv_kernels_1xH200.json

One 49,152-token micro-batch of 6 heads of 128, bf16, with and without a value embedding (no value residual, as
in the record); the q and k gradients arrive transposed, as FlexAttention's do. triton.testing.do_bench: the mean
over 200 ms of calls after 25 ms of warm-up, with the L2 cleared between calls. The step runs each kernel once per
attention layer and micro-batch, 88 times per step.
"""
import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from bench.timing import cuda_bf16_randn as randn
from model import layers, qkv_kernels

B, T, H, D = 1, 49152, 6, 128


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="forward,backward,compiled",
                    help="which of the three measurements to run, comma-separated (each costs its compiles)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    torch.manual_seed(0)

    qkv, ve = randn(B, T, 3 * H, D), randn(B, T, H * D)
    cos, sin = layers.rotary_tables(T, D, 1024.0, torch.device("cuda"))
    lambdas = torch.tensor([0.7, -0.4, 1.3], device="cuda")
    dq, dk, dv = randn(B, H, T, D).transpose(1, 2), randn(B, H, T, D).transpose(1, 2), randn(B, T, H, D)
    q, k, v = (randn(B, T, H, D) for _ in range(3))
    R = B * T * H
    result = {"sweep": [], "backward_sweep": [], "compiled": {}}
    forward_configs = itertools.product([8, 16, 32, 64], [2, 4, 8]) if "forward" in parts else []
    for (block_r, warps), has_ve in itertools.product(forward_configs, [False, True]):
        grid = (triton.cdiv(R, block_r),)
        flags = {"H": H, "D": D, "BLOCK_R": block_r, "HAS_V_FIRST": False, "HAS_VE": has_ve, "num_warps": warps}

        def forward():
            qkv_kernels._qkv_forward_kernel[grid](qkv, cos, sin, lambdas, qkv, ve if has_ve else qkv, q, k, v, R, T,
                                                  **flags)

        row = {"block_r": block_r, "warps": warps, "ve": has_ve, "forward_ms": do_bench(forward, warmup=25, rep=200)}
        result["sweep"].append(row)
        print(row, flush=True)

    # the backward as the step calls it (the launch and the partial sums; with FP8 also qkv's gradient's e4m3 copy,
    # its amax and the scale's few scalar ops), at each (rows per program, warps) of BACKWARD_CONFIG
    amax = torch.ones((), device="cuda")
    kept = qkv_kernels.BACKWARD_CONFIG
    backward_configs = itertools.product([8, 16, 32], [2, 4, 8]) if "backward" in parts else []
    for config, has_ve in itertools.product(backward_configs, [False, True]):
        qkv_kernels.BACKWARD_CONFIG = config
        operands = (dq, dk, dv, qkv, cos, sin, lambdas, None, ve if has_ve else None)
        row = {"block_r": config[0], "warps": config[1], "ve": has_ve,
               "bf16_ms": do_bench(lambda: qkv_kernels.qkv_prep_grad(*operands), warmup=25, rep=200),
               "fp8_ms": do_bench(lambda: qkv_kernels.qkv_prep_grad_fp8(*operands, amax), warmup=25, rep=200)}
        result["backward_sweep"].append(row)
        print(row, flush=True)
    qkv_kernels.BACKWARD_CONFIG = kept

    for has_ve in (False, True) if "compiled" in parts else ():
        for name, fn in (("torch_ops_compiled", layers.qkv_prep), ("kernels_compiled", layers.QKVPrep.apply)):
            compiled = torch.compile(fn, dynamic=False)
            leaves = [qkv.detach().requires_grad_(), lambdas.detach().requires_grad_(),
                      ve.detach().requires_grad_() if has_ve else None]

            def forward_backward():
                outs = compiled(leaves[0], cos, sin, leaves[1], None, leaves[2])
                torch.autograd.backward(outs, [dq, dk, dv])

            times = {"forward_ms": do_bench(lambda: compiled(qkv, cos, sin, lambdas, None, ve if has_ve else None),
                                            warmup=25, rep=200),
                     "forward_backward_ms": do_bench(forward_backward, warmup=25, rep=200)}
            result["compiled"][f"{name}_ve{int(has_ve)}"] = times
            print(name, has_ve, times, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
