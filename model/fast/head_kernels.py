"""Triton kernels of the head loss (model/head.py, HeadLoss) on CUDA: one forward kernel (which also writes the
logits' unit gradient when a backward will follow) and, for FP8, one transpose.

Compiled by inductor from torch ops, the head loss took 2.7 ms (forward) + 7.7 ms (backward) per 49,152 x 50,304
micro-batch on the H200 (bench/results/README.md) for ~15 GB of traffic, ~3.1 ms at 4.8 TB/s. These kernels read
the bf16 logits from HBM once and write the gradient once per layout:

- `lse_and_loss` (validation, and whatever runs without grad): one program per token row, one pass over the
  vocabulary (the capped logits z lie in [-c, c], so sum(exp(z - c)) needs no running maximum:
  model.head.bounded_logsumexp).
- `loss_and_unit_grad` / `loss_and_unit_grad_fp8` (training): the same pass, then a second pass over the same row,
  which it re-reads mostly from L2, storing the unit gradient (softmax - onehot) * tanh' row-major. The upstream
  gradient is one factor per token row; HeadLoss.backward applies it to the matrix products' other operand or
  output, so the (tokens x vocab) gradient is complete when the forward ends and the backward reads no logits.
  torch._scaled_mm wants its first operand row-major, so grad_x = u8_NV @ W and grad_w = u8t_VN @ x each need
  their own layout: the FP8 version then transposes its e5m2 output in a second kernel
  (model/transpose_kernels.py).
- Measured per micro-batch on the H200: the forward with the e5m2 gradient 3.08 ms and the transpose 1.31, against
  1.48 for the forward alone plus 3.74 for the backward kernels this replaced, which read the logits again (a
  32 x 256-tile gradient writer and the same transpose; bench/results/head_fused_scratch_1xH200_756a0f8.json, a
  scratch script against 756a0f8's kernels). The e5m2 bits are those kernels' for the uniform upstream gradient of
  a mean loss (head_bits_1xH200_b613f20_vs_756a0f8.txt). Earlier, one kernel storing each tile in both layouts
  took 7.6-10.8 ms at six tile shapes (head_kernels_1xH200_8ab2f99.json).

The softcap z = c tanh(l / c) takes one special-function (MUFU) operation, PTX's tanh.approx.f32 (sm_75 and later;
the bf16 model needs sm_80 anyway), and the softmax's exp2 one more: two per element, where the exp2 and division of
tanh's sigmoid form made three. At the H200's 16 per SM per clock, three took ~1.8 ms per micro-batch and held the
forward at 1.92 ms against its ~1 ms of memory traffic; with two, the forward took 1.33 ms and the FP8 backward's
first kernel 2.20 ms instead of 3.08 (bench/results/head_math_1xH200.json), and the whole step 700.1 ms instead of
716.4 on one machine (bench/results/README.md). tanh.approx's largest relative error is 1.1e-5, measured there over
every fp32 from 2^-10 to 9.1 (as N. Juffa found for the instruction on Turing, NVIDIA developer forums, 2021): z is
off by at most 1.7e-4 and tanh' = 1 - tanh^2 by at most 1.3e-5 of its bound of 1 (measured), far below the bf16
rounding of the logits and the e5m2 rounding of the gradient. On the bench's logits the loss moved by 3.5e-6 on
average against fp64 (the sigmoid form: 3.9e-7). The Triton interpreter runs no PTX: there, tanh is computed from
exp2 in fp32.

Each function is a torch.library.triton_op: it runs as a plain kernel launch in eager mode, and torch.compile
(HeadLoss runs inside the compiled Head) sees the kernels themselves. Launch configurations are fixed: autotuning
would lengthen the cold compile, a product goal (bench/results/README.md). This module imports triton; model/head.py
imports it only where triton is installed, and with TRITON_INTERPRET=1 the kernels run on CPU tensors
(tests/test_head_kernels.py).

Shape legend: N tokens, V vocab.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from model.transpose_kernels import transposed_launch

_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x log2(e)): exp2 is the GPU's native instruction
_IGNORE_INDEX = tl.constexpr(-100)  # model.head.IGNORE_INDEX

# The softcap is a compile-time constant too: passed as a runtime float, inductor hands it to the kernel as fp64
# and the forward's fp32 accumulator turned fp64 (a Triton compile error on the H200).
# The vocabulary size is a compile-time constant (one model, one V): the forward's loop has a fixed trip count.
# (It also keeps triton 3.6's interpreter off a runtime loop bound, which fails with numpy >= 2.4:
# triton-lang/triton#9171.)
# Forward: one program per row walks the vocabulary in chunks of 2,048: 8 elements (one 16-byte bf16 load) per
# thread of 8 warps; 50,304 = 24.6 chunks, so the masked tail wastes under 2% of the work. With the e5m2 gradient's
# second pass, two sweeps on two machines (bench/results/head_fused_scratch_1xH200_756a0f8.json, then
# head_kernels_1xH200_b613f20.json) gave 2.94 and 2.98 ms for chunks of 4,096 x 8 warps, 3.05 and 2.96 for 2,048 x 4,
# 3.08 and 3.17 for 2,048 x 8, and up to 5.3 for the others. 2,048 x 8 sums in the order of the kernels it replaced,
# so the loss and the e5m2 gradient keep their bits and the loss curves measured before this change still hold.
_FORWARD_BLOCK_V, _FORWARD_WARPS = 2048, 8


# The interpreter (TRITON_INTERPRET=1, CPU tests) cannot run inline PTX. triton.jit asks this knob (which reads the
# variable) whether to interpret when it decorates the kernels, so the two always agree.
_TANH_ON_MUFU = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _tanh_of(logits, softcap):
    """t = tanh(l / c) in fp32, from which z = c t and tanh' = 1 - t^2."""
    u = logits.to(tl.float32) * (1.0 / softcap)
    if _TANH_ON_MUFU:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:  # 1 - 2 / (exp(2|u|) + 1): within fp32's rounding of 1 (~1e-7) and never inf / inf
        t = 1.0 - 2.0 / (tl.exp2(tl.abs(u) * (2.0 * _LOG2E)) + 1.0)
        return tl.where(u < 0, -t, t)


