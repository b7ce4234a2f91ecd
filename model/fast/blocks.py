"""model/gpt.py's block on fused paths: the x0 mix and norm (MixNorm), the q, k, v preparation (QKVPrep) and FP8
projection (FP8QKV), and the MLP (model/fast/mlp.py); off CUDA, torch ops. With `fp8` the products that read a normed
input run in FP8, their backward at the previous micro-batch's amax (`grad_amax`, a saved buffer).

Shape legend: as model/gpt.py; M = B T rows, N = 3 A, G gate channels.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from model.attention import attend
from model.fast import norm_kernels, qkv_kernels
from model.fast.attention_kernels import Int8Mask
from model.fast.fp8 import (delayed_scale, fp8_mm, k_major_weight, normed_fp8_linear, normed_scale,
                            to_e4m3)
from model.fast.mlp import ReLU2MLP, transposed_copy
from model.gpt import MLP, Attention, Block, norm, offset_keys, prepare_qkv, x0_mix


def mix_norm(x_BTD: Tensor, x0_BTD: Tensor, lambdas: Tensor, gate_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """(x, n, n[..., :gate_width]) with x = x0_mix(x, x0, lambdas) and n = norm(x): MixNorm's torch ops."""
    x_BTD = x0_mix(x_BTD, x0_BTD, lambdas)
    n_BTD = norm(x_BTD)
    return x_BTD, n_BTD, n_BTD[..., :gate_width]


