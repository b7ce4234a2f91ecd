"""FP8 (e4m3) copies of matrix-product operands, with per-tensor scales, and the blocks' forward products in FP8:
the attention's q, k, v projection here; the MLP's two products (and with --fp8_backward three of its backward's)
in model/layers.py's ReLU2MLP.

Where the scales come from, none by a pass over the activations: a normed input (RMS 1 per row) has |x| <= sqrt(D),
a fixed scale that can never overflow; the MLP's hidden h = relu(x W1)^2 is bounded from its normed input and W1
alone (relu2_scale); a weight is scaled by its own absolute maximum. e4m3 keeps 3 mantissa bits over its whole
normal range, so the fixed scale of a normed input costs no precision against a measured one. h's bound lies far
above its typical values, which then sit low in e4m3's range (of the order of E4M3_MAX / D where x and W1's columns
are not aligned), with subnormals for the smallest, whose absolute error stays below the rounding of the typical ones.

Why FP8: the step runs at the H200's power limit, where an FP8 product takes about 60% of a bf16 one's time
(bench/results/mlp_fp8_1xH200.json, at the limit: the MLP's first layer 0.243 against 0.405 ms, the qkv projection
0.179 against 0.289). The backward's products read gradients, which have no bound to scale them by, and their weight
gradients read both operands transposed (tokens innermost, as Hopper's 8-bit MMA reads only K-major operands).
Measured for the backward (bench/fp8_backward.py, bench/results/README.md at 41836c2): a block's seven cuBLAS products
in FP8 took 1.02 ms against 1.86 in bf16 at the limit, but 2.24 with the casts of their operands as kernels of their
own. So FP8 in the backward pays only where the kernels that make the operands write the copies. --fp8_backward (on by
default) does that for the MLP's four products (ReLU2MLP in model/layers.py). For the three after its first, the
Gluon kernels write h's and the pre-activation gradient's copies in both layouts, the gradient's at a delayed scale
(delayed_scale): the step took 27.7 and 22.9 ms less with them, in same-machine pairs on two machines
(bench/results/README.md, section 2f3283f). The short speedrun reached 1.0158 at 124.61 s with them (seed 0) and
1.0174 and 1.0217 at 119.2-119.3 s (seeds 0 and 1, a faster machine), against 1.0159 and 1.0182 for the bf16 backward
(seed 0 at 153346e, seed 1 at dbd7665), all below the target 1.0253. The first, the widest, reads copies of the
output's gradient and of W2 made by a pass of their own (grad_operands): one (M, D) tensor, a quarter of the hidden's
size. It took 8.14 and 13.12 ms off the step in same-machine pairs on two machines (bench/results/README.md,
sections f00c0b4 and 8c60c3c). The short speedrun's seeds 0-3 reached 1.0159, 1.0221, 1.0146 and 1.0176 with it,
against 1.0181, 1.0175, 1.0145 and 1.0175 without it, the largest 0.0032 below the target.

--fp8_backward also runs both backward products of the attention's q, k, v projection in FP8 (FP8QKV in
model/layers.py): QKVPrep's backward kernel writes the projection's output gradient only as an e4m3 copy, at a delayed
scale. Its input gradient in FP8 took 6.34 ms off the step in two same-machine pairs (bench/results/README.md,
section ed6e773), where the short speedrun reached 1.0181 and 1.0175 (seeds 0 and 1). Its weight gradient reads the
same copy and x's e4m3 copy, each transposed by a kernel of its own (model/transpose_kernels.py): 7.52, 11.80 and
11.35 ms less in three same-machine pairs (section 371311c). The short speedrun's seed 1 then ended 6.5e-5 above the
target at 560 steps; at 580, the preset's steps since, seeds 0-3 reached 1.0123-1.0177 (section "580 steps"), and
1.0091-1.0142 since df03885 (section df03885). The transposed copy written by QKVPrep's kernel itself had cost more
than the product saves, 7.5-8.2 ms a step, and was wrong on the GPU (section b55e629;
bench/results/fp8_qkv_backward_experiment.patch). The output projection's products stay bf16.
"""
import torch
from torch import Tensor

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def scale_of(t: Tensor) -> Tensor:
    """Per-tensor e4m3 scale from the absolute maximum (an all-zero tensor, like a zero-initialised weight, gets 1)."""
    return delayed_scale(t.abs().amax().float())


def delayed_scale(amax: Tensor) -> Tensor:
    """The e4m3 scale that maps a 0-D fp32 absolute maximum to E4M3_MAX, 1 where it is 0. A gradient's copy written
    by the kernel that computes it takes the amax of the previous call at its site (a delayed scale, as in
    Transformer Engine's recipe): values above it saturate. A site without history (amax 0: its first call, or all
    its gradients 0 so far) gets 1, at which a gradient's small values underflow: in a new run, the first micro-batch
    whose gradient is not 0 (the MLP's is 0 throughout step 0, its W2 being zero-initialised). A checkpoint keeps
    the amax (model/layers.py's MLP), so a resumed run does not start without history."""
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def normed_scale(x: Tensor) -> Tensor:
    """The e4m3 scale of rows normed to RMS 1 over their last dim: |x| <= sqrt(D) maps to at most E4M3_MAX."""
    return torch.full((), x.size(-1) ** 0.5 / E4M3_MAX, device=x.device)


