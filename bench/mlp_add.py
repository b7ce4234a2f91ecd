"""The MLP's second product with the residual stream's add in its epilogue (model/mlp_kernels.py, matmul_add)
against what the block ran before: cuBLAS's product, then inductor's add kernel (GPU only).

    python -m bench.mlp_add --out bench/results/mlp_add_1xH200.json

One 49,152-token micro-batch, h (M, F) = relu(x @ W1)^2 as the forward makes it, W2 (D, F) as stored, the
residual stream r (M, D), bf16. Each call is checked against fp64 torch ops, then timed in a CUDA graph
(bench.timing.graph_ms). The training step runs it 11 blocks x 8 micro-batches = 88 times per step.

Measured on the H200 (bench/results/mlp_add_1xH200.json): the kernel at the MLP kernels' CONFIG 0.3109 ms, against
0.3338 for cuBLAS's product (0.2893 alone) and inductor's add; adopted in ReLU2MLP (bench/results/README.md).
"""
import argparse
import json
from pathlib import Path

import torch

from bench.mlp_kernels import error_of_max, training_problem
from bench.timing import graph_ms
from model import layers, mlp_kernels

CONFIGS = [mlp_kernels.CONFIG, (128, 128, 64, 4, 4), (128, 64, 64, 6, 4), (128, 128, 128, 2, 4)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    x, _, w2, _, h = training_problem()
    r = torch.randn_like(x)
    want = layers.matmul_add(h.double(), w2.double(), r.double())
    compiled = torch.compile(layers.matmul_add, dynamic=False)  # what the block compiled: product, then one add
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cublas_product_ms": graph_ms(lambda: h @ w2.t()),
              "cublas_then_add_ms": graph_ms(lambda: compiled(h, w2, r)),
              "cublas_then_add_max_err_of_max": error_of_max(compiled(h, w2, r), want),
              "configs": []}
    print(result, flush=True)
    for config in CONFIGS:
        row = {"config": config}
        try:
            row["max_err_of_max"] = error_of_max(mlp_kernels.launch(h, w2, r, mlp_kernels.ADD, config), want)
            row["ms"] = graph_ms(lambda c=config: mlp_kernels.launch(h, w2, r, mlp_kernels.ADD, c))
        except Exception as e:  # a configuration that does not fit is a result too
            row["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[-300:]}"
        result["configs"].append(row)
        print(row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
