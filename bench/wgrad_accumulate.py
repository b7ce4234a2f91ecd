"""The hidden matrices' weight gradients and their accumulation over the micro-batches (GPU only): what autograd
runs now against products that write fp32 themselves, and the fp32 -> bf16 casts of the weights that every
micro-batch repeats.

    python -m bench.wgrad_accumulate --out bench/results/wgrad_accumulate_1xH200.json

Now, per weight and micro-batch: cuBLAS's bf16 product (dW = a^T b), the cast of dW to fp32 (the backward of the
weight's `.type_as(x)`), and AccumulateGrad's add into the fp32 `.grad` (autograd's "fp32 accumulation", 3.22 ms
per step in bench/results' profile of 0ed78a8). The variants:
- "mm_fp32_then_add": torch.mm(..., out_dtype=float32), the product rounded once to fp32, then the add: no cast;
- "addmm_into_grad": torch.addmm(acc, ..., out_dtype=float32, out=acc), the product added into the fp32 gradient
  in cuBLAS's epilogue: no cast, no add (the "gradient accumulation fusion" of Megatron-LM's linear layers). Using it
  in the model means a backward that adds into `.grad` itself, as layers.TableRows does for the tables.
And the weights' casts to bf16: each micro-batch casts every weight again (`.type_as(x)`); cast once per
optimizer step, 7 of the 8 would go.

One 49,152-token micro-batch, the 124M model's shapes, each call timed in a CUDA graph (bench.timing.graph_ms) on
an accumulator that already holds a gradient, and checked against fp64 (relative to the largest entry). Per step:
8 micro-batches x the weights of each shape (11 attention layers: QKV and projection; 12 MLPs: two matrices).
"""
import argparse
import json
import math
from pathlib import Path

import torch

from bench.mlp_kernels import D, HIDDEN, M, error_of_max
from bench.timing import failure, graph_ms

MICRO_BATCHES = 8
# (name, rows, cols, weights of the shape in the model): dW (rows, cols) = a^T b, a (M, rows) and b (M, cols) bf16
SHAPES = [("qkv", 3 * D, D, 11), ("attn_proj", D, D, 11), ("mlp", D, HIDDEN, 24)]


def now(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc.add_((a.t() @ b).float())


def mm_fp32_then_add(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc.add_(torch.mm(a.t(), b, out_dtype=torch.float32))


def addmm_into_grad(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)


VARIANTS = {"now": now, "mm_fp32_then_add": mm_fp32_then_add, "addmm_into_grad": addmm_into_grad}


def relative_error(fn, acc0: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    acc = acc0.clone()
    fn(acc, a, b)
    return error_of_max(acc, acc0.double() + a.double().t() @ b.double())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {"per_shape": {}, "per_step_ms": {name: 0.0 for name in [*VARIANTS, "casts_every_micro_batch",
                                                                     "casts_once_per_step"]}}
    for name, rows, cols, count in SHAPES:
        a = torch.randn(M, rows, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(M, cols, device="cuda", dtype=torch.bfloat16)
        acc0 = torch.randn(rows, cols, device="cuda") * M ** 0.5  # a gradient of the product's own scale
        weight = torch.randn(rows, cols, device="cuda")
        row = {}
        for variant, fn in VARIANTS.items():
            acc = acc0.clone()
            try:
                row[variant] = {"ms": graph_ms(lambda: fn(acc, a, b)),
                                "relative_error": relative_error(fn, acc0, a, b)}
                result["per_step_ms"][variant] += row[variant]["ms"] * count * MICRO_BATCHES
            except Exception as e:  # an op or an out= aliasing that this torch refuses: recorded, not fatal
                row[variant] = {"error": failure(e)}
                result["per_step_ms"][variant] = float("nan")  # no total from some of the shapes
        row["cast_ms"] = graph_ms(lambda: weight.to(torch.bfloat16))
        result["per_step_ms"]["casts_every_micro_batch"] += row["cast_ms"] * count * MICRO_BATCHES
        result["per_step_ms"]["casts_once_per_step"] += row["cast_ms"] * count
        result["per_shape"][f"{name} ({rows}, {cols}) x {count}"] = row
    result["per_step_ms"] = {k: None if math.isnan(v) else round(v, 3) for k, v in result["per_step_ms"].items()}
    result["device"], result["torch"] = torch.cuda.get_device_name(), torch.__version__
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
