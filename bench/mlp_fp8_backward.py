"""The MLP's backward with its four products in FP8 (ReLU2MLP with grad_amax, model/layers.py),
against the MLP with only its forward in FP8, one micro-batch, compiled as the step compiles a block (GPU
only).

    python -m bench.mlp_fp8_backward --out bench/results/mlp_fp8_backward_1xH200.json

Why: a block's backward products took 45% less time in FP8 at the power limit, but casting their operands in
kernels of their own cost more than that (bench/fp8_backward.py). Here the copies come from where the operands
are made: the Gluon kernels write h's and the pre-activation gradient's e4m3 copies, transposed as well, and only
the (M, D) tensors (x's copy, the output's gradient) are cast and transposed by inductor.

First the kernels' copies against what they copy: relu2_matmul_fp8_t's h and copy equal relu2_matmul_fp8's bit
for bit and its transposed copy is their transpose; relu2_matmul_grad_fp8's copy, decoded, against the fp64 product
of the same e4m3 operands (the kernel's own error: FP8 accumulation and the copy's rounding) and against the bf16
kernel's gradient of the bf16 operands (that, plus the operands' e4m3 rounding). Then, for
both MLPs and the bf16 one, the gradients' relative RMS error against fp32 autograd, and the forward and backward's
time: in a CUDA graph, and replayed at the power limit as bench/power.py runs its kinds. --kernels stops after the
kernels' times.

Measured on the H200 (bench/results/README.md, sections 2f3283f and 93fe8a7):
- The copies are what they copy: the checks above all held.
- The kernel that writes the gradient's copies took 0.495 ms against the bf16 kernel's 0.399 (2f3283f). 93fe8a7's
  first version took 0.696: an atomic max of the amax at every tile cost 0.19 ms of it.
- Forward and backward at the power limit, with 93fe8a7's kernels: 1.985 ms with the backward in FP8 against 2.106
  with the forward alone in FP8 and 2.309 in bf16. Not measured with 2f3283f's kernels.
- With e4m3 operands (8c60c3c; --kernels at 80b43ce, section 8c60c3c): the kernel 0.3487 ms against 0.4042 for the
  bf16 one, grad_operands and the transposed copy 0.1008 compiled. Against the same e4m3 values the copy's relative
  RMS error is 0.0264 (bf16 operands' was 0.0265 at 17e7049), against the bf16 operands' gradient 0.0458.
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.fp8_backward import rel_rms
from bench.mlp_kernels import D, M
from bench.mlp_kernels import HIDDEN as FF
from bench.power import REST_S, run_kind
from bench.timing import failure, graph_ms, graph_ms_each
from model import layers, mlp_kernels
from model.fp8 import E4M3_MAX, delayed_scale, grad_operands, normed_operands, relu2_scale


def problem() -> dict:
    """One micro-batch: normed x, W1 at init scale, W2 at a trained one's (its init is zero), the residual stream and
    the output's gradient, all bf16."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    return {"x": F.rms_norm(randn(M, D).float(), (D,)).bfloat16(), "w1": randn(D, FF, scale=0.5 * D ** -0.5),
            "w2": randn(D, FF, scale=FF ** -0.5), "r": randn(M, D), "grad_y": randn(M, D, scale=1e-3)}


def kernel_checks(p: dict) -> dict:
    x8, w8, scale = normed_operands(p["x"], p["w1"])
    inv = 1 / relu2_scale(w8, scale)
    h, h8 = mlp_kernels.relu2_matmul_fp8(x8, w8, scale, inv)
    h_t, h8_t, h8t = mlp_kernels.relu2_matmul_fp8_t(x8, w8, scale, inv)
    g = mlp_kernels.relu2_matmul_grad(p["grad_y"], p["w2"], h)
    amax = torch.full((), 0.5 * g.float().abs().max().item(), device="cuda")  # half: the largest values saturate
    g_scale_want = delayed_scale(amax.clone())
    gy8, w2_8, gy_scale, w2_scale = grad_operands(p["grad_y"], p["w2"])
    g8, g8t, g_scale = mlp_kernels.relu2_matmul_grad_fp8(gy8, w2_8, gy_scale * w2_scale, h, amax)
    decoded = g8.double() * g_scale.double()
    exact = layers.relu2_matmul_grad(gy8.double() * (gy_scale * w2_scale).double(), w2_8.double().t(), h.double())
    checks = {"forward_h_equal": torch.equal(h_t, h), "forward_h8_equal": torch.equal(h8_t.view(torch.uint8),
                                                                                        h8.view(torch.uint8)),
              "forward_h8t_is_transpose": torch.equal(h8t.view(torch.uint8), h8.t().contiguous().view(torch.uint8)),
              "grad_scale_is_delayed": torch.equal(g_scale, g_scale_want),
              "grad_g8t_is_transpose": torch.equal(g8t.view(torch.uint8), g8.t().contiguous().view(torch.uint8)),
              "grad_amax_vs_exact": (amax.double() / exact.abs().max()).item(),
              "grad_saturated_fraction": (exact.abs() > E4M3_MAX * g_scale.double()).double().mean().item()}
    # suffix "": against the product of the same e4m3 values; "_vs_bf16_operands": against the bf16 kernel's g
    for suffix, want in (("", exact), ("_vs_bf16_operands", g.double())):
        clipped = want.clamp(-E4M3_MAX * g_scale.item(), E4M3_MAX * g_scale.item())
        checks["grad_rel_rms_of_clipped" + suffix] = rel_rms(decoded, clipped)
        checks["grad_max_err_over_scale" + suffix] = (
            (decoded - clipped).abs() / (clipped.abs() + 2 ** -9 * g_scale.item())).max().item()
    return checks


