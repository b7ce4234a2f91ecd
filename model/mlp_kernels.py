"""Gluon kernels of the MLP (model/layers.py, ReLU2MLP) on Hopper GPUs: its two (tokens x hidden) products, each
with the ReLU² step in the product's epilogue.

Forward, h = relu(x @ W1)^2; backward, the pre-activation's gradient (grad_y @ W2) * 2 relu(pre). Compiled from
torch ops, each product wrote its (tokens x hidden) result and a second kernel read it back to apply the ReLU²:
12.4 ms (forward) and 19.8 ms (backward) per step of those second kernels in the profile of the 700 ms step
(bench/results/profile_step28_1xH200_9cd4388.txt, triton_poi_fused_..._pow_relu). Here the forward costs nothing
beyond its product and the backward one more read, of h, in its epilogue.

Only h is kept for backward, not the pre-activation: h = relu(pre)^2 >= 0, so relu(pre) = sqrt(h). The bf16
rounding of h (2^-9 relative) moves sqrt(h) by half as much (2^-10), less than the rounding of the bf16
pre-activation itself that the torch ops saved.

Why Gluon (Triton's lower-level dialect, where the kernel places its own asynchronous copies and barriers) and not
plain Triton: the backward must read an h tile in every epilogue. In Triton that load waited in the epilogue while
the tensor cores idled, and the backward took 0.463 ms against the forward's 0.349; loading h before the products
only held it in registers (spills, up to 41 ms; bench/results/mlp_variants_1xH200.json). Here each program asks for
its next tile's h by TMA as soon as it has read the current one, so h arrives during the next tile's products:
0.397 ms, the forward 0.348 ms, against cuBLAS's bare product at 0.327 (bench/results/mlp_gluon_1xH200.json, CUDA
graphs, 8 configurations). Both directions give the Triton kernels' bits exactly, and the step took 8.1 and 8.6 ms
less in two same-machine pairs (bench/results/README.md).

The loop: one persistent program per SM walks its output tiles, M-tiles outermost, so the programs at work at any
moment share a few strips of A while B (768 x 3,072 in bf16: 4.7 MB) stays in L2. A and B arrive by TMA into a ring
of STAGES slots, each with its barrier; the loads run STAGES - 1 k-steps ahead across tile boundaries, so the next
tile's first operands are in flight during this tile's epilogue. One warpgroup issues the products asynchronously
and keeps one in flight: when it has waited for the one before, that one's slot is free for the next load. The
epilogue stores through shared memory by TMA, and waits for the previous tile's store only before overwriting it.

Both directions are torch.library custom ops: torch.compile cannot trace Gluon kernels (its user-kernel support
rewrites Triton source), so inductor calls them as opaque kernels. They run on compute capability 9 only (the
warpgroup MMA is Hopper's); elsewhere ReLU2MLP runs the torch ops (supports()).

Shape legend: M tokens, K model dim, N hidden dim.
"""
import functools

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), the fastest for both directions of 8 in
# bench/results/mlp_gluon_1xH200.json: 5 stages of 128 x 64 and 64 x 128 operand tiles, one output and one h tile
# take 224 KB of the SM's 227 KB of shared memory
CONFIG = (128, 128, 64, 5, 4)


@gluon.jit
def _issue_loads(a_desc, b_desc, a_bufs, b_bufs, ready, i, total, start, step, tiles_n, KSTEPS: gl.constexpr,
                 STAGES: gl.constexpr, B_K_CONTIGUOUS: gl.constexpr = False):
    """The TMA loads of this program's k-step i (its tile i // KSTEPS, k-step i % KSTEPS) into ring slot
    i % STAGES; none past its last k-step. B is (K, N), or (N, K) with B_K_CONTIGUOUS (a weight stored as
    nn.Linear's, which the products read transposed in shared memory)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0 if B_K_CONTIGUOUS else 1]
    tile = start + (i // KSTEPS) * step
    k = (i % KSTEPS) * BLOCK_K
    slot = i % STAGES
    pred = i < total
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [(tile // tiles_n) * BLOCK_M, k], bar, a_bufs.index(slot), pred)
    if B_K_CONTIGUOUS:
        tma.async_copy_global_to_shared(b_desc, [(tile % tiles_n) * BLOCK_N, k], bar, b_bufs.index(slot), pred)
    else:
        tma.async_copy_global_to_shared(b_desc, [k, (tile % tiles_n) * BLOCK_N], bar, b_bufs.index(slot), pred)


@gluon.jit
def _issue_h(h_desc, h_smem, h_bar, tile, tiles_n, pred):
    """The TMA load of the h tile of output tile `tile` into h_smem, if pred."""
    BLOCK_M: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = h_desc.block_type.shape[1]
    mbarrier.expect(h_bar, h_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(h_desc, [(tile // tiles_n) * BLOCK_M, (tile % tiles_n) * BLOCK_N], h_bar, h_smem,
                                    pred)


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr):
    """The operands' ring in shared memory: STAGES slots of an A and a B tile, and each slot's barrier, which
    completes when both of its TMA loads have landed."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    return a_bufs, b_bufs, ready


