"""The MLP's forward product (model/mlp_kernels.py's relu2_matmul) with FP8 operands, against the bf16 kernel the
step runs, and the attention's input projection in FP8 through cuBLAS (GPU only).

    python -m bench.mlp_fp8 --out bench/results/mlp_fp8_1xH200.json
    python -m bench.mlp_fp8 --second --out bench/results/mlp_fp8_second_1xH200.json

--second sweeps the MLP's second product instead, matmul_add_fp8 (r + h8 @ W2^T, K = 3,072, N = 768), over
SECOND_CONFIGS, each checked against fp64 on the same e4m3 values, beside the bf16 matmul_add at CONFIG.

Why: the step runs at the H200's power limit (bench/power.py), where the head's FP8 product ran 1.5 times the
throughput of a bf16 product. Both inputs here are normed rows (|x| <= sqrt(D), a fixed scale, as in model/head.py)
times a weight (scaled by its absolute maximum), so the FP8 copies need no extra pass over the activations.

One 49,152-token micro-batch, D = 768, F = 3,072 (the attention's 3 x 768 outputs for qkv). Each call is checked
against fp32 torch ops on the same FP8 values (the kernel's own error) and on the bf16 operands (what FP8 costs in
precision), then timed in a CUDA graph (bench.timing.graph_ms); the fastest FP8 configuration and the bf16 kernel
then run at the power limit as bench/power.py runs its kinds.
"""
import argparse
import json
import time
from pathlib import Path

import torch

from bench.mlp_kernels import D, error_of_max, tflops, training_problem
from bench.power import REST_S, run_kind
from bench.timing import cuda_bf16_randn, failure, graph_ms
from model import layers, mlp_kernels
from model.fp8 import normed_operands, relu2_scale, scale_of, to_e4m3

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps); 128 bytes of K per operand row (64 bf16, 128 e4m3) is the widest
# swizzle
FP8_CONFIGS = [(128, 128, 128, stages, warps) for warps in (4, 8) for stages in (3, 4, 5)] + [
    (128, 256, 128, 3, 8), (128, 256, 64, 4, 8), (128, 256, 64, 5, 8)]

# the second product's N = 768 is 6 tiles of 128, 12 of 64 or 3 of 256
SECOND_CONFIGS = FP8_CONFIGS + [(128, 64, 128, 6, 4), (64, 128, 128, 6, 4), (128, 256, 128, 2, 8)]


def second_product() -> dict:
    """matmul_add_fp8 at each of SECOND_CONFIGS on the h8 and the scale that ReLU2MLP's FP8 path makes, and the bf16
    matmul_add it replaced, each timed in a CUDA graph; errors relative to the largest of fp64 on the same values."""
    x, w1, w2, *_ = training_problem()
    r = cuda_bf16_randn(x.size(0), D)
    x8, w8, scale = normed_operands(x, w1)
    h_scale = relu2_scale(w8, scale)
    h, h8 = mlp_kernels.relu2_matmul_fp8(x8, w8, scale, 1 / h_scale)
    w2_scale = scale_of(w2)
    w2_8, s = to_e4m3(w2, w2_scale), h_scale * w2_scale
    want = r.double() + (h8.double() @ w2_8.double().t()) * s.double()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "bf16_matmul_add_ms": graph_ms(lambda: mlp_kernels.matmul_add(h, w2, r)),
              "bf16_err_vs_fp64": error_of_max(mlp_kernels.matmul_add(h, w2, r), layers.matmul_add(
                  h.double(), w2.double(), r.double())), "configs": []}
    print(result, flush=True)
    for config in SECOND_CONFIGS:
        row = {"config": config}
        try:
            call = lambda c=config: mlp_kernels.launch(h8, w2_8, r, mlp_kernels.ADD, c, s)  # noqa: E731
            row["err_vs_fp8_values"] = error_of_max(call(), want)
            row["ms"] = graph_ms(call)
        except Exception as e:
            row["error"] = failure(e)
        result["configs"].append(row)
        print(row, flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--second", action="store_true", help="sweep the second product (matmul_add_fp8) only")
    args = ap.parse_args()
    if args.second:
        Path(args.out).write_text(json.dumps(second_product(), indent=1) + "\n")
        return

    x, w1, *_ = training_problem()
    x8, w8, scale = normed_operands(x, w1)
    on_fp8 = layers.relu2_matmul(x8.float(), w8.float().t()) * scale ** 2  # relu(s p)^2 = s^2 relu(p)^2
    exact = layers.relu2_matmul(x.float(), w1.float())
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "bf16_gluon_ms": graph_ms(lambda: mlp_kernels.relu2_matmul(x, w1)),
              "bf16_cublas_product_ms": graph_ms(lambda: x @ w1),
              "fp8_cublas_product_ms": graph_ms(lambda: torch._scaled_mm(
                  x8, w8.t(), scale_a=scale, scale_b=torch.ones_like(scale), out_dtype=torch.bfloat16,
                  use_fast_accum=True)),
              "bf16_gluon_err_vs_fp32": error_of_max(mlp_kernels.relu2_matmul(x, w1), exact),
              "configs": []}
    print(result, flush=True)
    for config in FP8_CONFIGS:
        row = {"config": config}
        try:
            call = lambda c=config: mlp_kernels.launch(x8, w8, None, mlp_kernels.RELU2, c, scale)  # noqa: E731
            out = call()
            row |= {"err_vs_fp8_values": error_of_max(out, on_fp8), "err_vs_bf16_operands": error_of_max(out, exact)}
            row["ms"] = graph_ms(call)
            row["tflops"] = tflops(row["ms"])
        except Exception as e:
            row["error"] = failure(e)
        result["configs"].append(row)
        print(row, flush=True)

    wq = (torch.randn(3 * D, D, device="cuda") * 0.5 * D ** -0.5).bfloat16()  # the qkv weight, (3 A, D)
    q8, wq8, q_scale = normed_operands(x, wq.t())
    one = torch.ones_like(q_scale)
    qkv_bf16 = lambda: x @ wq.t()  # noqa: E731
    qkv_fp8 = lambda: torch._scaled_mm(q8, wq8.t(), scale_a=q_scale, scale_b=one,  # noqa: E731
                                       out_dtype=torch.bfloat16, use_fast_accum=True)
    result["qkv"] = {"bf16_ms": graph_ms(qkv_bf16), "fp8_ms": graph_ms(qkv_fp8),
                     "fp8_err_vs_bf16_operands": error_of_max(qkv_fp8(), (x.float() @ wq.float().t()))}
    print(result["qkv"], flush=True)

    timed = [row for row in result["configs"] if "ms" in row]
    best = min(timed, key=lambda row: row["ms"])["config"]
    at_limit = {"bf16 Gluon relu2_matmul (CONFIG)": lambda: mlp_kernels.relu2_matmul(x, w1),
                f"fp8 Gluon relu2_matmul {best}":
                    lambda: mlp_kernels.launch(x8, w8, None, mlp_kernels.RELU2, best, scale),
                "bf16 cuBLAS qkv": qkv_bf16, "fp8 cuBLAS qkv": qkv_fp8}
    result["power_limit"] = {}
    for name, call in at_limit.items():
        time.sleep(REST_S)
        result["power_limit"][name] = run_kind(call)
        print(name, {k: v for k, v in result["power_limit"][name].items() if k != "series_s_mhz_w_c"}, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
