"""Transformer pieces: parameter-free RMSNorm, half-truncated rotary embeddings, attention, ReLU² MLP, the U-net
skip, the block. On CUDA four of them run Triton kernels through autograd.Functions (MixNorm, QKVPrep, ReLU2MLP,
SkipAdd; ReLU2MLP's are Gluon kernels, Hopper only); elsewhere the torch ops beside each. Two more Functions route
gradients: FanOut (one tensor, many readers) and TableRows (embedding rows whose gradient goes straight into the
table's, on CUDA through the Triton kernel of model/embed_kernels.py).

Weights are fp32 master copies, cast to the activation dtype where they are used (`.type_as(x)`), so the
optimizer always updates fp32 while the matmuls run in bf16, or with `fp8` (Attention, MLP) the two forward products
that read a normed input in FP8 (model/fp8.py). Construction only declares shapes (`torch.empty`);
`init_weights()` assigns values.

Shape legend: B batch rows, T tokens, D model dim, H heads, d head dim, A = H * d attention width,
F = mlp_ratio * D MLP width, P = d // 2 rotary pairs, G = D / 64 gate channels (GATE_FRACTION).
"""

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from model.attention import attend
from model.fp8 import (NormedFP8Linear, delayed_scale, fp8_mm, grad_operands, k_major_weight, normed_fp8_linear,
                       normed_operands, normed_scale, relu2_scale, scale_of, to_e4m3)

try:  # the CUDA path's Triton kernels; CPU-only installs (CI) lack triton and run the torch ops below
    from model import embed_kernels, mlp_kernels, norm_kernels, qkv_kernels, skip_kernels, transpose_kernels
except ImportError:
    embed_kernels = mlp_kernels = norm_kernels = qkv_kernels = skip_kernels = transpose_kernels = None


GATE_FRACTION = 64  # the attention gate reads the first D / 64 channels (record #28's dampen_factor)
SMEAR_GATE_CHANNELS = 12  # the smear gate reads each row's first 12 channels (modded-nanogpt's smear module)


def norm(x: Tensor) -> Tensor:
    """RMSNorm without a learned gain (modded-nanogpt): one less parameter group, no measurable loss."""
    return F.rms_norm(x, (x.size(-1),))


def smear(rows_BTD: Tensor, inputs_BT: Tensor, gate_G: Tensor, lam_1: Tensor, bos_id: int) -> Tensor:
    """Each row plus a gated share of the row before it: rows[t] + lam * sigmoid(rows[t, :G] . gate) * rows[t - 1]
    (modded-nanogpt's smear module, after record #28: a cheap bigram feature before the first block). Never into a
    sequence's first token or a document's (BOS), so no document sees another, as in attention. The share is
    computed in fp32; the result has the rows' dtype."""
    G = gate_G.numel()
    rows_now, rows_before = rows_BTD[:, 1:], rows_BTD[:, :-1]
    share_BT = lam_1 * torch.sigmoid(rows_now[..., :G].float() @ gate_G.float())
    share_BT = share_BT * (inputs_BT[:, 1:] != bos_id)
    smeared = rows_now.float() + share_BT[..., None] * rows_before.float()
    return torch.cat([rows_BTD[:, :1], smeared.to(rows_BTD.dtype)], dim=1)


def rotary_tables(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin tables (T, P) in fp32 for half-truncated RoPE (modded-nanogpt): only half of the P rotary pairs
    turn, with frequencies from 1 down to 1/base; the other half has frequency 0 and carries position-free content."""
    turning = head_dim // 4
    freqs_P = torch.cat([base ** -torch.linspace(0, 1, turning, dtype=torch.float32, device=device),
                         torch.zeros(head_dim // 2 - turning, dtype=torch.float32, device=device)])
    angles_TP = torch.arange(seq_len, dtype=torch.float32, device=device)[:, None] * freqs_P[None, :]
    return angles_TP.cos(), angles_TP.sin()


def apply_rotary(x_BTHd: Tensor, cos_TP: Tensor, sin_TP: Tensor) -> Tensor:
    """Rotate pair (x[j], x[j + P]) by angle[t, j]; computed in fp32, returned in x's dtype."""
    x1, x2 = x_BTHd.float().chunk(2, dim=-1)
    cos, sin = cos_TP[None, :, None, :], sin_TP[None, :, None, :]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x_BTHd)


