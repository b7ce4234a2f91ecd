"""The Triton kernel of the value embeddings' backward (model/layers.py, TableRows) on CUDA: it adds each token's
gradient row into its table's fp32 gradient, in place.

Through autograd, each micro-batch's table gradient was a new tensor: zero-filled (33.6 us a table), scattered into
with atomic adds (197 us), then added into the gradient of the micro-batches before (105 us: a read and a write of
the whole 50,304 x 768 fp32 table beside the new one), per table and micro-batch in the profile of the H200 step
(bench/results/profile_step28_1xH200_13c9405.txt). Here the rows go straight into the table's gradient, which is
zero-filled once per optimizer step.

One program per token row: it reads the row once and adds it with relaxed atomics (rows of one token meet in any
order, as in inductor's scatter; fp32 sums of bf16 rows). The launch is direct, not through torch.library: it
runs in an eager autograd.Function's backward, never under torch.compile.

Shape legend: N tokens, A row width (the attention width), V vocab.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _add_rows_kernel(grad_ptr, ids_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    token = tl.load(ids_ptr + row).to(tl.int64)
    g = tl.load(grad_ptr + row * width + cols, mask=inside).to(tl.float32)
    tl.atomic_add(out_ptr + token * width + cols, g, mask=inside, sem="relaxed")


def add_rows(out_VA: Tensor, ids_N: Tensor, grad_NA: Tensor) -> None:
    """out[ids[n]] += grad[n] for every n, in place: out fp32 (V, A), grad (N, A) in any float dtype."""
    torch._check(out_VA.dtype == torch.float32 and out_VA.is_contiguous() and grad_NA.is_contiguous()
                 and ids_N.dim() == 1 and grad_NA.shape == (ids_N.size(0), out_VA.size(1)),
                 lambda: f"add_rows takes a contiguous fp32 table (V, A), ids (N,) and contiguous rows (N, A); got "
                         f"{tuple(out_VA.shape)} {out_VA.dtype}, {tuple(ids_N.shape)}, {tuple(grad_NA.shape)}")
    width = out_VA.size(1)
    block = triton.next_power_of_2(width)
    _add_rows_kernel[(ids_N.size(0),)](grad_NA, ids_N, out_VA, width, BLOCK=block, num_warps=4)