@triton.jit
def _row_lse_and_loss(row_ptr, targets_ptr, lse_ptr, loss_ptr, row, softcap: tl.constexpr, V: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """One pass over the logits at row_ptr: stores the row's lse and loss, returns (lse, target, ignored)."""
    # exp(z - c) = exp(c (t - 1)), summed lane-wise and reduced once at the end
    sum_V = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols_V = start + tl.arange(0, BLOCK_V)
        inside_V = cols_V < V
        t_V = _tanh_of(tl.load(row_ptr + cols_V, mask=inside_V, other=0.0), softcap)
        sum_V += tl.where(inside_V, tl.exp2((_LOG2E * softcap) * (t_V - 1.0)), 0.0)
    lse = softcap + tl.log(tl.sum(sum_V, axis=0))
    target = tl.load(targets_ptr + row)
    ignored = target == _IGNORE_INDEX
    z_target = softcap * _tanh_of(tl.load(row_ptr + tl.where(ignored, 0, target)), softcap)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - z_target))
    return lse, target, ignored


@triton.jit
def _forward_kernel(logits_ptr, targets_ptr, lse_ptr, loss_ptr, u_ptr, softcap: tl.constexpr, V: tl.constexpr,
                    BLOCK_V: tl.constexpr, GRAD: tl.constexpr, U_SCALE: tl.constexpr):
    """lse and loss of one row; with GRAD, a second pass over the row stores U_SCALE times the unit gradient
    (softmax(z) - onehot) * tanh' (0 where ignored) in u_ptr's dtype (else u_ptr is not written)."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * V  # N x V passes 2^31 at the training size
    lse, target, ignored = _row_lse_and_loss(row_ptr, targets_ptr, lse_ptr, loss_ptr, row, softcap, V, BLOCK_V)
    if GRAD:
        # the row was read a moment ago: most of this pass reads it from L2, not HBM
        scale = tl.where(ignored, 0.0, U_SCALE)
        u_row_ptr = u_ptr + row.to(tl.int64) * V
        for start in range(0, V, BLOCK_V):
            cols_V = start + tl.arange(0, BLOCK_V)
            inside_V = cols_V < V
            t_V = _tanh_of(tl.load(row_ptr + cols_V, mask=inside_V, other=0.0), softcap)
            probs_V = tl.exp2(_LOG2E * (softcap * t_V - lse))
            onehot_V = (cols_V == target).to(tl.float32)
            u_V = (probs_V - onehot_V) * (1.0 - t_V * t_V) * scale
            tl.store(u_row_ptr + cols_V, u_V.to(u_ptr.dtype.element_ty), mask=inside_V)


def _check(logits_NV: Tensor, *rows: Tensor) -> None:
    torch._check(logits_NV.dtype in (torch.bfloat16, torch.float32) and logits_NV.is_contiguous(),
                 lambda: f"the head kernels take contiguous bf16/fp32 logits, not {logits_NV.dtype}")
    for t in rows:
        torch._check(t.shape == logits_NV.shape[:1] and t.is_contiguous(), lambda: "one contiguous value per row")


def _forward(logits_NV: Tensor, targets_N: Tensor, softcap: float, u_NV: Tensor | None = None,
             u_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """(lse_N, loss_N) in fp32 from one launch of _forward_kernel; it also fills u_NV when one is given."""
    _check(logits_NV, targets_N)
    N, V = logits_NV.shape
    lse_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    loss_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    # without u_NV, lse_N stands in for the pointer the kernel does not write
    wrap_triton(_forward_kernel)[(N,)](logits_NV, targets_N, lse_N, loss_N, lse_N if u_NV is None else u_NV, softcap,
                                       V=V, BLOCK_V=_FORWARD_BLOCK_V, GRAD=u_NV is not None, U_SCALE=u_scale,
                                       num_warps=_FORWARD_WARPS)
    return lse_N, loss_N


@triton_op("speedrun::head_lse_and_loss", mutates_args=())
def lse_and_loss(logits_NV: Tensor, targets_N: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """(lse_N, loss_N) in fp32: model.head.lse_and_loss in one read of the logits."""
    return _forward(logits_NV, targets_N, softcap)


@triton_op("speedrun::head_loss_and_unit_grad", mutates_args=())
def loss_and_unit_grad(logits_NV: Tensor, targets_N: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """(loss_N, u_NV): the loss and the unit gradient in the logits' dtype: model.head.loss_and_unit_grad."""
    u_NV = torch.empty_like(logits_NV)
    return _forward(logits_NV, targets_N, softcap, u_NV)[1], u_NV


@triton_op("speedrun::head_loss_and_unit_grad_fp8", mutates_args=())
def loss_and_unit_grad_fp8(logits_NV: Tensor, targets_N: Tensor, softcap: float, u_scale: float
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss_N, u8_NV, u8t_VN): the loss and u_scale times the unit gradient in e5m2, row-major and transposed (the
    same bits): model.head.loss_and_unit_grad_fp8."""
    u8_NV = torch.empty(logits_NV.shape, dtype=torch.float8_e5m2, device=logits_NV.device)
    loss_N = _forward(logits_NV, targets_N, softcap, u8_NV, u_scale)[1]
    return loss_N, u8_NV, transposed_launch(u8_NV)
