"""Muon's update rule as plain tensor functions: Nesterov momentum, Newton–Schulz orthogonalisation, apply.

Muon (Keller Jordan, 2024, https://kellerjordan.github.io/posts/muon/) replaces each hidden matrix's
momentum-smoothed gradient by (approximately) its polar factor U V^T, computed with a few matrix products.
Every function takes a batch of same-shape matrices (..., rows, cols), so a stack of all parameters of one
shape is handled in one call. Scalars that change during training (momentum, learning rate) arrive as 0-D
tensors so a compiled caller never recompiles when they change. The optimizer object in optim/optimizer.py
decides which matrices each rank orthogonalises; nothing here communicates.
"""
import torch

# Quintic Newton–Schulz coefficients tuned by Keller Jordan for Muon: they push small singular values up fast
# at the price of converging to a band around 1 (about 0.7..1.1) rather than to exactly 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5  # as in Muon and every speedrun record
NS_EPS = 1e-7  # keeps the Frobenius normalisation finite for an all-zero input (e.g. rank padding)


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Approximate polar factor of each matrix in `g` (..., rows, cols), computed and returned in bf16.

    Dividing by the Frobenius norm puts every singular value in [0, 1], where the iteration converges.
    Tall inputs are transposed so the Gram matrix X X^T is the smaller of the two.
    """
    assert g.ndim >= 2, f"newton_schulz needs (..., rows, cols), got shape {tuple(g.shape)}"
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def nesterov_momentum(grad: torch.Tensor, momentum_buf: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Update `momentum_buf` in place (m = beta*m + (1-beta)*g) and return the Nesterov direction
    (1-beta)*g + beta*m. `beta` is a 0-D tensor."""
    momentum_buf.lerp_(grad, 1 - beta)
    return grad.lerp(momentum_buf, beta)


def shape_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """max(1, rows/cols)**0.5: the update's RMS grows with the fan-out for tall matrices, as in Muon."""
    rows, cols = shape[-2], shape[-1]
    return max(1.0, rows / cols) ** 0.5


def apply_updates(params: list[torch.Tensor], updates: torch.Tensor, lr: torch.Tensor) -> None:
    """p -= lr * update for each parameter; `updates` is the stacked (bf16) output of `newton_schulz`
    (at least len(params) entries along dim 0) and `lr` a 0-D tensor that already includes `shape_scale`."""
    for p, u in zip(params, updates.unbind(0)):
        p.sub_(u.to(p.dtype) * lr)
