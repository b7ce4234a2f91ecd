"""The LM head: final norm, untied projection to the vocabulary, tanh softcap and cross-entropy.

The head is the largest matrix product of the 124M model (a third of its FLOPs) and its (tokens x vocab)
logits are the largest tensor (49,152 x 50,304 per micro-batch: 9.9 GB in fp32). Two paths compute one loss:

- `reference_loss`: capped fp32 logits, then F.cross_entropy. The obvious code; tests compare against it.
- `HeadLoss`: an autograd.Function whose forward reduces the capped logits to one log-sum-exp per token and, in
  the same kernel, writes the logits' gradient once, already in FP8 when the projection is FP8 (in both layouts
  the two FP8 products need); it keeps that gradient for the backward instead of the logits. On CUDA that is one
  Triton kernel (model/head_kernels.py, plus a transpose for FP8) beside the matrix products; elsewhere the torch
  ops `lse_and_loss`, `loss_and_unit_grad` and `loss_and_unit_grad_fp8` below do the same. The fp32 (tokens x
  vocab) tensors of the reference never exist (the idea of Cut Cross-Entropy, Wijmans et al. 2024, "Cut Your
  Losses in Large-Vocabulary Language Models", without its custom matmul kernel).

FP8 (`fp8=True`, GPUs with compute capability 8.9+; modded-nanogpt's FP8 head, record of 2025-01-13): the
three matrix products run in torch._scaled_mm with e4m3 inputs/weights and e5m2 gradients, per-tensor scales.
The scales come from bounds, not from a history: the normed input's and the weight's as model/fp8.py gives them,
and the gradient's 2^15 times its bound (below).

Shape legend: N tokens (flattened batch), D model dim, V vocab.
"""
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.fp8 import fp8_mm, normed_scale, scale_of, to_e4m3
from model.layers import norm

try:  # the CUDA path's Triton kernels; CPU-only installs (CI) lack triton and run the torch ops below
    from model import head_kernels
except ImportError:
    head_kernels = None

IGNORE_INDEX = -100  # targets equal to this contribute no loss (F.cross_entropy's default)
# The unit gradient (softmax - onehot) * tanh' lies in [-1, 1]; 2^15 maps it below e5m2's max of 57,344 while
# keeping values down to 2^-16 / 2^15 ~ 5e-10 of the bound out of the flush-to-zero range.
GRAD_FP8_SCALE = 2.0 ** 15


def capped(logits: Tensor, softcap: float) -> Tensor:
    """softcap * tanh(logits / softcap) in fp32, or fp64 for fp64 input (Gemma 2's logit softcap)."""
    return softcap * torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / softcap)


def capped_logits(x: Tensor, weight_VD: Tensor, softcap: float) -> Tensor:
    """Capped fp32 logits of x @ W^T, the product computed in x's dtype."""
    return capped(F.linear(x, weight_VD.type_as(x)), softcap)


def reference_loss(x_ND: Tensor, weight_VD: Tensor, targets_N: Tensor, softcap: float) -> Tensor:
    """Per-token cross-entropy (N,) in fp32 of `capped_logits`; 0 where ignored."""
    return F.cross_entropy(capped_logits(x_ND, weight_VD, softcap), targets_N, ignore_index=IGNORE_INDEX,
                           reduction="none")


def bounded_logsumexp(z_NV: Tensor, softcap: float) -> Tensor:
    """log-sum-exp over the last dim of capped logits in one pass: z lies in [-c, c], so exp(z - c) never
    overflows and its sum is at least V e^(-2c), far from underflow; no running maximum is needed. Compiled, the
    head's forward reduction fell from 4.9 to 2.7 ms per 49,152-token micro-batch on the H200
    (torch.logsumexp reads the logits twice; bench/results/README.md)."""
    return softcap + torch.log(torch.exp(z_NV - softcap).sum(dim=-1))


def _col_major(t: Tensor) -> Tensor:
    """The same matrix stored column by column: the layout torch._scaled_mm wants for its second operand."""
    return t.t().contiguous().t()


