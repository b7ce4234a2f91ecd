"""Triton kernels of the embeddings' backward (model/fast/routing.py, TableRows): they add each token's rows straight
into the table's fp32 gradient, in a fixed order, so that runs repeat bit for bit. Rows come sorted by token id
(stably); a program sums each run of one id in registers and adds it once, as per-row atomics on text's frequent
tokens would queue. A run that goes on into later programs is summed in pieces that a second kernel adds in program
order. The launches are direct: they run in an eager backward, never under torch.compile.

Shape legend: N tokens, A row width, V vocab.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

# first kernel: sorted rows and warps per program, the fastest tried on text
_ROWS, _WARPS = 32, 2
# second kernel: first-kernel programs per program (fastest tried), partial sums at a time, columns
_GROUP, _PARTS, _COLS = 8, 128, 64


@triton.jit
def _add_sorted_rows_kernel(grad_a_ptr, grad_b_ptr, order_ptr, sorted_ids_ptr, out_ptr, partial_ptr, N, width,
                            ROWS: tl.constexpr, BLOCK: tl.constexpr, PAIR: tl.constexpr):
    """out[sorted_ids[i]] += grad_a[order[i]] (+ grad_b's with PAIR) for this program's ROWS positions, one atomic
    add per run; a first run that began earlier goes to partial[program]."""
    start = tl.program_id(0) * ROWS
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    run_token = tl.load(sorted_ids_ptr + start).to(tl.int64)
    before = tl.load(sorted_ids_ptr + start - 1, mask=start > 0, other=-1).to(tl.int64)  # -1: never a token
    continued = run_token == before  # the run began in an earlier program
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
    """out[token] += the partial sums of each run that begins in one of this group's GROUP programs and goes on,
    in program order: runs ending in the next program all at once, longer ones one by one."""
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
    # ids are sorted: the programs starting with the token are those the run goes on into
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
    """out[sorted_ids[i]] += the fp32 sum of one or two grads' (N, A) rows order[i], in place, out fp32 (V, A).
    The launch settings do not change the result."""
    N, width = sorted_ids_N.size(0), out_VA.size(1)
    torch._check(out_VA.dtype == torch.float32 and out_VA.is_contiguous() and 1 <= len(grads_NA) <= 2
                 and all(g.is_contiguous() and g.shape == (N, width) for g in grads_NA)
                 and order_N.shape == sorted_ids_N.shape == (N,),
                 lambda: f"add_rows takes a contiguous fp32 table (V, A), sorted ids and their order (N,), and one or "
                         f"two contiguous gradients (N, A); got {tuple(out_VA.shape)} {out_VA.dtype}, "
                         f"{tuple(sorted_ids_N.shape)}, {tuple(order_N.shape)}, {[tuple(g.shape) for g in grads_NA]}")
    programs = triton.cdiv(N, rows)
    partial_PA = out_VA.new_empty(programs, width)  # written where a first run continues
    _add_sorted_rows_kernel[(programs,)](
        grads_NA[0], grads_NA[-1], order_N, sorted_ids_N, out_VA, partial_PA, N, width, ROWS=rows,
        BLOCK=triton.next_power_of_2(width), PAIR=len(grads_NA) == 2, num_warps=warps)
    _add_partials_kernel[(triton.cdiv(programs, group), triton.cdiv(width, _COLS))](
        partial_PA, sorted_ids_N, out_VA, N, width, programs, ROWS=rows, GROUP=group, PARTS=_PARTS, COLS=_COLS,
        num_warps=4)
