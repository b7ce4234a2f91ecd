"""--profile_step: one step under torch.profiler, and tables from its trace: GPU time by kernel and by launch site."""
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from runtime.errors import UserError


def profiled(fn, step: int, out_dir: Path | None, cpu: bool = True):
    """Run fn(step) under torch.profiler; write the kernel table, the GPU's busy share and a Chrome trace into
    `out_dir`. Without `cpu` the host's ops are not traced: no launch sites, but a host slowed less."""
    cuda = torch.cuda.is_available()
    activities = ([torch.profiler.ProfilerActivity.CPU] if cpu else []) + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        result = fn(step)
        if cuda:
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    if out_dir is not None:
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=60)
        trace = out_dir / f"profile_step{step + 1}.json"
        prof.export_chrome_trace(str(trace))
        if cuda:
            events = json.loads(trace.read_text())["traceEvents"]  # read once: it is large
            busy_ms, span_ms = kernel_busy_ms(events)
            table = (f"step {step + 1}: {wall_ms:.1f} ms wall under the profiler; GPU kernels busy {busy_ms:.1f} ms "
                     f"of the {span_ms:.1f} ms from the first kernel to the last ({busy_ms / span_ms:.0%})\n" + table
                     + "\n\nGPU time by the code that launched it:\n"
                     + (launch_sites_table(events) if cpu else "not traced (--profile_cpu=0)\n"))
        (out_dir / f"profile_step{step + 1}.txt").write_text(table)
    return result


def kernel_busy_ms(events: list[dict]) -> tuple[float, float]:
    """(ms covered by at least one GPU kernel, ms from the first kernel's start to the last's end) in a trace."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e)
    if not spans:
        return 0.0, 0.0
    busy, (start, end) = 0.0, spans[0]
    first = start
    for s, e in spans[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    return busy / 1e3, (end - first) / 1e3


GPU_WORK = ("kernel", "gpu_memset", "gpu_memcpy")  # trace categories of work that runs on the GPU
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the CPU calls that queue it
CPU_SPANS = ("cpu_op", "user_annotation")  # aten ops, autograd nodes and record_function ranges


def read_gpu_trace(argv: list[str], prog: str) -> list[dict]:
    """The events of the one GPU trace file named in argv; a UserError names what to pass otherwise."""
    usage = f"usage: {prog} RUN_DIR/profile_stepN.json (the trace of a GPU run with --profile_step=N)"
    if len(argv) != 1 or argv[0].startswith("-"):
        raise UserError(usage)
    try:
        events = json.loads(Path(argv[0]).read_bytes())["traceEvents"]
    except OSError as error:
        raise UserError(f"{argv[0]}: {error.strerror}; {usage}") from None
    except (ValueError, KeyError, TypeError):  # not JSON (or bad UTF-8), or JSON of another kind
        raise UserError(f"{argv[0]} is not a torch.profiler trace; {usage}") from None
    if not any(e.get("cat") in GPU_WORK for e in events):
        raise UserError(f"{argv[0]} holds no GPU work: a CPU run's trace; {usage}")
    return events


def launch_sites(events: list[dict]) -> dict[tuple[tuple[str, ...], str], list]:
    """{(CPU ops open at the launch, outermost first; GPU event name): [count, ms]}: which code queued the work."""
    path_of = launch_paths(events)
    sites = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in GPU_WORK and "dur" in e:
            path = path_of.get(e.get("args", {}).get("correlation"), ("(launch not traced)",))
            site = sites[path, e["name"]]
            site[0] += 1
            site[1] += e["dur"] / 1e3
    return dict(sites)


def launch_paths(events: list[dict]) -> dict[int, tuple[str, ...]]:
    """{correlation id of a launch: the CPU ops open at it, outermost first}. Ops are matched on the launch's own
    thread: the autograd engine runs the backward on threads of its own."""
    by_thread = defaultdict(list)  # (pid, tid) -> [(ts, kind, -dur, event)]: ops sort before the launches they enclose
    for e in events:
        if e.get("cat") in CPU_SPANS and "dur" in e:
            by_thread[e.get("pid"), e.get("tid")].append((e["ts"], 0, -e["dur"], e))
        elif e.get("cat") in LAUNCHES and "correlation" in e.get("args", {}):
            by_thread[e.get("pid"), e.get("tid")].append((e["ts"], 1, 0, e))
    path_of = {}
    for items in by_thread.values():
        stack = []
        for ts, is_launch, _, e in sorted(items, key=lambda item: item[:3]):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ts:
                stack.pop()
            if is_launch:
                path_of[e["args"]["correlation"]] = tuple(op["name"] for op in stack) or ("(no CPU op)",)
            else:
                stack.append(e)
    return path_of


COMPILED_GRAPH = "## Call CompiledFxGraph"  # inductor's record_function range around a compiled graph


def by_innermost_op(sites: dict) -> tuple[list, dict[str, list]]:
    """([count, ms] launched inside compiled graphs, {innermost CPU op: [count, ms]} for the eager rest)."""
    compiled, eager = [0, 0.0], defaultdict(lambda: [0, 0.0])
    for (path, _), (count, ms) in sites.items():
        total = compiled if any(op.startswith(COMPILED_GRAPH) for op in path) else eager[path[-1]]
        total[0] += count
        total[1] += ms
    return compiled, dict(eager)


def launch_sites_table(events: list[dict], rows: int = 40) -> str:
    sites = launch_sites(events)
    (compiled_count, compiled_ms), eager = by_innermost_op(sites)
    lines = [f"inside compiled graphs: {compiled_ms:.2f} ms ({compiled_count} launches); outside them "
             f"{sum(ms for _, ms in eager.values()):.2f} ms, by the innermost CPU op:"]
    for name, (count, ms) in sorted(eager.items(), key=lambda item: -item[1][1])[:rows]:
        lines.append(f"{ms:8.2f} {count:6d}  {name[:120]}")
    lines += ["", f"{'ms':>8} {'count':>6}  CPU ops open at the launch (outermost first): GPU event"]
    for (path, name), (count, ms) in sorted(sites.items(), key=lambda item: -item[1][1])[:rows]:
        lines.append(f"{ms:8.2f} {count:6d}  {' > '.join(op[:50] for op in path)}: {name[:70]}")
    return "\n".join(lines) + "\n"
