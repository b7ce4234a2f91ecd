"""Triton kernels of each block's input (model/fast/blocks.py, MixNorm): the x0 mix x = l0 x_in + l1 x0, its RMS
norm n for the attention, and n's first G channels as a tensor of their own for the gate, in one pass over each row
each way. A program holds BLOCK_R whole rows in registers.
- forward: x, n, the gate's input and, with FP8 (mix_norm_fp8), n's e4m3 copy, which spares a cast kernel;
- backward: from the optional gradients of x, n and the gate's input (None skips the read), those of x_in and x0
  and one fp32 partial sum per program and weight, which torch sums in a fixed order. x and 1 / rms are recomputed.

Arithmetic is fp32; n comes from x rounded to the activations' dtype, as the block continues with, so the torch ops
(blocks.py's mix_norm) differ by bf16 rounding only. As in qkv_kernels.py, no @triton.jit helper takes a pointer.

Shape legend: B batch rows, T tokens, D model dim, G gate channels (0 for none); R = B T rows.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from model.fast.fp8 import E4M3_MAX
from model.fast.launch import launcher

_EPS = tl.constexpr(1.1920928955078125e-07)  # F.rms_norm's default: fp32's eps, also for bf16 input
_E4M3_MAX = tl.constexpr(E4M3_MAX)
# (rows per program, warps): the fastest backward tried, and near the fastest forward
FORWARD_CONFIG = (1, 1)
BACKWARD_CONFIG = (1, 1)


@triton.jit
def _rstd(x, D: tl.constexpr):
    """1 / rms of each row of x (rows, BLOCK_D) in fp32, its columns past D zero, as a (rows, 1) column."""
    return tl.rsqrt(tl.sum(x * x, axis=1) / D + _EPS)[:, None]


@triton.jit
def _mix_norm_forward_kernel(x_in_ptr, x0_ptr, lambdas_ptr, x_ptr, n_ptr, gate_ptr, n8_ptr, n8_scale_ptr, R,
                             D: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                             WRITES_FP8: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)[None, :]
    inside = (rows < R)[:, None] & (cols < D)  # D need not be a power of 2
    at = rows.to(tl.int64)[:, None] * D + cols  # B T D may pass 2^31
    x = (tl.load(lambdas_ptr) * tl.load(x_in_ptr + at, mask=inside, other=0.0).to(tl.float32)
         + tl.load(lambdas_ptr + 1) * tl.load(x0_ptr + at, mask=inside, other=0.0).to(tl.float32))
    x = x.to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + at, x, mask=inside)
    x = x.to(tl.float32)
    n = (x * _rstd(x, D)).to(n_ptr.dtype.element_ty)
    tl.store(n_ptr + at, n, mask=inside)
    tl.store(gate_ptr + rows.to(tl.int64)[:, None] * G + cols, n, mask=inside & (cols < G))
    if WRITES_FP8:  # fp8.to_e4m3 of the rounded n
        n8 = tl.clamp(n.to(tl.float32) / tl.load(n8_scale_ptr), -_E4M3_MAX, _E4M3_MAX)
        tl.store(n8_ptr + at, n8.to(n8_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _mix_norm_backward_kernel(x_in_ptr, x0_ptr, lambdas_ptr, g_x_ptr, g_n_ptr, g_gate_ptr, g_x_in_ptr, g_x0_ptr,
                              partial_ptr, R, D: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_D: tl.constexpr, HAS_G_X: tl.constexpr, HAS_G_N: tl.constexpr,
                              HAS_G_GATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)[None, :]
    inside = (rows < R)[:, None] & (cols < D)
    at = rows.to(tl.int64)[:, None] * D + cols
    l0, l1 = tl.load(lambdas_ptr), tl.load(lambdas_ptr + 1)
    x_in = tl.load(x_in_ptr + at, mask=inside, other=0.0).to(tl.float32)
    x0 = tl.load(x0_ptr + at, mask=inside, other=0.0).to(tl.float32)
    x = (l0 * x_in + l1 * x0).to(x_in_ptr.dtype.element_ty).to(tl.float32)  # the forward's rounded x
    r = _rstd(x, D)
    n = x * r

    g_n = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    if HAS_G_N:
        g_n += tl.load(g_n_ptr + at, mask=inside, other=0.0).to(tl.float32)
    if HAS_G_GATE:  # the gate read n's first G channels: their gradient adds to n's
        g_n += tl.load(g_gate_ptr + rows.to(tl.int64)[:, None] * G + cols, mask=inside & (cols < G),
                       other=0.0).to(tl.float32)
    g = r * (g_n - n * (tl.sum(g_n * n, axis=1) / D)[:, None])  # through n = x r: r (g_n - n mean(g_n n))
    if HAS_G_X:
        g += tl.load(g_x_ptr + at, mask=inside, other=0.0).to(tl.float32)
    tl.store(g_x_in_ptr + at, (l0 * g).to(g_x_in_ptr.dtype.element_ty), mask=inside)
    tl.store(g_x0_ptr + at, (l1 * g).to(g_x0_ptr.dtype.element_ty), mask=inside)
    partial = partial_ptr + tl.program_id(0) * 2
    tl.store(partial, tl.sum(tl.sum(g * x_in, axis=1), axis=0))
    tl.store(partial + 1, tl.sum(tl.sum(g * x0, axis=1), axis=0))


def _check(x_in: Tensor, x0: Tensor, lambdas: Tensor) -> None:
    torch._check(x_in.shape == x0.shape and x_in.dtype == x0.dtype and x_in.is_contiguous() and x0.is_contiguous(),
                 lambda: "x_in and x0 must be contiguous tensors of one shape and dtype")
    torch._check(lambdas.shape == (2,) and lambdas.is_contiguous(), lambda: "two weights, of (x_in, x0)")


def _forward(x_in: Tensor, x0: Tensor, lambdas: Tensor, gate_width: int,
             n8_scale: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One launch of the forward kernel: (x, n, gate input, and n's e4m3 copy at n8_scale if one is given)."""
    _check(x_in, x0, lambdas)
    D = x_in.size(-1)
    torch._check(0 <= gate_width <= D, lambda: "the gate reads at most the D channels of n")
    x, n = torch.empty_like(x_in), torch.empty_like(x_in)
    gate = x_in.new_empty((*x_in.shape[:-1], gate_width))
    n8 = None if n8_scale is None else torch.empty_like(x_in, dtype=torch.float8_e4m3fn)
    block_r, warps = FORWARD_CONFIG
    R = x_in.numel() // D
    # pointers never used stand in as n's and lambdas' (a 0-element tensor may have none)
    launcher(_mix_norm_forward_kernel)[(triton.cdiv(R, block_r),)](
        x_in, x0, lambdas, x, n, gate if gate_width else n, n if n8 is None else n8,
        lambdas if n8_scale is None else n8_scale, R, D=D, G=gate_width, BLOCK_R=block_r,
        BLOCK_D=triton.next_power_of_2(D), WRITES_FP8=n8 is not None, num_warps=warps)
    return x, n, gate, n8


