"""Gluon kernels of the MLP (model/fast/mlp.py, ReLU2MLP) on Hopper: each product that makes or reads the
(tokens x hidden) tensor does the step after it in its epilogue, so that nothing reads that tensor back. Only h is
kept for the backward: h = relu(pre)^2, so relu(pre) = sqrt(h), and h's bf16 rounding moves sqrt(h) by half as much.

One persistent program per SM walks its output tiles, M-tiles outermost, so that B stays in L2. A and B arrive by
TMA in a ring of STAGES slots, loaded STAGES - 1 k-steps ahead across tiles; one warpgroup keeps one product in
flight. The epilogue's tile t (h, or the residual) is asked for as soon as the previous one is read, so it arrives
during the next tile's products: hence Gluon, where the kernel places its own asynchronous copies and barriers.

The FP8 forms read K-major e4m3 operands and can write e4m3 copies of their output, transposed too. The kernels
are torch.library custom ops (torch.compile cannot trace Gluon), on compute capability 9 only (supports());
model/fast/mlp.py's torch ops of the same names are their references.

Shape legend: M tokens, K the product's inner dim, N its output dim.
"""
import functools

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from model.fast.fp8 import E4M3_MAX, delayed_scale

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): the fastest tried for the bf16 kernels; all tiles fit in shared memory
CONFIG = (128, 128, 64, 5, 4)
# e4m3 operands: 128 bytes of K per row as above; the fastest tried
FP8_CONFIG = (128, 128, 128, 5, 4)
SMEM_BYTES = 227 * 1024  # a block's opt-in shared memory on compute capability 9.0


