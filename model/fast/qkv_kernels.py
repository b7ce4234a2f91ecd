"""Triton kernels of the attention's inputs (model/fast/blocks.py, QKVPrep): from the fused projection's
(B, T, 3H, d) output, q and k's QK-norm and rotary embedding and the values' mix, reading every row once each way.
- forward: q, k, v and the optional value inputs in; q, k normed and rotated, and the mixed v out;
- backward: the output gradients (any strides: FlexAttention's come transposed) and the forward's inputs in; the
  projection's gradient (for FP8QKV only as an e4m3 copy at a delayed scale, with its amax), the value inputs'
  gradients and one fp32 partial sum per program and value weight, which torch sums in a fixed order. 1 / rms is
  recomputed, not saved.

Arithmetic is fp32, one rounding per stored value. Configurations are fixed, as autotuning would lengthen the cold
compile. No @triton.jit helper takes a pointer: inductor would count it as written and copy it.

Shape legend: B batch rows, T tokens, H heads, d head dim, P = d // 2 rotary pairs; R = B T H rows of d.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from model.fast.fp8 import E4M3_MAX, delayed_scale
from model.fast.launch import launcher

_EPS = tl.constexpr(1.1920928955078125e-07)  # F.rms_norm's default: fp32's eps, also for bf16 input
_E4M3_MAX = tl.constexpr(E4M3_MAX)
# (rows per program, warps): the fastest backward tried and near the fastest forward, with or without value inputs
FORWARD_CONFIG = (16, 4)
BACKWARD_CONFIG = (16, 4)


@triton.jit
def _norm_rotary(x1, x2, cos, sin, D: tl.constexpr):
    """Rows of (x1, x2), each half (rows, P) in fp32: RMS-normed over both halves, then pair j turned by its angle."""
    r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + _EPS)[:, None]
    n1, n2 = x1 * r, x2 * r
    return n1 * cos + n2 * sin, n2 * cos - n1 * sin


@triton.jit
def _norm_rotary_grad(x1, x2, g1, g2, cos, sin, D: tl.constexpr):
    """The gradient for (x1, x2) of _norm_rotary's output, given its gradient (g1, g2)."""
    r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + _EPS)[:, None]
    n1, n2 = x1 * r, x2 * r
    dn1, dn2 = g1 * cos - g2 * sin, g1 * sin + g2 * cos
    dot = ((tl.sum(dn1 * n1, axis=1) + tl.sum(dn2 * n2, axis=1)) / D)[:, None]
    return r * (dn1 - n1 * dot), r * (dn2 - n2 * dot)


