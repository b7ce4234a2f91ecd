"""One Triton kernel on CUDA: a transposing copy of a 2-D tensor, for the operands of FP8 weight gradients.

Hopper's 8-bit MMA reads both operands of a product K-major. A weight's gradient sums over the tokens, so it reads
its FP8 operands with the tokens innermost, while the kernels that make them write one row per token. Four products
read copies made here: the head's (model/head_kernels.py, the unit gradient's e5m2 copy), the q, k, v projection's
(model/layers.py, FP8QKV: the output gradient's e4m3 copy and the input's) and the MLP's two (ReLU2MLP: x's e4m3
copy for W1's, the output gradient's for W2's).

Tiles of 64 x 128 elements, 4 warps: the e5m2 unit gradient (49,152 x 50,304) took 1.30 ms on the H200, against 1.32
for 128 x 128, 1.67 for 64 x 64, 2.07 for 32 x 32 and 2.12 for inductor's g.t().contiguous()
(bench/results/head_kernels_1xH200_8ab2f99.json, and within 0.05 ms of these in later files): a one-byte tile row
is 128 bytes read, a transposed one 64 bytes written, whole 32-byte sectors either way. The tile goes through shared
memory (tl.trans), so that both the load and the store walk contiguous rows.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

_BLOCK_R, _BLOCK_C, _WARPS = 64, 128, 4


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst (C, R) = src (R, C) transposed, one tile per program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tile = tl.load(src_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :],
                   mask=(rows < R)[:, None] & (cols < C)[None, :])
    tl.store(dst_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], tl.trans(tile),
             mask=(cols < C)[:, None] & (rows < R)[None, :])


def transposed_launch(src_RC: Tensor) -> Tensor:
    """A new contiguous (C, R) copy of a contiguous src (R, C) by _transpose_kernel: the launch itself, for use inside
    another triton_op (model/head_kernels.py); elsewhere, `transposed`."""
    R, C = src_RC.shape
    torch._check(src_RC.is_contiguous(), lambda: "the transposing copy takes a contiguous (R, C) tensor")
    dst_CR = src_RC.new_empty((C, R))
    grid = (triton.cdiv(R, _BLOCK_R), triton.cdiv(C, _BLOCK_C))
    wrap_triton(_transpose_kernel)[grid](src_RC, dst_CR, R, C, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    return dst_CR


@triton_op("speedrun::transposed", mutates_args=())
def transposed(src_RC: Tensor) -> Tensor:
    """src.t().contiguous() in one launch of _transpose_kernel (transposed_launch), as an op torch.compile sees."""
    return transposed_launch(src_RC)