@gluon.jit
def _issue_loads(a_desc, b_desc, a_bufs, b_bufs, ready, i, total, start, step, tiles_n, KSTEPS: gl.constexpr,
                 STAGES: gl.constexpr, B_K_CONTIGUOUS: gl.constexpr = False):
    """The TMA loads of this program's k-step i (tile i // KSTEPS) into ring slot i % STAGES; none past the last.
    B is (K, N), or (N, K) with B_K_CONTIGUOUS."""
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
def _issue_tile(t_desc, t_smem, t_bar, tile, tiles_n, pred):
    """The TMA load of output tile `tile`'s t into t_smem, if pred."""
    BLOCK_M: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = t_desc.block_type.shape[1]
    mbarrier.expect(t_bar, t_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(t_desc, [(tile // tiles_n) * BLOCK_M, (tile % tiles_n) * BLOCK_N], t_bar, t_smem,
                                    pred)


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr):
    """STAGES slots of an A and a B tile in shared memory, and each slot's barrier (both loads landed)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    return a_bufs, b_bufs, ready


# The epilogues: what the kernel makes of acc = A @ B and a tile t
RELU2 = 0  # relu(acc)^2: the hidden h
RELU2_GRAD = 1  # acc * 2 sqrt(t), t = h: the pre-activation's gradient
ADD = 2  # acc + t, t = the residual stream, rounded once
_RELU2, _RELU2_GRAD = gl.constexpr(RELU2), gl.constexpr(RELU2_GRAD)  # globals the kernel reads must be constexpr
_E4M3_MAX = gl.constexpr(E4M3_MAX)


@gluon.jit
def _matmul_kernel(a_desc, b_desc, out_desc, t_desc, scale_ptr, out8_desc, out8t_desc, out8_scale_ptr, amax_ptr,
                   ACC_LAYOUT: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr,
                   EPILOGUE: gl.constexpr, B_K_CONTIGUOUS: gl.constexpr, SHARED_TILE: gl.constexpr,
                   SCALED: gl.constexpr, WRITES_OUT: gl.constexpr, WRITES_FP8: gl.constexpr,
                   WRITES_FP8_T: gl.constexpr, RECORDS_AMAX: gl.constexpr):
    """out = EPILOGUE(s * (A @ B)), s = *scale_ptr with SCALED, else 1; B is (K, N), or (N, K) with B_K_CONTIGUOUS.
    Without WRITES_OUT, out_desc only gives the shape. The e4m3 copies, the fp32 out * *out8_scale_ptr saturated, go
    to out8_desc (M, N) and out8t_desc (N, M). RECORDS_AMAX raises *amax_ptr to out's absolute maximum. SHARED_TILE:
    t lands in the output's buffer, asked for halfway through each tile's products. Edge tiles read zeros (TMA)."""
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    READS_TILE: gl.constexpr = EPILOGUE != _RELU2
    dtype: gl.constexpr = out_desc.dtype
    tiles_n = gl.cdiv(out_desc.shape[1], BLOCK_N)
    tiles = gl.cdiv(out_desc.shape[0], BLOCK_M) * tiles_n
    start = gl.program_id(0)
    step = gl.num_programs(0)
    my_tiles = gl.cdiv(tiles - start, step)
    total = my_tiles * KSTEPS

    a_bufs, b_bufs, ready = _ring(a_desc, b_desc, STAGES)
    if WRITES_OUT:
        out_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
    if WRITES_FP8:
        out8_smem = gl.allocate_shared_memory(out8_desc.dtype, out8_desc.block_type.shape, out8_desc.layout)
    if WRITES_FP8_T:  # (BLOCK_N, BLOCK_M), filled through its transposed view
        out8t_smem = gl.allocate_shared_memory(out8t_desc.dtype, out8t_desc.block_type.shape, out8t_desc.layout)
    if READS_TILE:
        if SHARED_TILE:
            t_smem = out_smem
        else:
            t_smem = gl.allocate_shared_memory(t_desc.dtype, t_desc.block_type.shape, t_desc.layout)
        t_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(t_bar, count=1)
        _issue_tile(t_desc, t_smem, t_bar, start, tiles_n, my_tiles > 0)
    for i in gl.static_range(STAGES - 1):
        _issue_loads(a_desc, b_desc, a_bufs, b_bufs, ready, i, total, start, step, tiles_n, KSTEPS, STAGES,
                     B_K_CONTIGUOUS)

    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=ACC_LAYOUT)
    if RECORDS_AMAX:  # over this program's tiles; one atomic at the end
        row_amax = gl.zeros((BLOCK_M, ), dtype=gl.float32, layout=gl.SliceLayout(1, ACC_LAYOUT))
    i = 0
    # the epilogue sits between two loops, not in a branch, where ptxas would wait on every product (C7517)
    for local in range(my_tiles):
        tile = start + local * step
        for kstep in range(KSTEPS):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            if B_K_CONTIGUOUS:  # read as (K, N)
                b_tile = b_bufs.index(slot).permute((1, 0))
            else:
                b_tile = b_bufs.index(slot)
            acc = warpgroup_mma(a_bufs.index(slot), b_tile, acc, use_acc=kstep != 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # the previous product's slot is free
            _issue_loads(a_desc, b_desc, a_bufs, b_bufs, ready, i + STAGES - 1, total, start, step, tiles_n, KSTEPS,
                         STAGES, B_K_CONTIGUOUS)
            if READS_TILE and SHARED_TILE:
                if (kstep == KSTEPS // 2) & (local > 0):  # (the first was asked for before the loop)
                    tma.store_wait(pendings=0)  # the previous tile has left the buffer
                    _issue_tile(t_desc, t_smem, t_bar, tile, tiles_n, True)
            i += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if SCALED:
            acc = acc * gl.load(scale_ptr)
        if READS_TILE:
            mbarrier.wait(t_bar, local & 1)
            t = t_smem.load(ACC_LAYOUT).to(gl.float32)
            gl.thread_barrier()  # every warp has read t_smem before it is overwritten
            if not SHARED_TILE:
                _issue_tile(t_desc, t_smem, t_bar, tile + step, tiles_n, local + 1 < my_tiles)
            if EPILOGUE == _RELU2_GRAD:
                out = acc * (2.0 * gl.sqrt(t))
            else:
                out = acc + t
        else:
            relu = gl.maximum(acc, 0.0)
            out = relu * relu
        if RECORDS_AMAX:  # (edge tiles hold zeros there)
            row_amax = gl.maximum(row_amax, gl.max(gl.abs(out), axis=1))
        tma.store_wait(pendings=0)  # the previous stores have left the staging tiles
        if WRITES_OUT:
            out_smem.store(out.to(dtype))
        if WRITES_FP8 or WRITES_FP8_T:
            out8 = gl.minimum(gl.maximum(out * gl.load(out8_scale_ptr), -_E4M3_MAX), _E4M3_MAX).to(gl.float8e4nv)
            if WRITES_FP8:
                out8_smem.store(out8)
            if WRITES_FP8_T:
                out8t_smem.permute((1, 0)).store(out8)
        fence_async_shared()
        off_m, off_n = (tile // tiles_n) * BLOCK_M, (tile % tiles_n) * BLOCK_N
        if WRITES_OUT:
            tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_smem)
        if WRITES_FP8:
            tma.async_copy_shared_to_global(out8_desc, [off_m, off_n], out8_smem)
        if WRITES_FP8_T:
            tma.async_copy_shared_to_global(out8t_desc, [off_n, off_m], out8t_smem)
    # the amax's reduction may reuse a staging tile's shared memory that the last stores still read
    tma.store_wait(pendings=0)
    if RECORDS_AMAX:
        gl.atomic_max(amax_ptr, gl.max(row_amax, axis=0))


def supports(a_MK: Tensor, b: Tensor) -> bool:
    """Whether the kernels take these operands: contiguous bf16 on compute capability 9, all dims of b and A's K
    multiples of 8 (TMA's 16-byte rows)."""
    return (a_MK.is_cuda and torch.cuda.get_device_properties(a_MK.device).major == 9
            and a_MK.dtype == b.dtype == torch.bfloat16 and a_MK.is_contiguous() and b.is_contiguous()
            and a_MK.size(1) % 8 == 0 and b.size(0) % 8 == 0 and b.size(1) % 8 == 0)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}


@functools.cache
def _shared_layout(block: tuple[int, int], dtype: torch.dtype = torch.bfloat16):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _descriptor(t: Tensor, block: tuple[int, int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, list(block), _shared_layout(block, t.dtype))


def launch(a_MK: Tensor, b: Tensor, t_MN: Tensor | None, epilogue: int, config: tuple[int, ...] = CONFIG,
           scale: Tensor | None = None, out8_MN: Tensor | None = None, out8_inv_scale: Tensor | None = None,
           out8_NM: Tensor | None = None, amax: Tensor | None = None, writes_out: bool = True) -> Tensor | None:
    """EPILOGUE(a @ B) into a new output (None without writes_out): B = b (K, N), or b.t() for ADD and e4m3
    operands, whose product is scaled by the 0-D `scale` into bf16. out8_MN, out8_NM receive e4m3 copies at
    out8_inv_scale; amax is raised to the output's absolute maximum."""
    fp8 = a_MK.dtype == torch.float8_e4m3fn
    if fp8:
        torch._check(b.dtype == a_MK.dtype and scale is not None and a_MK.is_contiguous() and b.is_contiguous()
                     and a_MK.size(1) % 16 == 0 and b.size(0) % 8 == 0,
                     lambda: "FP8 operands come in pairs, contiguous, K a multiple of 16 and N of 8, with their scale")
    else:
        torch._check(supports(a_MK, b), lambda: "the MLP kernels take contiguous bf16 operands on a Hopper GPU, "
                                                "with K and N multiples of 8 (model.fast.mlp_kernels.supports)")
    torch._check((t_MN is None) == (epilogue == RELU2), lambda: "RELU2 reads no tile; the other epilogues need one")
    copies = [c for c in (out8_MN, out8_NM) if c is not None]
    torch._check(not copies or (epilogue != ADD and out8_inv_scale is not None
                                and all(c.dtype == torch.float8_e4m3fn and c.is_contiguous() for c in copies)),
                 lambda: "only RELU2 and RELU2_GRAD write e4m3 copies, into contiguous e4m3 tensors, with their scale")
    torch._check(writes_out or out8_MN is not None, lambda: "a launch without writes_out must write the (M, N) copy")
    torch._check(amax is None or (amax.dtype == torch.float32 and amax.dim() == 0),
                 lambda: "amax must be a 0-D fp32 tensor")
    b_k_contiguous = epilogue == ADD or fp8
    (M, K), N = a_MK.shape, b.size(0 if b_k_contiguous else 1)
    torch._check(b.size(1 if b_k_contiguous else 0) == K, lambda: f"the weight {tuple(b.shape)} does not take K={K}")
    block_m, block_n, block_k, stages, warps = config
    out_dtype = torch.bfloat16 if fp8 else a_MK.dtype
    # without writes_out the row-major copy's descriptor gives the kernel the output's shape
    out_MN = torch.empty((M, N), dtype=out_dtype, device=a_MK.device) if writes_out else None
    torch._check(out8_MN is None or (out8_MN.shape == (M, N) and N % 16 == 0),
                 lambda: f"the e4m3 copy must be ({M}, {N}), N a multiple of 16 (TMA's 16-byte rows)")
    torch._check(out8_NM is None or (out8_NM.shape == (N, M) and M % 16 == 0),
                 lambda: f"the transposed e4m3 copy must be ({N}, {M}), M a multiple of 16 (TMA's 16-byte rows)")
    placeholder = out_MN if writes_out else out8_MN  # also stands for any pointer the kernel skips
    out_desc = _descriptor(placeholder, (block_m, block_n))
    t_desc = out_desc if t_MN is None else _descriptor(t_MN, (block_m, block_n))
    out8_desc = out_desc if out8_MN is None else _descriptor(out8_MN, (block_m, block_n))
    out8t_desc = out_desc if out8_NM is None else _descriptor(out8_NM, (block_n, block_m))
    b_desc = _descriptor(b, (block_n, block_k) if b_k_contiguous else (block_k, block_n))
    tiles = -(-M // block_m) * -(-N // block_n)
    programs = min(tiles, torch.cuda.get_device_properties(a_MK.device).multi_processor_count)
    # t gets its own buffer where it fits beside the ring and the staging tiles (1 KB left for barriers)
    ring_bytes = stages * (block_m + block_n) * block_k * a_MK.element_size()
    tile_bytes = block_m * block_n * out_dtype.itemsize
    staging_bytes = (tile_bytes if writes_out else 0) + len(copies) * block_m * block_n
    shared_tile = t_MN is not None and ring_bytes + staging_bytes + tile_bytes + 1024 > SMEM_BYTES
    torch._check(not shared_tile or writes_out, lambda: f"config {config}: the ring, the copies' staging tiles and "
                                                        f"the epilogue's tile do not fit in shared memory")
    # the warpgroup MMA's accumulator: warps stacked along M, one instruction spans N and 32 bytes of K
    acc_layout = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                           instr_shape=[16, block_n, 32 // a_MK.element_size()])
    _matmul_kernel[(programs,)](
        _descriptor(a_MK, (block_m, block_k)), b_desc, out_desc, t_desc, placeholder if scale is None else scale,
        out8_desc, out8t_desc, placeholder if out8_inv_scale is None else out8_inv_scale,
        placeholder if amax is None else amax,
        ACC_LAYOUT=acc_layout, KSTEPS=-(-K // block_k), STAGES=stages, EPILOGUE=epilogue,
        B_K_CONTIGUOUS=b_k_contiguous, SHARED_TILE=shared_tile, SCALED=scale is not None, WRITES_OUT=writes_out,
        WRITES_FP8=out8_MN is not None, WRITES_FP8_T=out8_NM is not None, RECORDS_AMAX=amax is not None,
        num_warps=warps)
    return out_MN


@torch.library.custom_op("speedrun::relu2_matmul", mutates_args=())
def relu2_matmul(x_MK: Tensor, w_KN: Tensor) -> Tensor:
    """relu(x @ w)^2 in x's dtype."""
    return launch(x_MK, w_KN, None, RELU2)


@relu2_matmul.register_fake
def _(x_MK: Tensor, w_KN: Tensor) -> Tensor:
    return x_MK.new_empty((x_MK.size(0), w_KN.size(1)))


def _check_h(h_MN: Tensor, M: int, N: int, dtype: torch.dtype) -> None:
    """h must be the forward's contiguous (M, N) output in dtype."""
    torch._check(h_MN.shape == (M, N) and h_MN.dtype == dtype and h_MN.is_contiguous(),
                 lambda: f"h must be the forward's contiguous {dtype} (M, N) = ({M}, {N}) output")


@torch.library.custom_op("speedrun::relu2_matmul_grad", mutates_args=())
def relu2_matmul_grad(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor) -> Tensor:
    """The pre-activation's gradient (grad_y @ w) * 2 sqrt(h)."""
    _check_h(h_MN, grad_y_MK.size(0), w_KN.size(1), grad_y_MK.dtype)
    return launch(grad_y_MK, w_KN, h_MN, RELU2_GRAD)


@relu2_matmul_grad.register_fake
def _(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor) -> Tensor:
    return grad_y_MK.new_empty(h_MN.shape)


@torch.library.custom_op("speedrun::matmul_add", mutates_args=())
def matmul_add(h_MK: Tensor, w_NK: Tensor, r_MN: Tensor) -> Tensor:
    """r + h @ w^T in h's dtype, rounded once, w stored (N, K)."""
    torch._check(r_MN.shape == (h_MK.size(0), w_NK.size(0)) and r_MN.dtype == h_MK.dtype and r_MN.is_contiguous(),
                 lambda: "the residual must be a contiguous (M, N) tensor in h's dtype")
    return launch(h_MK, w_NK, r_MN, ADD)


@matmul_add.register_fake
def _(h_MK: Tensor, w_NK: Tensor, r_MN: Tensor) -> Tensor:
    return h_MK.new_empty(r_MN.shape)


@torch.library.custom_op("speedrun::relu2_matmul_fp8", mutates_args=())
def relu2_matmul_fp8(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    """(h, h * h_inv_scale in e4m3), h = relu(scale * x8 @ w8^T)^2 in bf16, w8 stored (N, K)."""
    h8_MN = x8_MK.new_empty((x8_MK.size(0), w8_NK.size(0)))
    return launch(x8_MK, w8_NK, None, RELU2, FP8_CONFIG, scale, h8_MN, h_inv_scale), h8_MN


@relu2_matmul_fp8.register_fake
def _(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    shape = (x8_MK.size(0), w8_NK.size(0))
    return x8_MK.new_empty(shape, dtype=torch.bfloat16), x8_MK.new_empty(shape)


@torch.library.custom_op("speedrun::relu2_matmul_fp8_t", mutates_args=())
def relu2_matmul_fp8_t(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor,
                       h_inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """relu2_matmul_fp8's outputs and the e4m3 copy transposed, (N, M), for a product over the tokens."""
    (M, _), N = x8_MK.shape, w8_NK.size(0)
    h8_MN, h8_NM = x8_MK.new_empty((M, N)), x8_MK.new_empty((N, M))
    return launch(x8_MK, w8_NK, None, RELU2, FP8_CONFIG, scale, h8_MN, h_inv_scale, h8_NM), h8_MN, h8_NM


@relu2_matmul_fp8_t.register_fake
def _(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    (M, _), N = x8_MK.shape, w8_NK.size(0)
    return x8_MK.new_empty((M, N), dtype=torch.bfloat16), x8_MK.new_empty((M, N)), x8_MK.new_empty((N, M))


@torch.library.custom_op("speedrun::relu2_matmul_grad_fp8", mutates_args=("amax",))
def relu2_matmul_grad_fp8(grad_y8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_MN: Tensor,
                          amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """relu2_matmul_grad of e4m3 operands (w8 stored (N, K)) as e4m3 copies at amax's delayed scale: (g8 (M, N),
    g8 (N, M), their scale). amax then holds this gradient's absolute maximum."""
    _check_h(h_MN, grad_y8_MK.size(0), w8_NK.size(0), torch.bfloat16)
    g_scale = delayed_scale(amax)
    amax.zero_()  # after the scale is read: the kernel raises it from 0
    g8_MN = h_MN.new_empty(h_MN.shape, dtype=torch.float8_e4m3fn)
    g8_NM = h_MN.new_empty(h_MN.shape[::-1], dtype=torch.float8_e4m3fn)
    launch(grad_y8_MK, w8_NK, h_MN, RELU2_GRAD, FP8_CONFIG, scale, out8_MN=g8_MN, out8_inv_scale=1 / g_scale,
           out8_NM=g8_NM, amax=amax, writes_out=False)
    return g8_MN, g8_NM, g_scale


@relu2_matmul_grad_fp8.register_fake
def _(grad_y8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_MN: Tensor, amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return (h_MN.new_empty(h_MN.shape, dtype=torch.float8_e4m3fn),
            h_MN.new_empty(h_MN.shape[::-1], dtype=torch.float8_e4m3fn), amax.new_empty(()))


@torch.library.custom_op("speedrun::matmul_add_fp8", mutates_args=())
def matmul_add_fp8(h8_MK: Tensor, w8_NK: Tensor, scale: Tensor, r_MN: Tensor) -> Tensor:
    """r + scale * h8 @ w8^T in bf16, rounded once, w8 stored (N, K)."""
    torch._check(r_MN.shape == (h8_MK.size(0), w8_NK.size(0)) and r_MN.dtype == torch.bfloat16
                 and r_MN.is_contiguous(), lambda: "the residual must be a contiguous bf16 (M, N) tensor")
    return launch(h8_MK, w8_NK, r_MN, ADD, FP8_CONFIG, scale)


@matmul_add_fp8.register_fake
def _(h8_MK: Tensor, w8_NK: Tensor, scale: Tensor, r_MN: Tensor) -> Tensor:
    return r_MN.new_empty(r_MN.shape)
