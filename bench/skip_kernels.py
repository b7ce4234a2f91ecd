"""The U-net skip alone at the training shape (GPU only): x + w s and its backward through the eager torch ops
the model used before (model.layers.skip_add) against SkipAdd on the Triton kernels of model/skip_kernels.py.

    python -m bench.skip_kernels --out bench/results/skip_kernels_1xH200.json

One 49,152-token micro-batch, D = 768, bf16, w a 0-D fp32 tensor; triton.testing.do_bench (the mean over 300 ms of
calls after 50 ms of warm-up, with the L2 cleared between calls). The forward + backward time includes autograd's
work on three fresh leaves. The step runs the skip 6 times per micro-batch, 48 times per step.
"""
import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from model import layers


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    x = torch.randn(1, 49152, 768, device="cuda", dtype=torch.bfloat16)
    s, g = torch.randn_like(x), torch.randn_like(x)
    w = torch.tensor(0.9, device="cuda")
    result = {}
    for name, fn in [("eager_ops", layers.skip_add), ("kernels", layers.SkipAdd.apply)]:
        xs, ss, ws = x.clone().requires_grad_(), s.clone().requires_grad_(), w.clone().requires_grad_()

        def forward_backward():
            fn(xs, ss, ws).backward(g)

        result[name] = {"forward_ms": do_bench(lambda: fn(x, s, w), warmup=50, rep=300),
                        "forward_backward_ms": do_bench(forward_backward, warmup=50, rep=300)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
