"""The run folder and the controls around the training loop: stop requests, divergence, profiling."""
import json
import os
import shutil
import signal
import time
import uuid
from collections import defaultdict
from pathlib import Path

import torch

from runtime import dist
from runtime.errors import UserError


def make_run_dir(log_dir: str, rt: dist.Runtime) -> Path:
    """A fresh folder under --log_dir, named alike on every rank and proven writable before training."""
    run_id = dist.broadcast_object(time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6], rt)
    run_dir = Path(log_dir) / run_id
    if rt.is_master:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write_probe"
            probe.write_bytes(b"\0" * 4096)
            probe.unlink()
        except OSError as e:
            raise UserError(f"--log_dir={log_dir} is not writable ({e.strerror}); "
                            f"pass a folder you can write to, e.g. --log_dir=/tmp/logs") from None
    return run_dir


def check_disk_space(run_dir: Path, needed_bytes: int, what: str) -> None:
    free = shutil.disk_usage(run_dir).free
    if free < needed_bytes:
        raise UserError(f"--log_dir={run_dir.parent} has {free / 2**30:.2f} GiB free but {what} needs about "
                        f"{needed_bytes / 2**30:.2f} GiB; free some space or pass another --log_dir")


# Inductor launches its own kernels through its static CUDA launcher, but user-defined Triton kernels (ours, via
# torch.library.triton_op) through Triton's, which builds a C launcher with the host compiler on first use: 4.0 s of a
# strictly cold start's 87.6 s on the H200 (bench/results/cold_profile_1xH200_317d98e.txt). The compile workers are
# separate processes that read this variable when they start; a torch.compile option does not reach them
# (bench/results/README.md, 74b0f3a). Set, the launcher builds took 1.5 s instead of 4.0 (half the libraries) in a
# py-spy recording on another H200 (bench/results/cold_profile_1xH200_940105b.txt).
STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def use_static_launcher() -> None:
    """Statically launch our Triton kernels inside compiled graphs, unless the environment says otherwise. Call it
    before the first compile, which starts the compile workers."""
    import torch._inductor.config as inductor_config

    os.environ.setdefault(STATIC_LAUNCH_ENV, "1")
    inductor_config.static_launch_user_defined_triton_kernels = os.environ[STATIC_LAUNCH_ENV] == "1"


def all_finite(tensors) -> bool:
    """True when no element is inf/nan; one device sync for all the tensors."""
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def profiled(fn, step: int, out_dir: Path | None, cpu: bool = True):
    """Run fn(step) under torch.profiler; rank 0 writes the kernel table and a Chrome trace, and logs how much of
    the step the GPU spent in kernels (the rest is the GPU waiting for the CPU: launches, syncs, Python). Without
    cpu (on a GPU) the host's ops are not traced: no launch sites, and the host is slowed only by the GPU's tracing."""
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
            events = json.loads(trace.read_text())["traceEvents"]  # read once: a GPU step's trace is large
            busy_ms, span_ms = kernel_busy_ms(events)
            table = (f"step {step + 1}: {wall_ms:.1f} ms wall under the profiler; GPU kernels busy {busy_ms:.1f} ms "
                     f"of the {span_ms:.1f} ms from the first kernel to the last ({busy_ms / span_ms:.0%})\n" + table
                     + "\n\nGPU time by the code that launched it:\n"
                     + (launch_sites_table(events) if cpu else "not traced (--profile_cpu=0)\n"))
        (out_dir / f"profile_step{step + 1}.txt").write_text(table)
    return result


def kernel_busy_ms(events: list[dict]) -> tuple[float, float]:
    """(time covered by at least one GPU kernel, time from the first kernel's start to the last one's end), in ms,
    from the events of a torch.profiler Chrome trace."""
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
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the CPU calls that queue it (cudaLaunchKernel, cuLaunchKernelEx, ...)
CPU_SPANS = ("cpu_op", "user_annotation")  # aten ops and autograd nodes; record_function ranges such as a compiled
# graph's "## Call CompiledFxGraph ... ##"


def read_gpu_trace(argv: list[str], prog: str) -> list[dict]:
    """The events of the one trace file named in argv (the bench tools' command line), which must hold GPU work;
    a UserError names what to pass otherwise."""
    usage = f"usage: {prog} RUN_DIR/profile_stepN.json (the trace of a GPU run with --profile_step=N)"
    if len(argv) != 1 or argv[0].startswith("-"):
        raise UserError(usage)
    try:
        events = json.loads(Path(argv[0]).read_bytes())["traceEvents"]
    except OSError as error:
        raise UserError(f"{argv[0]}: {error.strerror}; {usage}") from None
    except (ValueError, KeyError, TypeError):  # not JSON (ValueError covers bad UTF-8), or JSON of another kind
        raise UserError(f"{argv[0]} is not a torch.profiler trace; {usage}") from None
    if not any(e.get("cat") in GPU_WORK for e in events):
        raise UserError(f"{argv[0]} holds no GPU work: a CPU run's trace; {usage}")
    return events


