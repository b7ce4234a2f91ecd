"""The head-loss kernels alone at the training shape (GPU only): Triton (model/head_kernels.py) against the same
math compiled by inductor from torch ops (model/head.py), and the Triton kernels at several launch shapes.

    python -m bench.head_kernels --out bench/results/head_kernels_1xH200.json

One 49,152-token micro-batch, V = 50,304, bf16 logits with a spread like the trained head's; median of REPEATS
after WARMUP calls, CUDA events. The whole training step runs these 8 times per step (bench/run.py measures that).
Each launch shape is a fixed configuration, not autotuned: cold compile time is a product goal.
"""
import argparse
import json
from pathlib import Path

import torch
import triton

from bench.timing import graph_ms, median_ms
from model import head, head_kernels, transpose_kernels

N, V, SOFTCAP = 48 * 1024, 50304, 15.0
# The training forward (lse, loss and the e5m2 unit gradient in two passes per row: chunk of the row, warps) and
# the e5m2 transpose's tiles (rows, columns, warps), swept here; model/head_kernels.py and
# model/transpose_kernels.py commit one of each.
# bench/results/head_kernels_1xH200_8ab2f99.json also timed a gradient kernel storing each tile in both layouts
# (7.6-10.8 ms at six shapes), which the separate transpose replaced.
FORWARD_SHAPES = [(1024, 4), (1024, 8), (2048, 4), (2048, 8), (2048, 16), (4096, 8), (4096, 16)]
TRANSPOSE_TILES = [(64, 64, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4), (256, 64, 8), (32, 32, 4)]


def first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def attempt(fn) -> float | str:
    """median_ms(fn), or the error's first line: a tile too large for the SM's registers or shared memory is a
    result too, and the sweep goes on."""
    try:
        return median_ms(fn)
    except Exception as e:
        return first_line(e)


def run_variant(row: dict, call, checks) -> dict:
    """One variant of a kernel sweep (bench/head_passes.py, head_persistent.py, head_resident.py): run `call` once,
    add `checks()` (its outputs against the model kernel's) and its time in CUDA graphs to `row`, or the error's
    first line (the sweep goes on); print the row and return it."""
    try:
        call()
        torch.cuda.synchronize()
        row.update(checks(), ms=graph_ms(call))
    except Exception as e:
        row["error"] = first_line(e)
    print(row)
    return row


def finish_sweep(result: dict, model_call, out: str) -> None:
    """Time the model's kernel once more (the machine may have drifted during the sweep) and write the JSON."""
    result["model_kernel_ms_again"] = graph_ms(model_call)
    print({"model_kernel_ms_again": result["model_kernel_ms_again"]})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")


def training_problem():
    """(logits_NV, targets_N) of one micro-batch on the GPU: bf16 logits of std 3, random targets."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits_NV = (3.0 * torch.randn(N, V, device="cuda", generator=gen)).bfloat16()
    return logits_NV, torch.randint(0, V, (N,), device="cuda", generator=gen)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    logits_NV, targets_N = training_problem()
    u_scale = head.GRAD_FP8_SCALE
    compiled_forward = torch.compile(head.lse_and_loss, dynamic=False)
    compiled_training = torch.compile(head.loss_and_unit_grad_fp8, dynamic=False)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "N": N, "V": V,
        # bytes moved at the least: read the bf16 logits once; training also writes e5m2 twice and reads it once
        "forward_min_bytes": 2 * N * V, "training_min_bytes": 5 * N * V,
        "forward_ms": {"inductor": median_ms(lambda: compiled_forward(logits_NV, targets_N, SOFTCAP)),
                       "triton": median_ms(lambda: head_kernels.lse_and_loss(logits_NV, targets_N, SOFTCAP))},
        "training_forward_fp8_ms": {
            "inductor": median_ms(lambda: compiled_training(logits_NV, targets_N, SOFTCAP, u_scale)),
            "triton": median_ms(lambda: head_kernels.loss_and_unit_grad_fp8(logits_NV, targets_N, SOFTCAP, u_scale))},
    }

    lse_N, loss_N = torch.empty(N, device="cuda"), torch.empty(N, device="cuda")
    u8_NV = torch.empty((N, V), dtype=torch.float8_e5m2, device="cuda")
    u8t_VN = torch.empty((V, N), dtype=torch.float8_e5m2, device="cuda")
    result["forward_with_e5m2_unit_grad_ms"] = {}
    for block_v, warps in FORWARD_SHAPES:
        result["forward_with_e5m2_unit_grad_ms"]["triton rows of %d, %d warps" % (block_v, warps)] = attempt(
            lambda: head_kernels._forward_kernel[(N,)](logits_NV, targets_N, lse_N, loss_N, u8_NV, SOFTCAP, V=V,
                                                       BLOCK_V=block_v, GRAD=True, U_SCALE=u_scale,
                                                       num_warps=warps))
    compiled_transpose = torch.compile(lambda g: g.t().contiguous(), dynamic=False)
    result["transpose_e5m2_ms"] = {"inductor": attempt(lambda: compiled_transpose(u8_NV))}
    for block_r, block_c, warps in TRANSPOSE_TILES:
        grid = (triton.cdiv(N, block_r), triton.cdiv(V, block_c))
        result["transpose_e5m2_ms"]["triton %dx%d, %d warps" % (block_r, block_c, warps)] = attempt(
            lambda: transpose_kernels._transpose_kernel[grid](u8_NV, u8t_VN, N, V, BLOCK_R=block_r,
                                                              BLOCK_C=block_c, num_warps=warps))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
