"""Triton kernels of the MLP (model/layers.py, ReLU2MLP) on CUDA: its two (tokens x hidden) products, each with the
ReLU² step in the product's epilogue.

Forward, h = relu(x @ W1)^2; backward, the pre-activation's gradient (grad_y @ W2) * 2 relu(pre). Compiled from
torch ops, each product wrote its (tokens x hidden) result and a second kernel read it back to apply the ReLU²:
12.4 ms (forward) and 19.8 ms (backward) per step of those second kernels in the profile of the 700 ms step
(bench/results/profile_step28_1xH200_9cd4388.txt, triton_poi_fused_..._pow_relu). Here the forward costs nothing
beyond its product and the backward one more read, of h, in its epilogue.

Only h is kept for backward, not the pre-activation: h = relu(pre)^2 >= 0, so relu(pre) = sqrt(h). The bf16
rounding of h (2^-9 relative) moves sqrt(h) by half as much (2^-10), less than the rounding of the bf16
pre-activation itself that the torch ops saved.

Both products are A (M, K) @ B (K, N) with A and B row-major, M tokens, K the model width and N the hidden width.
One persistent program per SM walks the output tiles, M-tiles outermost, so the programs at work at any moment
share a few strips of A while B (768 x 3,072 in bf16: 4.7 MB) stays in the H200's 50 MB L2. Operands move by TMA
(tensor descriptors), and the tile loop and the K loop are one flattened loop (`tl.range(flatten=True)`), so the
next tile's loads are in flight during this tile's epilogue. Measured per 49,152-token micro-batch on the H200
(bench/results/mlp_variants_1xH200.json, 8 tile shapes x 3 epilogue forms): forward 0.385 ms against cuBLAS's
0.36 ms for the bare product, backward 0.513 ms. Unflattened, the best took 0.427 and 0.522 ms; with pointer loads
instead of TMA, 0.427 and 0.563 ms. The first sweep (mlp_variants_1xH200_first_sweep.json, another machine) found
nothing faster among pointer loads and one program per tile either. The whole step took 702.4 ms instead of 712.8
on one machine, and 3.4 GiB less memory (bench/results/README.md).

The launches are plain functions, not torch.library.triton_ops as in model/head_kernels.py: dynamo traces them
inside ReLU2MLP, and only there does it turn the host-side tensor descriptors into what inductor passes to a user
kernel. Inside a triton_op, torch 2.11's inductor failed on them (KeyError 'a_desc' in its analysis of which
inputs a kernel writes) and its compiled code launched neither kernel (bench/results/README.md). Launch
configurations are fixed (autotuning would lengthen the cold compile).

Shape legend: M tokens, K model dim, N hidden dim.
"""
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton
from triton.tools.tensor_descriptor import TensorDescriptor

# (BLOCK_M, BLOCK_N, BLOCK_K, pipeline stages, warps), the fastest of each side in bench/results/mlp_variants_1xH200.json
FORWARD_CONFIG = (128, 128, 64, 5, 4)
BACKWARD_CONFIG = (128, 128, 64, 5, 8)

# triton 3.6's interpreter (TRITON_INTERPRET=1, CPU tests) multiplies bf16 tiles in tl.dot as if they were their
# raw 16-bit integers (a 16 x 16 product was off by 4e9); there the tiles go to fp32 first, which is exact for bf16
# values, as the GPU's MMA is with its fp32 accumulator. Triton reads the same variable when it decorates the kernel.
_DOT_IN_FP32 = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _relu2_matmul_kernel(a_desc, b_desc, out_desc, h_desc, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr,
                         BACKWARD: tl.constexpr):
    """out = relu(A @ B)^2 (forward), or (A @ B) * 2 sqrt(h) (BACKWARD: A = grad_y, B = W2, h the forward's
    output), in out's dtype; h_desc is not read in the forward. Tiles past an edge read zeros and store nothing
    there (TMA). K, the model width, is a compile-time constant (one model, one K)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        off_m = (tile // tiles_n) * BLOCK_M
        off_n = (tile % tiles_n) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a, b = a_desc.load([off_m, k]), b_desc.load([k, off_n])
            if _DOT_IN_FP32:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc)
        if BACKWARD:
            out = acc * (2.0 * tl.sqrt(h_desc.load([off_m, off_n]).to(tl.float32)))
        else:
            relu = tl.maximum(acc, 0.0)
            out = relu * relu
        out_desc.store([off_m, off_n], out.to(out_desc.dtype))


def supports(a_MK: Tensor, b_KN: Tensor) -> bool:
    """Whether the kernels take these operands: TMA wants 16-byte aligned rows, so K and N multiples of 8 in bf16."""
    return (a_MK.dtype == b_KN.dtype == torch.bfloat16 and a_MK.is_contiguous() and b_KN.is_contiguous()
            and a_MK.size(1) % 8 == 0 and b_KN.size(1) % 8 == 0)


def _launch(a_MK: Tensor, b_KN: Tensor, h_MN: Tensor | None, config: tuple[int, ...]) -> Tensor:
    """The kernel on new output: the backward when h_MN is given, else the forward."""
    torch._check(supports(a_MK, b_KN), lambda: "the MLP kernels take contiguous bf16 operands with K and N "
                                                 "multiples of 8 (model.mlp_kernels.supports)")
    (M, K), N = a_MK.shape, b_KN.size(1)
    block_m, block_n, block_k, stages, warps = config
    out_MN = torch.empty((M, N), dtype=a_MK.dtype, device=a_MK.device)
    out_desc = TensorDescriptor.from_tensor(out_MN, [block_m, block_n])
    h_desc = out_desc if h_MN is None else TensorDescriptor.from_tensor(h_MN, [block_m, block_n])
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    programs = min(tiles, torch.cuda.get_device_properties(a_MK.device).multi_processor_count
                   if a_MK.is_cuda else 4)  # the interpreter (CPU tensors): a few programs, each several tiles
    wrap_triton(_relu2_matmul_kernel)[(programs,)](
        TensorDescriptor.from_tensor(a_MK, [block_m, block_k]), TensorDescriptor.from_tensor(b_KN, [block_k, block_n]),
        out_desc, h_desc, M, N, K=K, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PROGRAMS=programs,
        BACKWARD=h_MN is not None, num_stages=stages, num_warps=warps)
    return out_MN


def relu2_matmul(x_MK: Tensor, w_KN: Tensor, config: tuple[int, ...] = FORWARD_CONFIG) -> Tensor:
    """relu(x @ w)^2 in x's dtype: model.layers.relu2_matmul."""
    return _launch(x_MK, w_KN, None, config)


def relu2_matmul_grad(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor,
                      config: tuple[int, ...] = BACKWARD_CONFIG) -> Tensor:
    """The pre-activation's gradient (grad_y @ w) * 2 sqrt(h): model.layers.relu2_matmul_grad."""
    torch._check(h_MN.shape == (grad_y_MK.size(0), w_KN.size(1)) and h_MN.dtype == grad_y_MK.dtype
                 and h_MN.is_contiguous(), lambda: "h must be the forward's contiguous (M, N) output")
    return _launch(grad_y_MK, w_KN, h_MN, config)