def kernel_times(p: dict) -> dict:
    """GPU ms (CUDA graph, idle GPU) of the two kernels that write the copies, against the kernels they replace, and
    against writing the row-major copy only and transposing it afterwards (torch's copy)."""
    x8, w8, scale = normed_operands(p["x"], p["w1"])
    inv = 1 / relu2_scale(w8, scale)
    h = mlp_kernels.relu2_matmul_fp8(x8, w8, scale, inv)[0]
    amax = torch.ones((), device="cuda")
    g8 = torch.empty(M, FF, device="cuda", dtype=torch.float8_e4m3fn)

    def g8_only(**copies):
        mlp_kernels.launch(p["grad_y"], p["w2"], h, mlp_kernels.RELU2_GRAD, mlp_kernels.CONFIG, out8_MN=g8,
                           out8_inv_scale=amax, writes_out=False, **copies)
        return g8

    g8t = torch.empty(FF, M, device="cuda", dtype=torch.float8_e4m3fn)
    gy8, w2_8, gy_scale, w2_scale = grad_operands(p["grad_y"], p["w2"])
    gw_scale = gy_scale * w2_scale

    @torch.compile(dynamic=False)
    def operands(grad_y, w2):  # what ReLU2MLP.backward makes of them: inductor fuses the casts and the transpose
        gy8, w2_8, gy_scale, w2_scale = grad_operands(grad_y, w2)
        return gy8, gy8.t().contiguous(), w2_8, gy_scale, w2_scale

    calls = {"relu2_matmul_fp8 (h, h8)": lambda: mlp_kernels.relu2_matmul_fp8(x8, w8, scale, inv),
             "relu2_matmul_fp8_t (h, h8, h8 transposed)": lambda: mlp_kernels.relu2_matmul_fp8_t(x8, w8, scale, inv),
             "relu2_matmul_fp8, then h8.t().contiguous()":
                 lambda: mlp_kernels.relu2_matmul_fp8(x8, w8, scale, inv)[1].t().contiguous(),
             "relu2_matmul_grad (bf16 out)": lambda: mlp_kernels.relu2_matmul_grad(p["grad_y"], p["w2"], h),
             "relu2_matmul_grad_fp8 (g8, g8 transposed, amax)":
                 lambda: mlp_kernels.relu2_matmul_grad_fp8(gy8, w2_8, gw_scale, h, amax),
             "the same copies and amax from bf16 operands (before the operands were e4m3)":
                 lambda: g8_only(out8_NM=g8t, amax=amax),
             "grad_operands and grad_y's transposed copy, compiled as in the step":
                 lambda: operands(p["grad_y"], p["w2"]),
             "the same kernel writing g8 only": g8_only,
             "the same kernel writing g8 and amax": lambda: g8_only(amax=amax),
             "the same kernel writing g8 and g8 transposed": lambda: g8_only(out8_NM=g8t),
             "g8 only, then g8.t().contiguous()": lambda: g8_only().t().contiguous()}
    return graph_ms_each(calls)


def mlp(p: dict, fp8: bool, amax: torch.Tensor | None):
    def forward(x, w1, w2, r):
        return layers.ReLU2MLP.apply(x, w1, w2, r, fp8, amax)

    compiled = torch.compile(forward, dynamic=False)
    leaves = [p[k].detach().requires_grad_() for k in ("x", "w1", "w2", "r")]
    return lambda: torch.autograd.grad(compiled(*leaves), leaves, p["grad_y"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", action="store_true", help="the kernels' checks and times only")
    args = ap.parse_args()
    p = problem()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "D": D, "F": FF}
    result["kernel_checks"] = kernel_checks(p)
    print("kernel checks", json.dumps(result["kernel_checks"]), flush=True)
    result["kernel_ms"] = kernel_times(p)
    print("kernel ms", json.dumps(result["kernel_ms"]), flush=True)
    if args.kernels:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return

    exact_leaves = [p[k].float().requires_grad_() for k in ("x", "w1", "w2", "r")]
    h = F.relu(exact_leaves[0] @ exact_leaves[1]).square()
    exact = torch.autograd.grad(exact_leaves[3] + h @ exact_leaves[2].t(), exact_leaves, p["grad_y"].float())
    variants = {"bf16": mlp(p, False, None), "fp8 forward only": mlp(p, True, None),
                "fp8 forward and backward": mlp(p, True, torch.zeros((), device="cuda"))}
    result["variants"] = {}
    for name, call in variants.items():
        call()  # a first call gives the FP8 backward's amax its history
        got = call()
        row = {"grad_rel_rms": {k: rel_rms(g, e) for k, g, e in zip(("x", "w1", "w2", "r"), got, exact, strict=True)}}
        try:
            row["graph_ms"] = graph_ms(call)
            time.sleep(REST_S)
            row["power_limit"] = run_kind(call)
        except Exception as e:
            row["error"] = failure(e)
        result["variants"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "power_limit"}),
              {k: v for k, v in row.get("power_limit", {}).items() if k != "series_s_mhz_w_c"}, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
