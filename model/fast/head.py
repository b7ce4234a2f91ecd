"""The LM head's loss without fp32 logits (HeadLoss): the forward reduces the logits, the largest tensor, to one
log-sum-exp per token and in the same pass writes their gradient, which it saves instead (as Cut Cross-Entropy,
Wijmans et al. 2024). On CUDA the pass is model/fast/head_kernels.py's, elsewhere the torch ops below. With `fp8`
the products run in torch._scaled_mm with e4m3 operands and e5m2 gradients.

Shape legend: N tokens (flattened batch), D model dim, V vocab.
"""
from types import SimpleNamespace

import torch
from torch import Tensor

from model.fast import head_kernels
from model.fast.fp8 import fp8_mm, normed_scale, scale_of, to_e4m3
from model.gpt import IGNORE_INDEX, Head, capped, norm, reduce_loss

# The unit gradient lies in [-1, 1]; 2^15 keeps it below e5m2's max of 57,344 and small values above flush-to-zero
GRAD_FP8_SCALE = 2.0 ** 15


def bounded_logsumexp(z_NV: Tensor, softcap: float) -> Tensor:
    """log-sum-exp over the last dim of capped logits z in [-c, c] in one pass: exp(z - c) cannot overflow and
    its sum is at least V e^(-2c), so no running maximum is needed."""
    return softcap + torch.log(torch.exp(z_NV - softcap).sum(dim=-1))


def _col_major(t: Tensor) -> Tensor:
    """The same matrix stored column-major, as torch._scaled_mm's second operand."""
    return t.t().contiguous().t()


