"""The MLP's output gradient's e4m3 copies, a design measurement before building one into the model (GPU only).

    python -m bench.grad_copies --out X.json

With --fp8_backward the MLP's backward (model/layers.py, ReLU2MLP) reads grad_y (M, D) twice in e4m3: row-major for
the first product and transposed (tokens innermost) for W2's gradient. In the step, inductor compiles grad_operands
and the transpose into two kernels: an amax pass over grad_y, then one kernel that writes both copies (26.3 + 64.3 us
a call at 8c60c3c, about 8 ms a step: bench/results/kernels_step28_1xH200_8c60c3c.txt). The second moves 150 MB, so
it runs at about 2.3 TB/s. Timed here, in CUDA graphs, at the record's shape:
- inductor's two kernels, compiled from the step's ops, and the amax pass alone;
- one Triton kernel that writes both copies from tiles of grad_y (each tile transposed through shared memory, so
  both stores walk contiguous rows), at the amax pass's scale: the same copies, so the same training math;
- the same kernel at a delayed scale (the previous call's amax, as the pre-activation gradient's copy is made), with
  no amax pass: it records this call's amax itself, one atomic max per program. The training math would change
  (values above the previous amax saturate).

Checks: the kernel's copies against eager to_e4m3's bits at the same scale (the kernel divides by the scale, as
to_e4m3 does, with div_rn), the transposed copy against the copy's transpose, the recorded amax against torch's.

Measured on the H200 (bench/results/grad_copies_1xH200_80b43ce.json): the checks held (no mismatch in 37.7M values).
Inductor's two kernels took 0.093 ms, the amax pass alone 0.0264. The kernel's best, at 64 x 64 tiles and 4 warps:
0.0862 with the amax pass, 0.0905 at a delayed scale; larger tiles took 0.107-0.157. So one kernel of this form
would take about 7 us a call, under 1 ms a step, off the step: not built into the model.
"""
import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.mlp_kernels import D, M
from bench.timing import graph_ms_each
from model.fp8 import E4M3_MAX, delayed_scale, scale_of, to_e4m3

# (BLOCK_M tokens, BLOCK_D features, warps): the transposed store writes BLOCK_M bytes per row
_E4M3_MAX = tl.constexpr(E4M3_MAX)
CONFIGS = [(64, 64, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (256, 64, 8), (256, 128, 8)]


@triton.jit
def _copies_kernel(g_ptr, scale_ptr, out_ptr, out_t_ptr, amax_ptr, M, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_D: tl.constexpr, AMAX: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = (rows < M)[:, None] & (cols < D)[None, :]
    g = tl.load(g_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    g8 = tl.clamp(tl.math.div_rn(g, scale), -_E4M3_MAX, _E4M3_MAX).to(tl.float8e4nv)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], g8, mask=inside)
    tl.store(out_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], tl.trans(g8), mask=(cols < D)[:, None] & (rows < M)[None, :])
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(g), axis=1), axis=0))


def copies(g_MD: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, config: tuple) -> tuple:
    """(g8 (M, D), g8 transposed (D, M)) at scale; with amax, also max(amax, |g|'s maximum) into amax."""
    block_m, block_d, warps = config
    rows, cols = g_MD.shape
    out = torch.empty(rows, cols, device=g_MD.device, dtype=torch.float8_e4m3fn)
    out_t = torch.empty(cols, rows, device=g_MD.device, dtype=torch.float8_e4m3fn)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_d))
    _copies_kernel[grid](g_MD, scale, out, out_t, scale if amax is None else amax, rows, D=cols, BLOCK_M=block_m,
                         BLOCK_D=block_d, AMAX=amax is not None, num_warps=warps)
    return out, out_t


def checks(grad_y: torch.Tensor) -> dict:
    scale = scale_of(grad_y)
    want = to_e4m3(grad_y, scale)
    amax = torch.zeros((), device=grad_y.device)
    g8, g8t = copies(grad_y, scale, amax, CONFIGS[1])
    return {"copy_mismatches": (g8.view(torch.uint8) != want.view(torch.uint8)).sum().item(),
            "transpose_is_transpose": torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8)),
            "amax_equal": torch.equal(amax, grad_y.abs().amax().float()),
            "values": grad_y.numel()}


def times(grad_y: torch.Tensor) -> dict:
    @torch.compile(dynamic=False)
    def inductor(g):  # ReLU2MLP.backward's ops on grad_y: grad_operands' copy, and its transpose for W2's gradient
        g8 = to_e4m3(g, scale_of(g))
        return g8, g8.t().contiguous()

    amax_pass = torch.compile(lambda g: scale_of(g), dynamic=False)
    history = torch.full((), grad_y.abs().amax().item(), device=grad_y.device)
    calls = {"inductor: amax pass, then both copies": lambda: inductor(grad_y),
             "inductor: the amax pass alone": lambda: amax_pass(grad_y)}
    for config in CONFIGS:
        calls[f"kernel {config}: amax pass, then the kernel"] = lambda c=config: copies(grad_y, amax_pass(grad_y),
                                                                                       None, c)
        calls[f"kernel {config}: delayed scale, amax recorded"] = lambda c=config: copies(
            grad_y, delayed_scale(history), history, c)
    return graph_ms_each(calls)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad_y = (torch.randn(M, D, device="cuda", generator=gen) * 1e-3).bfloat16()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "D": D,
              "e4m3_max": E4M3_MAX, "bytes_moved_by_the_copies": grad_y.numel() * 4}
    result["checks"] = checks(grad_y)
    print("checks", json.dumps(result["checks"]), flush=True)
    result["ms"] = times(grad_y)
    for name, ms in result["ms"].items():
        print(f"{name}: {ms}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
