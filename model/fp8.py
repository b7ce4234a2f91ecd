"""FP8 (e4m3) copies of matrix-product operands, with per-tensor scales, and the blocks' forward products in FP8:
the attention's q, k, v projection here; the MLP's two products in model/layers.py's ReLU2MLP.

Where the scales come from, none by a pass over the activations: a normed input (RMS 1 per row) has |x| <= sqrt(D),
a fixed scale that can never overflow; the MLP's hidden h = relu(x W1)^2 is bounded from its normed input and W1
alone (relu2_scale); a weight is scaled by its own absolute maximum. e4m3 keeps 3 mantissa bits over its whole
normal range, so the fixed scale of a normed input costs no precision against a measured one. h's bound lies far
above its typical values, which then sit low in e4m3's range (of the order of E4M3_MAX / D where x and W1's columns
are not aligned), with subnormals for the smallest, whose absolute error stays below the rounding of the typical ones.

Why only the forward: the step runs at the H200's power limit, where an FP8 product takes about 60% of a bf16 one's
time (bench/results/mlp_fp8_1xH200.json, at the limit: the MLP's first layer 0.243 against 0.405 ms, the qkv
projection 0.179 against 0.289). The backward's products read gradients, whose scale would need a pass of its own
(or a history) to find; they stay in bf16, from the saved bf16 operands (h included: the MLP's first product writes
it in bf16 and in e4m3). Measured for the backward (bench/fp8_backward.py, bench/results/README.md at 41836c2): a
block's seven cuBLAS products in FP8 took 1.02 ms against 1.86 in bf16 at the limit, but 2.24 with the casts of
their operands as kernels of their own. So the backward stays in bf16 until the kernels that make the gradients
(and the transposed inputs that the weight gradients read) write the e4m3 copies themselves. The precision would
do: with all eight backward products on e4m3 values (tensorwise scales from each tensor's amax, emulated), the
short speedrun reached 1.0135 and 1.0165 (seeds 0 and 1; main 1.0159 and 1.0182).
"""
import torch
from torch import Tensor

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def scale_of(t: Tensor) -> Tensor:
    """Per-tensor e4m3 scale from the absolute maximum (an all-zero tensor, like a zero-initialised weight, gets 1)."""
    amax = t.abs().amax().float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def normed_scale(x: Tensor) -> Tensor:
    """The e4m3 scale of rows normed to RMS 1 over their last dim: |x| <= sqrt(D) maps to at most E4M3_MAX."""
    return torch.full((), x.size(-1) ** 0.5 / E4M3_MAX, device=x.device)


def to_e4m3(t: Tensor, scale: Tensor) -> Tensor:
    # the clamp guards rounding at the bound: an out-of-range cast would not saturate on every backend
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def normed_operands(x_MK: Tensor, w_KN: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(x8 (M, K), w8 (N, K), scale) for x @ w: the e4m3 copies of normed rows x and of w (K, N), w's stored K-major
    as Hopper's 8-bit warpgroup MMA reads both operands, and the product of their scales."""
    x_scale, w_scale = normed_scale(x_MK), scale_of(w_KN)
    return to_e4m3(x_MK, x_scale), to_e4m3(w_KN.t(), w_scale).contiguous(), x_scale * w_scale


def relu2_scale(w8_NK: Tensor, scale: Tensor) -> Tensor:
    """The e4m3 scale of h = relu(p)^2, p = scale * x8 @ w8^T, for x8 the e4m3 copy of normed rows (normed_operands),
    from the weight alone, with no pass over h: |p| <= scale |x8 row| |w8 row| (Cauchy-Schwarz), and the copy of a
    row of RMS 1 has norm sqrt(D) / normed_scale = E4M3_MAX up to its elements' roundings (bf16's 2^-9 and e4m3's
    2^-4 of each) and the product's accumulation (2^-9 of the terms' magnitudes, tests/test_fp8.py), which the
    margin 1 + 2^-3 covers. Pre-activations far below the bound put small h among e4m3's subnormals, whose absolute
    error (2^-10 of the scale) stays below the rounding of h's typical values."""
    p_max = (1 + 2 ** -3) * E4M3_MAX * scale * w8_NK.float().square().sum(1).amax().sqrt()
    return torch.where(p_max > 0, p_max.square() / E4M3_MAX, torch.ones_like(p_max))


class NormedFP8Linear(torch.autograd.Function):
    """x @ w^T for normed rows x (..., K) and a weight w (N, K) in x's dtype: the product in FP8 (torch._scaled_mm,
    e4m3 operands, fp32 accumulation, output in x's dtype); the backward in x's dtype from the saved x and w, the
    gradients of the exact product at these operands, as F.linear's backward computes them. x8 is x's e4m3 copy,
    to_e4m3(x, normed_scale(x)), where its producer already wrote one (model/norm_kernels.py), else None."""

    @staticmethod
    def forward(ctx, x: Tensor, w_NK: Tensor, x8: Tensor | None) -> Tensor:
        x_scale, w_scale = normed_scale(x), scale_of(w_NK)
        x8_MK = (to_e4m3(x, x_scale) if x8 is None else x8).reshape(-1, x.size(-1))
        # _scaled_mm takes its second operand column-major: w stored (N, K) row-major is just that, transposed
        out_MN = torch._scaled_mm(x8_MK, to_e4m3(w_NK, w_scale).t(), scale_a=x_scale, scale_b=w_scale,
                                  out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(x, w_NK)
        return out_MN.view(*x.shape[:-1], w_NK.size(0))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w_NK = ctx.saved_tensors
        grad_MN = grad.reshape(-1, grad.size(-1))
        return grad @ w_NK, grad_MN.t() @ x.reshape(-1, x.size(-1)), None
