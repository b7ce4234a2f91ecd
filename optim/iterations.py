"""The Newton–Schulz coefficients of each --muon_method; no torch, so that flags are checked before it loads."""

# Quintic steps X <- a X + b (X X^T) X + c (X X^T)^2 X, and a Frobenius norm margin keeping singular values below 1.
# "jordan": Keller Jordan's, one polynomial (record #28); "polar_express": Polar Express (Amsel et al. 2025,
# arXiv:2505.16932), one per step, much closer to the polar factor (modded-nanogpt's coefficients).
ITERATIONS: dict[str, tuple[tuple[tuple[float, float, float], ...], float]] = {
    "jordan": (((3.4445, -4.7750, 2.0315),) * 5, 1.0),
    "polar_express": (((8.156554524902461, -22.48329292557795, 15.878769915207462),
                       (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                       (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                       (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                       (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)), 1.02),
}


def check_method(method: str) -> None:
    """A ValueError naming --muon_method when `method` is not a key of ITERATIONS."""
    if method not in ITERATIONS:
        raise ValueError(f"--muon_method={method!r}: use one of {sorted(ITERATIONS)}")
