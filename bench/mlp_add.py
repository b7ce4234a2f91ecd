"""The residual stream's add in the epilogue of the product before it (model/mlp_kernels.py, matmul_add) against
what the block ran before: cuBLAS's product, then an inductor kernel that adds it (GPU only). Two products:

- "mlp": the MLP's second product, h (M, F) = relu(x @ W1)^2 as the forward makes it, W2 (D, F) as stored; inductor
  only added there.
- "attention": the attention's output projection, y (M, A), W (D, A) as stored. Inductor's kernel after it also
  norms the new stream for the MLP, so both sides are timed with that norm: with the add in the epilogue, inductor
  only norms.

One 49,152-token micro-batch, the residual stream r (M, D), bf16. Each call is checked against fp64 torch ops, then
timed in a CUDA graph (bench.timing.graph_ms). The training step runs each 11 blocks x 8 micro-batches = 88 times
per step.

    python -m bench.mlp_add --out bench/results/mlp_add_1xH200.json

Measured on the H200 (bench/results/README.md):
- the MLP (mlp_add_1xH200.json): the kernel at the MLP kernels' CONFIG 0.3109 ms, against 0.3338 for cuBLAS's
  product (0.2893 alone) and inductor's add; adopted in ReLU2MLP.
- the attention (mlp_add_attention_1xH200.json): the kernel and the norm 0.1409 ms against 0.1750, though the
  kernel alone runs 0.1043 against cuBLAS's 0.0882. In the step it gained nothing (53f5293, reverted): there the
  kernel took 123.5 us a call against cuBLAS's 92, at the clock the GPU holds at its power limit.
"""
import argparse
import json
from pathlib import Path

import torch

from bench.mlp_kernels import D, M, error_of_max, training_problem
from bench.timing import failure, graph_ms
from model import layers, mlp_kernels

CONFIGS = [mlp_kernels.CONFIG, (128, 128, 64, 4, 4), (128, 64, 64, 6, 4), (64, 128, 64, 6, 4), (128, 128, 128, 2, 4)]


def attention_problem():
    """(y, W) of one micro-batch in bf16: the attention's output y (M, A), A = D, and its projection W (D, A) at a
    trained scale (its init is zero)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    y = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(D, D, device="cuda", generator=gen) * D ** -0.5).bfloat16()
    return y, w


def alone(add):
    """add(a, w, r) and nothing after it, as the MLP's output joins the stream."""
    return add


def with_norm(add):
    """add(a, w, r), then the norm of the sum, as the block feeds the MLP: the stream and the MLP's input."""
    def fn(a, w, r):
        stream = add(a, w, r)
        return stream, layers.norm(stream)
    return fn


def measure(a, w, r, then) -> dict:
    """Both ways compiled, `then` wrapping the add (alone, or with_norm): cuBLAS's product and inductor's add, and
    the kernel at CONFIG (an opaque custom op to inductor), each with inductor's work after it; then the kernel
    alone at each configuration of CONFIGS. Times and errors against fp64 of the stream."""
    want = layers.matmul_add(a.double(), w.double(), r.double())
    result = {"M": a.size(0), "K": a.size(1), "N": w.size(0), "cublas_product_ms": graph_ms(lambda: a @ w.t())}
    for name, add in (("cublas_then_inductor", layers.matmul_add), ("kernel_then_inductor", mlp_kernels.matmul_add)):
        compiled = torch.compile(then(add), dynamic=False)
        result[f"{name}_ms"] = graph_ms(lambda c=compiled: c(a, w, r))
        out = compiled(a, w, r)
        result[f"{name}_max_err_of_max"] = error_of_max(out if then is alone else out[0], want)
    result["configs"] = []
    print(result, flush=True)
    for config in CONFIGS:
        row = {"config": config}
        try:
            row["max_err_of_max"] = error_of_max(mlp_kernels.launch(a, w, r, mlp_kernels.ADD, config), want)
            row["ms"] = graph_ms(lambda c=config: mlp_kernels.launch(a, w, r, mlp_kernels.ADD, c))
        except Exception as e:  # a configuration that does not fit is a result too
            row["error"] = failure(e)
        result["configs"].append(row)
        print(row, flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    x, _, w2, _, h = training_problem()
    r = torch.randn_like(x)
    y, w = attention_problem()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "mlp": measure(h, w2, r, alone), "attention": measure(y, w, r, with_norm)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
