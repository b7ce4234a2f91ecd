"""model/mlp_kernels.py's two kernels as a ping-pong, against those kernels, at the training shape and two sizes off
every tile (GPU only). Measured, not adopted: forward 0.3386 ms against 0.3388, backward 0.3846 against 0.3937
(bench/results/mlp_pingpong_1xH200.json), under 1 ms per step for three-way warp specialization.

    python -m bench.mlp_pingpong --out bench/results/mlp_pingpong_1xH200.json

model/mlp_kernels.py's one warpgroup waits for its tile's epilogue before it issues the next tile's products: at
the training shape the forward took 0.348 ms against cuBLAS's bare product at 0.327, the backward 0.397
(bench/results/mlp_gluon_1xH200.json). Here a loading warpgroup (the default partition; one thread issues the TMA
copies) fills a ring shared by two consumer warpgroups that take alternate tiles of the program, so one's epilogue
runs while the other's products do. A consumer starts its products only when the other has issued those of the
tile before (`turns`): one consumer's products at a time, and no consumer ever waits on a ring slot's barrier more
than one phase ahead, where a parity wait would pass on an earlier fill. Each consumer keeps one tile of shared
memory for its output, and in the backward first for the tile's h. Registers: the loader gives up all but 40; each
consumer may use CONSUMER_REGS (3 warpgroups of 128 threads share the SM's 64K).
"""
import argparse
import json
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from bench.mlp_kernels import checked_row, training_problem
from bench.timing import graph_ms
from model import layers, mlp_kernels

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, consumer registers): 5 stages and two output tiles take 224 KB of shared memory
CONFIG = (128, 128, 64, 5, 232)


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, start, step, my_tiles, tiles_n, KSTEPS: gl.constexpr,
              STAGES: gl.constexpr):
    """The loader: each ring slot refilled once the consumer of its last k-step has released it."""
    total = my_tiles * KSTEPS
    for j in range(total):
        mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        mlp_kernels._issue_loads(a_desc, b_desc, a_bufs, b_bufs, ready, j, total, start, step, tiles_n, KSTEPS,
                                 STAGES)


