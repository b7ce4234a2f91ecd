"""The FP8 head's weight gradient without its transposed copy of the unit gradient (GPU only).

    python -m bench.head_wgrad --out bench/results/head_wgrad_1xH200.json

grad_w (V, D) = u (N, V)^T @ x_r (N, D) sums over the tokens. Main's backward (model/head.py, HeadLoss) hands
torch._scaled_mm a transposed e5m2 copy of u, made by a Triton kernel in the forward, because Hopper's FP8 tensor
cores read both operands K-major (K = N here) and u is stored with V contiguous. In the step's profile that copy
costs 1.27 ms per micro-batch and the product 2.36 ms (bench/results/kernels_step28_1xH200_93c851b.txt). Here a
Triton kernel reads u as it is stored, the transposition done on the way into the tensor cores, at several tile
shapes; it pays if it takes less than the copy and the product together.

One 49,152-token micro-batch, V = 50,304, D = 768. u comes from model/head_kernels.py on bf16 logits with a spread
like the trained head's, x_r is e4m3 like the head's normed input. Errors are against an fp32 product of the same
FP8 values (relative Frobenius norm, and the largest difference over the largest value). Times from CUDA graphs
(bench.timing.graph_ms): 20 replays near the idle clock, and 400 back to back, long enough to reach the GPU's power
limit, as the step runs.
"""
import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.mlp_kernels import error_of_max
from bench.timing import failure, graph_ms
from model import fp8, head, head_kernels, transpose_kernels

N, V, D, SOFTCAP = 48 * 1024, 50304, 768, 15.0
# (BLOCK_M over V, BLOCK_N over D, BLOCK_K over the tokens, stages, warps, imprecise accumulation)
CONFIGS = [(128, 256, 128, 3, 8, False), (128, 256, 128, 3, 8, True), (128, 128, 128, 4, 4, False),
           (128, 128, 128, 4, 8, False), (128, 256, 64, 4, 8, False), (64, 256, 128, 4, 4, False),
           (256, 128, 64, 3, 8, False), (128, 128, 64, 5, 4, False)]


@triton.jit
def _wgrad_kernel(u_ptr, xt_ptr, out_ptr, scale_ptr, N, V, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISE: tl.constexpr):
    """out (V, D) fp32 = scale * u^T @ x, u (N, V) e5m2 row-major, xt = x^T (D, N) e4m3 row-major. The programs of
    one row block of out are neighbours in the launch order, so they read the same columns of u while in L2."""
    n_blocks = D // BLOCK_N
    pid_m, pid_n = tl.program_id(0) // n_blocks, tl.program_id(0) % n_blocks
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = u_ptr + ks.to(tl.int64)[None, :] * V + rows[:, None]  # (BLOCK_M, BLOCK_K), contiguous along M
    b_ptrs = xt_ptr + cols.to(tl.int64)[None, :] * N + ks[:, None]  # (BLOCK_K, BLOCK_N), contiguous along K
    inside = rows[:, None] < V
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, N, BLOCK_K):
        a = tl.load(a_ptrs, mask=inside, other=0.0)
        b = tl.load(b_ptrs)
        if PRECISE:  # the products' sums promoted to fp32 after every block, as cuBLAS does without fast accumulation
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * V
        b_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], acc, mask=inside)


def wgrad(u_NV, xt_DN, scale, config):
    block_m, block_n, block_k, stages, warps, imprecise = config
    out = torch.empty((V, D), dtype=torch.float32, device=u_NV.device)
    grid = (triton.cdiv(V, block_m) * (D // block_n),)
    _wgrad_kernel[grid](u_NV, xt_DN, out, scale, N, V, D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        PRECISE=not imprecise, num_stages=stages, num_warps=warps)
    return out


def errors(out, ref):
    return {"rel_frobenius": float((out - ref).norm() / ref.norm()), "max_abs_over_max": error_of_max(out, ref)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    logits = (torch.randn(N, V, device="cuda") * 4.0).to(torch.bfloat16)  # a trained head's spread: |z| up to ~15
    targets = torch.randint(0, V, (N,), device="cuda")
    _, u_NV, u_VN = head_kernels.loss_and_unit_grad_fp8(logits, targets, SOFTCAP, head.GRAD_FP8_SCALE)
    del logits
    x = torch.nn.functional.rms_norm(torch.randn(N, D, device="cuda"), (D,))
    x_scale = fp8.normed_scale(x)
    x_op = fp8.to_e4m3(x, x_scale)
    xt_DN = x_op.t().contiguous()  # main makes this copy too (head._col_major), for either path
    g_scale = torch.full((), 3.1e-5, device="cuda")  # a mean loss's bound over 2^15
    scale = (g_scale * x_scale).reshape(1)

    torch.backends.cuda.matmul.allow_tf32 = False  # (the default) a true fp32 reference
    ref = (u_NV.float().t() @ x_op.float()) * scale  # the same FP8 values

    def transpose():
        return transpose_kernels.transposed(u_NV)

    def cublas():
        return torch._scaled_mm(u_VN, xt_DN.t(), scale_a=g_scale, scale_b=x_scale, out_dtype=torch.float32)

    assert torch.equal(transpose(), u_VN)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton_version": triton.__version__,
              "shape": {"N": N, "V": V, "D": D},
              "main": {"transpose_ms": graph_ms(transpose), "scaled_mm_ms": graph_ms(cublas),
                       "transpose_ms_400": graph_ms(transpose, replays=400),
                       "scaled_mm_ms_400": graph_ms(cublas, replays=400), **errors(cublas(), ref)},
              "triton": []}
    print(json.dumps(result["main"]), flush=True)
    for config in CONFIGS:
        row = {"config": dict(zip(("block_m", "block_n", "block_k", "stages", "warps", "imprecise"), config))}
        try:
            row.update(errors(wgrad(u_NV, xt_DN, scale, config), ref))
            row["ms"] = graph_ms(lambda: wgrad(u_NV, xt_DN, scale, config))
            row["ms_400"] = graph_ms(lambda: wgrad(u_NV, xt_DN, scale, config), replays=400)
        except Exception as e:  # a shape Triton cannot compile or launch here: recorded, the sweep goes on
            row["error"] = failure(e)
        print(json.dumps(row), flush=True)
        result["triton"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")  # after each row: a time limit keeps them


if __name__ == "__main__":
    main()
