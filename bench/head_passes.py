"""The second pass of the head's training forward (model/head_kernels.py, _forward_kernel with GRAD: the e5m2 unit
gradient of one row) in leaner forms, against the model's kernel, at the training shape (GPU only).

    python -m bench.head_passes --out bench/results/head_passes_1xH200.json

Read offline in the kernel's SASS (compiled for sm_90 by Triton 3.6): per 8 elements, the second pass issues 16 MUFU
instructions (tanh and exp2), 56 on the FP32 pipe and about 40 on the integer pipe, half of them for the one-hot
test against an int64 target. At 16 MUFU lanes per SM and clock, each pass takes at least 1.18 ms per micro-batch:
2.36 of the kernel's 3.1 ms. Its rows also outgrow the L2 (about a thousand rows of 100 KB in flight), so the second
pass reads most of the logits from HBM again: 12.3 GB, 2.6 ms at 4.8 TB/s. Both limits are close. The forms here:

- reverse: the second pass walks the row backwards, so it first re-reads the chunks read last, while they are still
  in L2. Same bits.
- lean: the scale and log2(e) folded into one FMA before the exp2 (u = 2^(log2e (c t - lse) + log2 scale) (1 - t^2)),
  the one-hot test on int32, ignored rows by a bias of -inf. The same math in another rounding order.
- fixup: no one-hot in the loop at all; after it, one thread rewrites the target's element with (p - 1)(1 - t^2).
- poly: the second pass's exp2 on the FP32 pipe: 2^n by the exponent field, n found by the 1.5 x 2^23 rounding trick
  (no conversion instruction, which would run at MUFU's rate), times a cubic in the fraction (FlashAttention-4's
  idea for part of its softmax). Its largest relative error, 8.3e-5, is far below e5m2's rounding (2 mantissa bits).
- evict: the first pass loads with L2 policy evict_last, the second evict_first, and the gradient is stored
  streaming (.cs), so that the rows stay in L2 between the passes.
- poly1: the first pass's exp2 on the FP32 pipe for every other chunk (the loss moves by the cubic's error).
- nomath (a floor, wrong outputs): the second pass stores the scaled logits, no tanh or exp2.

Measured on the H200 (head_passes_1xH200*.json; the model's kernel 3.03-3.15 ms a call):
- The floor: with no math at all, the kernel still takes 2.57-2.90 ms (2.29 with evict at 4,096 x 16 warps). The
  kernel is bound by its memory traffic first; the MUFU work adds 0.3-0.5 ms on top.
- Same bits as the model's: reverse + evict 3.026 against 3.029 on one machine. Nothing gained.
- Other bits (the e5m2 rounding of a few elements moves): reverse + lean + fixup + evict 2.84 ms at 4,096 x 16
  warps, 2.85-2.91 at 2,048 x 8; with poly as well, no faster. At most 0.3 ms a call, about 2 ms per step.
- poly and poly1 were slower where memory binds; the first pass alone takes 1.32-1.36 ms.
Not adopted: too little for a change of the gradient's bits, which would need the time-to-loss measured again.
"""
import argparse

import numpy as np
import torch
import triton
import triton.language as tl

from bench.head_kernels import SOFTCAP, finish_sweep, run_variant, training_problem
from bench.head_persistent import _chunk_cols
from bench.timing import graph_ms
from model import head
from model.head_kernels import _LOG2E, _forward, _row_lse_and_loss, _tanh_of, lse_and_loss

# 2^f on [-0.5, 0.5] as a cubic, fitted here for the least largest relative error (numpy, Lawson's iteration)
_CUBIC = (0.9999196108526532, 0.6932621429738498, 0.24271393960338958, 0.05521300592951287)
_P0, _P1, _P2, _P3 = (tl.constexpr(c) for c in _CUBIC)
_ROUND = tl.constexpr(12582912.0)  # 1.5 x 2^23: x + this rounds x to an integer held in the low mantissa bits


