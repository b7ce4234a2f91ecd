"""The head-loss kernels' special-function budget (GPU only): how each element's tanh and exp are computed.

    python -m bench.head_math --out bench/results/head_math_1xH200.json

Each element of the 49,152 x 50,304 logits costs the head's forward and backward kernels a capped logit
z = c tanh(l / c) and an exponential. Computed as model/head_kernels.py did until it moved to tanh.approx, that
was three special-function (MUFU) operations at 16 per SM per clock, which bounded both kernels above their memory
traffic. Variants of both kernels, otherwise as model/head_kernels.py (same tiles, same math around them):

- SIG (the softcap): 0 = the sigmoid form 1 / (1 + exp2(-2 l / c)) with tl.exp2 and a division; 1 = the same with
  the PTX approximations ex2.approx.ftz / rcp.approx.ftz (no denormal handling); 2 = tanh.approx.f32, one MUFU op.
- EXP (the softmax's exponential): 0 = tl.exp2; 1 = ex2.approx.ftz; 2 = a degree-5 polynomial on the FMA pipes
  (FlashAttention-4's trick for Blackwell), which moves one MUFU op per element to the FMA units.

Reported per variant: the forward (lse and loss) and the FP8 backward's row-major e5m2 kernel, median of 10 calls;
the loss's error against fp64 torch ops on the first 2,048 rows, and the fp32 gradient's. Also tanh.approx alone
against fp64 on every fp32 from 2^-10 to 9.1, and the committed forward for comparison.
"""
import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.head_kernels import N, SOFTCAP, V, training_problem
from bench.timing import median_ms
from model import head, head_kernels
from model.head_kernels import _IGNORE_INDEX, _LOG2E as LOG2E, _tanh_of

# 2^f on [-0.5, 0.5]: relative error 2.3e-7 (about 2 ulp) evaluated in fp32 (near-minimax coefficients,
# fitted here by Lawson-weighted least squares on Chebyshev nodes)
P0, P1, P2 = tl.constexpr(1.0000001192092896), tl.constexpr(0.6931469440460205), tl.constexpr(0.24022120237350464)
P3, P4, P5 = tl.constexpr(0.05550713092088699), tl.constexpr(0.009675541892647743), tl.constexpr(0.001327647129073739)


@triton.jit
def _ex2_ftz(x):
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _rcp_ftz(x):
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _exp2_poly(x):
    """2^x for x in [-126, 0] without MUFU: x = k + f, k integer (by the 1.5 * 2^23 rounding trick), |f| <= 0.5."""
    t = x + 12582912.0
    k = t - 12582912.0
    f = x - k
    p = P5 * f + P4
    p = p * f + P3
    p = p * f + P2
    p = p * f + P1
    p = p * f + P0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2(x, EXP: tl.constexpr):
    if EXP == 0:
        return tl.exp2(x)
    elif EXP == 1:
        return _ex2_ftz(x)
    else:
        return _exp2_poly(x)


@triton.jit
def _cap(logits, softcap: tl.constexpr, SIG: tl.constexpr):
    """(z - c, tanh') of the capped logits z = c tanh(l / c)."""
    u = logits.to(tl.float32)
    if SIG == 2:  # the committed kernels' tanh
        t = _tanh_of(u, softcap)
        return softcap * (t - 1.0), 1.0 - t * t
    else:
        if SIG == 0:
            s = 1.0 / (1.0 + tl.exp2(u * (-2.0 * LOG2E / softcap)))
        else:
            s = _rcp_ftz(1.0 + _ex2_ftz(u * (-2.0 * LOG2E / softcap)))
        return (2.0 * softcap) * (s - 1.0), 4.0 * s * (1.0 - s)


@triton.jit
def _forward(logits_ptr, targets_ptr, lse_ptr, loss_ptr, softcap: tl.constexpr, V: tl.constexpr,
             BLOCK_V: tl.constexpr, SIG: tl.constexpr, EXP: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * V
    sum_V = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols_V = start + tl.arange(0, BLOCK_V)
        inside_V = cols_V < V
        zc_V, _ = _cap(tl.load(row_ptr + cols_V, mask=inside_V, other=0.0), softcap, SIG)
        sum_V += tl.where(inside_V, _exp2(LOG2E * zc_V, EXP), 0.0)
    lse = softcap + tl.log(tl.sum(sum_V, axis=0))
    target = tl.load(targets_ptr + row)
    ignored = target == _IGNORE_INDEX
    zc_t, _ = _cap(tl.load(row_ptr + tl.where(ignored, 0, target)), softcap, SIG)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - (zc_t + softcap)))


