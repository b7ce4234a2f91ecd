"""The run folder and the controls around the training loop: stop requests, divergence, profiling."""
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
    """Run fn(step) under torch.profiler; rank 0 writes the kernel table and a Chrome trace."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        result = fn(step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if out_dir is not None:
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        (out_dir / f"profile_step{step + 1}.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=60))
        prof.export_chrome_trace(str(out_dir / f"profile_step{step + 1}.json"))
    return result


class StopRequest:
    """Turns SIGINT/SIGTERM into a flag the loop checks, so a stop ends with a checkpoint, not a crash."""

    def __init__(self):
        self.signal = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal = signum
