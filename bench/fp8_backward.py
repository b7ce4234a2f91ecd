"""The blocks' backward products in FP8 through cuBLAS (torch._scaled_mm), against the bf16 products the step runs
(GPU only): what FP8 in the backward could save, and what its casts cost.

    python -m bench.fp8_backward --out bench/results/fp8_backward_1xH200.json

Why: the step's backward spends about 170 ms of bf16 products (bench/results/kernels_step28_1xH200_deterministic.txt),
where the forward's FP8 products took about 60% of a bf16 one's time at the power limit (model/fp8.py). Gradients
have no bound to scale them by, so each FP8 copy of a gradient needs its scales from the values themselves: per
tensor (an amax pass), per row, or per block of 128 along the contraction (the 1 x 128 blocks of DeepSeek-V3's
training recipe, which a producer's tile could find without a pass of its own).

One 49,152-token micro-batch of a block: D = 768, the attention 3 x 768 wide, the MLP 3,072. Seven products (the
MLP's first dgrad, fused with ReLU²'s gradient in a Gluon kernel, is left out): the four weight gradients (wgrad,
contracted over the tokens) and three input gradients (dgrad). Each FP8 recipe gets its operands cast beforehand,
laid out K-major as Hopper's 8-bit MMA reads them; a wgrad then needs both operands transposed (tokens innermost).
For each product and recipe: the time in a CUDA graph (bench.timing.graph_ms), the largest error relative to the
largest value and the relative RMS error, both against fp32 products of the bf16 operands. Then the casts alone,
compiled by inductor (the cost if no producer fused them), and the block's seven products at the power limit, as
bench/power.py runs its kinds: bf16, FP8 at the forward's recipe (tensorwise scales, fast accumulation), and that
with the casts of all nine operands.

Measured on the H200 (bench/results/README.md, section "41836c2: the backward's products in FP8"):
- At the power limit the seven products took 1.019 ms in FP8 against 1.863 in bf16, but 2.245 with the casts as
  kernels of their own: FP8 pays only where the kernels that make the operands also write their e4m3 copies.
- cuBLAS's 1 x 128 blocks refuse fast accumulation, and three of their four weight gradients ran slower than bf16.
"""
import argparse
import json
import time
from pathlib import Path

import torch

from bench.mlp_kernels import D, M, error_of_max
from bench.mlp_kernels import HIDDEN as F
from bench.power import REST_S, run_kind
from bench.timing import failure, graph_ms
from model.fp8 import E4M3_MAX, to_e4m3

