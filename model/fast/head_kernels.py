"""Triton kernels of the head loss (model/fast/head.py's HeadLoss, whose torch functions are the references): per
row, one pass over the vocabulary for lse and loss and, in training, a second one, mostly from L2, storing the unit
gradient (softmax - onehot) * tanh'. tanh is PTX's tanh.approx, one MUFU operation with an error far below bf16's
rounding. Configurations are fixed: autotuning would lengthen the cold compile.

Shape legend: N tokens, V vocab.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from model.fast.launch import launcher
from model.fast.transpose_kernels import transposed_launch

_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x log2(e)), exp2 being native
_IGNORE_INDEX = tl.constexpr(-100)  # model.gpt.IGNORE_INDEX

# softcap and V are constexpr: a runtime float reaches the kernel as fp64, and a fixed V fixes the loop's trip
# count (a runtime bound fails in triton 3.6's interpreter, triton-lang/triton#9171).
# chunks of 2,048, one 16-byte load per thread of 8 warps: among the fastest tried
_FORWARD_BLOCK_V, _FORWARD_WARPS = 2048, 8


# the interpreter (TRITON_INTERPRET=1) runs no inline PTX: there tanh comes from exp2
_TANH_ON_MUFU = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _tanh_of(logits, softcap):
    """t = tanh(l / c) in fp32, from which z = c t and tanh' = 1 - t^2."""
    u = logits.to(tl.float32) * (1.0 / softcap)
    if _TANH_ON_MUFU:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:  # 1 - 2 / (exp(2|u|) + 1): never inf / inf
        t = 1.0 - 2.0 / (tl.exp2(tl.abs(u) * (2.0 * _LOG2E)) + 1.0)
        return tl.where(u < 0, -t, t)


@triton.jit
def _row_lse_and_loss(row_ptr, targets_ptr, lse_ptr, loss_ptr, row, softcap: tl.constexpr, V: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """One pass over the logits at row_ptr: stores the row's lse and loss, returns (lse, target, ignored)."""
    # exp(z - c) = exp(c (t - 1)), summed lane-wise, reduced once
    sum_V = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols_V = start + tl.arange(0, BLOCK_V)
        inside_V = cols_V < V
        t_V = _tanh_of(tl.load(row_ptr + cols_V, mask=inside_V, other=0.0), softcap)
        sum_V += tl.where(inside_V, tl.exp2((t_V - 1.0) * (_LOG2E * softcap)), 0.0)
    lse = softcap + tl.log(tl.sum(sum_V, axis=0))
    target = tl.load(targets_ptr + row)
    ignored = target == _IGNORE_INDEX
    z_target = _tanh_of(tl.load(row_ptr + tl.where(ignored, 0, target)), softcap) * softcap
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - z_target))
    return lse, target, ignored


@triton.jit
def _forward_kernel(logits_ptr, targets_ptr, lse_ptr, loss_ptr, u_ptr, softcap: tl.constexpr, V: tl.constexpr,
                    BLOCK_V: tl.constexpr, GRAD: tl.constexpr, U_SCALE: tl.constexpr):
    """lse and loss of one row; with GRAD, U_SCALE times the unit gradient (0 where ignored) into u_ptr."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * V  # N x V passes 2^31 at the training size
    lse, target, ignored = _row_lse_and_loss(row_ptr, targets_ptr, lse_ptr, loss_ptr, row, softcap, V, BLOCK_V)
    if GRAD:
        # the row is mostly still in L2
        scale = tl.where(ignored, 0.0, U_SCALE)
        u_row_ptr = u_ptr + row.to(tl.int64) * V
        for start in range(0, V, BLOCK_V):
            cols_V = start + tl.arange(0, BLOCK_V)
            inside_V = cols_V < V
            t_V = _tanh_of(tl.load(row_ptr + cols_V, mask=inside_V, other=0.0), softcap)
            probs_V = tl.exp2((t_V * softcap - lse) * _LOG2E)
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
    """(lse_N, loss_N) in fp32 from one launch, which also fills u_NV if given."""
    _check(logits_NV, targets_N)
    N, V = logits_NV.shape
    lse_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    loss_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    # without u_NV, lse_N stands in for the pointer the kernel does not write
    launcher(_forward_kernel)[(N,)](logits_NV, targets_N, lse_N, loss_N, lse_N if u_NV is None else u_NV, softcap,
                                       V=V, BLOCK_V=_FORWARD_BLOCK_V, GRAD=u_NV is not None, U_SCALE=u_scale,
                                       num_warps=_FORWARD_WARPS)
    return lse_N, loss_N


@triton_op("speedrun::head_lse_and_loss", mutates_args=())
def lse_and_loss(logits_NV: Tensor, targets_N: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """(lse_N, loss_N) in fp32, in one read of the logits."""
    return _forward(logits_NV, targets_N, softcap)


@triton_op("speedrun::head_loss_and_unit_grad", mutates_args=())
def loss_and_unit_grad(logits_NV: Tensor, targets_N: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """(loss_N, u_NV): the loss and the unit gradient in the logits' dtype."""
    u_NV = torch.empty_like(logits_NV)
    return _forward(logits_NV, targets_N, softcap, u_NV)[1], u_NV


@triton_op("speedrun::head_loss_and_unit_grad_fp8", mutates_args=())
def loss_and_unit_grad_fp8(logits_NV: Tensor, targets_N: Tensor, softcap: float, u_scale: float
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss_N, u8_NV, u8t_VN): the loss and u_scale times the unit gradient in e5m2, row-major and transposed."""
    u8_NV = torch.empty(logits_NV.shape, dtype=torch.float8_e5m2, device=logits_NV.device)
    loss_N = _forward(logits_NV, targets_N, softcap, u8_NV, u_scale)[1]
    return loss_N, u8_NV, transposed_launch(u8_NV)
