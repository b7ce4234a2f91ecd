"""FlexAttention's kernel options at the training shape (GPU only): tile sizes, warps and stages of the forward
and backward Triton kernels, and the flags of torch.nn.attention.flex_attention.FlexKernelOptions.

    python -m bench.flex_options --out bench/results/flex_options_1xH200.json [--shard ...fineweb_train_000001.bin]

Inductor picks one fixed configuration per GPU and head size unless max-autotune sweeps them, which would cost
minutes of every cold start. With windows of 3 to 7 key blocks a query block's loop is short, so the defaults,
chosen for long causal attention, may not be the fastest here. Each candidate is compiled afresh and timed like
bench/attention.py: one 49,152-token micro-batch with the documents of --shard, 6 heads of 128, bf16, at the
throughput config's long window and its short window; its output and input gradients are compared with the
default's (max abs difference, recorded).
"""
import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.attention import BLOCK, SCALE, flex_problem, tokens
from bench.timing import cuda_times_ms
from data.shard import BOS_ID
from model.attention import block_mask, document_ids
from model.config import short_window

LONG_WINDOW = 896  # bench/run.py's throughput window
REPEATS = 30  # more than bench.timing's 10: candidates differ by a few percent

def _bwd(m1: int, n1: int, m2: int, n2: int, warps: int, stages: int) -> dict:
    """Backward options: BLOCK_M1 x BLOCK_N1 tiles for dK/dV (a key block looping over query blocks), BLOCK_M2 x
    BLOCK_N2 for dQ (a query block looping over key blocks)."""
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_warps": warps, "bwd_num_stages": stages}


def _fwd(m: int, n: int, warps: int, stages: int) -> dict:
    return {"fwd_BLOCK_M": m, "fwd_BLOCK_N": n, "fwd_num_warps": warps, "fwd_num_stages": stages}


# Inductor's sm90 defaults for bf16, head_dim 128 (torch/_inductor/template_heuristics/triton.py): forward
# BLOCK_M 128, BLOCK_N 64, 8 warps, 3 stages; backward BLOCK_M1 64, BLOCK_N1 128, BLOCK_M2 128, BLOCK_N2 64,
# 8 warps, 3 stages. Every BLOCK divides the mask's 128-token blocks, as flex requires, and the backward's
# template asserts that BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0.
CANDIDATES = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "fwd_64x64_w4_s3": _fwd(64, 64, 4, 3),
    "fwd_128x128_w8_s2": _fwd(128, 128, 8, 2),
    "fwd_64x128_w4_s2": _fwd(64, 128, 4, 2),
    "fwd_128x64_w4_s3": _fwd(128, 64, 4, 3),
    "fwd_64x64_w4_s2": _fwd(64, 64, 4, 2),
    "fwd_64x32_w4_s3": _fwd(64, 32, 4, 3),
    "bwd_64_64_w4_s3": _bwd(64, 64, 64, 64, 4, 3),
    "bwd_32_64_w4_s3": _bwd(32, 64, 64, 32, 4, 3),
    "bwd_32_64_w4_s2": _bwd(32, 64, 64, 32, 4, 2),
    "bwd_32_64_w4_s4": _bwd(32, 64, 64, 32, 4, 4),
    "bwd_32_64_w8_s3": _bwd(32, 64, 64, 32, 8, 3),
    "bwd_32_32_w4_s3": _bwd(32, 32, 32, 32, 4, 3),
    "bwd_32_128_w4_s3": _bwd(32, 128, 128, 32, 4, 3),
    "bwd_64_128_w8_s2": _bwd(64, 128, 128, 64, 8, 2),
    "bwd_64_128_w4_s3": _bwd(64, 128, 128, 64, 4, 3),
    "write_dq_off": {"WRITE_DQ": False},
    "tma": {"USE_TMA": True},
    "prescale_qk": {"PRESCALE_QK": True},
    "fwd_64x64_bwd_32_64": _fwd(64, 64, 4, 3) | _bwd(32, 64, 64, 32, 4, 3),
}


def median_ms(fn) -> float:
    return round(statistics.median(cuda_times_ms(fn, repeats=REPEATS)), 3)


def main():
    from torch.nn.attention.flex_attention import flex_attention

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard", help="a token shard whose first micro-batch supplies the documents")
    ap.add_argument("--only", nargs="*", help="candidate names to run (default: all)")
    args = ap.parse_args()
    names = args.only or list(CANDIDATES)
    unknown = sorted(set(names) - set(CANDIDATES))
    if unknown:
        ap.error(f"unknown candidates {unknown}; choose from {list(CANDIDATES)}")

    ids_T = tokens(args.shard).cuda()
    doc_1T = document_ids(ids_T[None], BOS_ID)
    windows = {"long": torch.tensor(LONG_WINDOW, device="cuda")}
    windows["short"] = short_window(windows["long"], BLOCK)
    masks = {name: block_mask(doc_1T, w, BLOCK) for name, w in windows.items()}

    (q, k, v, grad), result = flex_problem(windows, args.shard)
    result["candidates"] = {}
    reference = {}
    for name in names:
        torch._dynamo.reset()  # a fresh compile per candidate (dynamo would stop recompiling after 8)
        flex = torch.compile(flex_attention, dynamic=False)
        options = CANDIDATES[name]
        row = {"kernel_options": options}
        for wname, mask in masks.items():
            def run():
                return flex(q, k, v, block_mask=mask, scale=SCALE, kernel_options=options)
            out = run()
            out.backward(grad)
            outputs = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            if name == "default":
                reference[wname] = outputs
            elif wname in reference:
                row[f"{wname}_max_abs_diff"] = max(float((a - b).abs().max())
                                                   for a, b in zip(outputs, reference[wname]))
            with torch.no_grad():
                row[f"{wname}_forward_ms"] = median_ms(run)
            row[f"{wname}_forward_backward_ms"] = median_ms(lambda: run().backward(grad))
            for t in (q, k, v):
                t.grad = None
        result["candidates"][name] = row
        print(name, json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