class MixNorm(torch.autograd.Function):
    """mix_norm on model/fast/norm_kernels.py's kernels, saving only its inputs; with fp8 a fourth output, n's e4m3
    copy at normed_scale (the attention's FP8 input), else None."""

    @staticmethod
    def forward(ctx, x_BTD: Tensor, x0_BTD: Tensor, lambdas: Tensor, gate_width: int,
                fp8: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, and the kernel skips its read
        ctx.save_for_backward(x_BTD, x0_BTD, lambdas)
        if not fp8:
            return *norm_kernels.mix_norm(x_BTD, x0_BTD, lambdas, gate_width), None
        outs = norm_kernels.mix_norm_fp8(x_BTD, x0_BTD, lambdas, gate_width, normed_scale(x_BTD))
        ctx.mark_non_differentiable(outs[3])
        return outs

    @staticmethod
    def backward(ctx, grad_x: Tensor | None, grad_n: Tensor | None, grad_gate: Tensor | None, _grad_n8: None):
        x_BTD, x0_BTD, lambdas = ctx.saved_tensors
        grad_x, grad_n, grad_gate = (g if g is None else g.contiguous() for g in (grad_x, grad_n, grad_gate))
        return (*norm_kernels.mix_norm_grad(grad_x, grad_n, grad_gate, x_BTD, x0_BTD, lambdas), None, None)


def qkv_prep_grad_fp8(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, qkv_BT3Hd: Tensor, cos_TP: Tensor,
                      sin_TP: Tensor, lambdas: Tensor, v_first_BTHd: Tensor | None, ve_BTA: Tensor | None,
                      amax: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """prepare_qkv's gradients, qkv's only as an e4m3 copy (M, N) at amax's delayed scale, amax then set to its
    absolute maximum: (qkv's copy, its scale, lambdas', v_first's, ve's), an absent input's empty. FP8QKV's torch
    path and the reference of qkv_kernels.qkv_prep_grad_fp8."""
    inputs = [None if t is None else t.detach().float().requires_grad_()
              for t in (qkv_BT3Hd, lambdas, v_first_BTHd, ve_BTA)]
    with torch.enable_grad():
        outs = prepare_qkv(inputs[0], cos_TP, sin_TP, *inputs[1:])
        present = [t for t in inputs if t is not None]
        grads = iter(torch.autograd.grad(outs, present, [g.float() for g in (grad_q, grad_k, grad_v)]))
    g_qkv, g_lambdas, g_v_first, g_ve = (None if t is None else next(grads) for t in inputs)
    scale = delayed_scale(amax)
    amax.copy_(g_qkv.abs().amax())
    absent = qkv_BT3Hd.new_empty(0)
    return (to_e4m3(g_qkv.flatten(0, 1).flatten(1), scale), scale, g_lambdas.to(lambdas.dtype),
            absent if g_v_first is None else g_v_first.to(v_first_BTHd.dtype),
            absent if g_ve is None else g_ve.to(ve_BTA.dtype))


def on_qkv_kernels(x: Tensor, head_dim: int) -> bool:
    """Whether prepare_qkv runs on qkv_kernels for x's device and this head width."""
    return x.is_cuda and qkv_kernels.supports(head_dim)


class QKVPrep(torch.autograd.Function):
    """prepare_qkv on model/fast/qkv_kernels.py's kernels, one each way; saves only its inputs."""

    @staticmethod
    def forward(ctx, qkv_BT3Hd: Tensor, cos_TP: Tensor, sin_TP: Tensor, lambdas: Tensor, v_first_BTHd: Tensor | None,
                ve_BTA: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        ctx.save_for_backward(qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA)
        return qkv_kernels.qkv_prep(qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA)

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor):
        qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA = ctx.saved_tensors
        # the kernel takes rows at any stride (FlexAttention's arrive transposed), elements unit-stride
        grad_q, grad_k, grad_v = (g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v))
        grad_qkv, grad_lambdas, grad_v_first, grad_ve = qkv_kernels.qkv_prep_grad(
            grad_q, grad_k, grad_v, qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA)
        return (grad_qkv, None, None, grad_lambdas, None if v_first_BTHd is None else grad_v_first,
                None if ve_BTA is None else grad_ve)


class FP8QKV(torch.autograd.Function):
    """prepare_qkv(x @ w^T) for normed rows x (B, T, D) and the fused weight w (N, D), the product and both backward
    products in FP8. It saves x's e4m3 copy transposed (tokens innermost, K-major for w's gradient) in place of x; the
    backward kernel writes the output gradient only as an e4m3 copy at grad_amax's delayed scale."""

    @staticmethod
    def forward(ctx, x_BTD: Tensor, w_ND: Tensor, x8_BTD: Tensor | None, cos_TP: Tensor, sin_TP: Tensor,
                lambdas: Tensor, v_first_BTHd: Tensor | None, ve_BTA: Tensor | None, grad_amax: Tensor,
                num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x_BTD.shape
        qkv_BTN, x8_MD, x_scale = normed_fp8_linear(x_BTD, w_ND, x8_BTD)
        qkv_BT3Hd = qkv_BTN.view(B, T, 3 * num_heads, -1)
        ctx.on_kernels = on_qkv_kernels(x_BTD, qkv_BT3Hd.size(-1))
        ctx.x_shape, ctx.x_dtype = x_BTD.shape, x_BTD.dtype
        ctx.save_for_backward(transposed_copy(x8_MD, ctx.on_kernels), x_scale, w_ND, qkv_BT3Hd, cos_TP, sin_TP,
                              lambdas, v_first_BTHd, ve_BTA, grad_amax)
        return (qkv_kernels.qkv_prep if ctx.on_kernels else prepare_qkv)(qkv_BT3Hd, cos_TP, sin_TP, lambdas,
                                                                         v_first_BTHd, ve_BTA)

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor):
        x8_DM, x_scale, w_ND, qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA, grad_amax = ctx.saved_tensors
        grad_q, grad_k, grad_v = (g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v))
        g8_MN, g_scale, grad_lambdas, grad_v_first, grad_ve = (
            qkv_kernels.qkv_prep_grad_fp8 if ctx.on_kernels else qkv_prep_grad_fp8)(
            grad_q, grad_k, grad_v, qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA, grad_amax)
        w8_DN, w_scale = k_major_weight(w_ND)
        # fp8_mm reads its second operand (K, N) column-major: w's K-major e4m3 copy, viewed back
        grad_x_MD = fp8_mm(g8_MN, w8_DN.t(), g_scale, w_scale, ctx.x_dtype)
        # w's gradient sums over the tokens: the gradient's copy transposed, x's kept copy viewed back
        grad_w_ND = fp8_mm(transposed_copy(g8_MN, ctx.on_kernels), x8_DM.t(), g_scale, x_scale, w_ND.dtype)
        return (grad_x_MD.view(ctx.x_shape), grad_w_ND, None, None, None, grad_lambdas,
                None if v_first_BTHd is None else grad_v_first, None if ve_BTA is None else grad_ve, None, None)


def add_scale_history(part: nn.Module) -> None:
    """part.fp8, set by FastGPT.configure, and part.grad_amax: the absolute maximum of the last gradient its FP8
    backward copied, the next copy's scale, saved with the weights so that a resumed run keeps its scales."""
    part.fp8 = False
    part.register_buffer("grad_amax", torch.zeros(()))