@triton_op("speedrun::mix_norm", mutates_args=())
def mix_norm(x_in: Tensor, x0: Tensor, lambdas: Tensor, gate_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """(x, n, n[..., :gate_width] as its own contiguous tensor), each in x_in's dtype."""
    return _forward(x_in, x0, lambdas, gate_width, None)[:3]


@triton_op("speedrun::mix_norm_fp8", mutates_args=())
def mix_norm_fp8(x_in: Tensor, x0: Tensor, lambdas: Tensor, gate_width: int,
                 n8_scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mix_norm's outputs and n's e4m3 copy to_e4m3(n, n8_scale), the attention's FP8 input, from the same pass."""
    torch._check(n8_scale.numel() == 1 and n8_scale.dtype == torch.float32, lambda: "one fp32 scale for n's copy")
    return _forward(x_in, x0, lambdas, gate_width, n8_scale)


@triton_op("speedrun::mix_norm_grad", mutates_args=())
def mix_norm_grad(g_x: Tensor | None, g_n: Tensor | None, g_gate: Tensor | None, x_in: Tensor, x0: Tensor,
                  lambdas: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of (x_in, x0, lambdas) from those of (x, n, gate input), each contiguous or None."""
    _check(x_in, x0, lambdas)
    D = x_in.size(-1)
    for g in (g_x, g_n):
        if g is not None:
            torch._check(g.shape == x_in.shape and g.is_contiguous(), lambda: "contiguous gradients of x and n")
    G = 0 if g_gate is None else g_gate.size(-1)
    if g_gate is not None:
        torch._check(g_gate.shape == (*x_in.shape[:-1], G) and G <= D and g_gate.is_contiguous(),
                     lambda: "a contiguous gradient of the gate's input, (B, T, G)")
    g_x_in, g_x0 = torch.empty_like(x_in), torch.empty_like(x0)
    block_r, warps = BACKWARD_CONFIG
    R = x_in.numel() // D
    programs = triton.cdiv(R, block_r)
    partial = torch.empty((programs, 2), dtype=torch.float32, device=x_in.device)
    # an absent gradient is never read: its pointer is x_in's
    launcher(_mix_norm_backward_kernel)[(programs,)](
        x_in, x0, lambdas, x_in if g_x is None else g_x, x_in if g_n is None else g_n,
        x_in if g_gate is None or G == 0 else g_gate, g_x_in, g_x0, partial, R, D=D, G=G, BLOCK_R=block_r,
        BLOCK_D=triton.next_power_of_2(D), HAS_G_X=g_x is not None, HAS_G_N=g_n is not None,
        HAS_G_GATE=g_gate is not None and G > 0, num_warps=warps)
    return g_x_in, g_x0, partial.sum(dim=0).to(lambdas.dtype)
