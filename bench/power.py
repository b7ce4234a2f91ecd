"""The power and SM clock that each kind of kernel in the step holds when it runs alone (GPU only): which of them
drive the H200 to its power limit, and what that costs them in time.

    python -m bench.power --out bench/results/power_1xH200.json
    python -m bench.power --tiles --out bench/results/power_mlp_tiles_1xH200.json

Why: the training step runs at the GPU's 700 W limit, its SM clock near 1,650 MHz against 1,980 idle
(bench/results/README.md, db0e380). A kernel that holds the GPU at the limit slows with the clock; one that stays
below it runs at full clock. Which kind is which tells where saved time, and where saved energy, turns into a
shorter step.

Each kind replays one CUDA graph of its call back to back for SECONDS, timed in chunks of about 10 ms by CUDA
events, while bench/gpu_monitor.py samples nvidia-smi every 0.1 s; before each kind the GPU idles for REST_S, so
that each starts from the same state. For each kind: ms per call over the first 100 ms (the nearest to full clock)
and over the last half; the clock and power over the last half, with their series; and the clock event reasons
that `nvidia-smi -q` reports active three quarters in. The shapes are one 49,152-token micro-batch's,
bf16 unless named (the head's product in FP8 at 8,192 tokens, to keep its logits at 0.8 GB). --tiles times the MLP's
Gluon kernels at the configurations of TILES the same way.

Measured on the H200 (bench/results/README.md, db0e380):
- Every matrix product held the GPU at 700 W ("SW Power Cap"), 8-18% slower than in its first 100 ms, at
  1,485-1,545 MHz.
- The memory-bound rms_norm stayed at 1,980 MHz and 594 W.
- The MLP's forward kernel at 128 x 256 tiles ran 9% slower than CONFIG in the first 100 ms, but 2.4% faster at the
  limit. matmul_add at 128 x 256 in 3 stages (SHARED_TILE) ran 3.8% faster at the limit, and the backward even.
"""
import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.gpu_monitor import GpuMonitor, active_clock_reasons, run_gpus
from bench.mlp_kernels import D, HIDDEN, M, error_of_max, training_problem
from bench.timing import captured, failure
from model import layers, mlp_kernels

SECONDS, REST_S, CHUNK_MS = 6.0, 4.0, 10.0
VOCAB, HEAD_TOKENS = 50304, 8192  # the model's padded vocabulary; the head's tokens here (see the docstring)


