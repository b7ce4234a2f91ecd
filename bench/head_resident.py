"""The head's training forward (model/head_kernels.py, _forward_kernel with GRAD: lse, loss and the e5m2 unit gradient)
with each row held in shared memory between its two passes, in Gluon, against the model's kernel (GPU only).

    python -m bench.head_resident --out bench/results/head_resident_1xH200.json

The model's kernel reads each 100 KB row twice from global memory: about a thousand rows are in flight, more than
the L2 holds, so the second pass reads most of them from HBM again (12.3 GB per micro-batch). Its second pass
alone, without any math, took 1.4 ms of the kernel's 3.1 (bench/results/head_passes_1xH200.json). Here two
persistent programs per SM each keep their row in 100 KB of shared memory: the first pass waits for the row's
chunks as they land, the second reads them from shared memory, and as it finishes with each chunk it asks for the
same chunk of its next row (cp.async, each thread copying and reading back its own 16 bytes, so no barrier is
needed). The logits then cross HBM once (7.4 GB with the gradient), the next row's loads run under this row's
math, and the kernel should be bound by its MUFU work (tanh and exp2 per element and pass: 2.36 ms at 16 per SM
per clock). The math is the model kernel's, expression for expression, so the bits should be its bits.

Measured on the H200 (head_resident_1xH200.json): the bits are the model kernel's (0 bytes of 2.47 G differ, lse
and loss equal), but the kernel is slower: 3.64 ms with each row's loads as one group (row_groups), 3.68 with one
group per chunk (chunk_groups, its registers capped at 128 so that two programs fit on an SM; uncapped it used 255
and ran alone: 4.44-4.48 ms), against 3.02-3.03 for the model's kernel. 100 KB of shared memory per row allows two
programs per SM: 16 warps, against the model kernel's 64, are too few to keep the MUFU busy. Not adopted.
"""
import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from bench.head_kernels import SOFTCAP, finish_sweep, run_variant, training_problem
from bench.timing import graph_ms
from model import head
from model.head_kernels import _LOG2E, _forward  # _LOG2E is a constexpr, which Gluon reads as its own


@gluon.jit
def _tanh(logits, softcap: gl.constexpr):
    """model/head_kernels.py's _tanh_of on the MUFU: t = tanh(l / c)."""
    u = logits.to(gl.float32) * (1.0 / softcap)
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _sum_term(chunk_smem, cols, layout: gl.constexpr, softcap: gl.constexpr, V: gl.constexpr):
    """A chunk's terms of the first pass's sum of exp(z - c), as model/head_kernels.py's _row_lse_and_loss."""
    t_V = _tanh(chunk_smem.load(layout), softcap)
    return gl.where(cols < V, gl.exp2((_LOG2E * softcap) * (t_V - 1.0)), 0.0)


@gluon.jit
def _store_grad(chunk_smem, cols, layout: gl.constexpr, u_row_ptr, lse, target, scale, softcap: gl.constexpr,
                V: gl.constexpr):
    """Stores a chunk's unit gradient, as model/head_kernels.py's _forward_kernel; returns t where the target is
    (0 elsewhere), so that the row's loss needs no load of its own."""
    t_V = _tanh(chunk_smem.load(layout), softcap)
    probs_V = gl.exp2(_LOG2E * (softcap * t_V - lse))
    hit_V = cols == target
    u_V = (probs_V - hit_V.to(gl.float32)) * (1.0 - t_V * t_V) * scale
    gl.store(u_row_ptr + cols, u_V.to(u_row_ptr.dtype.element_ty), mask=cols < V)
    return gl.where(hit_V, t_V, 0.0)


