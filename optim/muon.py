"""Muon's update rule as plain tensor functions: Nesterov momentum, Newton–Schulz orthogonalisation, NorMuon's
per-neuron normalisation (an option), apply.

Muon (Keller Jordan, 2024, https://kellerjordan.github.io/posts/muon/) replaces each hidden matrix's
momentum-smoothed gradient by (approximately) its polar factor U V^T, computed with a few matrix products.
Every function takes a batch of same-shape matrices (..., rows, cols), so a stack of all parameters of one
shape is handled in one call. Scalars that change during training (momentum, learning rate) arrive as 0-D
tensors so a compiled caller never recompiles when they change. The optimizer object in optim/optimizer.py
decides which matrices each rank orthogonalises; nothing here communicates.
"""
import torch

from optim.iterations import ITERATIONS

NS_EPS = 1e-7  # keeps the Frobenius normalisation finite for an all-zero input (e.g. rank padding)


def newton_schulz(g: torch.Tensor, method: str = "jordan") -> torch.Tensor:
    """Approximate polar factor of each matrix in `g` (..., rows, cols), computed and returned in bf16.

    Dividing by the Frobenius norm puts every singular value in [0, 1], where the iteration converges.
    Tall inputs are transposed so the Gram matrix X X^T is the smaller of the two. `method` names the
    coefficients in ITERATIONS.
    """
    assert g.ndim >= 2, f"newton_schulz needs (..., rows, cols), got shape {tuple(g.shape)}"
    coefficients, margin = ITERATIONS[method]
    x = g.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * margin + NS_EPS)
    for a, b, c in coefficients:
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


NEURON_EPS = 1e-10  # keeps the divisions finite for a neuron (or a whole padding matrix) whose update is zero


def normalize_neurons(updates: torch.Tensor, second_moment: torch.Tensor, beta2: torch.Tensor) -> torch.Tensor:
    """NorMuon's step (Li, Liu, Chen, Zhao, Zhou, Liang 2025, arXiv:2510.05491) on orthogonalised updates
    (..., rows, cols): each neuron's mean square update enters its running average in `second_moment` (in place,
    m = beta2*m + (1-beta2)*mean), the neuron's entries are divided by that average's root, and each matrix is
    rescaled to the Frobenius norm it had, so only the balance between neurons changes, not the step's size.
    Orthogonalisation evens out the singular values, not the neurons: some rows of U V^T carry much larger
    entries than others, and this evens those out as Adam does per entry.

    A neuron is a row, or a column where the matrix is wide (cols > rows): the mean runs over the shorter side, so
    `second_moment` is (..., rows, 1) or (..., 1, cols) in fp32 (neuron_shape), as nanochat's NorMuon has it (the
    paper's code takes rows only). `beta2` is a 0-D tensor. Returns fp32."""
    u = updates.float()
    norm = u.norm(dim=(-2, -1), keepdim=True)
    second_moment.lerp_(u.square().mean(dim=-1 if u.size(-2) >= u.size(-1) else -2, keepdim=True), 1 - beta2)
    u = u / (second_moment.sqrt() + NEURON_EPS)
    return u * (norm / (u.norm(dim=(-2, -1), keepdim=True) + NEURON_EPS))


def neuron_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The shape of normalize_neurons' second_moment for updates of this shape: one entry per neuron."""
    *batch, rows, cols = shape
    return (*batch, rows, 1) if rows >= cols else (*batch, 1, cols)


def apply_updates(params: list[torch.Tensor], updates: torch.Tensor, lr: torch.Tensor) -> None:
    """p -= lr * update for each parameter; `updates` is the stacked output of `newton_schulz` (bf16), or of
    normalize_neurons (fp32), with at least len(params) entries along dim 0, and `lr` a 0-D tensor that already
    includes `shape_scale`."""
    for p, u in zip(params, updates.unbind(0)):
        p.sub_(u.to(p.dtype) * lr)