def kinds() -> dict:
    """name -> a call of that kind of kernel on its inputs."""
    x, w1, w2, grad_y, h = training_problem()
    gen = torch.Generator(device="cuda").manual_seed(2)
    x8 = (torch.randn(HEAD_TOKENS, D, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
    w8 = (torch.randn(VOCAB, D, device="cuda", generator=gen)).to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    stream = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    return {
        "bf16 product, cuBLAS: x (M, D) @ W1 (D, F)": lambda: x @ w1,
        "bf16 product, Gluon relu2_matmul: relu(x @ W1)^2": lambda: mlp_kernels.relu2_matmul(x, w1),
        "bf16 product, Gluon relu2_matmul_grad: (grad_y @ W2) * 2 sqrt(h)":
            lambda: mlp_kernels.relu2_matmul_grad(grad_y, w2, h),
        "FP8 product, cuBLAS: the head's logits (8,192 x 768) @ (768 x 50,304)":
            lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "memory-bound: rms_norm of the residual stream (M, D)": lambda: F.rms_norm(stream, (D,)),
    }


def run_kind(call) -> dict:
    """Replay call's CUDA graph for SECONDS under the monitor; ms per call early and late, clock and power late."""
    graph = captured(call)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    per_chunk = max(1, round(CHUNK_MS / start.elapsed_time(end)))
    chunks = []  # (seconds since the first chunk began, ms per call in the chunk)
    gpu_ids = run_gpus(1)  # the GPU torch calls cuda:0
    reasons = []  # asked from a thread three quarters in, so the replays go on meanwhile
    timer = threading.Timer(0.75 * SECONDS, lambda: reasons.append(active_clock_reasons(gpu_ids)))
    with GpuMonitor(interval_s=0.1, gpus=gpu_ids) as monitor:
        timer.start()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < SECONDS:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_chunk):
                graph.replay()
            end.record()
            end.synchronize()
            chunks.append((time.perf_counter() - t0, start.elapsed_time(end) / per_chunk))
    timer.join()
    late = [ms for t, ms in chunks if t >= SECONDS / 2]
    early = [ms for t, ms in chunks if t <= 0.1] or [chunks[0][1]]
    summary = monitor.summary(since_s=SECONDS / 2)
    gpu = summary["gpus"][0] if "gpus" in summary else summary
    return {"calls_per_chunk": per_chunk, "ms_first_100ms": round(statistics.median(early), 4),
            "ms_last_half": round(statistics.median(late), 4),
            "clock_event_reasons_active": reasons[0] if reasons else None,
            **{k: gpu.get(k) for k in ("sm_clock_mhz_median", "sm_clock_mhz_min", "power_w_median", "power_limit_w",
                                        "temperature_c_max", "error", "series_s_mhz_w_c")}}


# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) of model/mlp_kernels.py's kernel for --tiles: its CONFIG, and 128 x 256
# tiles in as many stages as shared memory holds. An epilogue that reads a tile keeps a second 64 KB tile beside the
# ring and the output's, in 2 stages of 64 or 4 of 32; in 3 stages of 64 its tile shares the output's (SHARED_TILE)
TILES = {"relu2": [mlp_kernels.CONFIG, (128, 256, 64, 3, 8), (128, 256, 32, 6, 8)],
         "relu2_grad": [mlp_kernels.CONFIG, (128, 256, 64, 2, 8), (128, 256, 32, 4, 8), (128, 256, 64, 3, 8)],
         "add": [mlp_kernels.CONFIG, (128, 256, 64, 2, 8), (128, 256, 32, 4, 8), (128, 256, 64, 3, 8)]}


def tile_calls() -> dict:
    """name -> (a call of the MLP kernel at a configuration of TILES, the fp32 torch ops' result it should give),
    and the cuBLAS + inductor path that the forward kernel replaced."""
    x, w1, w2, grad_y, h = training_problem()
    r = torch.randn_like(x)
    problems = {"relu2": ((x, w1, None, mlp_kernels.RELU2), lambda: layers.relu2_matmul(x.float(), w1.float())),
                "relu2_grad": ((grad_y, w2, h, mlp_kernels.RELU2_GRAD),
                               lambda: layers.relu2_matmul_grad(grad_y.float(), w2.float(), h.float())),
                "add": ((h, w2, r, mlp_kernels.ADD), lambda: layers.matmul_add(h.float(), w2.float(), r.float()))}
    inductor = torch.compile(layers.relu2_matmul, dynamic=False)
    calls = {"relu2, cuBLAS + inductor": (lambda: inductor(x, w1), problems["relu2"][1])}
    for name, configs in TILES.items():
        operands, want = problems[name]
        for config in configs:
            calls[f"{name} {config}"] = (lambda o=operands, c=config: mlp_kernels.launch(*o, c), want)
    return calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiles", action="store_true", help="the MLP kernels at each configuration of TILES instead")
    ap.add_argument("--only", nargs="*", default=[], help="only the kinds whose name contains one of these")
    args = ap.parse_args()

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "D": D, "F": HIDDEN,
              "seconds": SECONDS, "rest_s": REST_S, "kinds": {}}
    calls = tile_calls() if args.tiles else {name: (call, None) for name, call in kinds().items()}
    for name, (call, want) in calls.items():
        if args.only and not any(part in name for part in args.only):
            continue
        time.sleep(REST_S)
        try:
            row = {} if want is None else {"max_err_of_max": error_of_max(call(), want())}
            row |= run_kind(call)
        except Exception as e:  # a configuration that does not fit is a result too
            row = {"error": failure(e)}
        result["kinds"][name] = row
        print(name, {k: v for k, v in row.items() if k != "series_s_mhz_w_c"}, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
