"""The MLP's kernels alone at the training shape (GPU only): the Triton products with the ReLU² in their epilogue
(model/mlp_kernels.py) against cuBLAS and against the same math compiled by inductor from torch ops
(model/layers.py); and the MLP's whole forward + backward both ways, compiled. bench/mlp_variants.py sweeps the
kernel's structure and tile shapes.

    python -m bench.mlp_kernels --out bench/results/mlp_kernels_1xH200.json

One 49,152-token micro-batch, D = 768, F = 3,072, bf16; median of REPEATS after WARMUP calls, CUDA events. The
training step runs each product 8 micro-batches x 12 layers = 96 times per step (bench/run.py measures that).
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.timing import failure, median_ms
from model import layers, mlp_kernels

M, D, HIDDEN = 48 * 1024, 768, 3072


def tflops(ms: float | str) -> float | str:
    """Throughput of one (M x D) @ (D x F) product in the time ms (an error message passes through)."""
    return round(2 * M * D * HIDDEN / (ms * 1e-3) / 1e12, 1) if isinstance(ms, float) else ms


def error_of_max(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error of got, taken in want's dtype, relative to want's largest value."""
    return ((got.to(want.dtype) - want).abs().max() / want.abs().max()).item()


def checked_row(side: str, call, want, timer) -> dict:
    """One side of a kernel sweep's row: call()'s largest error relative to want's largest value, then its time by
    timer, and the throughput. Where the call fails (a tile too large for the SM, say) the error message stands in
    for the error and the time reads "not run": a failed configuration is a result too, and the sweep goes on."""
    try:
        err = error_of_max(call(), want)
        ms = timer(call)
    except Exception as e:
        err, ms = failure(e), "not run"
    return {f"{side}_max_err_of_max": err, f"{side}_ms": ms, f"{side}_tflops": tflops(ms)}


def plain_mlp(x, w1, w2, r):
    """The MLP added to the residual stream r as model/layers.py wrote it before ReLU2MLP: autograd and inductor
    through torch ops."""
    return r + F.relu(x @ w1).square() @ w2.t()


def fused_mlp(x, w1, w2, r):
    return layers.ReLU2MLP.apply(x, w1, w2, r, False)


def forward_backward(fn, x, w1, w2, r, grad_y):
    """One call of fn and its backward on fresh leaves: what a block's MLP costs per micro-batch."""
    def run():
        leaves = [t.detach().requires_grad_() for t in (x, w1, w2, r)]
        fn(*leaves).backward(grad_y)
    return run


def training_problem():
    """(x, W1, W2, grad_y, h) of one micro-batch on the GPU in bf16: W1 at the model's init scale, W2 at a trained
    one's (its init is zero), h = relu(x @ W1)^2 by torch ops."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    w1 = (torch.randn(D, HIDDEN, device="cuda", generator=gen) * 0.5 * D ** -0.5).bfloat16()
    w2 = (torch.randn(D, HIDDEN, device="cuda", generator=gen) * HIDDEN ** -0.5).bfloat16()
    grad_y = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    return x, w1, w2, grad_y, layers.relu2_matmul(x, w1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    x, w1, w2, grad_y, h = training_problem()

    compiled_forward = torch.compile(layers.relu2_matmul, dynamic=False)
    compiled_backward = torch.compile(layers.relu2_matmul_grad, dynamic=False)
    kernel_forward = torch.compile(mlp_kernels.relu2_matmul, dynamic=False)
    kernel_backward = torch.compile(mlp_kernels.relu2_matmul_grad, dynamic=False)
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "D": D, "F": HIDDEN,
        "cublas_product_ms": median_ms(lambda: x @ w1),
        "inductor_forward_ms": median_ms(lambda: compiled_forward(x, w1)),
        "inductor_backward_ms": median_ms(lambda: compiled_backward(grad_y, w2, h)),
        # compiled too: an eager launch through wrap_triton takes longer on the host than the kernel on the GPU,
        # and the CUDA events then time the host (0.75-0.95 ms in mlp_kernels_1xH200_0253176.json)
        "triton_forward_ms": median_ms(lambda: kernel_forward(x, w1)),
        "triton_backward_ms": median_ms(lambda: kernel_backward(grad_y, w2, h)),
    }
    for side in ("cublas_product", "triton_forward", "triton_backward"):
        result[f"{side}_tflops"] = tflops(result[f"{side}_ms"])
    for name, fn in (("plain", plain_mlp), ("fused", fused_mlp)):
        compiled = torch.compile(fn, dynamic=False)
        result[f"mlp_forward_backward_{name}_compiled_ms"] = median_ms(forward_backward(compiled, x, w1, w2, x,
                                                                                        grad_y))
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