def to_e4m3(t: Tensor, scale: Tensor) -> Tensor:
    # the clamp guards rounding at the bound: an out-of-range cast would not saturate on every backend
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def k_major_weight(w_KN: Tensor) -> tuple[Tensor, Tensor]:
    """(w8 (N, K), its scale): the e4m3 copy of a weight w (K, N) at its own amax, stored K-major as Hopper's 8-bit
    warpgroup MMA reads both operands."""
    w_scale = scale_of(w_KN)
    return to_e4m3(w_KN.t(), w_scale).contiguous(), w_scale


def normed_operands(x_MK: Tensor, w_KN: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(x8 (M, K), w8 (N, K), scale) for x @ w: the e4m3 copies of normed rows x and of w (K, N) (k_major_weight),
    and the product of their scales."""
    x_scale = normed_scale(x_MK)
    w8_NK, w_scale = k_major_weight(w_KN)
    return to_e4m3(x_MK, x_scale), w8_NK, x_scale * w_scale


def grad_operands(g_MK: Tensor, w_KN: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(g8 (M, K), w8 (N, K), g's scale, w's scale) for g @ w, g a gradient and w (K, N) a weight: e4m3 copies at
    each tensor's own amax (a pass over g: a gradient has no bound known before it), w's as k_major_weight makes it."""
    g_scale = scale_of(g_MK)
    w8_NK, w_scale = k_major_weight(w_KN)
    return to_e4m3(g_MK, g_scale), w8_NK, g_scale, w_scale


def relu2_scale(w8_NK: Tensor, scale: Tensor) -> Tensor:
    """The e4m3 scale of h = relu(p)^2, p = scale * x8 @ w8^T, for x8 the e4m3 copy of normed rows (normed_operands),
    from the weight alone, with no pass over h: |p| <= scale |x8 row| |w8 row| (Cauchy-Schwarz), and the copy of a
    row of RMS 1 has norm sqrt(D) / normed_scale = E4M3_MAX up to its elements' roundings (bf16's 2^-9 and e4m3's
    2^-4 of each) and the product's accumulation (2^-9 of the terms' magnitudes, tests/test_fp8.py), which the
    margin 1 + 2^-3 covers. Pre-activations far below the bound put small h among e4m3's subnormals, whose absolute
    error (2^-10 of the scale) stays below the rounding of h's typical values."""
    p_max = (1 + 2 ** -3) * E4M3_MAX * scale * w8_NK.float().square().sum(1).amax().sqrt()
    return torch.where(p_max > 0, p_max.square() / E4M3_MAX, torch.ones_like(p_max))


def fp8_mm(a8_MK: Tensor, b8_KN: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(a_scale a8) @ (b_scale b8) in out_dtype from e4m3 copies, b8 column-major (a row-major (N, K) copy,
    transposed): torch._scaled_mm with fp32 accumulation in Hopper's fast mode (no extra promotion)."""
    return torch._scaled_mm(a8_MK, b8_KN, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype, use_fast_accum=True)


def normed_fp8_linear(x: Tensor, w_NK: Tensor, x8: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """x @ w^T for normed rows x (..., K) and a weight w (N, K), in FP8 (torch._scaled_mm, e4m3 operands, fp32
    accumulation, output in x's dtype): (the product, x's e4m3 copy (M, K), its scale). x8 is x's e4m3 copy,
    to_e4m3(x, normed_scale(x)), where its producer already wrote one (model/norm_kernels.py), else None."""
    x_scale, w_scale = normed_scale(x), scale_of(w_NK)
    x8_MK = (to_e4m3(x, x_scale) if x8 is None else x8).reshape(-1, x.size(-1))
    # _scaled_mm takes its second operand column-major: w stored (N, K) row-major is just that, transposed
    out_MN = fp8_mm(x8_MK, to_e4m3(w_NK, w_scale).t(), x_scale, w_scale, x.dtype)
    return out_MN.view(*x.shape[:-1], w_NK.size(0)), x8_MK, x_scale


class NormedFP8Linear(torch.autograd.Function):
    """normed_fp8_linear; the backward in x's dtype from the saved x and w, the gradients of the exact product at
    these operands, as F.linear's backward computes them."""

    @staticmethod
    def forward(ctx, x: Tensor, w_NK: Tensor, x8: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w_NK)
        return normed_fp8_linear(x, w_NK, x8)[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w_NK = ctx.saved_tensors
        grad_MN = grad.reshape(-1, grad.size(-1))
        return grad @ w_NK, grad_MN.t() @ x.reshape(-1, x.size(-1)), None
