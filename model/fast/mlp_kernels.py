"""Gluon kernels of the MLP (model/layers.py, ReLU2MLP) on Hopper GPUs: its three products that make or read the
(tokens x hidden) tensor, each with the step after it in the product's epilogue.

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

Where the ring, the output's tile and the epilogue's tile (h, or the residual) do not fit in shared memory together,
as with 128 x 256 tiles in 3 stages, the epilogue's tile lands in the output's buffer (SHARED_TILE). Each tile's t
is then asked for halfway through its products, once the store of the tile before has left the buffer. Why larger
tiles: the training step runs at the H200's power limit, and a 128 x 256 tile reads a quarter fewer operand bytes
per product. Alone at the limit (bench/results/power_mlp_tiles_1xH200_*.json, bench/power.py --tiles), with results
equal to CONFIG's bit for bit:
- matmul_add took 0.3509 ms against CONFIG's 0.3646;
- the forward took 0.3926 against 0.4022;
- the backward took 0.4554 against 0.4549.
In the step, with the forward and matmul_add at 128 x 256 (93c851b, reverted), five same-machine pairs showed no
gain beyond the noise (-0.8 ms/step, standard error 1.2), so CONFIG stays for all three.

The third kernel, matmul_add, is the MLP's second product with the residual stream's add in its epilogue: out = r +
h @ W2^T, r's tile asked for by TMA as the backward's h is, the weight read as stored, (D, F) (B_K_CONTIGUOUS).
Before it, cuBLAS's product wrote the MLP's output and an inductor kernel read it back with r to write their sum:
0.3338 ms per call (the product alone 0.2893), against 0.3109 here (bench/results/mlp_add_1xH200.json, CUDA graphs;
88 calls per step). Its sum is rounded once, not the product first. One kernel serves all three (_matmul_kernel,
EPILOGUE).

The forward's two products also run on e4m3 operands (relu2_matmul_fp8 and matmul_add_fp8; model/fp8.py says why):
the same kernel with 128 bytes of K per operand row, W1 stored (F, D) as the 8-bit warpgroup MMA reads only K-major
operands (W2 already is), and the scales' product applied to the accumulator before the epilogue. The first writes
h twice, in bf16 for the backward and in e4m3 for the second product, scaled by a bound that model/fp8.relu2_scale
takes from W1: its ring, output tile and e4m3 tile take 208 KB. At the power limit the first took 0.243 ms against
the bf16 kernel's 0.405 (bench/results/mlp_fp8_1xH200.json, before it wrote the e4m3 copy). In the step,
--fp8_forward (these two and attention's qkv) took 27.0 ms less than bf16 once the second product joined, 19.5-19.8
before (bench/results/README.md, pairs on one machine each).

With --fp8_backward (on by default) two more forms write e4m3 copies for the backward's FP8 products (ReLU2MLP): the
forward's first product also writes h's copy transposed (relu2_matmul_fp8_t), and the backward's first product
writes the pre-activation's gradient only as e4m3 copies, row-major and transposed, at a delayed scale, recording
its amax (relu2_matmul_grad_fp8); it reads e4m3 copies of the output's gradient and of W2, as the forward's products
do theirs. Both keep the ring's 5 stages (FP8_CONFIG): the transposed copy is stored from the accumulator's layout
through a transposed view of its staging tile. Measured alone
(bench/results/mlp_fp8_backward_kernels_1xH200_2f3283f.json, CUDA graphs, idle GPU): relu2_matmul_fp8_t 0.350 ms
against relu2_matmul_fp8's 0.281, relu2_matmul_grad_fp8 (then on bf16 operands) 0.495 against the bf16
relu2_matmul_grad's 0.399; on e4m3 operands 0.349 and 0.365 against 0.404 and 0.402, on two machines
(mlp_fp8_backward_kernels_1xH200_80b43ce.json, _8c60c3c.json). Two forms measured slower on one machine
(bench/results/README.md, 2f3283f's section): an atomic max of the amax at every tile (the kernel writing the
row-major copy and the amax took 0.578 ms, against 0.391 when each program keeps its rows' maxima across its tiles
and adds one atomic at its end), and a transposed copy whose layout changes in registers before its store, which
passes through shared memory and so cost a stage of the ring (relu2_matmul_grad_fp8 0.544 ms, against 0.464 this
way).

These are torch.library custom ops: torch.compile cannot trace Gluon kernels (its user-kernel support
rewrites Triton source), so inductor calls them as opaque kernels. They run on compute capability 9 only (the
warpgroup MMA is Hopper's); elsewhere ReLU2MLP runs the torch ops (supports()).

Shape legend: M tokens, K the product's inner dim, N its output dim (forward: K model dim, N hidden dim; matmul_add
the other way round).
"""
import functools

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from model.fp8 import E4M3_MAX, delayed_scale

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), the fastest for both directions of 8 in
# bench/results/mlp_gluon_1xH200.json, and for matmul_add of 4 in bench/results/mlp_add_1xH200.json: 5 stages of
# 128 x 64 and 64 x 128 operand tiles, one output and one h (or residual) tile take 224 KB of the SM's 227 KB of
# shared memory
CONFIG = (128, 128, 64, 5, 4)
# for e4m3 operands: 128 bytes of K per row as above, the fastest of 9 for relu2_matmul_fp8 in
# bench/results/mlp_fp8_1xH200.json (0.209 ms against 0.215-0.269), and for matmul_add_fp8 within 0.3 us of the
# fastest of 12 in bench/results/mlp_fp8_second_1xH200.json (0.1791 ms; the same tiles with 8 warps 0.1788, the
# others 0.1887-0.2735; the bf16 matmul_add 0.3085)
FP8_CONFIG = (128, 128, 128, 5, 4)
SMEM_BYTES = 227 * 1024  # shared memory a block may opt into on compute capability 9.0 (CUDA C++ Programming Guide)


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
def _issue_tile(t_desc, t_smem, t_bar, tile, tiles_n, pred):
    """The TMA load of the t tile (h, or the residual) of output tile `tile` into t_smem, if pred."""
    BLOCK_M: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = t_desc.block_type.shape[1]
    mbarrier.expect(t_bar, t_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(t_desc, [(tile // tiles_n) * BLOCK_M, (tile % tiles_n) * BLOCK_N], t_bar, t_smem,
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


# The kernel's epilogues (launch's `epilogue`): what it makes of the product acc = A @ B and, in the last two, of a
# tile t of a fourth tensor
RELU2 = 0  # relu(acc)^2: the MLP's hidden h
RELU2_GRAD = 1  # acc * 2 sqrt(t), t = h: the pre-activation's gradient
ADD = 2  # acc + t, t = the residual stream: the MLP's output added to it
_RELU2, _RELU2_GRAD = gl.constexpr(RELU2), gl.constexpr(RELU2_GRAD)  # as the kernel reads them (globals are constexpr)
_E4M3_MAX = gl.constexpr(E4M3_MAX)


@gluon.jit
def _matmul_kernel(a_desc, b_desc, out_desc, t_desc, scale_ptr, out8_desc, out8t_desc, out8_scale_ptr, amax_ptr,
                   ACC_LAYOUT: gl.constexpr, KSTEPS: gl.constexpr, STAGES: gl.constexpr,
                   EPILOGUE: gl.constexpr, B_K_CONTIGUOUS: gl.constexpr, SHARED_TILE: gl.constexpr,
                   SCALED: gl.constexpr, WRITES_OUT: gl.constexpr, WRITES_FP8: gl.constexpr,
                   WRITES_FP8_T: gl.constexpr, RECORDS_AMAX: gl.constexpr):
    """out = EPILOGUE(s * (A @ B)) in out's dtype, s = *scale_ptr with SCALED (FP8 operands' scales), else 1; t_desc
    is read only by the epilogues that take a tile (RELU2_GRAD, ADD). B is (K, N), or (N, K) with B_K_CONTIGUOUS.
    Without WRITES_OUT out_desc only gives the output's shape and nothing is stored there.
    Out's e4m3 copies, out * *out8_scale_ptr (the reciprocal of the copy's scale) saturated at E4M3_MAX, from the
    fp32 result, not from out's rounding: with WRITES_FP8 to out8_desc, (M, N) as out; with WRITES_FP8_T transposed,
    to out8t_desc, (N, M), for a later product that contracts over M (Hopper's 8-bit MMA reads only K-major
    operands). With RECORDS_AMAX the kernel raises *amax_ptr (fp32) to out's absolute maximum, for the next call's
    scale.
    Tiles past an edge read zeros and store nothing there (TMA).
    With SHARED_TILE the t tile lands in the output's buffer, where shared memory holds no second tile beside the
    ring: each tile's t is then asked for halfway through its products, once the tile before has left the buffer."""
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
    if WRITES_FP8_T:  # a (BLOCK_N, BLOCK_M) tile, filled through its transposed view
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
    if RECORDS_AMAX:  # each row's amax over this program's tiles, reduced and added atomically once, at the end
        row_amax = gl.zeros((BLOCK_M, ), dtype=gl.float32, layout=gl.SliceLayout(1, ACC_LAYOUT))
    i = 0
    # the epilogue sits between two loops, not in a branch of one: across a branch ptxas cannot see that the
    # accumulator is complete, and it waited for every product at each k-step (its warning C7517)
    for local in range(my_tiles):
        tile = start + local * step
        for kstep in range(KSTEPS):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            if B_K_CONTIGUOUS:  # the (N, K) tile read as (K, N): the MMA reads shared memory either way
                b_tile = b_bufs.index(slot).permute((1, 0))
            else:
                b_tile = b_bufs.index(slot)
            acc = warpgroup_mma(a_bufs.index(slot), b_tile, acc, use_acc=kstep != 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))  # the previous product is done: its slot is free
            _issue_loads(a_desc, b_desc, a_bufs, b_bufs, ready, i + STAGES - 1, total, start, step, tiles_n, KSTEPS,
                         STAGES, B_K_CONTIGUOUS)
            if READS_TILE and SHARED_TILE:
                if (kstep == KSTEPS // 2) & (local > 0):  # (the first tile's t was asked for before the loop)
                    tma.store_wait(pendings=0)  # the tile before has left the buffer during these products
                    _issue_tile(t_desc, t_smem, t_bar, tile, tiles_n, True)
            i += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        if SCALED:
            acc = acc * gl.load(scale_ptr)
        if READS_TILE:
            mbarrier.wait(t_bar, local & 1)
            t = t_smem.load(ACC_LAYOUT).to(gl.float32)
            gl.thread_barrier()  # every warp has read t_smem before it is overwritten (by the next t, or by out)
            if not SHARED_TILE:
                _issue_tile(t_desc, t_smem, t_bar, tile + step, tiles_n, local + 1 < my_tiles)
            if EPILOGUE == _RELU2_GRAD:
                out = acc * (2.0 * gl.sqrt(t))
            else:
                out = acc + t
        else:
            relu = gl.maximum(acc, 0.0)
            out = relu * relu
        if RECORDS_AMAX:  # (tiles past an edge hold zeros there: the operands' padding)
            row_amax = gl.maximum(row_amax, gl.max(gl.abs(out), axis=1))
        tma.store_wait(pendings=0)  # the previous tile's stores have left the staging tiles
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
    # before the amax's cross-warp reduction, whose shared-memory scratch the compiler may place over a staging tile
    # that the last stores still read (it sat in a ring slot, compiled for sm_90 with Triton 3.6)
    tma.store_wait(pendings=0)
    if RECORDS_AMAX:
        gl.atomic_max(amax_ptr, gl.max(row_amax, axis=0))


def supports(a_MK: Tensor, b: Tensor) -> bool:
    """Whether the kernels take these operands: contiguous bf16 on a Hopper GPU (compute capability 9), with every
    dimension of the weight b ((K, N), or (N, K) for ADD) and A's K a multiple of 8 (TMA wants 16-byte aligned
    rows)."""
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
    """The kernel on new output, EPILOGUE(a @ B): B = b (K, N) for RELU2 and RELU2_GRAD, B = b.t() for ADD (b is
    then the (N, K) weight as stored); t_MN is the epilogue's tile source (None for RELU2). config as CONFIG.
    FP8 (e4m3) operands: b is always (N, K), as the warpgroup MMA reads 8-bit operands only K-major, the product is
    multiplied by the 0-D fp32 `scale` (their scales' product) and the output is bf16. The output's e4m3 copies, the
    fp32 output times the 0-D fp32 out8_inv_scale, saturated (RELU2 and RELU2_GRAD): into out8_MN, and transposed
    into out8_NM. With amax (0-D fp32) the kernel raises it to the output's absolute maximum. Without writes_out
    only the copies are written, and launch returns None."""
    fp8 = a_MK.dtype == torch.float8_e4m3fn
    if fp8:
        torch._check(b.dtype == a_MK.dtype and scale is not None and a_MK.is_contiguous() and b.is_contiguous()
                     and a_MK.size(1) % 16 == 0 and b.size(0) % 8 == 0,
                     lambda: "FP8 operands come in pairs, contiguous, K a multiple of 16 and N of 8, with their scale")
    else:
        torch._check(supports(a_MK, b), lambda: "the MLP kernels take contiguous bf16 operands on a Hopper GPU, "
                                                "with K and N multiples of 8 (model.mlp_kernels.supports)")
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
    # without writes_out no output is allocated (302 MB at the record's shape): the row-major copy's descriptor
    # gives the kernel its shape
    out_MN = torch.empty((M, N), dtype=out_dtype, device=a_MK.device) if writes_out else None
    torch._check(out8_MN is None or (out8_MN.shape == (M, N) and N % 16 == 0),
                 lambda: f"the e4m3 copy must be ({M}, {N}), N a multiple of 16 (TMA's 16-byte rows)")
    torch._check(out8_NM is None or (out8_NM.shape == (N, M) and M % 16 == 0),
                 lambda: f"the transposed e4m3 copy must be ({N}, {M}), M a multiple of 16 (TMA's 16-byte rows)")
    placeholder = out_MN if writes_out else out8_MN  # the tensor behind out_desc, and any pointer the kernel skips
    out_desc = _descriptor(placeholder, (block_m, block_n))
    t_desc = out_desc if t_MN is None else _descriptor(t_MN, (block_m, block_n))
    out8_desc = out_desc if out8_MN is None else _descriptor(out8_MN, (block_m, block_n))
    out8t_desc = out_desc if out8_NM is None else _descriptor(out8_NM, (block_n, block_m))
    b_desc = _descriptor(b, (block_n, block_k) if b_k_contiguous else (block_k, block_n))
    tiles = -(-M // block_m) * -(-N // block_n)
    programs = min(tiles, torch.cuda.get_device_properties(a_MK.device).multi_processor_count)
    # the epilogue's tile gets a buffer of its own where the ring, the staging tiles and it fit (1 KB left for the
    # barriers), else it shares the output's
    ring_bytes = stages * (block_m + block_n) * block_k * a_MK.element_size()
    tile_bytes = block_m * block_n * out_dtype.itemsize
    staging_bytes = (tile_bytes if writes_out else 0) + len(copies) * block_m * block_n
    shared_tile = t_MN is not None and ring_bytes + staging_bytes + tile_bytes + 1024 > SMEM_BYTES
    torch._check(not shared_tile or writes_out, lambda: f"config {config}: the ring, the copies' staging tiles and "
                                                        f"the epilogue's tile do not fit in shared memory")
    # the accumulator as the warpgroup MMA leaves it: warps stacked along M, one instruction spanning the tile's N
    # and 32 bytes of K
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
    """relu(x @ w)^2 in x's dtype: model.layers.relu2_matmul."""
    return launch(x_MK, w_KN, None, RELU2)


@relu2_matmul.register_fake
def _(x_MK: Tensor, w_KN: Tensor) -> Tensor:
    return x_MK.new_empty((x_MK.size(0), w_KN.size(1)))


def _check_h(h_MN: Tensor, M: int, N: int, dtype: torch.dtype) -> None:
    """The backward kernels' h: the forward's contiguous (M, N) output, in dtype (bf16 for the FP8 kernel, whose
    operands are e4m3; grad_y's otherwise)."""
    torch._check(h_MN.shape == (M, N) and h_MN.dtype == dtype and h_MN.is_contiguous(),
                 lambda: f"h must be the forward's contiguous {dtype} (M, N) = ({M}, {N}) output")


@torch.library.custom_op("speedrun::relu2_matmul_grad", mutates_args=())
def relu2_matmul_grad(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor) -> Tensor:
    """The pre-activation's gradient (grad_y @ w) * 2 sqrt(h): model.layers.relu2_matmul_grad."""
    _check_h(h_MN, grad_y_MK.size(0), w_KN.size(1), grad_y_MK.dtype)
    return launch(grad_y_MK, w_KN, h_MN, RELU2_GRAD)


@relu2_matmul_grad.register_fake
def _(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor) -> Tensor:
    return grad_y_MK.new_empty(h_MN.shape)


@torch.library.custom_op("speedrun::matmul_add", mutates_args=())
def matmul_add(h_MK: Tensor, w_NK: Tensor, r_MN: Tensor) -> Tensor:
    """r + h @ w^T in h's dtype, rounded once, w stored (N, K): model.layers.matmul_add."""
    torch._check(r_MN.shape == (h_MK.size(0), w_NK.size(0)) and r_MN.dtype == h_MK.dtype and r_MN.is_contiguous(),
                 lambda: "the residual must be a contiguous (M, N) tensor in h's dtype")
    return launch(h_MK, w_NK, r_MN, ADD)


@matmul_add.register_fake
def _(h_MK: Tensor, w_NK: Tensor, r_MN: Tensor) -> Tensor:
    return h_MK.new_empty(r_MN.shape)


@torch.library.custom_op("speedrun::relu2_matmul_fp8", mutates_args=())
def relu2_matmul_fp8(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    """h = relu(scale * x8 @ w8^T)^2 in bf16 and h * h_inv_scale in e4m3, for e4m3 operands, w8 stored (N, K):
    model.layers.relu2_matmul_fp8."""
    h8_MN = x8_MK.new_empty((x8_MK.size(0), w8_NK.size(0)))
    return launch(x8_MK, w8_NK, None, RELU2, FP8_CONFIG, scale, h8_MN, h_inv_scale), h8_MN


@relu2_matmul_fp8.register_fake
def _(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    shape = (x8_MK.size(0), w8_NK.size(0))
    return x8_MK.new_empty(shape, dtype=torch.bfloat16), x8_MK.new_empty(shape)


@torch.library.custom_op("speedrun::relu2_matmul_fp8_t", mutates_args=())
def relu2_matmul_fp8_t(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor,
                       h_inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """relu2_matmul_fp8's h and e4m3 copy, and that copy transposed, (N, M), for the backward's product that
    contracts over the tokens: model.layers.relu2_matmul_fp8_t."""
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
    """relu2_matmul_grad of e4m3 operands, w8 stored (N, K), their scales' product `scale`, written only as e4m3
    copies, (M, N) and transposed (N, M), at the scale of amax (model.fp8.delayed_scale), which the kernel then sets
    to this gradient's absolute maximum: (g8, g8 transposed, the copies' scale). model.layers.relu2_matmul_grad_fp8."""
    _check_h(h_MN, grad_y8_MK.size(0), w8_NK.size(0), torch.bfloat16)
    g_scale = delayed_scale(amax)
    amax.zero_()  # after the scale is read: the kernel's programs raise it from 0
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
    """r + scale * h8 @ w8^T in r's dtype (bf16), rounded once, for e4m3 operands, w8 stored (N, K):
    model.layers.matmul_add_fp8."""
    torch._check(r_MN.shape == (h8_MK.size(0), w8_NK.size(0)) and r_MN.dtype == torch.bfloat16
                 and r_MN.is_contiguous(), lambda: "the residual must be a contiguous bf16 (M, N) tensor")
    return launch(h8_MK, w8_NK, r_MN, ADD, FP8_CONFIG, scale)


@matmul_add_fp8.register_fake
def _(h8_MK: Tensor, w8_NK: Tensor, scale: Tensor, r_MN: Tensor) -> Tensor:
    return r_MN.new_empty(r_MN.shape)
