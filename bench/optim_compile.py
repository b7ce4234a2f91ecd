"""The optimizer step of the record model alone (GPU only): eager (what train_gpt2.py runs) against the same step
under torch.compile, for the cold start and for the step. One variant per process, with fresh compile caches, so a
compiled first step compiles from nothing.

    python -m bench.optim_compile --out bench/results/optim_compile_1xH200.json

Until fa4c217, train_gpt2.py compiled the update functions (16 graphs), and a strictly cold start spent
10.7 s of its main thread compiling them (bench/results/README.md, section fa4c217). Variants: eager
(MuonAdam with the record's settings, NorMuon on) and compiled (its whole `step` in torch.compile(dynamic=False), the
learning rate and momentum fixed, as a yardstick of what a compiler could still take from the step). Each variant
also prints a profile of three of its steps (stderr).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = ("eager", "compiled")
REPEATS = 20


def one_variant(variant: str) -> dict:
    from model.gpt import GPT
    from optim.optimizer import MuonAdam
    from runtime.config import TrainConfig, group_learning_rates, model_config
    torch.manual_seed(0)
    cfg = TrainConfig()
    model = GPT(model_config(cfg)).cuda()
    model.init_weights()
    opt = MuonAdam(model.param_groups(), lr=group_learning_rates(cfg), muon_method=cfg.muon_method,
                   normuon_beta2=cfg.normuon_beta2)
    if variant == "compiled":
        opt.step = torch.compile(opt.step, dynamic=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step(1.0, 0.9)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    # CUDA events around each whole step: the host's launches count, as they do in training (not a CUDA graph)
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step(1.0, 0.9)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            opt.step(1.0, 0.9)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90),
          file=sys.stderr)
    return {"variant": variant, "first_step_s": round(first_s, 2), "step_ms_median": round(statistics.median(times), 3),
            "step_ms_min": round(min(times), 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--variant", choices=VARIANTS, help="run one variant in this process and print its row")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(one_variant(args.variant)))
        return
    rows = []
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": f"{cache}/triton"}
            proc = subprocess.run([sys.executable, "-m", "bench.optim_compile", "--variant", variant], env=env,
                                  capture_output=True, text=True)
            print(proc.stderr[-12000:], file=sys.stderr)
            proc.check_returncode()
            out = proc.stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1])
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