def launch_sites(events: list[dict]) -> dict[tuple[tuple[str, ...], str], list]:
    """{(CPU ops open at the launch, outermost first; GPU event name): [count, ms]} from the events of a
    torch.profiler Chrome trace.

    The kernel table says which kernels took the time; this says which code queued them, so that eager glue,
    memsets and copies can be traced to an aten op, an autograd node or a compiled graph."""
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
    """{correlation id of a launch: names of the CPU ops open at it, outermost first}. A GPU event carries the
    correlation id of the runtime call that launched it; the CPU ops open on that call's thread at that moment
    enclose it (the autograd engine runs the backward on threads of its own)."""
    by_thread = defaultdict(list)  # (pid, tid) -> [(ts, kind, -dur, event)]: ops sort before the launches they enclose
    for e in events:
        if e.get("cat") in CPU_SPANS and "dur" in e:
            by_thread[e.get("pid"), e.get("tid")].append((e["ts"], 0, -e["dur"], e))
        elif e.get("cat") in LAUNCHES and "correlation" in e.get("args", {}):
            by_thread[e.get("pid"), e.get("tid")].append((e["ts"], 1, 0, e))
    path_of = {}  # correlation id -> names of the enclosing ops
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


COMPILED_GRAPH = "## Call CompiledFxGraph"  # the record_function range inductor opens around a compiled graph's call


def by_innermost_op(sites: dict) -> tuple[list, dict[str, list]]:
    """(GPU time launched inside compiled graphs as [count, ms]; {innermost CPU op: [count, ms]} for the rest):
    the eager glue between compiled regions, named by the aten op or autograd node that launched it."""
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


class StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks, so a stop ends with a checkpoint, not a crash."""

    def __init__(self):
        self.signal = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum


class TrainClock:
    """Train time in ms. It runs from start() to stop(), which both sync the GPU. A mark() taken in between reads the
    time at which the GPU reached that point of its queue, without draining the queue: a CUDA event timed from one
    queued at start() (the GPU is idle then, so that one completes at once). Without a GPU, whose work is
    synchronous, a mark is the time it was taken."""

    def __init__(self, cuda: bool, ms: float = 0.0):
        self.cuda, self.ms = cuda, ms

    def start(self) -> None:
        self._sync()
        self.t0 = time.perf_counter()
        if self.cuda:
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()

    def stop(self) -> float:
        self._sync()
        self.ms += 1e3 * (time.perf_counter() - self.t0)
        return self.ms

    def mark(self):
        """A function that returns the train time at this point of the GPU's queue, waiting until the GPU is there."""
        base = self.ms
        if not self.cuda:
            at = 1e3 * (time.perf_counter() - self.t0)
            return lambda: base + at
        origin, event = self.origin, torch.cuda.Event(enable_timing=True)
        event.record()

        def read() -> float:
            event.synchronize()
            return base + origin.elapsed_time(event)
        return read

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class LossRecord:
    """A logged step's train loss and the ranks' stop votes, summed over the ranks by one collective (so every rank
    decides alike) and copied to the host without waiting. The loop reads a record after queueing the next step,
    so the GPU's queue never drains between steps: at 8c60c3c's step, logging every step made the step 7-10 ms longer
    than logging every 20th, and reading the loss a step late made it 3.80 and 8.90 ms shorter in two pairs
    (bench/results/README.md, section e569653). Nothing here syncs: a tensor made from a Python number on the GPU
    would (a pageable copy), torch.full does not."""

    def __init__(self, step: int, loss: torch.Tensor, stop: bool, world_size: int, clock: TrainClock):
        flags = torch.stack([loss.float(), torch.full((), float(stop), device=loss.device)])
        if world_size > 1:
            torch.distributed.all_reduce(flags)
        self.step, self.world_size = step, world_size
        self.flags = torch.empty(2, pin_memory=flags.is_cuda)  # pinned: the copy is queued, not waited for
        self.flags.copy_(flags, non_blocking=True)
        self.time = clock.mark()  # queued after the copy: once the GPU is there, the copy is done

    def read(self) -> tuple[float, bool, float]:
        """(the ranks' mean train loss, whether any rank asked to stop, train time at the step's end in ms)."""
        ms = self.time()
        loss, votes = self.flags.tolist()
        return loss / self.world_size, votes > 0, ms