def x0_mix(x_BTD: Tensor, x0_BTD: Tensor, lambdas: Tensor) -> Tensor:
    """lambdas[0] x + lambdas[1] x0 in x's dtype: the x0 shortcut of modded-nanogpt at each block's start."""
    mix = lambdas.type_as(x_BTD)
    return mix[0] * x_BTD + mix[1] * x0_BTD


def mix_norm(x_BTD: Tensor, x0_BTD: Tensor, lambdas: Tensor, gate_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """(x, n, n's first gate_width channels) for an attention block: x = x0_mix(x, x0, lambdas) the residual stream,
    n = norm(x) the attention's input and its first G channels the gate's. By torch ops: Block's path off CUDA and
    the reference of model/norm_kernels.py's kernels."""
    x_BTD = x0_mix(x_BTD, x0_BTD, lambdas)
    n_BTD = norm(x_BTD)
    return x_BTD, n_BTD, n_BTD[..., :gate_width]


class MixNorm(torch.autograd.Function):
    """mix_norm on the Triton kernels of model/norm_kernels.py, one each way (CUDA, or the CPU under the Triton
    interpreter), the gate's input a tensor of its own, whose gradient the backward adds to n's as it reads it;
    saves only its inputs for backward. A fourth output: with fp8, n's e4m3 copy at normed_scale (the attention's FP8
    input, written by the same kernel: its own cast kernel took 34.7 us of each 49,152-token micro-batch and
    layer, bench/results/kernels_step28_1xH200_bab869d.txt), else None."""

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


def _uniform_(w: Tensor, std: float) -> None:
    bound = math.sqrt(3.0) * std  # a uniform on [-b, b] has std b / sqrt(3)
    nn.init.uniform_(w, -bound, bound)


def qkv_prep(qkv_BT3Hd: Tensor, cos_TP: Tensor, sin_TP: Tensor, lambdas: Tensor, v_first_BTHd: Tensor | None,
             ve_BTA: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) (B, T, H, d) for attention from the fused projection's output (B, T, 3H, d): q and k RMS-normed and
    rotated, v = own v + first v_first + embed ve with (own, first, embed) = lambdas, the terms of absent inputs
    left out. By torch ops: Attention's path off CUDA and the reference of model/qkv_kernels.py's kernels."""
    q_BTHd, k_BTHd, v_BTHd = qkv_BT3Hd.chunk(3, dim=2)
    # QK-norm (Dehghani et al. 2023): bounded logits, stable at high learning rates
    q_BTHd = apply_rotary(norm(q_BTHd), cos_TP, sin_TP)
    k_BTHd = apply_rotary(norm(k_BTHd), cos_TP, sin_TP)
    own, first, embed = lambdas.type_as(qkv_BT3Hd).unbind()
    v_BTHd = own * v_BTHd
    if v_first_BTHd is not None:  # value residual (Zhou et al. 2024, "Value Residual Learning")
        v_BTHd = v_BTHd + first * v_first_BTHd
    if ve_BTA is not None:  # value embeddings (modded-nanogpt record of 2024-11)
        v_BTHd = v_BTHd + embed * ve_BTA.view(v_BTHd.shape)
    return q_BTHd, k_BTHd, v_BTHd


def qkv_prep_grad_fp8(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, qkv_BT3Hd: Tensor, cos_TP: Tensor,
                      sin_TP: Tensor, lambdas: Tensor, v_first_BTHd: Tensor | None, ve_BTA: Tensor | None,
                      amax: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """qkv_prep's gradients for (qkv, lambdas, v_first, ve), qkv's only as an e4m3 copy (B T, 3 H d) at amax's delayed
    scale (model/fp8.py), after which amax holds this gradient's absolute maximum: (qkv's copy, its scale, lambdas',
    v_first's and ve's gradients), an absent input's an empty tensor. By fp32 autograd through the torch ops:
    FP8QKV's path off CUDA and the reference of model/qkv_kernels.py's kernel."""
    inputs = [None if t is None else t.detach().float().requires_grad_()
              for t in (qkv_BT3Hd, lambdas, v_first_BTHd, ve_BTA)]
    with torch.enable_grad():
        outs = qkv_prep(inputs[0], cos_TP, sin_TP, *inputs[1:])
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
    """Whether qkv_prep runs on model/qkv_kernels.py's kernels for x's device and this head width."""
    return x.is_cuda and qkv_kernels is not None and qkv_kernels.supports(head_dim)


class QKVPrep(torch.autograd.Function):
    """qkv_prep on the Triton kernels of model/qkv_kernels.py, one each way (CUDA, or the CPU under the Triton
    interpreter); saves only its inputs for backward."""

    @staticmethod
    def forward(ctx, qkv_BT3Hd: Tensor, cos_TP: Tensor, sin_TP: Tensor, lambdas: Tensor, v_first_BTHd: Tensor | None,
                ve_BTA: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        ctx.save_for_backward(qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA)
        return qkv_kernels.qkv_prep(qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA)

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor):
        qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA = ctx.saved_tensors
        # the kernel takes the gradients' rows at any stride (FlexAttention's arrive transposed), not their elements
        grad_q, grad_k, grad_v = (g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v))
        grad_qkv, grad_lambdas, grad_v_first, grad_ve = qkv_kernels.qkv_prep_grad(
            grad_q, grad_k, grad_v, qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA)
        return (grad_qkv, None, None, grad_lambdas, None if v_first_BTHd is None else grad_v_first,
                None if ve_BTA is None else grad_ve)


def transposed_copy(t_RC: Tensor, on_kernels: bool) -> Tensor:
    """t.t().contiguous(); with on_kernels (CUDA), by model/transpose_kernels.py's kernel, whose tiles copied the head's
    e5m2 gradient in 1.30 ms where inductor's copy of the same torch ops took 2.12 (that module's measurements)."""
    return transpose_kernels.transposed(t_RC) if on_kernels else t_RC.t().contiguous()


class FP8QKV(torch.autograd.Function):
    """qkv_prep(x @ w^T) for normed rows x (B, T, D) and the fused weight w (3A, D) in x's dtype, with the product and
    both of its backward's products in FP8. The forward is normed_fp8_linear's (model/fp8.py), then QKVPrep's kernel;
    it keeps x's e4m3 copy in place of x, transposed (tokens innermost, as Hopper's 8-bit MMA reads both operands of a
    weight's gradient). The backward's kernel (QKVPrep's, with FP8) writes the product's output gradient only as an
    e4m3 copy, at grad_amax's delayed scale (model/fp8.py's delayed_scale), as the MLP's first backward kernel does
    (ReLU2MLP). x's gradient reads that copy; w's reads it transposed by a kernel of its own (transposed_copy). A
    transposed copy written by QKVPrep's kernel itself cost more than the product saves, and was wrong on the GPU
    (bench/results/README.md, section b55e629); with the copies made here, the weight's gradient in FP8 took
    7.5-11.8 ms off the step in three same-machine pairs (section 371311c). Off CUDA the torch ops of qkv_prep and
    qkv_prep_grad_fp8, and torch's transposing copies."""

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
        return (qkv_kernels.qkv_prep if ctx.on_kernels else qkv_prep)(qkv_BT3Hd, cos_TP, sin_TP, lambdas,
                                                                      v_first_BTHd, ve_BTA)

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor):
        x8_DM, x_scale, w_ND, qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA, grad_amax = ctx.saved_tensors
        # the kernel takes the gradients' rows at any stride (FlexAttention's arrive transposed), not their elements
        grad_q, grad_k, grad_v = (g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v))
        g8_MN, g_scale, grad_lambdas, grad_v_first, grad_ve = (
            qkv_kernels.qkv_prep_grad_fp8 if ctx.on_kernels else qkv_prep_grad_fp8)(
            grad_q, grad_k, grad_v, qkv_BT3Hd, cos_TP, sin_TP, lambdas, v_first_BTHd, ve_BTA, grad_amax)
        w8_DN, w_scale = k_major_weight(w_ND)
        # fp8_mm's second operand is read (K, N) column-major: w's K-major e4m3 copy, viewed back
        grad_x_MD = fp8_mm(g8_MN, w8_DN.t(), g_scale, w_scale, ctx.x_dtype)
        # w's gradient sums over the tokens (K = M): the gradient's copy transposed, and x's kept copy viewed back
        grad_w_ND = fp8_mm(transposed_copy(g8_MN, ctx.on_kernels), x8_DM.t(), g_scale, x_scale, w_ND.dtype)
        return (grad_x_MD.view(ctx.x_shape), grad_w_ND, None, None, None, grad_lambdas,
                None if v_first_BTHd is None else grad_v_first, None if ve_BTA is None else grad_ve, None, None)


