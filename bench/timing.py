"""CUDA-event timing for the micro-benchmarks (bench/attention.py, bench/fwd_bwd.py, bench/head_kernels.py), and
the kernel benches' random bf16 inputs."""
import statistics

import torch

WARMUP, REPEATS = 3, 10  # untimed calls first (compile, first launches, allocator growth), then the timed ones


def cuda_times_ms(fn, warmup: int = WARMUP, repeats: int = REPEATS) -> list[float]:
    """Milliseconds of each of `repeats` calls of fn, after `warmup` untimed calls; each timed call lies between
    two CUDA events and is waited for before the next, so queued work never overlaps the measurement."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def median_ms(fn) -> float:
    return round(statistics.median(cuda_times_ms(fn)), 3)


def failure(e: Exception) -> str:
    """A failed configuration's result in a kernel sweep: the error's type and the last 300 characters of its
    message, on one line (Triton's compile errors end with the cause)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[-300:]}"


def graph_ms_each(calls: dict) -> dict:
    """graph_ms of each named call, or its failure: one configuration that does not compile ends no sweep."""
    times = {}
    for name, call in calls.items():
        try:
            times[name] = graph_ms(call)
        except Exception as e:
            times[name] = failure(e)
    return times


def cuda_bf16_randn(*shape) -> torch.Tensor:
    """Standard normal bf16 on the GPU from the default generator (the kernel benches seed it first)."""
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def captured(fn) -> torch.cuda.CUDAGraph:
    """fn's GPU work captured in a CUDA graph, after one call outside it (compiles, first launches, allocations)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(fn, replays: int = 20) -> float:
    """GPU milliseconds of one call of fn, captured in a CUDA graph: the median over 5 timings of `replays` replays,
    after one untimed timing. Without the host's launch work, which an eager call of a kernel that builds its TMA
    descriptors in Python (model/mlp_kernels.py) would time as well."""
    graph = captured(fn)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return round(statistics.median(times[1:]), 4)
