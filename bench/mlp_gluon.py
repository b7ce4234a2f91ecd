"""The MLP's Gluon kernels (model/mlp_kernels.py) at several launch configurations, against cuBLAS's bare product
and the Triton kernel they replaced (bench/mlp_variants.py's flattened persistent TMA kernel at its configurations:
128 x 128 x 64 tiles, 5 stages, 4 warps forward and 8 backward), at the training shape (GPU only).

    python -m bench.mlp_gluon --out bench/results/mlp_gluon_1xH200.json

One 49,152-token micro-batch, D = 768, F = 3,072, bf16, inputs as bench/mlp_kernels.py's; each call timed in a CUDA
graph (bench.timing.graph_ms), checked against the torch ops of model/layers.py before it is timed.
"""
import argparse
import json
from pathlib import Path

import torch

from bench.mlp_kernels import checked_row, training_problem
from bench.mlp_variants import run_desc
from bench.timing import graph_ms
from model import layers, mlp_kernels

CONFIGS = [(128, 128, 64, stages, warps) for warps in (4, 8) for stages in (3, 4, 5)] + [
    (128, 128, 128, 2, warps) for warps in (4, 8)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    x, w1, w2, grad_y, h = training_problem()
    want = {"forward": h.float(), "backward": layers.relu2_matmul_grad(grad_y, w2, h).float()}
    operands = {"forward": (x, w1, None, mlp_kernels.RELU2), "backward": (grad_y, w2, h, mlp_kernels.RELU2_GRAD)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cublas_product_ms": graph_ms(lambda: x @ w1),
              "triton_forward_ms": graph_ms(lambda: run_desc(x, w1, None, 128, 128, 64, 5, 4, sms, True, False)),
              "triton_backward_ms": graph_ms(lambda: run_desc(grad_y, w2, h, 128, 128, 64, 5, 8, sms, True, False)),
              "configs": []}
    print(result, flush=True)
    for config in CONFIGS:
        row = {"config": config}
        for side in ("forward", "backward"):
            row |= checked_row(side, lambda c=config, s=side: mlp_kernels.launch(*operands[s], c), want[side],
                               graph_ms)
        result["configs"].append(row)
        print(row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
