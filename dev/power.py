"""The power and SM clock that each kind of kernel in the step holds when it runs alone (GPU only): which kinds drive
the GPU to its power limit, and what that costs them in time.

    python -m dev.power --out power.json [--only FP8 rms_norm]

A kernel that holds the GPU at its power limit slows with the clock the limit leaves it; one that stays below runs
at full clock. Which kind is which tells where saved time, and where saved energy, turns into a shorter step.

Each kind replays one CUDA graph of its call back to back for SECONDS, timed in chunks of about CHUNK_MS by CUDA
events, while bench/gpu_monitor.py samples nvidia-smi every 0.1 s; before each kind the GPU idles for REST_S, so
that each starts from the same state. For each kind: ms per call over the first 100 ms (the nearest to full clock)
and over the last half; the clock and power over the last half, with their series; and the clock event reasons
that `nvidia-smi -q` reports active three quarters in. Shapes: one 49,152-token micro-batch of the record model
(D = 768, F = 3,072), the MLP's first product in bf16 and in FP8 (e4m3, per-tensor scales), and a memory-bound
norm of the residual stream.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.gpu_monitor import GpuMonitor, failed, id_args, run_gpus

SECONDS, REST_S, CHUNK_MS = 6.0, 4.0, 10.0
M, D, HIDDEN = 48 * 1024, 768, 3072  # one micro-batch's tokens, the model's width, the MLP's hidden width


def active_clock_reasons(gpus: list[str] | None = None) -> list[str] | str:
    """The reasons `nvidia-smi -q -d PERFORMANCE` reports active now, what holds the clocks down ("SW Power Cap",
    "Idle", ...), over the GPUs with these ids (None: all), each once in the order first seen; or why it could not
    say."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return "nvidia-smi not found"
    try:
        out = subprocess.run([executable, "-q", "-d", "PERFORMANCE", *id_args(gpus)], capture_output=True, text=True,
                             timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return failed(e)
    reasons = [line.split(":")[0].strip() for line in out.splitlines() if line.strip().endswith(": Active")]
    return list(dict.fromkeys(reasons))


def kinds() -> dict:
    """name -> a call of that kind of kernel on its inputs."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(M, D, device="cuda", generator=gen).bfloat16()
    w1 = (torch.randn(D, HIDDEN, device="cuda", generator=gen) / D ** 0.5).bfloat16()
    x8 = x.to(torch.float8_e4m3fn)
    w8 = w1.t().contiguous().to(torch.float8_e4m3fn)  # (F, D): Hopper's FP8 product reads both operands K-major
    one = torch.ones((), device="cuda")
    return {
        "bf16 product, cuBLAS: x (M, D) @ W1 (D, F)": lambda: x @ w1,
        "FP8 product, cuBLAS: the same in e4m3": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one,
                                                                          out_dtype=torch.bfloat16),
        "memory-bound: rms_norm of the residual stream (M, D)": lambda: F.rms_norm(x, (D,)),
    }


def captured(fn) -> torch.cuda.CUDAGraph:
    """fn's GPU work captured in a CUDA graph, after one call outside it (first launches, allocations)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", default=[], help="only the kinds whose name contains one of these")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("no CUDA device that torch can use: this measures a GPU's power and clock")

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "M": M, "D": D, "F": HIDDEN,
              "seconds": SECONDS, "rest_s": REST_S, "kinds": {}}
    for name, call in kinds().items():
        if args.only and not any(part in name for part in args.only):
            continue
        time.sleep(REST_S)
        row = run_kind(call)
        result["kinds"][name] = row
        print(name, {k: v for k, v in row.items() if k != "series_s_mhz_w_c"}, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
