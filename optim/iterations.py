"""Muon's Newton–Schulz iterations: the coefficients of each --muon_method. Data only, no torch: the run's config
(runtime/config.py) checks the flag before torch loads."""

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


def check_method(method: str) -> None:
    """A ValueError naming --muon_method when `method` is not a key of ITERATIONS."""
    if method not in ITERATIONS:
        raise ValueError(f"--muon_method={method!r}: use one of {sorted(ITERATIONS)}")
