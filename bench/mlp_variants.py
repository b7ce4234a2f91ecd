"""Kernel structures for the MLP's ReLU² products (model/mlp_kernels.py), at the training shape (GPU only):
persistent, the tile and K loops flattened into one or not, TMA descriptors or pointer loads, the epilogue whole,
in two halves, or with the backward's h tile requested before the products. model/mlp_kernels.py is the first
(flattened, whole) at the fastest tile shape of each side. The first sweep (mlp_variants_1xH200_first_sweep.json)
also timed pointer loads at more tiles and one program per tile; bench/results/mlp_kernels_1xH200_tile_per_program.json
the first kernel, one program per tile with TMA.

    python -m bench.mlp_variants --out bench/results/mlp_variants_1xH200.json

Each variant computes relu(A @ B)^2 (forward) or (A @ B) * 2 sqrt(h) (backward) for A (49,152 x 768), B (768 x
3,072) in bf16, checked against the torch ops of model/layers.py before it is timed.
"""
import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.head_kernels import attempt
from bench.mlp_kernels import checked_row, training_problem
from model import layers


@triton.jit
def _epilogue(acc, h, BACKWARD: tl.constexpr):
    if BACKWARD:
        return acc * (2.0 * tl.sqrt(h.to(tl.float32)))
    relu = tl.maximum(acc, 0.0)
    return relu * relu


@triton.jit
def _persistent_desc_kernel(a_desc, b_desc, out_desc, h_desc, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr,
                            BACKWARD: tl.constexpr, FLATTEN: tl.constexpr, HALVES: tl.constexpr,
                            EARLY_H: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN):
        off_m = (tile // tiles_n) * BLOCK_M
        off_n = (tile % tiles_n) * BLOCK_N
        if EARLY_H:  # the backward's h tile requested before the products, to arrive while they run
            h_early = h_desc.load([off_m, off_n])
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([off_m, k]), b_desc.load([k, off_n]), acc)
        if EARLY_H:
            out_desc.store([off_m, off_n], _epilogue(acc, h_early, BACKWARD).to(out_desc.dtype))
        elif HALVES:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            h_left = left
            h_right = right
            if BACKWARD:
                h_left = h_desc.load([off_m, off_n])
                h_right = h_desc.load([off_m, off_n + BLOCK_N // 2])
            out_desc.store([off_m, off_n], _epilogue(left, h_left, BACKWARD).to(out_desc.dtype))
            out_desc.store([off_m, off_n + BLOCK_N // 2], _epilogue(right, h_right, BACKWARD).to(out_desc.dtype))
        else:
            h = acc
            if BACKWARD:
                h = h_desc.load([off_m, off_n])
            out_desc.store([off_m, off_n], _epilogue(acc, h, BACKWARD).to(out_desc.dtype))


@triton.jit
def _pointer_kernel(a_ptr, b_ptr, out_ptr, h_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr, BACKWARD: tl.constexpr,
                    FLATTEN: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN):
        rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * K + (k + ks)[None, :], mask=(rows < M)[:, None])
            b = tl.load(b_ptr + (k + ks)[:, None] * N + cols[None, :], mask=(cols < N)[None, :])
            acc = tl.dot(a, b, acc)
        inside = (rows < M)[:, None] & (cols < N)[None, :]
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        h = acc
        if BACKWARD:
            h = tl.load(h_ptr + offsets, mask=inside)
        tl.store(out_ptr + offsets, _epilogue(acc, h, BACKWARD).to(out_ptr.dtype.element_ty), mask=inside)


def run_desc(a, b, h, block_m, block_n, block_k, stages, warps, programs, flatten, halves, early=False):
    out = torch.empty((a.size(0), b.size(1)), dtype=a.dtype, device=a.device)
    store_n = block_n // 2 if halves else block_n
    out_desc = TensorDescriptor.from_tensor(out, [block_m, store_n])
    h_desc = out_desc if h is None else TensorDescriptor.from_tensor(h, [block_m, store_n])
    _persistent_desc_kernel[(programs,)](
        TensorDescriptor.from_tensor(a, [block_m, block_k]), TensorDescriptor.from_tensor(b, [block_k, block_n]),
        out_desc, h_desc, a.size(0), b.size(1), K=a.size(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PROGRAMS=programs, BACKWARD=h is not None, FLATTEN=flatten, HALVES=halves, EARLY_H=early, num_stages=stages,
        num_warps=warps)
    return out


def run_pointer(a, b, h, block_m, block_n, block_k, stages, warps, programs, flatten):
    out = torch.empty((a.size(0), b.size(1)), dtype=a.dtype, device=a.device)
    _pointer_kernel[(programs,)](a, b, out, out if h is None else h, a.size(0), b.size(1), K=a.size(1),
                                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PROGRAMS=programs,
                                 BACKWARD=h is not None, FLATTEN=flatten, num_stages=stages, num_warps=warps)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    x, w1, w2, grad_y, h = training_problem()
    want_h, want_g = h.float(), layers.relu2_matmul_grad(grad_y, w2, h).float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    variants = []
    for tile in [(128, 128, 64, 5, 4), (128, 128, 64, 6, 4), (128, 128, 64, 4, 4), (128, 128, 64, 5, 8),
                 (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 128, 3, 4), (128, 128, 128, 3, 8)]:
        for flatten in (True, False):
            for halves in (False, True):
                variants.append((f"persistent_desc {tile} flatten={flatten} halves={halves}",
                                 lambda a, b, hh, t=tile, f=flatten, s=halves: run_desc(a, b, hh, *t, sms, f, s)))
            variants.append((f"persistent_desc {tile} flatten={flatten} early_h (backward only)",
                             lambda a, b, hh, t=tile, f=flatten: run_desc(a, b, hh, *t, sms, f, False, hh is not None)))
    # pointer loads instead of TMA, at the first sweep's best tile for them (mlp_variants_1xH200_first_sweep.json)
    variants.append(("persistent_pointer (128, 256, 64, 4, 8) flatten=False",
                     lambda a, b, hh: run_pointer(a, b, hh, 128, 256, 64, 4, 8, sms, False)))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "cublas_product_ms": attempt(lambda: x @ w1), "variants": []}
    for name, fn in variants:
        row = {"variant": name}
        row |= checked_row("forward", lambda: fn(x, w1, None), want_h, attempt)
        row |= checked_row("backward", lambda: fn(grad_y, w2, h), want_g, attempt)
        result["variants"].append(row)
        print(row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