def lse_and_loss(logits_NV: Tensor, targets_N: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """(lse_N, loss_N): the capped logits' log-sum-exp and the per-token loss, 0 where ignored."""
    valid_N = targets_N != IGNORE_INDEX
    lse_N = bounded_logsumexp(capped(logits_NV, softcap), softcap)
    target_logit_N = capped(logits_NV.gather(1, torch.where(valid_N, targets_N, 0)[:, None]).squeeze(1), softcap)
    return lse_N, torch.where(valid_N, lse_N - target_logit_N, 0.0)


def unit_grad(logits_NV: Tensor, lse_N: Tensor, targets_N: Tensor, softcap: float) -> Tensor:
    """d loss_n / d raw logits = (softmax - onehot) * (1 - tanh^2), in [-1, 1]; 0 in ignored rows. fp32 or fp64."""
    z_NV = capped(logits_NV, softcap)
    probs_NV = torch.exp(z_NV - lse_N[:, None])
    onehot_NV = torch.arange(z_NV.size(1), device=z_NV.device)[None, :] == targets_N[:, None]
    valid_N1 = (targets_N != IGNORE_INDEX)[:, None]
    return (probs_NV - onehot_NV.to(z_NV.dtype)) * (1.0 - (z_NV / softcap) ** 2) * valid_N1


def loss_and_unit_grad(logits_NV: Tensor, targets_N: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """(loss_N, u_NV): the per-token loss and `unit_grad` in the logits' dtype."""
    lse_N, loss_N = lse_and_loss(logits_NV, targets_N, softcap)
    return loss_N, unit_grad(logits_NV, lse_N, targets_N, softcap).to(logits_NV.dtype)


def loss_and_unit_grad_fp8(logits_NV: Tensor, targets_N: Tensor, softcap: float, u_scale: float
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """(loss_N, u8_NV, u8t_VN): u_scale times `unit_grad` in e5m2, also transposed."""
    lse_N, loss_N = lse_and_loss(logits_NV, targets_N, softcap)
    u8_NV = (unit_grad(logits_NV, lse_N, targets_N, softcap) * u_scale).to(torch.float8_e5m2)
    return loss_N, u8_NV, u8_NV.t().contiguous()


# HeadLoss's ops off the GPU, under the kernels' names
TORCH_OPS = SimpleNamespace(lse_and_loss=lse_and_loss, loss_and_unit_grad=loss_and_unit_grad,
                            loss_and_unit_grad_fp8=loss_and_unit_grad_fp8)


def ops_for(t: Tensor):
    """The Triton ops for CUDA tensors, TORCH_OPS for others."""
    return head_kernels if t.is_cuda else TORCH_OPS


class HeadLoss(torch.autograd.Function):
    """Per-token loss (N,) fp32 from normed x (N, D) and the master weight (V, D). With `with_grad` it saves the
    unit gradient; the upstream gradient, one factor per row, is applied to the (N, D) tensors."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, weight_VD: Tensor, targets_N: Tensor, softcap: float, fp8: bool,
                with_grad: bool) -> Tensor:
        if fp8:
            x_scale, w_scale = normed_scale(x_ND), scale_of(weight_VD)
            x_op, w_op = to_e4m3(x_ND, x_scale), to_e4m3(weight_VD, w_scale)
            logits_NV = fp8_mm(x_op, w_op.t(), x_scale, w_scale, x_ND.dtype)
        else:
            x_scale = w_scale = None
            x_op, w_op = x_ND, weight_VD.type_as(x_ND)
            logits_NV = x_op @ w_op.t()
        ops = ops_for(logits_NV)
        if not with_grad:
            return ops.lse_and_loss(logits_NV, targets_N, softcap)[1]
        if fp8:
            loss_N, u_NV, u_VN = ops.loss_and_unit_grad_fp8(logits_NV, targets_N, softcap, GRAD_FP8_SCALE)
        else:
            (loss_N, u_NV), u_VN = ops.loss_and_unit_grad(logits_NV, targets_N, softcap), None
        ctx.save_for_backward(x_op, w_op, x_scale, w_scale, u_NV, u_VN, targets_N)
        ctx.fp8, ctx.x_dtype, ctx.w_dtype = fp8, x_ND.dtype, weight_VD.dtype
        return loss_N

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        x_op, w_op, x_scale, w_scale, u_NV, u_VN, targets_N = ctx.saved_tensors
        grad_N = torch.where(targets_N != IGNORE_INDEX, grad_N, 0.0)
        if not ctx.fp8:
            grad_x = ((u_NV @ w_op) * grad_N[:, None]).to(x_op.dtype)
            grad_w = u_NV.t() @ (x_op * grad_N[:, None]).to(x_op.dtype)
            return grad_x, grad_w.to(ctx.w_dtype), None, None, None, None
        # u8 holds GRAD_FP8_SCALE * unit: g_scale rescales it to the largest |grad_N|, and the factor per row
        # r_N = grad_N / max|grad_N| in [-1, 1] does the rest (exactly 1 or 0 for a mean loss's gradient)
        grad_bound = grad_N.abs().amax().float()
        grad_bound = torch.where(grad_bound > 0, grad_bound, torch.ones_like(grad_bound))
        g_scale, r_N1 = grad_bound / GRAD_FP8_SCALE, (grad_N / grad_bound)[:, None]
        grad_x = torch._scaled_mm(u_NV, _col_major(w_op), scale_a=g_scale, scale_b=w_scale, out_dtype=ctx.x_dtype)
        # |r| <= 1 keeps x's e4m3 values within x_scale's bound
        x_r_op = (x_op.float() * r_N1).to(torch.float8_e4m3fn)
        grad_w = torch._scaled_mm(u_VN, _col_major(x_r_op), scale_a=g_scale, scale_b=x_scale,
                                  out_dtype=torch.float32)
        return (grad_x * r_N1).to(ctx.x_dtype), grad_w.to(ctx.w_dtype), None, None, None, None


class FastHead(Head):
    """Head whose loss is HeadLoss; with `fp8` (set by FastGPT.configure) its products run in FP8."""

    def __init__(self, *args):
        super().__init__(*args)
        self.fp8 = False

    def forward(self, x_BTD: Tensor, targets_BT: Tensor, reduction: str) -> Tensor:
        loss_N = HeadLoss.apply(norm(x_BTD).flatten(0, 1), self.weight, targets_BT.flatten(), self.softcap, self.fp8,
                                torch.is_grad_enabled())
        return reduce_loss(loss_N, targets_BT, reduction)
