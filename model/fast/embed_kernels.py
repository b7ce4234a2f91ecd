"""The Triton kernels of the embeddings' backward (model/layers.py, TableRows) on CUDA: they add the token rows'
gradients into their table's fp32 gradient, in place, each token's rows summed first.

Through autograd, each micro-batch's table gradient was a new tensor: zero-filled (33.6 us a table), scattered into
with atomic adds (197 us), then added into the gradient of the micro-batches before (105 us: a read and a write of
the whole 50,304 x 768 fp32 table beside the new one), per table and micro-batch in the profile of the H200 step
(bench/results/profile_step28_1xH200_13c9405.txt). Here the rows go straight into the table's gradient, which is
zero-filled once per optimizer step.

The rows arrive in the order of the sorted token ids (layers.sort_ids, once per micro-batch for all tables; a stable
sort, so each run of one id is in the same order every time). One program walks ROWS consecutive sorted rows, sums
each run of one token in registers and adds the sum with a relaxed atomic add when the token changes. A run that
goes on into the next programs' rows is summed in pieces: each of those programs stores its piece in a scratch row,
and a second kernel adds them, in program order, into the table row after the run's first program has added its own.
So each table row takes one add per kernel, and the table's gradient repeats bit for bit; so did whole runs with the
MLP's backward in bf16 (two runs of one seed gave the same losses at every step,
bench/results/repeat_short60_1xH200_deterministic_{a,b}.json; with main's FP8 backward two processes parted, from
inductor's timed choices, until model/gpt.py's REPEATABLE_COMPILE turned them off: bench/results/README.md, d00ab85
and de9c191). When every program added its piece of a run atomically, the order of those adds varied, and so did the
gradient: in six repeats of one micro-batch, one element of one value embedding's gradient
(bench/results/determinism_1xH200_2fb2527.txt), and two runs of one seed parted by about 1e-3 in validation loss
within 20 steps (bench/results/README.md, 677253b).

One program per row, adding every row by itself, took 193.7 us a table in the H200's training step
(bench/results/kernels_step28_1xH200_f8bbdeb.txt): text repeats tokens hundreds or thousands of times per
micro-batch, and their atomic adds queue on the same addresses. Alone, on the proxy corpus's first micro-batch (one
id 16,929 times), it took 225 us, and 108 us on uniform ids; sorted, 93 us with the sort (42 us) included
(bench/results/embed_scatter_1xH200.json).

Each value embedding has two readers (a first and a last layer), whose gradients autograd summed into a new (N, A)
bf16 tensor before the scatter (52 us). The first kernel reads both and sums them in fp32 instead: 101.5 us for the
pair, against 280 (the same file). In the step, 47.8 us a call, for the three value embeddings and the token
embedding (kernels_step28_1xH200_gate_sum_experiment.txt). Repeating bit for bit costs about 0.9 ms of the step:
51.6 us a call, and 24.8 for the second kernel, 32 calls a step (kernels_step28_1xH200_deterministic.txt, with 32
programs of the first checked per program of the second; at 8, the setting now, the pair was 7 us faster alone).

The launches are direct, not through torch.library: they run in an eager autograd.Function's backward, never under
torch.compile.

Shape legend: N tokens, A row width (the attention width), V vocab.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

# 32 sorted rows of 2 warps per program: 93.1 us with the sort (one gradient), 101.5 (two), the fastest of 8 to 64
# rows and 2 or 4 warps on the proxy corpus's ids, the others 96-114 us, in the single pass before the second kernel
# (bench/results/embed_scatter_1xH200.json). With it, 117.8 us for two, the others 120.7-130.2 at 32 or 64 rows and
# 161-232 at 8 or 16 (embed_scatter_1xH200_deterministic.json)
_ROWS, _WARPS = 32, 2
# the second kernel: 8 programs of the first checked per program, 64.0 us for two gradients on the proxy corpus's
# first 8 micro-batches (sort not included), against 66.6, 69.7 and 70.9 at 4, 16 and 32 (the same file); 128 partial
# sums added at a time (a run of 4,096 rows goes on through 128 programs), 64 columns per program
_GROUP, _PARTS, _COLS = 8, 128, 64


@triton.jit
def _add_sorted_rows_kernel(grad_a_ptr, grad_b_ptr, order_ptr, sorted_ids_ptr, out_ptr, partial_ptr, N, width,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr, PAIR: tl.constexpr):
    """out[sorted_ids[i]] += grad_a[order[i]] (+ grad_b[order[i]] with PAIR) for this program's ROWS positions i,
    one atomic add per run of equal ids, but for a first run that began in an earlier program's rows: its sum goes
    to partial[program] for _add_partials_kernel."""
    start = tl.program_id(0) * ROWS
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    run_token = tl.load(sorted_ids_ptr + start).to(tl.int64)
    before = tl.load(sorted_ids_ptr + start - 1, mask=start > 0, other=-1).to(tl.int64)  # -1: never a token
    continued = run_token == before  # the current run is the continuation of another program's
    for j in range(ROWS):
        pos = start + j
        valid = pos < N
        token = tl.load(sorted_ids_ptr + pos, mask=valid, other=-1).to(tl.int64)
        src = tl.load(order_ptr + pos, mask=valid, other=0).to(tl.int64) * width
        g = tl.load(grad_a_ptr + src + cols, mask=inside & valid, other=0.0).to(tl.float32)
        if PAIR:
            g += tl.load(grad_b_ptr + src + cols, mask=inside & valid, other=0.0).to(tl.float32)
        ends = token != run_token  # the run before this row is complete
        tl.atomic_add(out_ptr + run_token * width + cols, acc, mask=inside & ends & ~continued, sem="relaxed")
        tl.store(partial_ptr + tl.program_id(0) * width + cols, acc, mask=inside & ends & continued)
        continued = continued & ~ends
        acc = tl.where(ends, g, acc + g)
        run_token = token
    tl.atomic_add(out_ptr + run_token * width + cols, acc, mask=inside & (run_token >= 0) & ~continued,
                  sem="relaxed")
    tl.store(partial_ptr + tl.program_id(0) * width + cols, acc, mask=inside & continued)


@triton.jit
def _add_partials_kernel(partial_ptr, sorted_ids_ptr, out_ptr, N, width, num_programs,
                         ROWS: tl.constexpr, GROUP: tl.constexpr, PARTS: tl.constexpr, COLS: tl.constexpr):
    """For each run that starts in the rows of one of this group's GROUP programs of _add_sorted_rows_kernel and goes
    on into the next programs': out[its token] += those programs' partial sums, added in program order. Most such runs
    end in the next program (text's frequent tokens aside); those are added for the whole group at once, the longer
    ones one after another, PARTS partial sums at a time. All of them one after another took 77.7 us for two gradients
    on text, against 63.7, and 131.6 on uniform ids against 101.8
    (bench/results/embed_second_kernel_one_path_1xH200_153346e.json)."""
    programs = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    inside = cols < width
    real = programs < num_programs
    starts = programs * ROWS
    lasts = tl.minimum(starts + ROWS, N) - 1
    tokens = tl.load(sorted_ids_ptr + lasts, mask=real, other=-1).to(tl.int64)
    afters = tl.load(sorted_ids_ptr + lasts + 1, mask=real & (lasts + 1 < N), other=-2).to(tl.int64)
    befores = tl.load(sorted_ids_ptr + starts - 1, mask=real & (starts > 0), other=-2).to(tl.int64)
    owners = real & (afters == tokens) & (befores != tokens)  # a last run that goes on and began in that program
    # sorted ids: the programs whose first id is the token are those that the run goes on into
    seconds = programs + 2
    longer = owners & (tl.load(sorted_ids_ptr + seconds.to(tl.int64) * ROWS, mask=owners & (seconds < num_programs),
                               other=-1).to(tl.int64) == tokens)
    firsts = tl.load(partial_ptr + (programs + 1).to(tl.int64)[:, None] * width + cols[None, :],
                     mask=owners[:, None] & inside[None, :], other=0.0)
    tl.atomic_add(out_ptr + tokens[:, None] * width + cols[None, :], firsts,
                  mask=(owners & ~longer)[:, None] & inside[None, :], sem="relaxed")
    while tl.sum(longer.to(tl.int32), axis=0) > 0:
        owner = tl.min(tl.where(longer, programs, num_programs), axis=0)
        token = tl.max(tl.where(programs == owner, tokens, -1), axis=0)
        total = tl.sum(tl.where((programs == owner)[:, None], firsts, 0.0), axis=0)
        first = owner + 2
        more = True
        while more:
            parts = first + tl.arange(0, PARTS)
            heads = tl.load(sorted_ids_ptr + parts.to(tl.int64) * ROWS, mask=parts < num_programs, other=-1)
            goes_on = heads.to(tl.int64) == token
            total += tl.sum(tl.load(partial_ptr + parts.to(tl.int64)[:, None] * width + cols[None, :],
                                    mask=goes_on[:, None] & inside[None, :], other=0.0), axis=0)
            more = tl.sum(goes_on.to(tl.int32), axis=0) == PARTS
            first += PARTS
        tl.atomic_add(out_ptr + token * width + cols, total, mask=inside, sem="relaxed")
        longer = longer & (programs != owner)


def add_rows(out_VA: Tensor, sorted_ids_N: Tensor, order_N: Tensor, grads_NA: list[Tensor], rows: int = _ROWS,
             warps: int = _WARPS, group: int = _GROUP) -> None:
    """out[sorted_ids[i]] += the sum of the grads' rows order[i], for every i, in place: out fp32 (V, A); one or two
    grads (N, A) in any float dtype, summed in fp32; sorted_ids, order as layers.sort_ids returns them. `rows`,
    `warps`: the first kernel's rows per program and warps; `group`: the second's programs of the first per program
    (bench/embed_scatter.py sweeps them; none of them changes the order of the sums, so neither the result)."""
    N, width = sorted_ids_N.size(0), out_VA.size(1)
    torch._check(out_VA.dtype == torch.float32 and out_VA.is_contiguous() and 1 <= len(grads_NA) <= 2
                 and all(g.is_contiguous() and g.shape == (N, width) for g in grads_NA)
                 and order_N.shape == sorted_ids_N.shape == (N,),
                 lambda: f"add_rows takes a contiguous fp32 table (V, A), sorted ids and their order (N,), and one or "
                         f"two contiguous gradients (N, A); got {tuple(out_VA.shape)} {out_VA.dtype}, "
                         f"{tuple(sorted_ids_N.shape)}, {tuple(order_N.shape)}, {[tuple(g.shape) for g in grads_NA]}")
    programs = triton.cdiv(N, rows)
    partial_PA = out_VA.new_empty(programs, width)  # written only where a program's first run is a continuation
    _add_sorted_rows_kernel[(programs,)](
        grads_NA[0], grads_NA[-1], order_N, sorted_ids_N, out_VA, partial_PA, N, width, ROWS=rows,
        BLOCK=triton.next_power_of_2(width), PAIR=len(grads_NA) == 2, num_warps=warps)
    _add_partials_kernel[(triton.cdiv(programs, group), triton.cdiv(width, _COLS))](
        partial_PA, sorted_ids_N, out_VA, N, width, programs, ROWS=rows, GROUP=group, PARTS=_PARTS, COLS=_COLS,
        num_warps=4)
