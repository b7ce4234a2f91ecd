"""The attention inputs' kernels alone at the training shape (GPU only): a sweep of the launch configurations of
model/qkv_kernels.py's two kernels, launched directly; then model.layers.qkv_prep compiled by inductor from torch
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
    args = ap.parse_args()
    torch.manual_seed(0)

    qkv, ve = randn(B, T, 3 * H, D), randn(B, T, H * D)
    cos, sin = layers.rotary_tables(T, D, 1024.0, torch.device("cuda"))
    lambdas = torch.tensor([0.7, -0.4, 1.3], device="cuda")
    dq, dk, dv = randn(B, H, T, D).transpose(1, 2), randn(B, H, T, D).transpose(1, 2), randn(B, T, H, D)
    q, k, v = (randn(B, T, H, D) for _ in range(3))
    dqkv = torch.empty_like(qkv)
    dve = torch.empty_like(ve)
    R = B * T * H
    result = {"sweep": [], "compiled": {}}
    for (block_r, warps), has_ve in itertools.product(itertools.product([8, 16, 32, 64], [2, 4, 8]), [False, True]):
        grid = (triton.cdiv(R, block_r),)
        partial = torch.empty(grid[0], 3, device="cuda")
        ve_in, dve_out = (ve, dve) if has_ve else (qkv, dqkv)
        flags = {"H": H, "D": D, "BLOCK_R": block_r, "HAS_V_FIRST": False, "HAS_VE": has_ve, "num_warps": warps}

        def forward():
            qkv_kernels._qkv_forward_kernel[grid](qkv, cos, sin, lambdas, qkv, ve_in, q, k, v, R, T, **flags)

        def backward():
            qkv_kernels._qkv_backward_kernel[grid](qkv, cos, sin, lambdas, qkv, ve_in, dq, dk, dv, *dq.stride()[:3],
                                                   *dk.stride()[:3], *dv.stride()[:3], dqkv, dqkv, dve_out, partial,
                                                   R, T, **flags)

        row = {"block_r": block_r, "warps": warps, "ve": has_ve, "forward_ms": do_bench(forward, warmup=25, rep=200),
               "backward_ms": do_bench(backward, warmup=25, rep=200)}
        result["sweep"].append(row)
        print(row, flush=True)

    for has_ve in (False, True):
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
