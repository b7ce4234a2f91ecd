"""The head-loss kernels alone at the training shape (GPU only): Triton (model/head_kernels.py) against the same
math compiled by inductor from torch ops (model/head.py), and the Triton backward's two kernels at several tile
shapes.

    python -m bench.head_kernels --out bench/results/head_kernels_1xH200.json

One 49,152-token micro-batch, V = 50,304, bf16 logits with a spread like the trained head's; median of REPEATS
after WARMUP calls, CUDA events. The whole training step runs these 8 times per step (bench/run.py measures that).
Each tile shape is a fixed launch configuration, not autotuned: cold compile time is a product goal.
"""
import argparse
import json
from pathlib import Path

import torch
import triton

from bench.timing import median_ms
from model import head, head_kernels

N, V, SOFTCAP = 48 * 1024, 50304, 15.0
# The FP8 backward is two kernels: the gradient stored row-major, then its e5m2 transpose. Their tile shapes
# (rows, columns, warps) swept here; model/head_kernels.py commits the fastest of each.
# bench/results/head_kernels_1xH200_8ab2f99.json also timed the one-kernel version (both layouts stored from each
# tile, 7.6-10.8 ms at six shapes), which the split replaced.
GRAD_TILES = [(64, 128, 8), (32, 256, 4), (16, 512, 4), (8, 1024, 4)]
TRANSPOSE_TILES = [(64, 64, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4), (256, 64, 8), (32, 32, 4)]


def attempt(fn) -> float | str:
    """median_ms(fn), or the error's first line: a tile too large for the SM's registers or shared memory is a
    result too, and the sweep goes on."""
    try:
        return median_ms(fn)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def training_problem():
    """(logits_NV, targets_N, grad_N, g_scale) of one micro-batch on the GPU: bf16 logits of std 3, random targets,
    the upstream gradient of a mean loss, and HeadLoss's e5m2 scale for it."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits_NV = (3.0 * torch.randn(N, V, device="cuda", generator=gen)).bfloat16()
    targets_N = torch.randint(0, V, (N,), device="cuda", generator=gen)
    grad_N = torch.full((N,), 1.0 / N, device="cuda")
    return logits_NV, targets_N, grad_N, grad_N.abs().amax() / head.GRAD_FP8_SCALE


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    logits_NV, targets_N, grad_N, g_scale = training_problem()
    lse_N, _ = head_kernels.lse_and_loss(logits_NV, targets_N, SOFTCAP)

    compiled_forward = torch.compile(head.lse_and_loss, dynamic=False)
    compiled_backward = torch.compile(head.logits_grad_fp8, dynamic=False)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "N": N, "V": V,
        # bytes moved at the least: read the bf16 logits once; the backward also writes e5m2 twice
        "forward_min_bytes": 2 * N * V, "backward_min_bytes": 4 * N * V,
        "forward_ms": {"inductor": median_ms(lambda: compiled_forward(logits_NV, targets_N, SOFTCAP)),
                       "triton": median_ms(lambda: head_kernels.lse_and_loss(logits_NV, targets_N, SOFTCAP))},
        "backward_fp8_ms": {
            "inductor": median_ms(lambda: compiled_backward(logits_NV, lse_N, targets_N, grad_N, g_scale, SOFTCAP)),
            "triton": median_ms(
                lambda: head_kernels.logits_grad_fp8(logits_NV, lse_N, targets_N, grad_N, g_scale, SOFTCAP))},
    }

    g8_NV = torch.empty((N, V), dtype=torch.float8_e5m2, device="cuda")
    g8t_VN = torch.empty((V, N), dtype=torch.float8_e5m2, device="cuda")
    result["grad_e5m2_row_major_ms"] = {}
    for block_n, block_v, warps in GRAD_TILES:
        grid = (triton.cdiv(N, block_n), triton.cdiv(V, block_v))
        result["grad_e5m2_row_major_ms"]["triton %dx%d, %d warps" % (block_n, block_v, warps)] = attempt(
            lambda: head_kernels._grad_kernel[grid](logits_NV, lse_N, targets_N, grad_N, g_scale, g8_NV, N, SOFTCAP,
                                                    V=V, BLOCK_N=block_n, BLOCK_V=block_v, SCALED=True,
                                                    num_warps=warps))
    compiled_transpose = torch.compile(lambda g: g.t().contiguous(), dynamic=False)
    result["transpose_e5m2_ms"] = {"inductor": attempt(lambda: compiled_transpose(g8_NV))}
    for block_r, block_c, warps in TRANSPOSE_TILES:
        grid = (triton.cdiv(N, block_r), triton.cdiv(V, block_c))
        result["transpose_e5m2_ms"]["triton %dx%d, %d warps" % (block_r, block_c, warps)] = attempt(
            lambda: head_kernels._transpose_kernel[grid](g8_NV, g8t_VN, N, V, BLOCK_R=block_r, BLOCK_C=block_c,
                                                         num_warps=warps))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
