"""Muon's update rule as plain tensor functions: Nesterov momentum, Newton–Schulz orthogonalisation, NorMuon's
per-neuron normalisation (an option), apply.

Muon (Keller Jordan, 2024, https://kellerjordan.github.io/posts/muon/) replaces each hidden matrix's
momentum-smoothed gradient by (approximately) its polar factor U V^T, computed with a few matrix products.
Every function takes a batch of same-shape matrices (..., rows, cols), so a stack of all parameters of one
shape is handled in one call. They run eagerly, with Python floats for the scalars that change during training
(momentum, learning rate). The optimizer object in optim/optimizer.py decides which matrices each rank
orthogonalises; nothing here communicates.
"""
import torch

from optim.iterations import ITERATIONS

NS_EPS = 1e-7  # keeps the Frobenius normalisation finite for an all-zero input (e.g. rank padding)


def newton_schulz(g: torch.Tensor, method: str = "jordan") -> torch.Tensor:
    """Approximate polar factor of each matrix in `g` (..., rows, cols), computed and returned in bf16.

    Dividing by the Frobenius norm puts every singular value in [0, 1], where the iteration converges.
    Tall inputs are transposed so the Gram matrix X X^T is the smaller of the two. `method` names the
    coefficients in ITERATIONS. Each iteration is three batched GEMMs whose scale and add ride in the GEMM's
    epilogue (baddbmm), so eager mode launches no elementwise kernel between them (bench/results/README.md, section
    fa4c217: the optimizer runs uncompiled).
    """
    assert g.ndim >= 2, f"newton_schulz needs (..., rows, cols), got shape {tuple(g.shape)}"
    coefficients, margin = ITERATIONS[method]
    x = g.bfloat16()
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])  # bmm and baddbmm take exactly one batch dim
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * margin + NS_EPS)
    for a, b, c in coefficients:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*gram + c*gram@gram
        x = torch.baddbmm(x, poly, x, beta=a)  # a*x + poly@x
    return (x.mT if tall else x).reshape(shape)


def nesterov_momentum(grad: torch.Tensor, momentum_buf: torch.Tensor, beta: float) -> torch.Tensor:
    """Update `momentum_buf` in place (m = beta*m + (1-beta)*g) and return the Nesterov direction
    (1-beta)*g + beta*m, written over `grad` (the optimizer passes a stacked copy of the gradients)."""
    momentum_buf.lerp_(grad, 1 - beta)
    return grad.lerp_(momentum_buf, beta)


def shape_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """max(1, rows/cols)**0.5: the update's RMS grows with the fan-out for tall matrices, as in Muon."""
    rows, cols = shape[-2], shape[-1]
    return max(1.0, rows / cols) ** 0.5


NEURON_EPS = 1e-10  # keeps the divisions finite for a neuron (or a whole padding matrix) whose update is zero


def neuron_scales(updates: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon's step (Li, Liu, Chen, Zhao, Zhou, Liang 2025, arXiv:2510.05491) on orthogonalised updates
    (..., rows, cols), as one factor per neuron: `updates * neuron_scales(...)` is the normalised update. Each
    neuron's mean square update enters its running average in `second_moment` (in place, m = beta2*m +
    (1-beta2)*mean), the neuron is divided by that average's root, and each matrix is rescaled to the Frobenius norm
    it had, so only the balance between neurons changes, not the step's size. Orthogonalisation evens out the
    singular values, not the neurons: some rows of U V^T carry much larger entries than others, and this evens those
    out as Adam does per entry.

    A neuron is a row, or a column where the matrix is wide (cols > rows): the mean runs over the shorter side, so
    `second_moment` and the result are (..., rows, 1) or (..., 1, cols) in fp32 (neuron_shape), as nanochat's
    NorMuon has it (the paper's code takes rows only). Both norms come from the per-neuron sums of squares, so the
    updates are read once here and once where the scaled update is applied, and no normalised copy is written."""
    dim = -1 if updates.size(-2) >= updates.size(-1) else -2
    sums = torch.linalg.vector_norm(updates, dim=dim, keepdim=True, dtype=torch.float32).square()
    second_moment.lerp_(sums / updates.size(dim), 1 - beta2)
    inverse = (second_moment.sqrt() + NEURON_EPS).reciprocal()
    norm = sums.sum(dim=(-2, -1), keepdim=True).sqrt()
    evened_norm = (sums * inverse.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return inverse * (norm / (evened_norm + NEURON_EPS))


def neuron_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The shape of neuron_scales' second_moment for updates of this shape: one entry per neuron."""
    *batch, rows, cols = shape
    return (*batch, rows, 1) if rows >= cols else (*batch, 1, cols)


def apply_updates(params: list[torch.Tensor], updates: torch.Tensor, lr: float,
                  scales: torch.Tensor | None = None) -> None:
    """p -= lr * update (times its neuron scales, with NorMuon) for each parameter; `updates` is the stacked output
    of `newton_schulz` (bf16) with at least len(params) entries along dim 0, `scales` neuron_scales' output for it,
    and `lr` already includes `shape_scale`. One in-place kernel per parameter, in fp32."""
    for i, p in enumerate(params):
        if scales is None:
            p.add_(updates[i], alpha=-lr)
        else:
            p.addcmul_(updates[i], scales[i], value=-lr)