@triton.jit
def _grad(logits_ptr, lse_ptr, targets_ptr, grad_ptr, g_scale_ptr, g_ptr, N, softcap: tl.constexpr,
          V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, SIG: tl.constexpr, EXP: tl.constexpr):
    rows_N = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_V = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows_inside_N = rows_N < N
    inside_NV = rows_inside_N[:, None] & (cols_V < V)[None, :]
    logits_NV = tl.load(logits_ptr + rows_N.to(tl.int64)[:, None] * V + cols_V[None, :], mask=inside_NV, other=0.0)
    lse_N = tl.load(lse_ptr + rows_N, mask=rows_inside_N, other=0.0)
    targets_N = tl.load(targets_ptr + rows_N, mask=rows_inside_N, other=_IGNORE_INDEX)
    row_grad_N = tl.load(grad_ptr + rows_N, mask=rows_inside_N, other=0.0) / tl.load(g_scale_ptr)
    zc_NV, dcap_NV = _cap(logits_NV, softcap, SIG)
    probs_NV = _exp2(LOG2E * (zc_NV + (softcap - lse_N[:, None])), EXP)
    onehot_NV = (cols_V[None, :] == targets_N[:, None]).to(tl.float32)
    g_NV = (probs_NV - onehot_NV) * dcap_NV * row_grad_N[:, None]
    tl.store(g_ptr + rows_N.to(tl.int64)[:, None] * V + cols_V[None, :], g_NV.to(g_ptr.dtype.element_ty),
             mask=inside_NV)


VARIANTS = [(0, 0), (1, 1), (0, 2), (1, 2), (2, 0), (2, 1), (2, 2)]


@triton.jit
def _tanh_kernel(x_ptr, t_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(t_ptr + offs, _tanh_of(tl.load(x_ptr + offs, mask=offs < n), 1.0), mask=offs < n)


def tanh_approx_errors() -> dict:
    """tanh.approx.f32 against fp64 tanh on every fp32 from 2^-10 to 9.1 (tanh is odd; above 9.02 fp32's tanh is
    1): the largest relative error of tanh, and the largest absolute error of 1 - tanh^2 computed from it."""
    lo, hi = (torch.tensor([2.0 ** -10, 9.1]).view(torch.int32)).tolist()
    worst_rel, worst_dcap = 0.0, 0.0
    for start in range(lo, hi, 1 << 25):
        x = torch.arange(start, min(start + (1 << 25), hi), device="cuda", dtype=torch.int32).view(torch.float32)
        t = torch.empty_like(x)
        _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, t, x.numel(), BLOCK=1024)
        want = torch.tanh(x.double())
        worst_rel = max(worst_rel, ((t.double() - want).abs() / want).max().item())
        worst_dcap = max(worst_dcap, ((1.0 - t.double() ** 2) - (1.0 - want ** 2)).abs().max().item())
    return {"range": [2.0 ** -10, 9.1], "max_rel_err_tanh": worst_rel, "max_abs_err_1_minus_tanh_sq": worst_dcap}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logits_NV, targets_N = training_problem()  # the same as bench/head_kernels.py's
    # the upstream gradient of a mean loss, and the e5m2 scale that HeadLoss.backward derived from it (before
    # the unit gradient moved to the forward)
    grad_N = torch.full((N,), 1.0 / N, device="cuda")
    g_scale = grad_N.abs().amax() / head.GRAD_FP8_SCALE
    one = torch.ones((), device="cuda")
    # fp64 references on the first rows (accuracy) from model/head.py's torch ops
    R = 2048
    ref_lse, ref_loss = head.lse_and_loss(logits_NV[:R].double(), targets_N[:R], SOFTCAP)
    ref_g = head.unit_grad(logits_NV[:R].double(), ref_lse, targets_N[:R], SOFTCAP) * grad_N[:R].double()[:, None]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "committed_forward_ms": median_ms(lambda: head_kernels.lse_and_loss(logits_NV, targets_N, SOFTCAP)),
              "tanh_approx": tanh_approx_errors()}
    print(result, flush=True)
    g8_NV = torch.empty((N, V), dtype=torch.float8_e5m2, device="cuda")
    lse_N = torch.empty(N, device="cuda")
    loss_N = torch.empty(N, device="cuda")
    grid = (triton.cdiv(N, 32), triton.cdiv(V, 256))
    for sig, exp in VARIANTS:
        key = f"SIG={sig} EXP={exp}"
        row = {}
        try:
            fwd = lambda: _forward[(N,)](logits_NV, targets_N, lse_N, loss_N, SOFTCAP, V=V, BLOCK_V=2048, SIG=sig,
                                         EXP=exp, num_warps=8)
            row["forward_ms"] = median_ms(fwd)
            fwd()
            row["loss_mean_minus_ref"] = (loss_N[:R].double() - ref_loss).mean().item()
            row["loss_max_abs_err"] = (loss_N[:R].double() - ref_loss).abs().max().item()
            row["grad_e5m2_ms"] = median_ms(
                lambda: _grad[grid](logits_NV, lse_N, targets_N, grad_N, g_scale, g8_NV, N, SOFTCAP, V=V, BLOCK_N=32,
                                    BLOCK_V=256, SIG=sig, EXP=exp, num_warps=4))
            g32 = torch.empty((R, V), device="cuda")
            _grad[(R // 32, triton.cdiv(V, 256))](logits_NV, ref_lse.float(), targets_N, grad_N, one, g32, R, SOFTCAP,
                                                  V=V, BLOCK_N=32, BLOCK_V=256, SIG=sig, EXP=exp, num_warps=4)
            err = (g32.double() - ref_g)
            row["grad_rel_l2_err"] = (err.norm() / ref_g.norm()).item()
            row["grad_max_abs_err_over_max"] = (err.abs().max() / ref_g.abs().max()).item()
        except Exception as e:  # a variant that fails to build is a result too; the sweep goes on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result[key] = row
        print(key, row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