class FastAttention(Attention):
    """Attention with its q, k, v projection in FP8 both ways with `fp8` (FP8QKV) and its q, k, v preparation on
    qkv_kernels on CUDA. Under an Int8Mask (forward-only passes) `int8` chooses the attention: "off" FlexAttention,
    "on" INT8/FP8 (model/fast/attention_kernels.py), "measure" FlexAttention's output, with `int8_error` set to
    the INT8/FP8 output's relative L1 error against it."""

    def __init__(self, *args):
        super().__init__(*args)
        add_scale_history(self)
        self.int8, self.int8_error = "off", None

    def attend_and_project(self, q_BTHd: Tensor, k_BTHd: Tensor, v_BTHd: Tensor, gate_in_BTG: Tensor,
                           mask: BlockMask | Tensor | Int8Mask) -> Tensor:
        if not isinstance(mask, Int8Mask) or self.int8 == "off":
            flex = mask.flex if isinstance(mask, Int8Mask) else mask
            return super().attend_and_project(q_BTHd, k_BTHd, v_BTHd, gate_in_BTG, flex)
        y_BTHd = mask.attend(q_BTHd, k_BTHd, v_BTHd, self.scale)
        if self.int8 == "measure":
            ref_BTHd = attend(q_BTHd.transpose(1, 2), k_BTHd.transpose(1, 2), v_BTHd.transpose(1, 2), mask.flex,
                              self.scale).transpose(1, 2)
            self.int8_error = float((y_BTHd.float() - ref_BTHd.float()).abs().sum() / ref_BTHd.float().abs().sum())
            y_BTHd = ref_BTHd
        return self.gate_and_project(y_BTHd, gate_in_BTG)

    def init_weights(self) -> None:
        super().init_weights()
        self.grad_amax.zero_()  # no history (built on the meta device, the buffer holds garbage)

    def forward(self, x_BTD: Tensor, x8_BTD: Tensor | None, gate_in_BTG: Tensor, v_first_BTHd: Tensor | None,
                ve_BTA: Tensor | None, cos_TP: Tensor, sin_TP: Tensor,
                mask: BlockMask | Tensor | Int8Mask) -> tuple[Tensor, Tensor]:
        """As Attention's, with gate_in = x's first G channels (MixNorm) and x8 = x's e4m3 copy or None."""
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        qkv_w = self.qkv_w.flatten(0, 1).type_as(x_BTD)
        if self.fp8:
            q, k, v = FP8QKV.apply(x_BTD, qkv_w, x8_BTD, cos_TP, sin_TP, self.value_lambdas, v_first_BTHd, ve_BTA,
                                   self.grad_amax, H)
        else:
            q, k, v = (QKVPrep.apply if on_qkv_kernels(x_BTD, d) else prepare_qkv)(
                F.linear(x_BTD, qkv_w).view(B, T, 3 * H, d), cos_TP, sin_TP, self.value_lambdas, v_first_BTHd, ve_BTA)
        if self.offsets_keys:
            k = offset_keys(k)
        return self.attend_and_project(q, k, v, gate_in_BTG, mask), v


class FastMLP(MLP):
    """residual + MLP(x) in one ReLU2MLP: Gluon kernels on Hopper, FP8 with `fp8` (model/fast/mlp.py)."""

    def __init__(self, *args):
        super().__init__(*args)
        add_scale_history(self)

    def init_weights(self) -> None:
        super().init_weights()
        self.grad_amax.zero_()

    def forward(self, x_BTD: Tensor, residual_BTD: Tensor) -> Tensor:
        """The residual stream after the MLP: residual + the MLP of the normed x."""
        x_MD = x_BTD.flatten(0, 1)
        y_MD = ReLU2MLP.apply(x_MD, self.fc_w.type_as(x_MD), self.proj_w.type_as(x_MD),
                              residual_BTD.flatten(0, 1).contiguous(), self.fp8,
                              self.grad_amax if self.fp8 else None)
        return y_MD.view_as(x_BTD)


class FastBlock(Block):
    make_attention, make_mlp = FastAttention, FastMLP

    def forward(self, x_BTD: Tensor, x0_BTD: Tensor, v_first_BTHd: Tensor | None, ve_BTA: Tensor | None,
                cos_TP: Tensor, sin_TP: Tensor, mask: BlockMask | Tensor) -> tuple[Tensor, Tensor | None]:
        v_BTHd = None
        if self.attn is not None:
            gate_width = self.attn.gate_w.size(1)
            if x_BTD.is_cuda:
                x_BTD, n_BTD, gate_in_BTG, n8_BTD = MixNorm.apply(x_BTD, x0_BTD, self.lambdas, gate_width,
                                                                  self.attn.fp8)
            else:
                (x_BTD, n_BTD, gate_in_BTG), n8_BTD = mix_norm(x_BTD, x0_BTD, self.lambdas, gate_width), None
            y_BTD, v_BTHd = self.attn(n_BTD, n8_BTD, gate_in_BTG, v_first_BTHd, ve_BTA, cos_TP, sin_TP, mask)
            x_BTD = x_BTD + y_BTD
        else:
            x_BTD = x0_mix(x_BTD, x0_BTD, self.lambdas)
        if self.mlp is not None:
            x_BTD = self.mlp(norm(x_BTD), x_BTD)
        return x_BTD, v_BTHd if self.shares_values else None


def fp8_parts(blocks: nn.ModuleList) -> list[nn.Module]:
    """The blocks' attentions and MLPs: the parts whose products may run in FP8."""
    return [part for block in blocks for part in (block.attn, block.mlp) if part is not None]