@triton.jit
def _qkv_forward_kernel(qkv_ptr, cos_ptr, sin_ptr, lambdas_ptr, v_first_ptr, ve_ptr, q_ptr, k_ptr, v_ptr, R, T,
                    H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_V_FIRST: tl.constexpr,
                    HAS_VE: tl.constexpr):
    P: tl.constexpr = D // 2
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = (rows < R)[:, None]
    half, full = tl.arange(0, P)[None, :], tl.arange(0, D)[None, :]
    token = (rows // H).to(tl.int64)
    src = (token * (3 * H * D) + (rows % H) * D)[:, None]  # row (t, h) of q; k and v are H and 2H rows further
    dst = rows.to(tl.int64)[:, None] * D  # (B, T, H, d) outputs and value inputs
    angle = (token % T)[:, None] * P + half
    cos = tl.load(cos_ptr + angle, mask=inside, other=0.0)
    sin = tl.load(sin_ptr + angle, mask=inside, other=0.0)

    x1 = tl.load(qkv_ptr + src + half, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + src + P + half, mask=inside, other=0.0).to(tl.float32)
    o1, o2 = _norm_rotary(x1, x2, cos, sin, D)
    tl.store(q_ptr + dst + half, o1.to(q_ptr.dtype.element_ty), mask=inside)
    tl.store(q_ptr + dst + P + half, o2.to(q_ptr.dtype.element_ty), mask=inside)

    x1 = tl.load(qkv_ptr + src + H * D + half, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + src + H * D + P + half, mask=inside, other=0.0).to(tl.float32)
    o1, o2 = _norm_rotary(x1, x2, cos, sin, D)
    tl.store(k_ptr + dst + half, o1.to(k_ptr.dtype.element_ty), mask=inside)
    tl.store(k_ptr + dst + P + half, o2.to(k_ptr.dtype.element_ty), mask=inside)

    v = tl.load(lambdas_ptr) * tl.load(qkv_ptr + src + 2 * H * D + full, mask=inside, other=0.0).to(tl.float32)
    if HAS_V_FIRST:
        v += tl.load(lambdas_ptr + 1) * tl.load(v_first_ptr + dst + full, mask=inside, other=0.0).to(tl.float32)
    if HAS_VE:
        v += tl.load(lambdas_ptr + 2) * tl.load(ve_ptr + dst + full, mask=inside, other=0.0).to(tl.float32)
    tl.store(v_ptr + dst + full, v.to(v_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _abs_max(x):
    return tl.max(tl.max(tl.abs(x), axis=1), axis=0)


@triton.jit
def _e4m3(x, inv_scale):
    """fp8.to_e4m3 at the scale whose inverse is inv_scale."""
    return tl.clamp(x * inv_scale, -_E4M3_MAX, _E4M3_MAX).to(tl.float8e4nv)


@triton.jit
def _qkv_backward_kernel(qkv_ptr, cos_ptr, sin_ptr, lambdas_ptr, v_first_ptr, ve_ptr, dq_ptr, dk_ptr, dv_ptr,
                     dq_sb, dq_st, dq_sh, dk_sb, dk_st, dk_sh, dv_sb, dv_st, dv_sh,
                     dqkv_ptr, dv_first_ptr, dve_ptr, partial_ptr, g8_ptr, inv_scale_ptr, amax_ptr, R, T,
                     H: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_V_FIRST: tl.constexpr,
                     HAS_VE: tl.constexpr, FP8: tl.constexpr):
    P: tl.constexpr = D // 2
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = (rows < R)[:, None]
    half, full = tl.arange(0, P)[None, :], tl.arange(0, D)[None, :]
    token = (rows // H).to(tl.int64)
    head = rows % H
    batch, t = token // T, token % T
    src = (token * (3 * H * D) + head * D)[:, None]
    dst = rows.to(tl.int64)[:, None] * D
    angle = t[:, None] * P + half
    cos = tl.load(cos_ptr + angle, mask=inside, other=0.0)
    sin = tl.load(sin_ptr + angle, mask=inside, other=0.0)
    # FP8: dqkv only as an e4m3 copy and its amax (one atomic per program)
    inv_scale = 1.0
    amax = 0.0
    if FP8:
        inv_scale = tl.load(inv_scale_ptr)

    g = (batch * dq_sb + t * dq_st + head * dq_sh)[:, None]
    x1 = tl.load(qkv_ptr + src + half, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + src + P + half, mask=inside, other=0.0).to(tl.float32)
    g1 = tl.load(dq_ptr + g + half, mask=inside, other=0.0).to(tl.float32)
    g2 = tl.load(dq_ptr + g + P + half, mask=inside, other=0.0).to(tl.float32)
    d1, d2 = _norm_rotary_grad(x1, x2, g1, g2, cos, sin, D)
    if FP8:
        tl.store(g8_ptr + src + half, _e4m3(d1, inv_scale), mask=inside)
        tl.store(g8_ptr + src + P + half, _e4m3(d2, inv_scale), mask=inside)
        amax = tl.maximum(amax, tl.maximum(_abs_max(d1), _abs_max(d2)))
    else:
        tl.store(dqkv_ptr + src + half, d1.to(dqkv_ptr.dtype.element_ty), mask=inside)
        tl.store(dqkv_ptr + src + P + half, d2.to(dqkv_ptr.dtype.element_ty), mask=inside)

    g = (batch * dk_sb + t * dk_st + head * dk_sh)[:, None]
    x1 = tl.load(qkv_ptr + src + H * D + half, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + src + H * D + P + half, mask=inside, other=0.0).to(tl.float32)
    g1 = tl.load(dk_ptr + g + half, mask=inside, other=0.0).to(tl.float32)
    g2 = tl.load(dk_ptr + g + P + half, mask=inside, other=0.0).to(tl.float32)
    d1, d2 = _norm_rotary_grad(x1, x2, g1, g2, cos, sin, D)
    if FP8:
        tl.store(g8_ptr + src + H * D + half, _e4m3(d1, inv_scale), mask=inside)
        tl.store(g8_ptr + src + H * D + P + half, _e4m3(d2, inv_scale), mask=inside)
        amax = tl.maximum(amax, tl.maximum(_abs_max(d1), _abs_max(d2)))
    else:
        tl.store(dqkv_ptr + src + H * D + half, d1.to(dqkv_ptr.dtype.element_ty), mask=inside)
        tl.store(dqkv_ptr + src + H * D + P + half, d2.to(dqkv_ptr.dtype.element_ty), mask=inside)

    g_v = tl.load(dv_ptr + (batch * dv_sb + t * dv_st + head * dv_sh)[:, None] + full, mask=inside,
                  other=0.0).to(tl.float32)
    v_own = tl.load(qkv_ptr + src + 2 * H * D + full, mask=inside, other=0.0).to(tl.float32)
    d_v = tl.load(lambdas_ptr) * g_v
    if FP8:
        tl.store(g8_ptr + src + 2 * H * D + full, _e4m3(d_v, inv_scale), mask=inside)
        tl.atomic_max(amax_ptr, tl.maximum(amax, _abs_max(d_v)))
    else:
        tl.store(dqkv_ptr + src + 2 * H * D + full, d_v.to(dqkv_ptr.dtype.element_ty), mask=inside)
    partial = partial_ptr + tl.program_id(0) * 3
    tl.store(partial, tl.sum(tl.sum(g_v * v_own, axis=1), axis=0))
    if HAS_V_FIRST:
        v_first = tl.load(v_first_ptr + dst + full, mask=inside, other=0.0).to(tl.float32)
        tl.store(dv_first_ptr + dst + full, (tl.load(lambdas_ptr + 1) * g_v).to(dv_first_ptr.dtype.element_ty),
                 mask=inside)
        tl.store(partial + 1, tl.sum(tl.sum(g_v * v_first, axis=1), axis=0))
    else:
        tl.store(partial + 1, 0.0)
    if HAS_VE:
        ve = tl.load(ve_ptr + dst + full, mask=inside, other=0.0).to(tl.float32)
        tl.store(dve_ptr + dst + full, (tl.load(lambdas_ptr + 2) * g_v).to(dve_ptr.dtype.element_ty), mask=inside)
        tl.store(partial + 2, tl.sum(tl.sum(g_v * ve, axis=1), axis=0))
    else:
        tl.store(partial + 2, 0.0)


def supports(head_dim: int) -> bool:
    """Whether the kernels take this head width: each half must be a power of 2 (one tl.arange)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 1 and half & (half - 1) == 0


def _check(qkv: Tensor, cos: Tensor, sin: Tensor, lambdas: Tensor, *values: Tensor | None) -> None:
    B, T, H3, d = qkv.shape
    torch._check(qkv.is_contiguous() and H3 % 3 == 0 and supports(d),
                 lambda: "qkv must be the projection's contiguous (B, T, 3H, d) output, d a power of 2 "
                         "(model.fast.qkv_kernels.supports)")
    torch._check(cos.shape == sin.shape == (T, d // 2) and cos.is_contiguous() and sin.is_contiguous()
                 and cos.dtype == sin.dtype == torch.float32, lambda: "cos and sin must be contiguous fp32 (T, d/2)")
    torch._check(lambdas.shape == (3,) and lambdas.is_contiguous(), lambda: "three value weights")
    for t in values:
        if t is not None:
            torch._check(t.numel() == qkv.numel() // 3 and t.is_contiguous(),
                         lambda: "value inputs must be contiguous, (B, T, H, d) or (B, T, H d)")


@triton_op("speedrun::qkv_prep", mutates_args=())
def qkv_prep(qkv: Tensor, cos: Tensor, sin: Tensor, lambdas: Tensor, v_first: Tensor | None,
             ve: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v), each (B, T, H, d) in qkv's dtype: model.gpt.prepare_qkv."""
    _check(qkv, cos, sin, lambdas, v_first, ve)
    B, T, H3, d = qkv.shape
    H = H3 // 3
    q, k, v = (qkv.new_empty((B, T, H, d)) for _ in range(3))
    block_r, warps = FORWARD_CONFIG
    R = B * T * H
    launcher(_qkv_forward_kernel)[(triton.cdiv(R, block_r),)](
        qkv, cos, sin, lambdas, qkv if v_first is None else v_first, qkv if ve is None else ve, q, k, v, R, T,
        H=H, D=d, BLOCK_R=block_r, HAS_V_FIRST=v_first is not None, HAS_VE=ve is not None, num_warps=warps)
    return q, k, v


def _backward(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, lambdas: Tensor,
              v_first: Tensor | None, ve: Tensor | None, g8: Tensor | None, inv_scale: Tensor | None,
              amax: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dqkv, lambdas' gradient, v_first's, ve's); with g8, dqkv only as its e4m3 copy into g8, amax raised."""
    _check(qkv, cos, sin, lambdas, v_first, ve)
    B, T, H3, d = qkv.shape
    H = H3 // 3
    for g in (dq, dk, dv):
        torch._check(g.shape == (B, T, H, d) and g.stride(3) == 1,
                     lambda: "output gradients of shape (B, T, H, d), each row unit-stride")
    # unwritten outputs' pointers are dqkv's (a 0-element tensor may have none); with FP8 dqkv is g8
    dqkv = torch.empty_like(qkv) if g8 is None else g8
    dv_first = torch.empty_like(v_first) if v_first is not None else qkv.new_empty(0)
    dve = torch.empty_like(ve) if ve is not None else qkv.new_empty(0)
    block_r, warps = BACKWARD_CONFIG
    R = B * T * H
    programs = triton.cdiv(R, block_r)
    partial = torch.empty((programs, 3), dtype=torch.float32, device=qkv.device)
    launcher(_qkv_backward_kernel)[(programs,)](
        qkv, cos, sin, lambdas, qkv if v_first is None else v_first, qkv if ve is None else ve, dq, dk, dv,
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), dqkv, dqkv if v_first is None else dv_first,
        dqkv if ve is None else dve, partial, dqkv, partial if inv_scale is None else inv_scale,
        partial if amax is None else amax, R, T, H=H, D=d, BLOCK_R=block_r, HAS_V_FIRST=v_first is not None,
        HAS_VE=ve is not None, FP8=g8 is not None, num_warps=warps)
    return dqkv, partial.sum(dim=0).to(lambdas.dtype), dv_first, dve


@triton_op("speedrun::qkv_prep_grad", mutates_args=())
def qkv_prep_grad(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, lambdas: Tensor,
                  v_first: Tensor | None, ve: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of (qkv, lambdas, v_first, ve); an absent value input's is empty, its lambda's 0."""
    return _backward(dq, dk, dv, qkv, cos, sin, lambdas, v_first, ve, None, None, None)


@triton_op("speedrun::qkv_prep_grad_fp8", mutates_args=("amax",))
def qkv_prep_grad_fp8(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, lambdas: Tensor,
                      v_first: Tensor | None, ve: Tensor | None,
                      amax: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """qkv_prep_grad with qkv's gradient only as an e4m3 copy (B T, 3 H d) at amax's delayed scale; amax then holds
    its absolute maximum. Returns (g8, scale, lambdas', v_first's, ve's gradients); reference:
    model.fast.blocks.qkv_prep_grad_fp8."""
    torch._check(amax.dtype == torch.float32 and amax.dim() == 0, lambda: "amax must be a 0-D fp32 tensor")
    B, T, H3, d = qkv.shape
    scale = delayed_scale(amax)
    amax.zero_()  # after the scale is read: the kernel raises it from 0
    g8 = qkv.new_empty((B * T, H3 * d), dtype=torch.float8_e4m3fn)
    _, *others = _backward(dq, dk, dv, qkv, cos, sin, lambdas, v_first, ve, g8, 1 / scale, amax)
    return g8, scale, *others