@gluon.jit
def _row_buffer(CHUNKS: gl.constexpr, BLOCK_V: gl.constexpr, layout: gl.constexpr):
    """The shared-memory row (CHUNKS slots of BLOCK_V bf16), each thread's offsets within a slot, and this program's
    first row and its stride over the rows."""
    return (gl.allocate_shared_memory(gl.bfloat16, [CHUNKS, BLOCK_V], gl.SwizzledSharedLayout(1, 1, 1, [0])),
            gl.arange(0, BLOCK_V, layout=layout), gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _row_facts(sum_V, targets_ptr, u_ptr, row, softcap: gl.constexpr, V: gl.constexpr, U_SCALE: gl.constexpr):
    """After the first pass: the row's lse, its target, whether it is ignored, the gradient's scale (0 for ignored
    rows) and where the row's gradient goes."""
    lse = softcap + gl.log(gl.sum(sum_V, axis=0))
    target = gl.load(targets_ptr + row)
    ignored = target == -100
    return lse, target, ignored, gl.where(ignored, 0.0, U_SCALE), u_ptr + row.to(gl.int64) * V


@gluon.jit
def _resident_kernel(logits_ptr, targets_ptr, lse_ptr, loss_ptr, u_ptr, N, softcap: gl.constexpr,
                     V: gl.constexpr, U_SCALE: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_V: gl.constexpr = 8 * 32 * num_warps  # one 16-byte bf16 vector per thread and chunk
    CHUNKS: gl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [num_warps], [0])
    rows_smem, offs, start, step = _row_buffer(CHUNKS, BLOCK_V, layout)
    for i in gl.static_range(CHUNKS):  # the first row's chunks, one commit group each
        cols = i * BLOCK_V + offs
        async_copy.async_copy_global_to_shared(rows_smem.index(i), logits_ptr + start.to(gl.int64) * V + cols,
                                               mask=(cols < V) & (start < N))
        async_copy.commit_group()
    for row in range(start, N, step):
        # first pass: the sum of exp(z - c), lane-wise, as model/head_kernels.py's _row_lse_and_loss
        sum_V = gl.zeros([BLOCK_V], gl.float32, layout)
        for i in gl.static_range(CHUNKS):
            async_copy.wait_group(CHUNKS - 1 - i)  # the groups after chunk i's: this row's later chunks
            sum_V += _sum_term(rows_smem.index(i), i * BLOCK_V + offs, layout, softcap, V)
        lse, target, ignored, scale, u_row_ptr = _row_facts(sum_V, targets_ptr, u_ptr, row, softcap, V, U_SCALE)
        next_ptr = logits_ptr + (row + step).to(gl.int64) * V
        has_next = row + step < N
        # second pass: the gradient from shared memory; each chunk read, its slot takes the next row's chunk
        t_target_V = gl.zeros([BLOCK_V], gl.float32, layout)
        for i in gl.static_range(CHUNKS):
            cols = i * BLOCK_V + offs
            t_target_V += _store_grad(rows_smem.index(i), cols, layout, u_row_ptr, lse, target, scale, softcap, V)
            async_copy.async_copy_global_to_shared(rows_smem.index(i), next_ptr + cols, mask=(cols < V) & has_next)
            async_copy.commit_group()
        # the target's t, found in the second pass: a sum of one value and zeros, so exactly the model's
        gl.store(lse_ptr + row, lse)
        gl.store(loss_ptr + row, gl.where(ignored, 0.0, lse - softcap * gl.sum(t_target_V, axis=0)))
    async_copy.wait_group(0)


@gluon.jit
def _row_group_kernel(logits_ptr, targets_ptr, lse_ptr, loss_ptr, u_ptr, N, softcap: gl.constexpr,
                      V: gl.constexpr, U_SCALE: gl.constexpr, num_warps: gl.constexpr):
    """_resident_kernel with each row's copies as one group: the program waits for its whole row, runs both passes
    as plain loops (no unrolling: half the registers, so two programs fit on an SM without a register cap), then
    asks for its next row. Two shared-memory barriers per row instead of one per chunk; the loads of one program run
    under the other program's math."""
    BLOCK_V: gl.constexpr = 8 * 32 * num_warps
    CHUNKS: gl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [num_warps], [0])
    rows_smem, offs, start, step = _row_buffer(CHUNKS, BLOCK_V, layout)
    for i in range(CHUNKS):
        cols = i * BLOCK_V + offs
        async_copy.async_copy_global_to_shared(rows_smem.index(i), logits_ptr + start.to(gl.int64) * V + cols,
                                               mask=(cols < V) & (start < N))
    async_copy.commit_group()
    for row in range(start, N, step):
        async_copy.wait_group(0)
        sum_V = gl.zeros([BLOCK_V], gl.float32, layout)
        for i in range(CHUNKS):
            sum_V += _sum_term(rows_smem.index(i), i * BLOCK_V + offs, layout, softcap, V)
        lse, target, ignored, scale, u_row_ptr = _row_facts(sum_V, targets_ptr, u_ptr, row, softcap, V, U_SCALE)
        t_target_V = gl.zeros([BLOCK_V], gl.float32, layout)
        for i in range(CHUNKS):
            t_target_V += _store_grad(rows_smem.index(i), i * BLOCK_V + offs, layout, u_row_ptr, lse, target, scale,
                                      softcap, V)
        gl.store(lse_ptr + row, lse)
        gl.store(loss_ptr + row, gl.where(ignored, 0.0, lse - softcap * gl.sum(t_target_V, axis=0)))
        next_row = row + step
        for i in range(CHUNKS):
            cols = i * BLOCK_V + offs
            async_copy.async_copy_global_to_shared(rows_smem.index(i), logits_ptr + next_row.to(gl.int64) * V + cols,
                                                   mask=(cols < V) & (next_row < N))
        async_copy.commit_group()
    async_copy.wait_group(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    logits_NV, targets_N = training_problem()
    targets_N[::97] = head.IGNORE_INDEX  # some ignored rows, as at the end of a document stream
    N, V = logits_NV.shape
    u_scale = head.GRAD_FP8_SCALE
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ref_u8 = torch.empty((N, V), dtype=torch.float8_e5m2, device="cuda")
    ref_lse, ref_loss = _forward(logits_NV, targets_N, SOFTCAP, ref_u8, u_scale)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "N": N, "V": V, "sms": sms,
              "model_kernel_ms": graph_ms(lambda: _forward(logits_NV, targets_N, SOFTCAP, ref_u8, u_scale)),
              "variants": []}
    print(result)
    lse_N, loss_N = torch.empty_like(ref_lse), torch.empty_like(ref_loss)
    u8_NV = torch.empty_like(ref_u8)
    kernels = {"chunk_groups": _resident_kernel, "row_groups": _row_group_kernel}
    for name, programs_per_sm, warps, maxnreg in [
            ("row_groups", 2, 8, None), ("row_groups", 1, 8, None), ("chunk_groups", 2, 8, 128),
            ("chunk_groups", 2, 8, 120), ("chunk_groups", 1, 8, None), ("chunk_groups", 2, 8, None)]:
        u8_NV.fill_(1.0)

        def call():
            kernels[name][(min(N, programs_per_sm * sms),)](logits_NV, targets_N, lse_N, loss_N, u8_NV, N, SOFTCAP,
                                                            V=V, U_SCALE=u_scale, num_warps=warps, maxnreg=maxnreg)

        def checks():
            return {"u8_bytes_differing": int((u8_NV.view(torch.uint8) != ref_u8.view(torch.uint8)).sum()),
                    "lse_bits_equal": bool(torch.equal(lse_N, ref_lse)),
                    "loss_bits_equal": bool(torch.equal(loss_N, ref_loss)),
                    "loss_max_abs_diff": float((loss_N - ref_loss).abs().max())}
        row = {"kernel": name, "programs_per_sm": programs_per_sm, "warps": warps, "maxnreg": maxnreg}
        result["variants"].append(run_variant(row, call, checks))
    finish_sweep(result, lambda: _forward(logits_NV, targets_N, SOFTCAP, ref_u8, u_scale), args.out)

if __name__ == "__main__":
    main()
