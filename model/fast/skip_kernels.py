"""Triton kernels of the U-net skip (model/layers.py, SkipAdd) on CUDA: out = x + w s, with s the output of a
first-half block and w its learned 0-D weight, and the gradients w g (for s) and sum(g s) (for w).

The skip runs between the compiled blocks, as eager torch ops. There, the product with the 0-D weight took
torch's unvectorised broadcast kernel (`elementwise_kernel<128, 4, ...>` in
bench/results/profile_step28_1xH200_fa8347a.txt, 92 us a call), and forward and backward took five kernels. Here
the forward reads x and s once and writes out; the backward reads g and s once and writes w g and one fp32 partial
sum per program, which torch sums (a fixed order: the same bits every run). Per 49,152-token micro-batch on the
H200 the forward took 0.059 ms against 0.145, forward + backward 0.231 against 0.426
(bench/results/skip_kernels_1xH200.json), and the whole step 685.6 ms against 696.8 on one machine
(bench/results/README.md).

The launches are direct, not through torch.library: these run eagerly, and the MLP's kernels, called eagerly
through `wrap_triton`, took 0.95 and 1.10 ms between two CUDA events against 0.43 ms in the compiled step
(bench/results/README.md): the host's launch, slower than the kernel. Weights are read in their own dtype (fp32
masters) and all arithmetic is fp32; the stored tensors take x's dtype.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

# 4,096 elements per program of 8 warps: 16 per thread, two 16-byte bf16 loads per operand
_BLOCK, _WARPS = 4096, 8


@triton.jit
def _skip_add_kernel(x_ptr, s_ptr, w_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 49,152 x 768 x B passes 2^31 at B = 57
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
    """x + w s in x's dtype, computed in fp32: model.layers.skip_add."""
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
