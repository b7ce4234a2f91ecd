"""Triton kernels of the U-net skip (model/fast/routing.py, SkipAdd): out = x + w s, w a 0-D weight, and the
gradients w g and sum(g s), each reading its inputs once, in fp32; torch sums the per-program partial sums in a
fixed order. The skip runs eagerly, so the launches are direct: torch.library's eager launch costs more host time.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

# 4,096 elements per program of 8 warps: 16 per thread, two 16-byte bf16 loads per operand
_BLOCK, _WARPS = 4096, 8


@triton.jit
def _skip_add_kernel(x_ptr, s_ptr, w_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # the element count may pass 2^31
    inside = offsets < n
    w = tl.load(w_ptr).to(tl.float32)
    x = tl.load(x_ptr + offsets, mask=inside).to(tl.float32)
    s = tl.load(s_ptr + offsets, mask=inside).to(tl.float32)
    tl.store(out_ptr + offsets, (x + w * s).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _skip_add_grad_kernel(g_ptr, s_ptr, w_ptr, grad_s_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    w = tl.load(w_ptr).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(grad_s_ptr + offsets, (w * g).to(grad_s_ptr.dtype.element_ty), mask=inside)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(g * s, axis=0))


def _check(x: Tensor, s: Tensor, w: Tensor) -> None:
    torch._check(x.shape == s.shape and x.dtype == s.dtype and x.is_contiguous() and s.is_contiguous()
                 and w.dim() == 0 and x.device == s.device == w.device,
                 lambda: f"skip_add takes two contiguous tensors of one shape and dtype and a 0-D weight on their "
                         f"device; got {tuple(x.shape)} {x.dtype}, {tuple(s.shape)} {s.dtype}, a weight of shape "
                         f"{tuple(w.shape)}")


def skip_add(x: Tensor, s: Tensor, w: Tensor) -> Tensor:
    """x + w s in x's dtype, computed in fp32: model.fast.routing.skip_add."""
    _check(x, s, w)
    out = torch.empty_like(x)
    n = x.numel()
    _skip_add_kernel[(triton.cdiv(n, _BLOCK),)](x, s, w, out, n, BLOCK=_BLOCK, num_warps=_WARPS)
    return out


def skip_add_grad(g: Tensor, s: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(w g in g's dtype, sum(g s) as a 0-D tensor in w's dtype): the gradients of skip_add for s and w."""
    _check(g, s, w)
    grad_s = torch.empty_like(g)
    n = g.numel()
    programs = triton.cdiv(n, _BLOCK)
    partial = torch.empty(programs, dtype=torch.float32, device=g.device)
    _skip_add_grad_kernel[(programs,)](g, s, w, grad_s, partial, n, BLOCK=_BLOCK, num_warps=_WARPS)
    return grad_s, partial.sum().to(w.dtype)
