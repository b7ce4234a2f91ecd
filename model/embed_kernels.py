"""The Triton kernel of the embeddings' backward (model/layers.py, TableRows) on CUDA: it adds the token rows'
gradients into their table's fp32 gradient, in place, each token's rows summed first.

Through autograd, each micro-batch's table gradient was a new tensor: zero-filled (33.6 us a table), scattered into
with atomic adds (197 us), then added into the gradient of the micro-batches before (105 us: a read and a write of
the whole 50,304 x 768 fp32 table beside the new one), per table and micro-batch in the profile of the H200 step
(bench/results/profile_step28_1xH200_13c9405.txt). Here the rows go straight into the table's gradient, which is
zero-filled once per optimizer step.

The rows arrive in the order of the sorted token ids (layers.sort_ids, once per micro-batch for all tables). One
program walks ROWS consecutive sorted rows, sums each run of one token in registers and adds the sum with relaxed
atomics when the token changes (a run that crosses into the next program's rows is finished there, with one more
atomic add). Where two programs add into one token's row, the order of their adds varies from run to run, so the
table's gradient, and with it a training run, does not repeat bit for bit
(bench/results/determinism_1xH200_2fb2527.txt: in six repeats of one micro-batch, the only gradient that differed).
One program per row, adding every row by itself, took 193.7 us a table in the H200's training step
(bench/results/kernels_step28_1xH200_f8bbdeb.txt): text repeats tokens hundreds or thousands of times per
micro-batch, and their atomic adds queue on the same addresses. Alone, on the proxy corpus's first micro-batch (one
id 16,929 times), it took 225 us, and 108 us on uniform ids; sorted, 93 us with the sort (42 us) included
(bench/results/embed_scatter_1xH200.json).

Each value embedding has two readers (a first and a last layer), whose gradients autograd summed into a new (N, A)
bf16 tensor before the scatter (52 us). The kernel reads both and sums them in fp32 instead: 101.5 us for the pair,
against 280 (the same file). In the step, 47.8 us a call, for the three value embeddings and the token embedding
(kernels_step28_1xH200_gate_sum_experiment.txt).

The launch is direct, not through torch.library: it runs in an eager autograd.Function's backward, never under
torch.compile.

Shape legend: N tokens, A row width (the attention width), V vocab.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

# 32 sorted rows of 2 warps per program: 93.1 us with the sort (one gradient), 101.5 (two), the fastest of 8 to 64
# rows and 2 or 4 warps on the proxy corpus's ids, the others 96-114 us (bench/results/embed_scatter_1xH200.json)
_ROWS, _WARPS = 32, 2


@triton.jit
def _add_sorted_rows_kernel(grad_a_ptr, grad_b_ptr, order_ptr, sorted_ids_ptr, out_ptr, N, width,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr, PAIR: tl.constexpr):
    """out[sorted_ids[i]] += grad_a[order[i]] (+ grad_b[order[i]] with PAIR) for this program's ROWS positions i,
    one atomic add per run of equal ids."""
    start = tl.program_id(0) * ROWS
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    run_token = tl.load(sorted_ids_ptr + start).to(tl.int64)
    for j in range(ROWS):
        pos = start + j
        valid = pos < N
        token = tl.load(sorted_ids_ptr + pos, mask=valid, other=-1).to(tl.int64)  # -1: past the end, never a token
        src = tl.load(order_ptr + pos, mask=valid, other=0).to(tl.int64) * width
        g = tl.load(grad_a_ptr + src + cols, mask=inside & valid, other=0.0).to(tl.float32)
        if PAIR:
            g += tl.load(grad_b_ptr + src + cols, mask=inside & valid, other=0.0).to(tl.float32)
        ends = token != run_token  # the run before this row is complete
        tl.atomic_add(out_ptr + run_token * width + cols, acc, mask=inside & ends, sem="relaxed")
        acc = tl.where(ends, g, acc + g)
        run_token = token
    tl.atomic_add(out_ptr + run_token * width + cols, acc, mask=inside & (run_token >= 0), sem="relaxed")


def add_rows(out_VA: Tensor, sorted_ids_N: Tensor, order_N: Tensor, grads_NA: list[Tensor]) -> None:
    """out[sorted_ids[i]] += the sum of the grads' rows order[i], for every i, in place: out fp32 (V, A); one or two
    grads (N, A) in any float dtype, summed in fp32; sorted_ids, order as layers.sort_ids returns them."""
    N, width = sorted_ids_N.size(0), out_VA.size(1)
    torch._check(out_VA.dtype == torch.float32 and out_VA.is_contiguous() and 1 <= len(grads_NA) <= 2
                 and all(g.is_contiguous() and g.shape == (N, width) for g in grads_NA)
                 and order_N.shape == sorted_ids_N.shape == (N,),
                 lambda: f"add_rows takes a contiguous fp32 table (V, A), sorted ids and their order (N,), and one or "
                         f"two contiguous gradients (N, A); got {tuple(out_VA.shape)} {out_VA.dtype}, "
                         f"{tuple(sorted_ids_N.shape)}, {tuple(order_N.shape)}, {[tuple(g.shape) for g in grads_NA]}")
    _add_sorted_rows_kernel[(triton.cdiv(N, _ROWS),)](
        grads_NA[0], grads_NA[-1], order_N, sorted_ids_N, out_VA, N, width, ROWS=_ROWS,
        BLOCK=triton.next_power_of_2(width), PAIR=len(grads_NA) == 2, num_warps=_WARPS)
