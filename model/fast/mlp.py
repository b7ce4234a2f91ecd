"""The ReLU² MLP with its residual add as one autograd.Function (ReLU2MLP), and the torch ops that stand in for
model/fast/mlp_kernels.py's kernels off Hopper: same names, same results; they are the kernels' references.

Shape legend: M rows (tokens), K the product's inner dim, N its outer dim; D model dim, F MLP width.
"""
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from model.fast import mlp_kernels, transpose_kernels
from model.fast.fp8 import (delayed_scale, fp8_mm, grad_operands, normed_operands, normed_scale, relu2_scale,
                            scale_of, to_e4m3)


def transposed_copy(t_RC: Tensor, on_kernels: bool) -> Tensor:
    """t.t().contiguous(); on_kernels, by transpose_kernels' tiled kernel."""
    return transpose_kernels.transposed(t_RC) if on_kernels else t_RC.t().contiguous()


def relu2_matmul(x_MK: Tensor, w_KN: Tensor) -> Tensor:
    """relu(x @ w)^2 (ReLU², So et al. 2021, Primer)."""
    return F.relu(x_MK @ w_KN).square()


def relu2_matmul_fp8(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    """h = relu(scale * x8 @ w8^T)^2 in bf16 and its e4m3 copy h * h_inv_scale, both from the fp32 h, w8 (N, K)."""
    h_MN = relu2_matmul(x8_MK.float(), w8_NK.float().t() * scale)
    return h_MN.bfloat16(), (h_MN * h_inv_scale).to(torch.float8_e4m3fn)


def relu2_matmul_fp8_t(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor,
                       h_inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """relu2_matmul_fp8's h and e4m3 copy, and that copy transposed (N, M)."""
    h_MN, h8_MN = relu2_matmul_fp8(x8_MK, w8_NK, scale, h_inv_scale)
    return h_MN, h8_MN, h8_MN.t().contiguous()


def relu2_matmul_grad(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor) -> Tensor:
    """The gradient of h = relu(pre)^2 w.r.t. pre, (grad_y @ w) * 2 relu(pre), from h: relu(pre) = sqrt(h)."""
    return (grad_y_MK @ w_KN) * (2.0 * h_MN.sqrt())


def relu2_matmul_grad_fp8(grad_y8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_MN: Tensor,
                          amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """relu2_matmul_grad of e4m3 operands as (g8 (M, N), g8 (N, M), their scale), at amax's delayed scale; amax then
    holds the gradient's absolute maximum."""
    g_MN = relu2_matmul_grad(grad_y8_MK.float(), w8_NK.float().t() * scale, h_MN.float())
    scale = delayed_scale(amax)
    amax.copy_(g_MN.abs().amax())
    g8_MN = to_e4m3(g_MN, scale)
    return g8_MN, g8_MN.t().contiguous(), scale


def matmul_add(h_MK: Tensor, w_NK: Tensor, r_MN: Tensor) -> Tensor:
    """r + h @ w^T, the MLP's output added to the residual stream r (the kernel rounds the sum once)."""
    return r_MN + h_MK @ w_NK.t()


def matmul_add_fp8(h8_MK: Tensor, w8_NK: Tensor, scale: Tensor, r_MN: Tensor) -> Tensor:
    """r + scale * h8 @ w8^T for e4m3 operands, summed in fp32 and rounded once to r's dtype."""
    return (r_MN.float() + (h8_MK.float() @ w8_NK.float().t()) * scale).to(r_MN.dtype)


# ReLU2MLP's ops off the kernels, under the kernels' names
TORCH_OPS = SimpleNamespace(relu2_matmul=relu2_matmul, relu2_matmul_fp8=relu2_matmul_fp8,
                            relu2_matmul_fp8_t=relu2_matmul_fp8_t, relu2_matmul_grad=relu2_matmul_grad,
                            relu2_matmul_grad_fp8=relu2_matmul_grad_fp8, matmul_add=matmul_add,
                            matmul_add_fp8=matmul_add_fp8)


class ReLU2MLP(torch.autograd.Function):
    """r + relu(x @ W1)^2 @ W2^T for x (M, D), W1, W2 (D, F) and the residual stream r (M, D), saving h =
    relu(x @ W1)^2; on Hopper in the Gluon kernels. With fp8 the forward products read e4m3 copies; with grad_amax
    (0-D fp32) too, the backward's four products do, each copy written K-major for the product that reads it."""

    @staticmethod
    def forward(ctx, x_MD: Tensor, fc_DF: Tensor, proj_DF: Tensor, r_MD: Tensor, fp8: bool,
                grad_amax: Tensor | None = None) -> Tensor:
        on_kernels = mlp_kernels.supports(x_MD, fc_DF)
        ops = mlp_kernels if on_kernels else TORCH_OPS
        ctx.on_kernels, ctx.fp8_backward = on_kernels, fp8 and grad_amax is not None
        if not fp8:
            h_MF = ops.relu2_matmul(x_MD, fc_DF)
            ctx.save_for_backward(x_MD, fc_DF, proj_DF, h_MF)
            return ops.matmul_add(h_MF, proj_DF, r_MD)
        x8_MD, fc8_FD, fc_scale = normed_operands(x_MD, fc_DF)
        h_scale, proj_scale = relu2_scale(fc8_FD, fc_scale), scale_of(proj_DF)
        if ctx.fp8_backward:
            h_MF, h8_MF, h8_FM = ops.relu2_matmul_fp8_t(x8_MD, fc8_FD, fc_scale, 1 / h_scale)
            ctx.save_for_backward(transposed_copy(x8_MD, on_kernels), normed_scale(x_MD), fc_DF, proj_DF,
                                  h_MF.type_as(x_MD), h8_FM, h_scale, grad_amax)
        else:
            h_MF, h8_MF = ops.relu2_matmul_fp8(x8_MD, fc8_FD, fc_scale, 1 / h_scale)
            ctx.save_for_backward(x_MD, fc_DF, proj_DF, h_MF.type_as(x_MD))
        return ops.matmul_add_fp8(h8_MF, to_e4m3(proj_DF, proj_scale), h_scale * proj_scale, r_MD)

    @staticmethod
    def backward(ctx, grad_y_MD: Tensor):
        ops = mlp_kernels if ctx.on_kernels else TORCH_OPS
        grad_y_MD = grad_y_MD.contiguous()
        if not ctx.fp8_backward:
            x_MD, fc_DF, proj_DF, h_MF = ctx.saved_tensors
            grad_pre_MF = ops.relu2_matmul_grad(grad_y_MD, proj_DF, h_MF)
            return grad_pre_MF @ fc_DF.t(), x_MD.t() @ grad_pre_MF, grad_y_MD.t() @ h_MF, grad_y_MD, None, None
        x8_DM, x_scale, fc_DF, proj_DF, h_MF, h8_FM, h_scale, grad_amax = ctx.saved_tensors
        gy8_MD, proj8_FD, gy_scale, proj_scale = grad_operands(grad_y_MD, proj_DF)
        g8_MF, g8_FM, g_scale = ops.relu2_matmul_grad_fp8(gy8_MD, proj8_FD, gy_scale * proj_scale, h_MF, grad_amax)
        fc_scale = scale_of(fc_DF)
        # fp8_mm reads its second operand column-major: the (N, K) copies, transposed
        grad_x_MD = fp8_mm(g8_MF, to_e4m3(fc_DF, fc_scale).t(), g_scale, fc_scale, grad_y_MD.dtype)
        grad_fc_DF = fp8_mm(x8_DM, g8_FM.t(), x_scale, g_scale, fc_DF.dtype)
        grad_proj_DF = fp8_mm(transposed_copy(gy8_MD, ctx.on_kernels), h8_FM.t(), gy_scale, h_scale, proj_DF.dtype)
        return grad_x_MD, grad_fc_DF, grad_proj_DF, grad_y_MD, None, None
