"""Muon's update rule (Keller Jordan 2024, https://kellerjordan.github.io/posts/muon/) as tensor functions on
stacks of same-shape matrices (..., rows, cols): each momentum-smoothed gradient becomes about its polar factor
U V^T, optionally evened out per neuron (NorMuon). Nothing here communicates.
"""
import torch

from optim.iterations import ITERATIONS

NS_EPS = 1e-7  # finite normalisation for an all-zero input (rank padding)


def newton_schulz(g: torch.Tensor, method: str = "jordan") -> torch.Tensor:
    """Approximate polar factor of each matrix in `g` (..., rows, cols), in bf16, by ITERATIONS[method]; tall ones
    are transposed so that X X^T is the smaller Gram matrix."""
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
    """m = beta*m + (1-beta)*g in place; returns the Nesterov direction (1-beta)*g + beta*m, written over `grad`."""
    momentum_buf.lerp_(grad, 1 - beta)
    return grad.lerp_(momentum_buf, beta)


def shape_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """max(1, rows/cols)**0.5: larger steps for tall matrices, as in Muon."""
    rows, cols = shape[-2], shape[-1]
    return max(1.0, rows / cols) ** 0.5


NEURON_EPS = 1e-10  # finite divisions for an all-zero neuron or padding matrix


def neuron_scales(updates: torch.Tensor, second_moment: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon (Li et al. 2025, arXiv:2510.05491): fp32 per-neuron factors (neuron_shape) such that `updates *
    factors` divides each neuron by the root of its running mean square (`second_moment`, updated in place) while
    each matrix keeps its Frobenius norm. A neuron is a row, or a column of a wide matrix (nanochat)."""
    dim = -1 if updates.size(-2) >= updates.size(-1) else -2
    sums = torch.linalg.vector_norm(updates, dim=dim, keepdim=True, dtype=torch.float32).square()
    second_moment.lerp_(sums / updates.size(dim), 1 - beta2)
    inverse = (second_moment.sqrt() + NEURON_EPS).reciprocal()
    norm = sums.sum(dim=(-2, -1), keepdim=True).sqrt()
    evened_norm = (sums * inverse.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return inverse * (norm / (evened_norm + NEURON_EPS))


def neuron_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """neuron_scales' second_moment shape for updates of this shape."""
    *batch, rows, cols = shape
    return (*batch, rows, 1) if rows >= cols else (*batch, 1, cols)


def apply_updates(params: list[torch.Tensor], updates: torch.Tensor, lr: float,
                  scales: torch.Tensor | None = None) -> None:
    """p -= lr * update (times `scales`, NorMuon's) for each parameter, updates[i] for params[i]; `lr` includes
    shape_scale."""
    for i, p in enumerate(params):
        if scales is None:
            p.add_(updates[i], alpha=-lr)
        else:
            p.addcmul_(updates[i], scales[i], value=-lr)
