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

# Quintic iterations X <- a X + b (X X^T) X + c (X X^T)^2 X, five steps, and the factor by which the Frobenius
# norm is inflated first (a margin that keeps every singular value below 1, where the polynomials are designed):
# - "jordan": Keller Jordan's coefficients for Muon, the same every step; they push small singular values up
#   fast at the price of converging to a band around 1 (about 0.7..1.2) rather than to 1.
# - "polar_express": Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932), a different optimal
#   polynomial per step, so the result lands much closer to the polar factor for the same five steps; these are
#   modded-nanogpt's coefficients (num_iters=5, safety_factor=2e-2, cushion=2) with its 1.02 norm margin.
#   In the 300-step speedrun of 8 sequences with plain Muon it ended at val 1.0390 against jordan's 1.0359 (one run
#   each, e59a500 vs 3f3145a), within run-to-run noise. With NorMuon, 550 steps of 3 sequences ended at 1.0146
#   against 1.0196-1.0229 in jordan's five runs, and 540 steps at 1.0184-1.0227 in four seeds against jordan's 1.0254
#   (bench/results/README.md, 17be207), so --preset short uses it. The default stays record #28's jordan.
ITERATIONS: dict[str, tuple[tuple[tuple[float, float, float], ...], float]] = {
    "jordan": (((3.4445, -4.7750, 2.0315),) * 5, 1.0),
    "polar_express": (((8.156554524902461, -22.48329292557795, 15.878769915207462),
                       (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                       (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                       (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                       (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)), 1.02),
}
NS_EPS = 1e-7  # keeps the Frobenius normalisation finite for an all-zero input (e.g. rank padding)


def check_method(method: str) -> None:
    """A ValueError naming --muon_method when `method` is not a key of ITERATIONS."""
    if method not in ITERATIONS:
        raise ValueError(f"--muon_method={method!r}: use one of {sorted(ITERATIONS)}")


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