@triton.jit
def _exp2_fma(x):
    """2^x on the FP32 and integer pipes, for -126 <= x <= 127 (no clamp: the callers' x lie in [-100 - 22, 15])."""
    j = x + _ROUND
    f = x - (j - _ROUND)  # in [-0.5, 0.5]
    p = ((_P3 * f + _P2) * f + _P1) * f + _P0
    # j's bits are those of 1.5 x 2^23 plus the integer n, whose low 9 bits are all that survive the shift
    bits = p.to(tl.int32, bitcast=True) + (j.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _variant_kernel(logits_ptr, targets_ptr, lse_ptr, loss_ptr, u_ptr, softcap: tl.constexpr, V: tl.constexpr,
                    BLOCK_V: tl.constexpr, U_SCALE: tl.constexpr, LOG2_SCALE: tl.constexpr, REVERSE: tl.constexpr,
                    LEAN: tl.constexpr, FIXUP: tl.constexpr, POLY: tl.constexpr, NOMATH: tl.constexpr,
                    POLY1: tl.constexpr, EVICT: tl.constexpr):
    CHUNKS: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * V
    if POLY1 or EVICT:  # POLY1: every other chunk's exp2 on the FP32 pipe; EVICT: the row kept in L2 for pass 2
        sum_V = tl.zeros([BLOCK_V], dtype=tl.float32)
        for i in range(CHUNKS):
            cols_V = i * BLOCK_V + tl.arange(0, BLOCK_V)
            inside_V = cols_V < V
            if EVICT:
                t_V = _tanh_of(tl.load(row_ptr + cols_V, mask=inside_V, other=0.0, eviction_policy="evict_last"),
                               softcap)
            else:
                t_V = _tanh_of(tl.load(row_ptr + cols_V, mask=inside_V, other=0.0), softcap)
            x_V = (_LOG2E * softcap) * (t_V - 1.0)
            if POLY1 and i % 2 == 1:
                e_V = _exp2_fma(x_V)
            else:
                e_V = tl.exp2(x_V)
            sum_V += tl.where(inside_V, e_V, 0.0)
        lse = softcap + tl.log(tl.sum(sum_V, axis=0))
        target = tl.load(targets_ptr + row)
        ignored = target == -100
        z_target = softcap * _tanh_of(tl.load(row_ptr + tl.where(ignored, 0, target)), softcap)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - z_target))
    else:  # the model's
        lse, target, ignored = _row_lse_and_loss(row_ptr, targets_ptr, lse_ptr, loss_ptr, row, softcap, V, BLOCK_V)
    scale = tl.where(ignored, 0.0, U_SCALE)
    # ignored rows: 2^(-100 + x) rounds to 0 in e5m2, and keeps _exp2_fma in its range
    bias = tl.where(ignored, -100.0, LOG2_SCALE - _LOG2E * lse)
    target32 = target.to(tl.int32)
    u_row_ptr = u_ptr + row.to(tl.int64) * V
    for i in range(CHUNKS):
        cols_V, inside_V = _chunk_cols(i, CHUNKS, BLOCK_V, V, REVERSE)
        if EVICT:
            logits_V = tl.load(row_ptr + cols_V, mask=inside_V, other=0.0, eviction_policy="evict_first")
        else:
            logits_V = tl.load(row_ptr + cols_V, mask=inside_V, other=0.0)
        if NOMATH:
            u_V = logits_V.to(tl.float32) * scale
        elif LEAN:
            t_V = _tanh_of(logits_V, softcap)
            x_V = t_V * (_LOG2E * softcap) + bias
            if POLY:
                e_V = _exp2_fma(x_V)
            else:
                e_V = tl.exp2(x_V)
            slope_V = 1.0 - t_V * t_V
            u_V = e_V * slope_V
            if not FIXUP:
                u_V -= tl.where(cols_V == target32, slope_V * scale, 0.0)
        else:  # the model's
            t_V = _tanh_of(logits_V, softcap)
            probs_V = tl.exp2(_LOG2E * (softcap * t_V - lse))
            onehot_V = (cols_V == target).to(tl.float32)
            u_V = (probs_V - onehot_V) * (1.0 - t_V * t_V) * scale
        if EVICT:
            tl.store(u_row_ptr + cols_V, u_V.to(u_ptr.dtype.element_ty), mask=inside_V, cache_modifier=".cs")
        else:
            tl.store(u_row_ptr + cols_V, u_V.to(u_ptr.dtype.element_ty), mask=inside_V)
    if FIXUP:
        tl.debug_barrier()  # the loop's store of the target's element is visible before it is rewritten
        if not ignored:
            t = _tanh_of(tl.load(row_ptr + target), softcap)
            probs = tl.exp2(_LOG2E * (softcap * t - lse))
            tl.store(u_row_ptr + target, ((probs - 1.0) * (1.0 - t * t) * U_SCALE).to(u_ptr.dtype.element_ty))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    f = np.linspace(-0.5, 0.5, 100001)
    logits_NV, targets_N = training_problem()
    N, V = logits_NV.shape
    u_scale = head.GRAD_FP8_SCALE
    ref_u8 = torch.empty((N, V), dtype=torch.float8_e5m2, device="cuda")
    ref_lse, ref_loss = _forward(logits_NV, targets_N, SOFTCAP, ref_u8, u_scale)
    # an fp64 reference of the unit gradient, for the error of each form (a band of rows: fp64 N x V would not fit)
    rows = slice(0, 2048)
    ref64 = head.unit_grad(logits_NV[rows].double(), ref_lse[rows].double(), targets_N[rows], SOFTCAP) * u_scale
    ref_err = (ref_u8[rows].double() - ref64).abs()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "N": N, "V": V, "cubic_max_rel_err": float(np.abs(np.polyval(_CUBIC[::-1], f) / 2.0 ** f - 1.0).max()),
              "model_kernel_ms": graph_ms(lambda: _forward(logits_NV, targets_N, SOFTCAP, ref_u8, u_scale)),
              "pass1_only_ms": graph_ms(lambda: lse_and_loss(logits_NV, targets_N, SOFTCAP)),
              "model_err_vs_fp64": {"mean": float(ref_err.mean()), "max": float(ref_err.max())},
              "variants": []}
    print(result)
    lse_N, loss_N = torch.empty_like(ref_lse), torch.empty_like(ref_loss)
    u8_NV = torch.empty_like(ref_u8)
    names = ["REVERSE", "LEAN", "FIXUP", "POLY", "NOMATH", "POLY1", "EVICT"]
    best = ("REVERSE", "LEAN", "FIXUP", "POLY")
    evict = best + ("EVICT",)
    for flags, block_v, warps in [
            (("REVERSE", "EVICT"), 2048, 8), (("EVICT",), 2048, 8), (evict, 2048, 8), (evict, 2048, 16),
            (evict, 4096, 16), (evict, 4096, 32), (best, 2048, 16),
            (best, 4096, 32), (("REVERSE", "LEAN", "FIXUP", "EVICT"), 4096, 16), (evict + ("POLY1",), 4096, 16),
            (("REVERSE", "NOMATH", "EVICT"), 4096, 16), (("REVERSE", "NOMATH", "EVICT"), 2048, 16),
            (("REVERSE", "NOMATH", "EVICT"), 2048, 8),
            ((), 2048, 8), (("REVERSE",), 2048, 8), (("LEAN",), 2048, 8), (("REVERSE", "LEAN"), 2048, 8),
            (("REVERSE", "LEAN", "FIXUP"), 2048, 8), (("REVERSE", "LEAN", "POLY"), 2048, 8), (best, 2048, 8),
            (best, 4096, 8), (best, 4096, 16), (best, 2048, 4), (best + ("POLY1",), 2048, 8),
            (best + ("POLY1",), 4096, 16), (("LEAN", "FIXUP", "POLY"), 2048, 8), (("REVERSE", "NOMATH"), 2048, 8),
            (("NOMATH",), 2048, 8), (("REVERSE", "NOMATH"), 4096, 16)]:
        u8_NV.fill_(1.0)

        def call():
            _variant_kernel[(N,)](logits_NV, targets_N, lse_N, loss_N, u8_NV, SOFTCAP, V=V, BLOCK_V=block_v,
                                  U_SCALE=u_scale, LOG2_SCALE=float(np.log2(u_scale)), num_warps=warps,
                                  **{n: n in flags for n in names})

        def checks():
            err = (u8_NV[rows].double() - ref64).abs()
            return {"u8_bytes_differing": int((u8_NV.view(torch.uint8) != ref_u8.view(torch.uint8)).sum()),
                    "u8_max_abs_diff": float((u8_NV.float() - ref_u8.float()).abs().max()),
                    "err_vs_fp64": {"mean": float(err.mean()), "max": float(err.max())},
                    "loss_bits_equal": bool(torch.equal(loss_N, ref_loss)),
                    "loss_max_abs_diff": float((loss_N - ref_loss).abs().max())}
        result["variants"].append(run_variant({"flags": list(flags), "block_v": block_v, "warps": warps}, call,
                                              checks))
    finish_sweep(result, lambda: _forward(logits_NV, targets_N, SOFTCAP, ref_u8, u_scale), args.out)

if __name__ == "__main__":
    main()