def _no_history_in_older_checkpoints(module: nn.Module, state: dict, prefix: str, *args) -> None:
    """A load_state_dict pre-hook of the parts with an FP8 backward: checkpoints written before their grad_amax was
    saved load with no history (0), as a new run starts."""
    state.setdefault(prefix + "grad_amax", torch.zeros(()))


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int, scale: float, gate: bool = True):
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        attn_dim = num_heads * head_dim
        # q, k, v as one (3, A, D) parameter: one matmul in forward; Muon orthogonalises each of the 3 matrices.
        self.qkv_w = nn.Parameter(torch.empty(3, attn_dim, dim))
        self.proj_w = nn.Parameter(torch.empty(dim, attn_dim))
        # weights of (own values, first layer's values, value embedding) in this layer's values; the second is used
        # only with the value residual (GPTConfig.value_residual), the third only in layers with a value embedding
        self.value_lambdas = nn.Parameter(torch.empty(3))
        # sparse attention gate (record #28, modded-nanogpt 2025-08-23): each head's output is scaled by
        # sigmoid(w_h . x[:G]), read from only the first G = D / 64 channels of the block's normed input, so a head
        # can switch itself off for a token at almost no cost (the gated attention of Qiu et al. 2025, made sparse)
        self.gate_w = nn.Parameter(torch.empty(num_heads, max(1, dim // GATE_FRACTION))) if gate else None
        self.fp8 = False  # the q, k, v projection in FP8 (model/fp8.py); set by runtime.dist.use_device_paths
        self.fp8_backward = False  # with fp8, that projection's input gradient too (FP8QKV); likewise set
        # the absolute maximum of the last gradient of the projection's output, for the next one's e4m3 scale, as the
        # MLP's (whose comment says how it is saved, restored and agreed on between ranks)
        self.register_buffer("grad_amax", torch.zeros(()))
        self.register_load_state_dict_pre_hook(_no_history_in_older_checkpoints)

    def init_weights(self) -> None:
        _uniform_(self.qkv_w, 0.5 * self.qkv_w.size(-1) ** -0.5)  # std 0.5 / sqrt(fan_in): modded-nanogpt
        nn.init.zeros_(self.proj_w)  # zero-init output projection (modded-nanogpt): each block starts as identity
        # 0.5 each: value residual's mix (Zhou et al. 2024) and the value-embedding records' starting weights
        nn.init.constant_(self.value_lambdas, 0.5)
        if self.gate_w is not None:
            nn.init.zeros_(self.gate_w)  # every gate starts at sigmoid(0) = 1/2, as in record #28
        self.grad_amax.zero_()  # a new run has no history (built on the meta device, the buffer holds garbage)

    def forward(self, x_BTD: Tensor, x8_BTD: Tensor | None, gate_in_BTG: Tensor, v_first_BTHd: Tensor | None,
                ve_BTA: Tensor | None, cos_TP: Tensor, sin_TP: Tensor,
                mask: BlockMask | Tensor) -> tuple[Tensor, Tensor]:
        """Returns (output (B, T, D), this layer's mixed values (B, T, H, d) for the value residual). gate_in holds
        x's first G channels (mix_norm), read by the gate; x8, if given, x's e4m3 copy at normed_scale (MixNorm),
        which the FP8 product then reads instead of casting x."""
        B, T, _ = x_BTD.shape
        H, d = self.num_heads, self.head_dim
        qkv_w = self.qkv_w.flatten(0, 1).type_as(x_BTD)
        if self.fp8 and self.fp8_backward:
            q_BTHd, k_BTHd, v_BTHd = FP8QKV.apply(x_BTD, qkv_w, x8_BTD, cos_TP, sin_TP, self.value_lambdas,
                                                  v_first_BTHd, ve_BTA, self.grad_amax, H)
        else:
            if self.fp8:
                qkv_BT3Hd = NormedFP8Linear.apply(x_BTD, qkv_w, x8_BTD)
            else:
                qkv_BT3Hd = F.linear(x_BTD, qkv_w)
            qkv_BT3Hd = qkv_BT3Hd.view(B, T, 3 * H, d)
            q_BTHd, k_BTHd, v_BTHd = (QKVPrep.apply if on_qkv_kernels(x_BTD, d) else qkv_prep)(
                qkv_BT3Hd, cos_TP, sin_TP, self.value_lambdas, v_first_BTHd, ve_BTA)
        y_BHTd = attend(q_BTHd.transpose(1, 2), k_BTHd.transpose(1, 2), v_BTHd.transpose(1, 2), mask, self.scale)
        y_BTHd = y_BHTd.transpose(1, 2)
        if self.gate_w is not None:
            gate_BTH = torch.sigmoid(F.linear(gate_in_BTG, self.gate_w.type_as(gate_in_BTG)))
            y_BTHd = y_BTHd * gate_BTH[..., None]
        y_BTA = y_BTHd.reshape(B, T, H * d)
        return F.linear(y_BTA, self.proj_w.type_as(y_BTA)), v_BTHd


def relu2_matmul(x_MK: Tensor, w_KN: Tensor) -> Tensor:
    """relu(x @ w)^2 (ReLU², So et al. 2021, Primer), by torch ops: ReLU2MLP's path off CUDA and the reference of
    model/mlp_kernels.py's kernel of the same name."""
    return F.relu(x_MK @ w_KN).square()


def relu2_matmul_fp8(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_inv_scale: Tensor) -> tuple[Tensor, Tensor]:
    """h = relu(scale * x8 @ w8^T)^2 in bf16 and its e4m3 copy h * h_inv_scale, both from the fp32 h, for e4m3
    operands (w8 stored (N, K), K-major) in fp32 torch ops: ReLU2MLP's FP8 path off CUDA and the reference of
    model/mlp_kernels.py's kernel of the same name."""
    h_MN = relu2_matmul(x8_MK.float(), w8_NK.float().t() * scale)
    return h_MN.bfloat16(), (h_MN * h_inv_scale).to(torch.float8_e4m3fn)


def relu2_matmul_fp8_t(x8_MK: Tensor, w8_NK: Tensor, scale: Tensor,
                       h_inv_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """relu2_matmul_fp8's h and e4m3 copy, and that copy transposed (N, M), by torch ops: the reference of
    model/mlp_kernels.py's kernel of the same name."""
    h_MN, h8_MN = relu2_matmul_fp8(x8_MK, w8_NK, scale, h_inv_scale)
    return h_MN, h8_MN, h8_MN.t().contiguous()


def relu2_matmul_grad(grad_y_MK: Tensor, w_KN: Tensor, h_MN: Tensor) -> Tensor:
    """The gradient of h = relu(pre)^2 w.r.t. pre, (grad_y @ w) * 2 relu(pre), from h itself: relu(pre) = sqrt(h)."""
    return (grad_y_MK @ w_KN) * (2.0 * h_MN.sqrt())


def relu2_matmul_grad_fp8(grad_y8_MK: Tensor, w8_NK: Tensor, scale: Tensor, h_MN: Tensor,
                          amax: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """relu2_matmul_grad of e4m3 operands, (scale * grad_y8 @ w8^T) * 2 relu(pre) (w8 stored (N, K), K-major), in
    fp32 torch ops, written as e4m3 copies (M, N) and (N, M) at amax's delayed scale, amax then set to the gradient's
    absolute maximum: (g8, g8 transposed, the copies' scale). The reference of model/mlp_kernels.py's kernel of the
    same name."""
    g_MN = relu2_matmul_grad(grad_y8_MK.float(), w8_NK.float().t() * scale, h_MN.float())
    scale = delayed_scale(amax)
    amax.copy_(g_MN.abs().amax())
    g8_MN = to_e4m3(g_MN, scale)
    return g8_MN, g8_MN.t().contiguous(), scale


def matmul_add(h_MK: Tensor, w_NK: Tensor, r_MN: Tensor) -> Tensor:
    """r + h @ w^T, the MLP's output added to the residual stream r, by torch ops: ReLU2MLP's path off CUDA and the
    reference of model/mlp_kernels.py's kernel of the same name (which rounds the sum once, not the product first)."""
    return r_MN + h_MK @ w_NK.t()


def matmul_add_fp8(h8_MK: Tensor, w8_NK: Tensor, scale: Tensor, r_MN: Tensor) -> Tensor:
    """r + scale * h8 @ w8^T for e4m3 operands, summed in fp32 and rounded once to r's dtype, in torch ops: the
    reference of model/mlp_kernels.py's kernel of the same name."""
    return (r_MN.float() + (h8_MK.float() @ w8_NK.float().t()) * scale).to(r_MN.dtype)


# ReLU2MLP's ops off the kernels: the torch functions above, under the kernels' names
TORCH_OPS = SimpleNamespace(relu2_matmul=relu2_matmul, relu2_matmul_fp8=relu2_matmul_fp8,
                            relu2_matmul_fp8_t=relu2_matmul_fp8_t, relu2_matmul_grad=relu2_matmul_grad,
                            relu2_matmul_grad_fp8=relu2_matmul_grad_fp8, matmul_add=matmul_add,
                            matmul_add_fp8=matmul_add_fp8)


class ReLU2MLP(torch.autograd.Function):
    """r + relu(x @ W1)^2 @ W2^T for x (M, D), W1, W2 (D, F) in x's dtype and the residual stream r (M, D), keeping
    only x, the weights and the hidden h = relu(x @ W1)^2 for backward. On Hopper GPUs all three products that make
    or use the (M, F) hidden tensor run in the Gluon kernels of model/mlp_kernels.py, with the ReLU² and the residual's
    add in their epilogues; elsewhere in the torch ops above (same names, same results).

    With fp8 both forward products read e4m3 operands: the first, copies of x (normed: model/fp8.py's fixed scale)
    and of W1, and it writes h twice, in bf16 for the backward and in e4m3 (at relu2_scale's bound, from W1 alone) for
    the second, whose weight W2 is scaled by its absolute maximum. The backward is the same bf16 backward, at h.

    With grad_amax as well (a 0-D fp32 buffer of this MLP's), the backward's four products run in FP8 too: the first
    in the Gluon kernel, on e4m3 copies of the output's gradient and of W2, each at its own amax (model/fp8.py's
    grad_operands: a pass over the (M, D) gradient), the other three in torch._scaled_mm. Each reads its operands
    K-major, the tokens innermost for the weights' gradients, so the copies are laid out for them where they are
    made: the forward's kernel writes h's e4m3 copy transposed too, x's copy is transposed once and kept in place of
    x, the output gradient's copy is transposed once more, and the first backward kernel writes the pre-activation's
    gradient only as e4m3 copies, in both layouts, at grad_amax's delayed scale (model/fp8.py's delayed_scale).
    x's and the output gradient's transposed copies are transposed_copy's: inductor fused its own copy of x's into
    the norm before the MLP, a looped reduction; with the transposing kernel the step took 5.93, 2.01, 5.00 and
    6.41 ms less in four same-machine pairs (bench/results/README.md, sections eacf029 and df03885)."""

    @staticmethod
    def forward(ctx, x_MD: Tensor, fc_DF: Tensor, proj_DF: Tensor, r_MD: Tensor, fp8: bool,
                grad_amax: Tensor | None = None) -> Tensor:
        on_kernels = mlp_kernels is not None and mlp_kernels.supports(x_MD, fc_DF)
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
        # fp8_mm's second operand is read (K, N) column-major: the (N, K) row-major copies, transposed
        grad_x_MD = fp8_mm(g8_MF, to_e4m3(fc_DF, fc_scale).t(), g_scale, fc_scale, grad_y_MD.dtype)
        grad_fc_DF = fp8_mm(x8_DM, g8_FM.t(), x_scale, g_scale, fc_DF.dtype)
        grad_proj_DF = fp8_mm(transposed_copy(gy8_MD, ctx.on_kernels), h8_FM.t(), gy_scale, h_scale, proj_DF.dtype)
        return grad_x_MD, grad_fc_DF, grad_proj_DF, grad_y_MD, None, None


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        # fc_w is stored (D, F), input side first, like record #28's c_fc: both MLP matrices then share one shape
        # (one Muon stack), and Muon's tall-matrix scale max(1, rows / cols) ** 0.5 is 1 for it, as in the record
        # whose learning rate we use (stored (F, D) it would get twice the step)
        self.fc_w = nn.Parameter(torch.empty(dim, hidden_dim))
        self.proj_w = nn.Parameter(torch.empty(dim, hidden_dim))
        self.fp8 = False  # the forward's products in FP8 (ReLU2MLP); set by runtime.dist.use_device_paths
        self.fp8_backward = False  # with fp8, the backward's products too; likewise set
        # the absolute maximum of the last gradient of relu(pre)^2's input, for the next one's e4m3 scale (ReLU2MLP).
        # Saved with the weights, so that a resumed run continues with the scales it had (with several processes the
        # ranks agree on it each step: runtime/dist.py's agree_on_scales); train_gpt2's warm-up restores the initial 0
        self.register_buffer("grad_amax", torch.zeros(()))
        self.register_load_state_dict_pre_hook(_no_history_in_older_checkpoints)

    def init_weights(self) -> None:
        _uniform_(self.fc_w, 0.5 * self.fc_w.size(0) ** -0.5)  # std 0.5 / sqrt(fan_in): modded-nanogpt
        nn.init.zeros_(self.proj_w)  # zero-init output projection (modded-nanogpt)
        self.grad_amax.zero_()  # a new run has no history (built on the meta device, the buffer holds garbage)

    def forward(self, x_BTD: Tensor, residual_BTD: Tensor) -> Tensor:
        """residual + the MLP of x: the residual stream after the MLP."""
        x_MD = x_BTD.flatten(0, 1)
        y_MD = ReLU2MLP.apply(x_MD, self.fc_w.type_as(x_MD), self.proj_w.type_as(x_MD),
                              residual_BTD.flatten(0, 1).contiguous(), self.fp8,
                              self.grad_amax if self.fp8_backward else None)
        return y_MD.view_as(x_BTD)


def skip_add(x: Tensor, s: Tensor, w: Tensor) -> Tensor:
    """x + w s for the U-net skip, w a 0-D weight, by torch ops: SkipAdd's path off CUDA and the reference of
    model/skip_kernels.py's kernel of the same name."""
    return x + w.type_as(x) * s


class SkipAdd(torch.autograd.Function):
    """x + w s with its gradients (g, w g, sum(g s)). On CUDA both directions are one Triton kernel each
    (model/skip_kernels.py), computed in fp32 with w read in its own dtype; elsewhere the torch ops of skip_add."""

    @staticmethod
    def forward(ctx, x: Tensor, s: Tensor, w: Tensor) -> Tensor:
        ctx.on_kernels = x.is_cuda and skip_kernels is not None
        ctx.save_for_backward(s, w)
        return skip_kernels.skip_add(x, s, w) if ctx.on_kernels else skip_add(x, s, w)

    @staticmethod
    def backward(ctx, grad: Tensor):
        s, w = ctx.saved_tensors
        if ctx.on_kernels:
            grad_s, grad_w = skip_kernels.skip_add_grad(grad.contiguous(), s, w)
        else:
            grad_s, grad_w = w.type_as(grad) * grad, (grad * s).sum().to(w.dtype)
        return grad, grad_s, grad_w


def add_all(tensors: list[Tensor]) -> Tensor:
    """The sum of same-shaped tensors: FanOut's backward (compiled by GPT.compile_regions into one kernel)."""
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


class FanOut(torch.autograd.Function):
    """n views of one tensor, one per reader, whose n gradients the backward sums in one call of `add` (a list of
    tensors -> their sum).

    Autograd sums the gradients of a tensor with n readers pairwise as they arrive: n - 1 adds, each reading two
    tensors and writing one. Compiled, `add` reads all n and writes one. For x0, read by all 12 blocks and the
    stream's start (13 readers), autograd's adds took 12 x 52 us per micro-batch on the H200
    (bench/results/profile_step28_1xH200_13c9405.txt). The price: the n gradients wait in memory until the last."""

    @staticmethod
    def forward(ctx, t: Tensor, n: int, add) -> tuple[Tensor, ...]:
        ctx.add = add
        ctx.set_materialize_grads(False)  # a view that the loss does not depend on sends None, not zeros
        return tuple(t.view_as(t) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        present = [g for g in grads if g is not None]
        return ctx.add(present) if present else None, None, None


def sort_ids(ids_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(sorted ids, order) (N,) of a micro-batch's flattened token ids, ids.flatten()[order] = sorted ids: the order
    in which TableRows' backward walks the rows (one sort for all tables)."""
    return torch.sort(ids_BT.flatten(), stable=True)  # stable: each run of one id is summed in the same order


def add_rows(out_VA: Tensor, sorted_ids_N: Tensor, order_N: Tensor, grads_NA: list[Tensor]) -> None:
    """out[sorted_ids[i]] += the sum of the grads' rows order[i] (summed in fp32) in place, by torch ops: TableRows'
    path off CUDA and the reference of model/embed_kernels.py's kernel of the same name."""
    total_NA = grads_NA[0].float()
    for g in grads_NA[1:]:
        total_NA = total_NA + g.float()
    out_VA.index_add_(0, sorted_ids_N.long(), total_NA[order_N.long()].to(out_VA.dtype))


class TableRows(torch.autograd.Function):
    """Rows of an embedding `table`, looked up outside autograd (detached, in any dtype), as `readers` views of them,
    one per reader, whose gradients the backward adds straight into table.grad (made as zeros when it is None),
    summed as it adds them; nothing else is returned to autograd for the table, so it never makes a table-sized
    gradient per micro-batch (model/embed_kernels.py says what that cost), nor sums the readers' gradients in a
    tensor of their own. So the gradient shows only in table.grad: to torch.autograd.grad(loss, table) the table
    looks unused (and the backward adds into table.grad all the same), and the table's gradient hooks do not run.
    `sorted_ids`, `order`: the micro-batch's ids as sort_ids returns them. On CUDA at most two readers (each value
    embedding has two)."""

    @staticmethod
    def forward(ctx, rows_BTA: Tensor, table_VA: Tensor, sorted_ids_N: Tensor, order_N: Tensor,
                readers: int) -> tuple[Tensor, ...]:
        ctx.table = table_VA
        ctx.set_materialize_grads(False)  # a reader the loss does not depend on sends None, not zeros
        ctx.save_for_backward(sorted_ids_N, order_N)
        return tuple(rows_BTA.view_as(rows_BTA) for _ in range(readers))

    @staticmethod
    def backward(ctx, *grads_BTA: Tensor | None):
        (sorted_ids_N, order_N), table = ctx.saved_tensors, ctx.table
        if table.grad is None:
            table.grad = torch.zeros_like(table)
        present = [g.flatten(0, -2).contiguous() for g in grads_BTA if g is not None]
        if present:
            on_kernels = present[0].is_cuda and embed_kernels is not None
            (embed_kernels.add_rows if on_kernels else add_rows)(table.grad, sorted_ids_N, order_N, present)
        return None, None, None, None, None


class Block(nn.Module):
    """x0 mix, attention, MLP. Everything a layer needs arrives as a tensor (or None, or the mask), so all blocks
    share one compiled graph per presence pattern of (v_first, ve, attention, MLP); the one block that shares its
    values (block 0 under the value residual) is a pattern of its own anyway, as it has no v_first."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_ratio: int, attn_scale: float,
                 attention: bool = True, mlp: bool = True, attn_gate: bool = True, shares_values: bool = False):
        super().__init__()
        # a block may go without its attention or its MLP (record #28: no attention in layer 7)
        self.attn = Attention(dim, num_heads, head_dim, attn_scale, attn_gate) if attention else None
        self.mlp = MLP(dim, mlp_ratio * dim) if mlp else None
        # only the block whose values later layers read returns them: autograd fills a zero gradient for each
        # output of a compiled region that nothing reads, one (B, T, H, d) tensor per block and micro-step
        # (returning them from every block cost 5-6 ms of the H200 step, bench/results/README.md, 4ef7db2)
        self.shares_values = shares_values and attention
        # weights of (residual stream, normed embedding x0): the x0 shortcut of modded-nanogpt
        self.lambdas = nn.Parameter(torch.empty(2))

    def init_weights(self) -> None:
        for part in (self.attn, self.mlp):
            if part is not None:
                part.init_weights()
        with torch.no_grad():
            self.lambdas.copy_(torch.tensor([1.0, 0.0]))  # start as a plain residual stream

    def forward(self, x_BTD: Tensor, x0_BTD: Tensor, v_first_BTHd: Tensor | None, ve_BTA: Tensor | None,
                cos_TP: Tensor, sin_TP: Tensor, mask: BlockMask | Tensor) -> tuple[Tensor, Tensor | None]:
        """Returns (new residual stream (B, T, D), this layer's values (B, T, H, d) if it shares them, else None)."""
        v_BTHd = None
        if self.attn is not None:
            gate_width = 0 if self.attn.gate_w is None else self.attn.gate_w.size(1)
            on_kernels = x_BTD.is_cuda and norm_kernels is not None
            if on_kernels:
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
