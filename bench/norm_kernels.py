"""The block input's x0 mix and norm alone at the training shape (GPU only): a sweep of the launch configurations of
model/norm_kernels.py's two kernels, launched directly; then model.layers.mix_norm compiled by inductor from torch
ops against MixNorm on the kernels, compiled, forward and forward + backward.

    python -m bench.norm_kernels --out bench/results/norm_kernels_1xH200.json

One 49,152-token micro-batch of D = 768, bf16, with the record's gate of G = 12 channels; the gradients of all three
outputs (x, n, the gate's input) reach the backward, as in the model. triton.testing.do_bench: the mean over 200 ms
of calls after 25 ms of warm-up, with the L2 cleared between calls. Each sweep row carries its kernels' traffic
(forward: x_in, x0 in, x, n, gate out, and for forward_fp8 also n's e4m3 copy; backward: x_in, x0, three gradients
in, two out) as GB/s; each compiled pair, the time of each of its kernels per forward + backward under
torch.profiler; the inputs' .grad accumulate over the calls, so those rows include autograd's adds into them
(CUDAFunctor_add), the same for both. The step runs the pair once per attention layer and micro-batch, 88 times per
step.
"""
import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from bench.timing import cuda_bf16_randn as randn
from model import layers, norm_kernels
from model.fp8 import normed_scale

B, T, D, G = 1, 49152, 768, 12
PROFILED = 10  # forward + backward calls under the profiler, whose kernel times are averaged


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)

    x_in, x0, g_x, g_n, g_gate = randn(B, T, D), randn(B, T, D), randn(B, T, D), randn(B, T, D), randn(B, T, G)
    lambdas = torch.tensor([0.7, 0.3], device="cuda")
    x, n, gate, g_x_in, g_x0 = randn(B, T, D), randn(B, T, D), randn(B, T, G), randn(B, T, D), randn(B, T, D)
    R, row_bytes, gate_bytes = B * T, D * x_in.element_size(), G * x_in.element_size()
    n8, n8_scale = torch.empty_like(n, dtype=torch.float8_e4m3fn), normed_scale(n)
    traffic = {"forward": R * (4 * row_bytes + gate_bytes), "backward": R * (6 * row_bytes + gate_bytes)}
    traffic["forward_fp8"] = traffic["forward"] + R * D  # n's e4m3 copy, one byte per value
    result = {"traffic_GB": {k: v / 1e9 for k, v in traffic.items()}, "sweep": [], "compiled": {}}

    def rate(name, ms):
        return round(traffic[name] / ms / 1e6, 1)  # GB/s

    for block_r, warps in itertools.product([1, 2, 4, 8], [1, 2, 4, 8]):
        grid = (triton.cdiv(R, block_r),)
        partial = torch.empty(grid[0], 2, device="cuda")
        flags = {"D": D, "G": G, "BLOCK_R": block_r, "BLOCK_D": triton.next_power_of_2(D), "num_warps": warps}

        def forward():
            norm_kernels._mix_norm_forward_kernel[grid](x_in, x0, lambdas, x, n, gate, n, lambdas, R,
                                                        WRITES_FP8=False, **flags)

        def forward_fp8():
            norm_kernels._mix_norm_forward_kernel[grid](x_in, x0, lambdas, x, n, gate, n8, n8_scale, R,
                                                        WRITES_FP8=True, **flags)

        def backward():
            norm_kernels._mix_norm_backward_kernel[grid](x_in, x0, lambdas, g_x, g_n, g_gate, g_x_in, g_x0, partial, R,
                                                         HAS_G_X=True, HAS_G_N=True, HAS_G_GATE=True, **flags)

        row = {"block_r": block_r, "warps": warps}
        for name, fn in (("forward", forward), ("forward_fp8", forward_fp8), ("backward", backward)):
            ms = do_bench(fn, warmup=25, rep=200)
            row |= {f"{name}_ms": ms, f"{name}_GBps": rate(name, ms)}
        result["sweep"].append(row)
        print(row, flush=True)

    def on_kernels(x_in, x0, lambdas, gate_width):
        return layers.MixNorm.apply(x_in, x0, lambdas, gate_width, False)[:3]

    for name, fn in (("torch_ops_compiled", layers.mix_norm), ("kernels_compiled", on_kernels)):
        compiled = torch.compile(fn, dynamic=False, fullgraph=True)
        leaves = [x_in.detach().requires_grad_(), x0.detach().requires_grad_(), lambdas.detach().requires_grad_()]

        def forward_backward():
            torch.autograd.backward(compiled(*leaves, G), [g_x, g_n, g_gate])

        times = {"forward_ms": do_bench(lambda: compiled(x_in, x0, lambdas, G), warmup=25, rep=200),
                 "forward_backward_ms": do_bench(forward_backward, warmup=25, rep=200)}
        # do_bench's times include the host's autograd work; the profiler's kernel times are the GPU's alone
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED):
                forward_backward()
            torch.cuda.synchronize()
        times["kernel_us"] = {e.key: e.self_device_time_total / PROFILED for e in prof.key_averages()
                              if e.device_type == torch.autograd.DeviceType.CUDA}
        result["compiled"][name] = times
        print(name, times, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
