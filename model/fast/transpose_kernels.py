"""A Triton transposing copy of a 2-D tensor: FP8 weight gradients sum over the tokens and Hopper's 8-bit MMA reads
K-major operands. Tiles (the fastest tried) pass through shared memory, so both sides walk contiguous rows.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from model.fast.launch import launcher

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
    """A new contiguous (C, R) copy of a contiguous src (R, C): the bare launch, for use inside another triton_op
    (model/fast/head_kernels.py); elsewhere, `transposed`."""
    R, C = src_RC.shape
    torch._check(src_RC.is_contiguous(), lambda: "the transposing copy takes a contiguous (R, C) tensor")
    dst_CR = src_RC.new_empty((C, R))
    grid = (triton.cdiv(R, _BLOCK_R), triton.cdiv(C, _BLOCK_C))
    launcher(_transpose_kernel)[grid](src_RC, dst_CR, R, C, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, num_warps=_WARPS)
    return dst_CR


@triton_op("speedrun::transposed", mutates_args=())
def transposed(src_RC: Tensor) -> Tensor:
    """src.t().contiguous() in one launch, as an op torch.compile sees."""
    return transposed_launch(src_RC)
