"""FP8 (e4m3) operand copies with per-tensor scales, for the FP8 products of model/fast. No scale costs a pass over
activations: a normed input has |x| <= sqrt(D), a fixed scale that loses no precision (e4m3 keeps 3 mantissa bits
over its normal range), the MLP's hidden is bounded from W1 (relu2_scale), a weight takes its own amax. Gradients,
with no bound known in advance, get delayed scales (delayed_scale).
"""
import torch
from torch import Tensor

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def scale_of(t: Tensor) -> Tensor:
    """Per-tensor e4m3 scale from the absolute maximum (1 for an all-zero tensor)."""
    return delayed_scale(t.abs().amax().float())


def delayed_scale(amax: Tensor) -> Tensor:
    """The e4m3 scale mapping a 0-D fp32 amax to E4M3_MAX (1 for 0). Gradient copies take their site's previous
    amax (as in Transformer Engine); larger values saturate."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def normed_scale(x: Tensor) -> Tensor:
    """The e4m3 scale of rows of RMS 1: |x| <= sqrt(D) maps to at most E4M3_MAX."""
    return torch.full((), x.size(-1) ** 0.5 / E4M3_MAX, device=x.device)


def to_e4m3(t: Tensor, scale: Tensor) -> Tensor:
    # an out-of-range cast does not saturate on every backend
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def k_major_weight(w_KN: Tensor) -> tuple[Tensor, Tensor]:
    """(w8 (N, K), its scale): w (K, N)'s e4m3 copy at its own amax, K-major."""
    w_scale = scale_of(w_KN)
    return to_e4m3(w_KN.t(), w_scale).contiguous(), w_scale


def normed_operands(x_MK: Tensor, w_KN: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(x8 (M, K), w8 (N, K), their scales' product) for x @ w, x normed rows."""
    x_scale = normed_scale(x_MK)
    w8_NK, w_scale = k_major_weight(w_KN)
    return to_e4m3(x_MK, x_scale), w8_NK, x_scale * w_scale


def grad_operands(g_MK: Tensor, w_KN: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(g8 (M, K), w8 (N, K), g's scale, w's scale) for g @ w, each at its own amax."""
    g_scale = scale_of(g_MK)
    w8_NK, w_scale = k_major_weight(w_KN)
    return to_e4m3(g_MK, g_scale), w8_NK, g_scale, w_scale


def relu2_scale(w8_NK: Tensor, scale: Tensor) -> Tensor:
    """The e4m3 scale of h = relu(p)^2, p = scale * x8 @ w8^T, x8 normed rows' copy: |p| <= scale |x8 row| |w8 row|
    (Cauchy-Schwarz), x8's rows have norm E4M3_MAX, and the margin 1 + 2^-3 covers roundings and accumulation."""
    p_max = (1 + 2 ** -3) * E4M3_MAX * scale * w8_NK.float().square().sum(1).amax().sqrt()
    return torch.where(p_max > 0, p_max.square() / E4M3_MAX, torch.ones_like(p_max))


def fp8_mm(a8_MK: Tensor, b8_KN: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(a_scale a8) @ (b_scale b8) in out_dtype, b8 column-major (torch._scaled_mm)."""
    return torch._scaled_mm(a8_MK, b8_KN, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype, use_fast_accum=True)


def normed_fp8_linear(x: Tensor, w_NK: Tensor, x8: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(x @ w^T in x's dtype, x8 (M, K), x's scale) in FP8 for normed rows x (..., K) and w (N, K); x8 is x's copy
    if its producer wrote one, else None."""
    x_scale, w_scale = normed_scale(x), scale_of(w_NK)
    x8_MK = (to_e4m3(x, x_scale) if x8 is None else x8).reshape(-1, x.size(-1))
    # column-major: w (N, K) transposed
    out_MN = fp8_mm(x8_MK, to_e4m3(w_NK, w_scale).t(), x_scale, w_scale, x.dtype)
    return out_MN.view(*x.shape[:-1], w_NK.size(0)), x8_MK, x_scale
