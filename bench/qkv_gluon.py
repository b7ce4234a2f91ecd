"""The attention's projection with the QK-norm, rotary embedding and value mix in its epilogue, as a Gluon kernel,
against cuBLAS's product followed by model/qkv_kernels.py's qkv_prep (GPU only). Measured, not adopted: right, but
0.395 ms at best against 0.373 (bench/results/qkv_gluon_1xH200.json).

    python -m bench.qkv_gluon --out bench/results/qkv_gluon_1xH200.json

A Triton form of this took 0.447 ms against 0.374 (bench/results/qkv_fused_1xH200_experiment.json): its epilogue
could not overlap the products. Here, as in model/mlp_kernels.py, the epilogue's inputs (cos and sin for a q or k
tile, the value embedding for a v tile) are requested by TMA when the tile's products start, and arrive during them.

Each output tile is one head's q, k or v for BLOCK_M tokens. The weight's rows are interleaved per head, (j, j + P)
adjacent, so the accumulator splits into the rotary halves inside each thread. Outputs: q, k, v (M, H d) as
qkv_prep's; v_own, the projection's value part (M, H d), and rstd (M, 2H), each q and k head's 1 / rms, which a
backward would need instead of the projection's output.
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.timing import cuda_bf16_randn as randn, failure, graph_ms
from model import layers, mlp_kernels, qkv_kernels

B, T, H, D, DIM = 1, 49152, 6, 128, 768
EPS = 1.1920928955078125e-07  # F.rms_norm's default, as model/qkv_kernels.py


@gluon.jit
def _issue_epilogue_loads(cos_desc, sin_desc, ve_desc, cos_smem, sin_smem, ve_smem, epi_bar, tile, tiles_n, T,
                          H: gl.constexpr, D: gl.constexpr, HAS_VE: gl.constexpr):
    """What tile's epilogue reads besides the accumulator: cos and sin rows for q and k, the value embedding's
    halves for v; with nothing to read, the barrier's phase completes at once."""
    BLOCK_M: gl.constexpr = cos_desc.block_type.shape[0]
    P: gl.constexpr = D // 2
    off_m = (tile // tiles_n) * BLOCK_M
    col = tile % tiles_n
    if col < 2 * H:
        mbarrier.expect(epi_bar, 2 * cos_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(cos_desc, [off_m % T, 0], epi_bar, cos_smem)
        tma.async_copy_global_to_shared(sin_desc, [off_m % T, 0], epi_bar, sin_smem)
    elif HAS_VE:
        head_off = (col % H) * D
        mbarrier.expect(epi_bar, 2 * ve_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(ve_desc, [off_m, head_off], epi_bar, ve_smem.index(0))
        tma.async_copy_global_to_shared(ve_desc, [off_m, head_off + P], epi_bar, ve_smem.index(1))
    else:
        mbarrier.arrive(epi_bar)


@gluon.jit
def _store_halves(desc, out_smem, o1, o2, off_m, head_off, P: gl.constexpr):
    tma.store_wait(pendings=0)  # the previous stores have left out_smem
    out_smem.index(0).store(o1.to(desc.dtype))
    out_smem.index(1).store(o2.to(desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [off_m, head_off], out_smem.index(0))
    tma.async_copy_shared_to_global(desc, [off_m, head_off + P], out_smem.index(1))


@gluon.jit
def qkv_project_kernel(x_desc, w_desc, q_desc, k_desc, v_desc, v_own_desc, cos_desc, sin_desc, ve_desc, lambdas_ptr,
                       rstd_ptr, M, T, H: gl.constexpr, D: gl.constexpr, EPS: gl.constexpr,
                       ACC_LAYOUT: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr, HAS_VE: gl.constexpr):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    P: gl.constexpr = D // 2
    dtype: gl.constexpr = x_desc.dtype
    tiles_n = 3 * H
    tiles = gl.cdiv(M, BLOCK_M) * tiles_n
    start = gl.program_id(0)
    step = gl.num_programs(0)
    my_tiles = gl.cdiv(tiles - start, step)
    total = my_tiles * KSTEPS

    a_bufs, b_bufs, ready = mlp_kernels._ring(x_desc, w_desc, STAGES)
    out_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    cos_smem = gl.allocate_shared_memory(gl.float32, cos_desc.block_type.shape, cos_desc.layout)
    sin_smem = gl.allocate_shared_memory(gl.float32, sin_desc.block_type.shape, sin_desc.layout)
    ve_smem = gl.allocate_shared_memory(dtype, [2] + ve_desc.block_type.shape, ve_desc.layout)
    epi_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(epi_bar, count=1)
    for i in gl.static_range(STAGES - 1):
        mlp_kernels._issue_loads(x_desc, w_desc, a_bufs, b_bufs, ready, i, total, start, step, tiles_n, KSTEPS,
                                 STAGES, True)

    own = gl.load(lambdas_ptr)
    embed = gl.load(lambdas_ptr + 2)
    acc = gl.zeros((BLOCK_M, D), dtype=gl.float32, layout=ACC_LAYOUT)
    i = 0
    for local in range(my_tiles):
        tile = start + local * step
        _issue_epilogue_loads(cos_desc, sin_desc, ve_desc, cos_smem, sin_smem, ve_smem, epi_bar, tile, tiles_n, T,
                              H, D, HAS_VE)
        for kstep in range(KSTEPS):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, use_acc=kstep != 0,
                                is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mlp_kernels._issue_loads(x_desc, w_desc, a_bufs, b_bufs, ready, i + STAGES - 1, total, start, step,
                                     tiles_n, KSTEPS, STAGES, True)
            i += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        acc1, acc2 = gl.split(gl.reshape(acc, [BLOCK_M, P, 2]))
        half_layout: gl.constexpr = acc1.type.layout
        mbarrier.wait(epi_bar, local & 1)
        off_m = (tile // tiles_n) * BLOCK_M
        col = tile % tiles_n
        head_off = (col % H) * D
        if col < 2 * H:
            cos = cos_smem.load(half_layout)
            sin = sin_smem.load(half_layout)
            r = gl.rsqrt((gl.sum(acc1 * acc1, axis=1) + gl.sum(acc2 * acc2, axis=1)) / D + EPS)
            rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, half_layout))
            gl.store(rstd_ptr + rows.to(gl.int64) * (2 * H) + col, r, mask=rows < M)
            n1 = acc1 * gl.expand_dims(r, 1)
            n2 = acc2 * gl.expand_dims(r, 1)
            if col < H:
                _store_halves(q_desc, out_smem, n1 * cos + n2 * sin, n2 * cos - n1 * sin, off_m, head_off, P)
            else:
                _store_halves(k_desc, out_smem, n1 * cos + n2 * sin, n2 * cos - n1 * sin, off_m, head_off, P)
        else:
            _store_halves(v_own_desc, out_smem, acc1, acc2, off_m, head_off, P)
            v1 = own * acc1
            v2 = own * acc2
            if HAS_VE:
                v1 += embed * ve_smem.index(0).load(half_layout).to(gl.float32)
                v2 += embed * ve_smem.index(1).load(half_layout).to(gl.float32)
            _store_halves(v_desc, out_smem, v1, v2, off_m, head_off, P)
        gl.thread_barrier()  # the epilogue's reads of cos, sin and ve are done before the next tile's land
    tma.store_wait(pendings=0)


def _descriptor(t, block, dtype):
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dtype))


def qkv_project(x_MK, w_NK, cos_TP, sin_TP, lambdas, ve_MA, T, H, config=(128, 64, 3, 4)):
    """(q, k, v, v_own, rstd) from x @ w^T: q, k, v (M, H d) as qkv_prep's without a value residual."""
    block_m, block_k, stages, warps = config
    M, K = x_MK.shape
    d = w_NK.size(0) // (3 * H)
    P = d // 2
    assert T % block_m == 0, "cos and sin tiles are read by TMA, BLOCK_M rows of one sequence"
    w_interleaved = w_NK.view(3 * H, 2, P, K).transpose(1, 2).reshape(w_NK.shape)
    q, k, v, v_own = (x_MK.new_empty((M, H * d)) for _ in range(4))
    rstd = torch.empty((M, 2 * H), dtype=torch.float32, device=x_MK.device)
    half = [block_m, P]
    outs = [_descriptor(t, half, gl.bfloat16) for t in (q, k, v, v_own)]
    ve_desc = outs[3] if ve_MA is None else _descriptor(ve_MA, half, gl.bfloat16)
    acc_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, d, 16])
    tiles = -(-M // block_m) * 3 * H
    programs = min(tiles, torch.cuda.get_device_properties(x_MK.device).multi_processor_count)
    qkv_project_kernel[(programs,)](
        _descriptor(x_MK, [block_m, block_k], gl.bfloat16), _descriptor(w_interleaved, [d, block_k], gl.bfloat16),
        *outs, _descriptor(cos_TP, half, gl.float32), _descriptor(sin_TP, half, gl.float32), ve_desc, lambdas, rstd,
        M, T, H=H, D=d, EPS=EPS, ACC_LAYOUT=acc_layout, KSTEPS=-(-K // block_k), STAGES=stages,
        HAS_VE=ve_MA is not None, num_warps=warps)
    return q, k, v, v_own, rstd


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = randn(B * T, DIM)
    w = (torch.randn(3 * H * D, DIM, device="cuda") * 0.5 * DIM ** -0.5).bfloat16()
    ve = randn(B * T, H * D)
    cos, sin = layers.rotary_tables(T, D, 1024.0, torch.device("cuda"))
    lambdas = torch.tensor([0.7, 0.0, 1.3], device="cuda")
    pre = F.linear(x.float(), w.float())
    want = layers.qkv_prep(pre.view(B, T, 3 * H, D), cos, sin, lambdas, None, ve.float().view(B, T, H * D))
    want_rstd = torch.rsqrt(pre.view(B * T, 3 * H, D)[:, :2 * H].square().mean(-1) + EPS)

    def baseline():
        return qkv_kernels.qkv_prep(F.linear(x, w).view(B, T, 3 * H, D), cos, sin, lambdas, None, ve)

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cublas_product_ms": graph_ms(lambda: F.linear(x, w)), "baseline_ms": graph_ms(baseline),
              "configs": []}
    print(result, flush=True)
    exact = [*want, pre[:, 2 * H * D:], want_rstd]
    for config in [(128, 64, 3, 4), (128, 64, 2, 4), (128, 64, 3, 8), (64, 64, 4, 4)]:
        def call(c=config):
            return qkv_project(x, w, cos, sin, lambdas, ve, T, H, c)
        try:
            got = call()
            row = {"config": config, "max_err_of_max": {
                name: ((g.float().view_as(e) - e).abs().max() / e.abs().max()).item()
                for name, g, e in zip(("q", "k", "v", "v_own", "rstd"), got, exact)}, "ms": graph_ms(call)}
        except Exception as e:
            row = {"config": config, "error": failure(e)}
        result["configs"].append(row)
        print(row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
