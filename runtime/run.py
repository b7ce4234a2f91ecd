"""The run folder and the controls around the training loop: stop requests, divergence, profiling."""
import json
import shutil
import signal
import time
import uuid
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


def all_finite(tensors) -> bool:
    """True when no element is inf/nan; one device sync for all the tensors."""
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def profiled(fn, step: int, out_dir: Path | None):
    """Run fn(step) under torch.profiler; rank 0 writes the kernel table and a Chrome trace, and logs how much of
    the step the GPU spent in kernels (the rest is the GPU waiting for the CPU: launches, syncs, Python)."""
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
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
            busy_ms, span_ms = kernel_busy_ms(trace)
            table = (f"step {step + 1}: {wall_ms:.1f} ms wall under the profiler; GPU kernels busy {busy_ms:.1f} ms "
                     f"of the {span_ms:.1f} ms from the first kernel to the last ({busy_ms / span_ms:.0%})\n" + table)
        (out_dir / f"profile_step{step + 1}.txt").write_text(table)
    return result


def kernel_busy_ms(chrome_trace: Path) -> tuple[float, float]:
    """(time covered by at least one GPU kernel, time from the first kernel's start to the last one's end), in ms,
    from a torch.profiler Chrome trace."""
    events = json.loads(chrome_trace.read_text())["traceEvents"]
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


class StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks, so a stop ends with a checkpoint, not a crash."""

    def __init__(self):
        self.signal = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