def lse_and_loss(logits_NV: Tensor, targets_N: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """(lse_N, loss_N): the log-sum-exp of the capped logits and the per-token loss (0 where ignored), by torch
    ops: HeadLoss's path on the CPU and the reference of model/head_kernels.py's kernel of the same name."""
    valid_N = targets_N != IGNORE_INDEX
    lse_N = bounded_logsumexp(capped(logits_NV, softcap), softcap)
    target_logit_N = capped(logits_NV.gather(1, torch.where(valid_N, targets_N, 0)[:, None]).squeeze(1), softcap)
    return lse_N, torch.where(valid_N, lse_N - target_logit_N, 0.0)


def unit_grad(logits_NV: Tensor, lse_N: Tensor, targets_N: Tensor, softcap: float) -> Tensor:
    """d loss_n / d raw logits of row n = (softmax - onehot) * (1 - tanh^2), each factor bounded by 1 in magnitude;
    0 in the rows of ignored targets. fp32 (fp64 for fp64 logits)."""
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
    """(loss_N, u8_NV, u8t_VN): the loss and u_scale times `unit_grad` in e5m2, as (N, V) and as its transpose
    (V, N), both row-major: the first operands of the two backward torch._scaled_mm."""
    lse_N, loss_N = lse_and_loss(logits_NV, targets_N, softcap)
    u8_NV = (unit_grad(logits_NV, lse_N, targets_N, softcap) * u_scale).to(torch.float8_e5m2)
    return loss_N, u8_NV, u8_NV.t().contiguous()


# HeadLoss's ops on tensors that are not on a GPU: the torch functions above, under the kernels' names
TORCH_OPS = SimpleNamespace(lse_and_loss=lse_and_loss, loss_and_unit_grad=loss_and_unit_grad,
                            loss_and_unit_grad_fp8=loss_and_unit_grad_fp8)


def ops_for(t: Tensor):
    """model/head_kernels.py's Triton ops for CUDA tensors, TORCH_OPS for others."""
    return head_kernels if t.is_cuda else TORCH_OPS


class HeadLoss(torch.autograd.Function):
    """Per-token loss of capped logits (N,) fp32, from normed x (N, D) and the fp32 master weight (V, D).

    With `with_grad`, the forward also computes the logits' unit gradient (`unit_grad`: the gradient of each token's
    own loss) in the same pass, and saves it instead of the logits: the backward's upstream gradient grad_N is one
    factor per token row, which it applies to the small (N, D) tensors (grad_x's rows, x's rows for grad_w), so the
    backward runs the two matrix products and a few (N, D) ops, and never reads the logits. Also saved: the
    projection's operands (FP8 copies when `fp8`). Between the matrix products, CUDA tensors go through the Triton
    kernels of model/head_kernels.py, others through the torch ops above (same names, same results)."""

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


class Head(nn.Module):
    """Final norm, untied LM head, softcap and cross-entropy: a module of its own so it compiles as one region.

    Set from outside (runtime.dist.use_device_paths): `fused` (HeadLoss; off on the CPU, where eager
    F.cross_entropy is faster: 0.45 against 0.75 s for one forward+backward of the smoke model's head on 2 cores,
    bench/results/cpu_timings_2core.json) and `fp8` (with `fused`, on GPUs that have FP8 matrix units)."""

    def __init__(self, dim: int, vocab_size: int, softcap: float):
        super().__init__()
        self.softcap = softcap
        self.fused, self.fp8 = True, False
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def logits(self, x_BTD: Tensor) -> Tensor:
        """Capped fp32 logits (B, T, V), for sampling and tests (in x's dtype, never FP8)."""
        return capped_logits(norm(x_BTD), self.weight, self.softcap)

    def forward(self, x_BTD: Tensor, targets_BT: Tensor, reduction: str) -> Tensor:
        """Cross-entropy over targets != IGNORE_INDEX: "mean" and "sum" give a scalar, "none" a (B, T) tensor."""
        x_ND = norm(x_BTD).flatten(0, 1)
        if self.fused:
            loss_N = HeadLoss.apply(x_ND, self.weight, targets_BT.flatten(), self.softcap, self.fp8,
                                    torch.is_grad_enabled())
        else:
            assert not self.fp8, "the FP8 head needs the fused path (Head.fused = True)"
            loss_N = reference_loss(x_ND, self.weight, targets_BT.flatten(), self.softcap)
        if reduction == "none":
            return loss_N.view_as(targets_BT)
        if reduction == "sum":
            return loss_N.sum()
        return loss_N.sum() / (targets_BT != IGNORE_INDEX).sum()