@gluon.jit
def _relu2_matmul_kernel(a_desc, b_desc, out_desc, h_desc, ACC_LAYOUT: gl.constexpr, KSTEPS: gl.constexpr,
                         STAGES: gl.constexpr, BACKWARD: gl.constexpr):
    """out = relu(A @ B)^2 (forward), or (A @ B) * 2 sqrt(h) (BACKWARD: A = grad_y, B = W2, h the forward's
    output), in out's dtype; h_desc is not read in the forward. Tiles past an edge read zeros and store nothing
    there (TMA)."""
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    tiles_n = gl.cdiv(b_desc.shape[1], BLOCK_N)
    tiles = gl.cdiv(a_desc.shape[0], BLOCK_M) * tiles_n
    start = gl.program_id(0)
    step = gl.num_programs(0)
    my_tiles = gl.cdiv(tiles - start, step)
    total = my_tiles * KSTEPS

    a_bufs, b_bufs, ready = _ring(a_desc, b_desc, STAGES)
    out_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
    if BACKWARD:
        h_smem = gl.allocate_shared_memory(dtype, h_desc.block_type.shape, h_desc.layout)
        h_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(h_bar, count=1)
        _issue_h(h_desc, h_smem, h_bar, start, tiles_n, my_tiles > 0)
    for i in gl.static_range(STAGES - 1):
        _issue_loads(a_desc, b_desc, a_bufs, b_bufs, ready, i, total, start, step, tiles_n, KSTEPS, STAGES)

    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=ACC_LAYOUT)
    i = 0
    # the epilogue sits between two loops, not in a branch of one: across a branch ptxas cannot see that the
    # accumulator is complete, and it waited for every product at each k-step (its warning C7517)
    for local in range(my_tiles):
        for kstep in range(KSTEPS):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot), acc, use_acc=kstep != 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # the previous product is done: its slot is free
            _issue_loads(a_desc, b_desc, a_bufs, b_bufs, ready, i + STAGES - 1, total, start, step, tiles_n, KSTEPS,
                         STAGES)
            i += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        tile = start + local * step
        if BACKWARD:
            mbarrier.wait(h_bar, local & 1)
            h = h_smem.load(ACC_LAYOUT).to(gl.float32)
            gl.thread_barrier()  # every warp has read h_smem before the next tile's h may overwrite it
            _issue_h(h_desc, h_smem, h_bar, tile + step, tiles_n, local + 1 < my_tiles)
            out = acc * (2.0 * gl.sqrt(h))
        else:
            relu = gl.maximum(acc, 0.0)
            out = relu * relu
        tma.store_wait(pendings=0)  # the previous tile's store has left out_smem
        out_smem.store(out.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [(tile // tiles_n) * BLOCK_M, (tile % tiles_n) * BLOCK_N], out_smem)
    tma.store_wait(pendings=0)


def supports(a_MK: Tensor, b_KN: Tensor) -> bool:
    """Whether the kernels take these operands: contiguous bf16 on a Hopper GPU (compute capability 9), with K and N
    multiples of 8 (TMA wants 16-byte aligned rows)."""
    return (a_MK.is_cuda and torch.cuda.get_device_properties(a_MK.device).major == 9
            and a_MK.dtype == b_KN.dtype == torch.bfloat16 and a_MK.is_contiguous() and b_KN.is_contiguous()
            and a_MK.size(1) % 8 == 0 and b_KN.size(1) % 8 == 0)


@functools.cache
def _shared_layout(block: tuple[int, int]):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16)


def _descriptor(t: Tensor, block: tuple[int, int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, list(block), _shared_layout(block))


def launch(a_MK: Tensor, b_KN: Tensor, h_MN: Tensor | None, config: tuple[int, ...] = CONFIG) -> Tensor:
    """The kernel on new output: the backward when h_MN is given, else the forward. config as CONFIG."""
    torch._check(supports(a_MK, b_KN), lambda: "the MLP kernels take contiguous bf16 operands on a Hopper GPU, with "
                                                 "K and N multiples of 8 (model.mlp_kernels.supports)")
    (M, K), N = a_MK.shape, b_KN.size(1)
    block_m, block_n, block_k, stages, warps = config
    out_MN = torch.empty((M, N), dtype=a_MK.dtype, device=a_MK.device)
    out_desc = _descriptor(out_MN, (block_m, block_n))
    h_desc = out_desc if h_MN is None else _descriptor(h_MN, (block_m, block_n))
    tiles = -(-M // block_m) * -(-N // block_n)
    programs = min(tiles, torch.cuda.get_device_properties(a_MK.device).multi_processor_count)
    # the accumulator as the warpgroup MMA leaves it: warps stacked along M, one instruction spanning the tile's N
    acc_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_n, 16])
    _relu2_matmul_kernel[(programs,)](
        _descriptor(a_MK, (block_m, block_k)), _descriptor(b_KN, (block_k, block_n)), out_desc, h_desc,
        ACC_LAYOUT=acc_layout, KSTEPS=-(-K // block_k), STAGES=stages, BACKWARD=h_MN is not None, num_warps=warps)
    return out_MN


@torch.library.custom_op("speedrun::relu2_matmul", mutates_args=())
def relu2_matmul(x_MK: Tensor, w_KN: Tensor) -> Tensor:
    """relu(x @ w)^2 in x's dtype: model.layers.relu2_matmul."""
    return launch(x_MK, w_KN, None)


@relu2_matmul.register_fake
def _(x_MK: Tensor, w_KN: Tensor) -> Tensor:
    return x_MK.new_empty((x_MK.size(0), w_KN.size(1)))


@torch.library.custom_op("speedrun::relu2_matmul_grad", mutates_args=())
def relu2_matmul_grad(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor) -> Tensor:
    """The pre-activation's gradient (grad_y @ w) * 2 sqrt(h): model.layers.relu2_matmul_grad."""
    torch._check(h_MN.shape == (grad_y_MK.size(0), w_KN.size(1)) and h_MN.dtype == grad_y_MK.dtype
                 and h_MN.is_contiguous(), lambda: "h must be the forward's contiguous (M, N) output")
    return launch(grad_y_MK, w_KN, h_MN)


@relu2_matmul_grad.register_fake
def _(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor) -> Tensor:
    return grad_y_MK.new_empty(h_MN.shape)
