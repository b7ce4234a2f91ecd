"""Triton kernels of each block's input (model/layers.py, MixNorm) on CUDA: the x0 mix x = l0 x_in + l1 x0 with
(l0, l1) = lambdas, its RMS norm n for the attention, and n's first G channels as their own tensor for the attention
gate, in one pass over each row each way.

Compiled from torch ops, the backward was one inductor kernel that loops twice over each row (the norm's mean, then
the gradients), adds the gate slice's gradient into n's and writes an fp32 intermediate: 173.9 us per call, 88 calls
(15.3 ms) per step (bench/results/profile_step28_1xH200_033b50a.txt,
triton_red_fused__fused_rms_norm__fused_rms_norm_backward__to_copy_add), for 0.45 GB of traffic, 106 us at the
4.26 TB/s a copy reached there. Here a program holds BLOCK_R whole rows in registers. Profiled in the compiled
record model on one H200 (one 49,152-token micro-batch; bench/results/norm_in_model_1xH200.txt), the backward took
111.5 us against inductor's 175.4 and the forward 73.6 against 54.4; the forward also writes x, which the MLP's
norm then reads instead of recomputing the mix (91.8 us there against 108.4). The whole step took 639.9 ms against
645.4 on one machine (bench/results/README.md).
- forward: x_in, x0 and the fp32 weights in; x and n (B, T, D) and the gate's input n[..., :G] (B, T, G) out, and
  with FP8 (mix_norm_fp8) n's e4m3 copy for the attention's FP8 product, one byte per value more of traffic where
  a cast kernel of its own read n again;
- backward: the gradients of x, n and the gate's input (each optional: None skips its read) and the forward's
  inputs in; the gradients of x_in and x0 and one fp32 partial sum per program and weight out, which torch sums
  (a fixed order: the same bits every run). x and the norm's 1 / rms are recomputed, not saved.

All arithmetic is fp32, with the weights read as the fp32 masters. x is rounded once to the activations' dtype,
and n is computed from that rounded x, the residual stream the block continues with; the torch ops round the
weights, each product and their sum to bf16, so the two paths differ by bf16 rounding only.
The functions are torch.library.triton_ops, as in model/qkv_kernels.py: they run inside the compiled blocks, where
inductor launches the kernels directly. Launch configurations are fixed (autotuning would lengthen the cold
compile). As there, no @triton.jit helper takes a pointer: inductor would count it as written and copy it.

Shape legend: B batch rows, T tokens, D model dim, G gate channels (D / 64 in the model, 0 for none); R = B T rows.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from model.fp8 import E4M3_MAX

_EPS = tl.constexpr(1.1920928955078125e-07)  # F.rms_norm's default: fp32's eps, also for bf16 input
_E4M3_MAX = tl.constexpr(E4M3_MAX)
# (rows per program, warps): of 16 configurations (1-8 rows, 1-8 warps; bench/results/norm_kernels_1xH200.json),
# the fastest backward, 0.115 ms (3.9 TB/s), against 0.129-0.46 ms for the others, and within 1% of the fastest
# forward, 0.078 ms (3.9 TB/s)
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
    inside = (rows < R)[:, None] & (cols < D)  # D = 768 is no power of 2: the tile's row is BLOCK_D wide
    at = rows.to(tl.int64)[:, None] * D + cols  # B T D passes 2^31 at B = 57 of the record's T = 49,152
    x = (tl.load(lambdas_ptr) * tl.load(x_in_ptr + at, mask=inside, other=0.0).to(tl.float32)
         + tl.load(lambdas_ptr + 1) * tl.load(x0_ptr + at, mask=inside, other=0.0).to(tl.float32))
    x = x.to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + at, x, mask=inside)
    x = x.to(tl.float32)
    n = (x * _rstd(x, D)).to(n_ptr.dtype.element_ty)
    tl.store(n_ptr + at, n, mask=inside)
    tl.store(gate_ptr + rows.to(tl.int64)[:, None] * G + cols, n, mask=inside & (cols < G))
    if WRITES_FP8:  # model.fp8.to_e4m3 of the rounded n, the same division and clamp
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
    # without a gate or a copy nothing is stored there: their pointers are n's (a 0-element tensor may have none),
    # and without a copy its scale is never read: that pointer is lambdas'
    wrap_triton(_mix_norm_forward_kernel)[(triton.cdiv(R, block_r),)](
        x_in, x0, lambdas, x, n, gate if gate_width else n, n if n8 is None else n8,
        lambdas if n8_scale is None else n8_scale, R, D=D, G=gate_width, BLOCK_R=block_r,
        BLOCK_D=triton.next_power_of_2(D), WRITES_FP8=n8 is not None, num_warps=warps)
    return x, n, gate, n8


@triton_op("speedrun::mix_norm", mutates_args=())
def mix_norm(x_in: Tensor, x0: Tensor, lambdas: Tensor, gate_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """(x, n, n[..., :gate_width] as its own contiguous tensor), each in x_in's dtype: model.layers.mix_norm."""
    return _forward(x_in, x0, lambdas, gate_width, None)[:3]


@triton_op("speedrun::mix_norm_fp8", mutates_args=())
def mix_norm_fp8(x_in: Tensor, x0: Tensor, lambdas: Tensor, gate_width: int,
                 n8_scale: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mix_norm's three outputs and n's e4m3 copy, model.fp8.to_e4m3(n, n8_scale), from the same pass: the input of
    the attention's FP8 product (model.fp8.NormedFP8Linear), which then needs no cast kernel of its own."""
    torch._check(n8_scale.numel() == 1 and n8_scale.dtype == torch.float32, lambda: "one fp32 scale for n's copy")
    return _forward(x_in, x0, lambdas, gate_width, n8_scale)


@triton_op("speedrun::mix_norm_grad", mutates_args=())
def mix_norm_grad(g_x: Tensor | None, g_n: Tensor | None, g_gate: Tensor | None, x_in: Tensor, x0: Tensor,
                  lambdas: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients for (x_in, x0, lambdas) from those of mix_norm's outputs (x, n, gate input), all contiguous;
    None for an output that got none."""
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
    wrap_triton(_mix_norm_backward_kernel)[(programs,)](
        x_in, x0, lambdas, x_in if g_x is None else g_x, x_in if g_n is None else g_n,
        x_in if g_gate is None or G == 0 else g_gate, g_x_in, g_x0, partial, R, D=D, G=G, BLOCK_R=block_r,
        BLOCK_D=triton.next_power_of_2(D), HAS_G_X=g_x is not None, HAS_G_N=g_n is not None,
        HAS_G_GATE=g_gate is not None and G > 0, num_warps=warps)
    return g_x_in, g_x0, partial.sum(dim=0).to(lambdas.dtype)