BLOCK = 128  # the block of DeepSeek-V3's recipe, and cuBLAS's one blockwise size on Hopper
RECIPES = ("tensor", "row", "block1x128")


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def quantize(t_RK: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 copy, decoding scales) of t (rows, K), K the contraction, laid out for torch._scaled_mm's first operand
    (for the second, pass t8.t() and scales.t()): one scale, one per row, or one per row and 128 of K (stored
    outer-dim-major, as cuBLAS reads them)."""
    t = t_RK.float()
    R, K = t.shape
    if recipe == "block1x128":
        blocks = t.reshape(R, K // BLOCK, BLOCK)
        scale = blocks.abs().amax(2).clamp(min=1e-30) / E4M3_MAX
        return to_e4m3(blocks, scale[..., None]).reshape(R, K), scale.t().contiguous().t()
    amax = t.abs().amax() if recipe == "tensor" else t.abs().amax(1, keepdim=True)
    scale = amax.clamp(min=1e-30) / E4M3_MAX
    return to_e4m3(t, scale), scale


def problem() -> dict:
    """One micro-batch's operands in bf16: inputs of unit RMS (as normed rows), h = relu(z)^2, gradients of unit RMS
    with about 1% of their rows (tokens) 30 times larger (an uneven gradient, for the scales to cope with), weights of
    std D^-0.5."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    def grad(*shape):
        g = torch.randn(*shape, device="cuda", generator=gen)
        g[torch.randint(0, shape[0], (shape[0] // 100,), device="cuda", generator=gen)] *= 30
        return g.bfloat16()

    h = torch.relu(torch.randn(M, F, device="cuda", generator=gen)).square().bfloat16()
    return {"x": randn(M, D), "y": randn(M, D), "h": h, "g_qkv": grad(M, 3 * D), "g": grad(M, D),
            "g_pre": grad(M, F), "w_qkv": randn(3 * D, D, scale=D ** -0.5), "w_proj": randn(D, D, scale=D ** -0.5),
            "w_fc": randn(D, F, scale=D ** -0.5)}


def products(p: dict) -> dict:
    """name -> (first operand (rows, K), second operand (K, cols)) of each backward product, as the step forms them
    (autograd's `grad @ w` and `grad.t() @ x`; cuBLAS reads the transposed views in place)."""
    return {"qkv_dgrad": (p["g_qkv"], p["w_qkv"]), "qkv_wgrad": (p["g_qkv"].t(), p["x"]),
            "proj_dgrad": (p["g"], p["w_proj"]), "proj_wgrad": (p["g"].t(), p["y"]),
            "fc_dgrad": (p["g_pre"], p["w_fc"].t()), "fc_wgrad": (p["x"].t(), p["g_pre"]),
            "proj2_wgrad": (p["g"].t(), p["h"])}


def fp8_call(a_RK: torch.Tensor, b_KC: torch.Tensor, recipe: str, fast_accum: bool):
    """The call of the FP8 product of a @ b at recipe (both operands alike), its operands cast once here into K-major
    copies."""
    a8, sa = quantize(a_RK.contiguous(), recipe)
    b8, sb = quantize(b_KC.t().contiguous(), recipe)
    return lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum)


def cast(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensorwise e4m3 copy of t as a product reads it (K-major: a transposed view is copied transposed)."""
    return quantize(t.contiguous(), "tensor")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    p = problem()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "D": D, "F": F,
              "products": {}}
    fp8_calls = []  # the forward's configuration: tensorwise scales, fast accumulation (model/fp8.py)
    for name, (a, b) in products(p).items():
        want = a.float() @ b.float()
        row = {"bf16_ms": graph_ms(lambda a=a, b=b: a @ b), "bf16_err_of_max": error_of_max(a @ b, want),
               "bf16_rel_rms": rel_rms(a @ b, want)}
        for recipe in RECIPES:
            for fast_accum in (True, False):
                key = f"{recipe}{'_fast' if fast_accum else ''}"
                try:
                    call = fp8_call(a, b, recipe, fast_accum)
                    out = call()
                    row[key] = {"ms": graph_ms(call), "err_of_max": error_of_max(out, want),
                                "rel_rms": rel_rms(out, want)}
                except Exception as e:
                    row[key] = {"error": failure(e)}
        fp8_calls.append(fp8_call(a, b, "tensor", True))
        result["products"][name] = row
        print(name, json.dumps(row), flush=True)

    # the casts alone, compiled: what the FP8 copies cost where no producer writes them. A wgrad's operands are read
    # transposed (tokens innermost), so theirs are transposing copies.
    torch._dynamo.config.recompile_limit = 64  # one compiled quantize per recipe and input layout
    operands = {"g_qkv": p["g_qkv"], "g_qkv.t()": p["g_qkv"].t(), "g": p["g"], "g.t()": p["g"].t(),
                "g_pre": p["g_pre"], "g_pre.t()": p["g_pre"].t(), "x.t()": p["x"].t(), "y.t()": p["y"].t(),
                "h.t()": p["h"].t()}
    casts = {}
    for recipe in RECIPES:
        fn = torch.compile(lambda t, r=recipe: quantize(t.contiguous(), r), dynamic=False)
        for name in ("g_qkv", "g_qkv.t()", "g_pre", "g_pre.t()"):
            try:
                casts[f"{recipe} {name}"] = graph_ms(lambda fn=fn, t=operands[name]: fn(t))
            except Exception as e:
                casts[f"{recipe} {name}"] = failure(e)
    result["casts_ms"] = casts
    print("casts", json.dumps(casts), flush=True)

    bf16_calls = [lambda a=a, b=b: a @ b for a, b in products(p).values()]
    compiled_cast = torch.compile(cast, dynamic=False)
    at_limit = {"bf16, 7 products": lambda: [c() for c in bf16_calls],
                "fp8 tensorwise (fast accumulation), 7 products": lambda: [c() for c in fp8_calls],
                f"fp8 as above + tensorwise casts of {len(operands)} operands (compiled, unfused)":
                    lambda: ([c() for c in fp8_calls], [compiled_cast(t) for t in operands.values()])}
    result["power_limit"] = {}
    for name, call in at_limit.items():
        time.sleep(REST_S)
        try:
            result["power_limit"][name] = run_kind(call)
        except Exception as e:
            result["power_limit"][name] = {"error": failure(e)}
        print(name, {k: v for k, v in result["power_limit"][name].items() if k != "series_s_mhz_w_c"}, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