@gluon.jit
def _consumer(c: gl.constexpr, a_bufs, b_bufs, ready, empty, bufs, h_bars, turns, out_desc, h_desc, start, step,
              my_tiles, tiles_n, ACC_LAYOUT: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr,
              BACKWARD: gl.constexpr):
    """Consumer c takes this program's tiles c, c + 2, ... Its products start only when the other consumer's
    products of the tile before are issued (turns): one consumer's products at a time, and a consumer never waits on
    a ring slot's barrier more than one phase ahead (with its parity alone, an earlier fill would pass the wait)."""
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    dtype: gl.constexpr = out_desc.dtype
    buf = bufs.index(c)
    h_bar = h_bars.index(c)
    if BACKWARD:
        mlp_kernels._issue_tile(h_desc, buf, h_bar, start + c * step, tiles_n, c < my_tiles)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=ACC_LAYOUT)
    for local in range(c, my_tiles, 2):
        mbarrier.wait(turns.index(1 - c), ((local - 1) // 2) & 1, pred=local > 0)
        for kstep in range(KSTEPS):
            i = local * KSTEPS + kstep
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot), acc, use_acc=kstep != 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=kstep > 0)  # the product before is done
        mbarrier.arrive(turns.index(c))  # the other consumer may start its products
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((local * KSTEPS + KSTEPS - 1) % STAGES))
        tile = start + local * step
        if BACKWARD:
            mbarrier.wait(h_bar, (local // 2) & 1)
            out = acc * (2.0 * gl.sqrt(buf.load(ACC_LAYOUT).to(gl.float32)))
        else:
            tma.store_wait(pendings=0)  # this consumer's previous store has left buf
            relu = gl.maximum(acc, 0.0)
            out = relu * relu
        buf.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [(tile // tiles_n) * BLOCK_M, (tile % tiles_n) * BLOCK_N], buf)
        if BACKWARD:
            tma.store_wait(pendings=0)  # the store has left buf before the next h lands in it
            mlp_kernels._issue_tile(h_desc, buf, h_bar, tile + 2 * step, tiles_n, local + 2 < my_tiles)
    tma.store_wait(pendings=0)


@gluon.jit
def _relu2_matmul_pingpong_kernel(a_desc, b_desc, out_desc, h_desc, ACC_LAYOUT: gl.constexpr, KSTEPS: gl.constexpr,
                                  STAGES: gl.constexpr, BACKWARD: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    tiles_n = gl.cdiv(b_desc.shape[1], out_desc.block_type.shape[1])
    tiles = gl.cdiv(a_desc.shape[0], BLOCK_M) * tiles_n
    start = gl.program_id(0)
    step = gl.num_programs(0)
    my_tiles = gl.cdiv(tiles - start, step)

    a_bufs, b_bufs, ready = mlp_kernels._ring(a_desc, b_desc, STAGES)
    bufs = gl.allocate_shared_memory(dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    h_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(empty.index(s), count=1)
    for c in gl.static_range(2):
        mbarrier.init(h_bars.index(c), count=1)
        mbarrier.init(turns.index(c), count=1)

    # the default partition (the kernel's 4 warps) loads; each consumer is a worker warpgroup
    gl.warp_specialize([
        (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, start, step, my_tiles, tiles_n, KSTEPS, STAGES)),
        (_consumer, (0, a_bufs, b_bufs, ready, empty, bufs, h_bars, turns, out_desc, h_desc, start, step, my_tiles,
                     tiles_n, ACC_LAYOUT, KSTEPS, STAGES, BACKWARD)),
        (_consumer, (1, a_bufs, b_bufs, ready, empty, bufs, h_bars, turns, out_desc, h_desc, start, step, my_tiles,
                     tiles_n, ACC_LAYOUT, KSTEPS, STAGES, BACKWARD)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def launch(a_MK, b_KN, h_MN, config=CONFIG):
    """model.mlp_kernels.launch on the ping-pong kernel; config as CONFIG."""
    torch._check(mlp_kernels.supports(a_MK, b_KN), lambda: "operands as model.mlp_kernels.supports takes")
    (M, K), N = a_MK.shape, b_KN.size(1)
    block_m, block_n, block_k, stages, regs = config
    out_MN = torch.empty((M, N), dtype=a_MK.dtype, device=a_MK.device)
    out_desc = mlp_kernels._descriptor(out_MN, (block_m, block_n))
    h_desc = out_desc if h_MN is None else mlp_kernels._descriptor(h_MN, (block_m, block_n))
    tiles = -(-M // block_m) * -(-N // block_n)
    programs = min(tiles, torch.cuda.get_device_properties(a_MK.device).multi_processor_count)
    acc_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16])
    _relu2_matmul_pingpong_kernel[(programs,)](
        mlp_kernels._descriptor(a_MK, (block_m, block_k)), mlp_kernels._descriptor(b_KN, (block_k, block_n)),
        out_desc, h_desc, ACC_LAYOUT=acc_layout, KSTEPS=-(-K // block_k), STAGES=stages, BACKWARD=h_MN is not None,
        CONSUMER_REGS=regs, num_warps=4)
    return out_MN


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "edges": [], "configs": []}
    # sizes off every tile, each checked against fp64 (the reference takes relu(pre) from the exact pre-activation)
    for m, k, n in [(300, 72, 520), (4100, 72, 1032)]:
        g = torch.Generator("cuda").manual_seed(0)
        x, w1, w2, grad_y = (torch.randn(*shape, generator=g, device="cuda").bfloat16()
                             for shape in ((m, k), (k, n), (k, n), (m, k)))
        pre = x.double() @ w1.double()
        h = launch(x, w1, None)
        grad = launch(grad_y, w2, h)
        want_h, want_g = torch.relu(pre).square(), (grad_y.double() @ w2.double()) * 2.0 * torch.relu(pre)
        row = {"size": (m, k, n),
               "forward_max_err_of_max": ((h.double() - want_h).abs().max() / want_h.abs().max()).item(),
               "backward_max_err_of_max": ((grad.double() - want_g).abs().max() / want_g.abs().max()).item()}
        result["edges"].append(row)
        print(row, flush=True)

    x, w1, w2, grad_y, h = training_problem()
    want = {"forward": h.float(), "backward": layers.relu2_matmul_grad(grad_y, w2, h).float()}
    operands = {"forward": (x, w1, None), "backward": (grad_y, w2, h)}
    epilogues = {"forward": mlp_kernels.RELU2, "backward": mlp_kernels.RELU2_GRAD}
    result["one_warpgroup"] = {side: graph_ms(lambda s=side: mlp_kernels.launch(*operands[s], epilogues[s]))
                               for side in want}
    print(result["one_warpgroup"], flush=True)
    for config in [CONFIG, (128, 128, 64, 4, 232), (128, 128, 64, 5, 224)]:
        row = {"config": config}
        for side in ("forward", "backward"):
            row |= checked_row(side, lambda c=config, s=side: launch(*operands[s], c), want[side], graph_ms)
        result["configs"].append(row)
        print(row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
