"""Process setup: device, rank and, under torchrun, the process group, a hang watchdog, and death with torchrun."""
import ctypes
import dataclasses
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from runtime.cli import parse_config
from runtime.config import PRESETS, TrainConfig
from runtime.errors import UserError, tell_torchrun

HUNG_EXIT = 4  # exit status when a rank stops answering (2: user error, 3: diverged)
PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal this process gets when its parent dies


@dataclasses.dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    device: torch.device  # cuda:LOCAL_RANK under torchrun

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def choose_device(flag: str, local_rank: int) -> torch.device:
    if flag not in ("auto", "cuda", "cpu"):
        raise UserError(f"--device={flag!r} is not a device; use --device auto, cuda or cpu")
    if flag == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        gpus = nvidia_device_files()
        if flag == "cuda" or gpus:  # auto falls back to the CPU only where there is no GPU
            raise UserError(no_usable_gpu(flag, gpus))
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} are visible; "
                        f"start torchrun with --nproc_per_node={torch.cuda.device_count()}")
    check_kernel_toolchain()
    return torch.device("cuda", local_rank)


def device_for_flags(argv: list[str]) -> torch.device:
    """The device train_gpt2's first process would take with these flags, or its UserError; run.sh asks before a
    download, so an unusable GPU stops the run early."""
    return choose_device(parse_config(TrainConfig, argv, PRESETS).device, 0)


def nvidia_device_files(dev: str = "/dev") -> list[str]:
    """The NVIDIA GPUs' device files (/dev/nvidia0, ...), whatever this torch build can do with them."""
    names = [name for name in os.listdir(dev) if re.fullmatch(r"nvidia\d+", name)] if os.path.isdir(dev) else []
    return [os.path.join(dev, name) for name in sorted(names, key=lambda name: int(name.removeprefix("nvidia")))]


# the torch build for a CUDA 12 driver, also named in the README
CUDA12_TORCH = "`pip install torch --index-url https://download.pytorch.org/whl/cu128` for a CUDA 12 driver"


def no_usable_gpu(flag: str, gpus: list[str]) -> str:
    """Why torch sees no GPU, and the fix. On a machine with GPUs --device auto stops here rather than train on the
    CPU: pip's default torch cannot use an older driver, which is the usual cause."""
    if not gpus:
        return ("--device cuda, but no CUDA GPU is visible (torch.cuda.is_available() is False, and there is no "
                "/dev/nvidia0): check nvidia-smi (in Docker: docker run --gpus all), or train on the CPU with "
                "--device cpu")
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hides_every_gpu(hidden, len(gpus)):
        cause, fix = f"CUDA_VISIBLE_DEVICES={hidden!r} leaves torch none", "unset it or name GPUs that exist"
    elif torch.version.cuda is None:
        cause = f"torch {torch.__version__} is a CPU-only build"
        fix = f"install a CUDA build of torch for your driver, e.g. {CUDA12_TORCH} (nvidia-smi shows its CUDA Version)"
    else:
        cause = (f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, cannot use them "
                 f"(torch.cuda.is_available() is False{driver_cuda_note()})")
        fix = f"install the torch build for your driver's CUDA, e.g. {CUDA12_TORCH}, or update the driver"
    return (f"{'--device cuda: ' * (flag == 'cuda')}this machine has NVIDIA GPUs ({', '.join(gpus)}), but {cause}: "
            f"{fix}; or train on the CPU with --device cpu")


def hides_every_gpu(visible: str, gpus: int) -> bool:
    """Whether CUDA_VISIBLE_DEVICES=`visible` hides all `gpus`: CUDA stops at the first entry naming none. UUIDs
    cannot be checked and count as GPUs."""
    first = visible.split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return False
    return not (first.isdigit() and int(first) < gpus)


def driver_cuda_note() -> str:
    """"; the driver runs CUDA up to X" from nvidia-smi, or ""."""
    try:
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    found = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return f"; the driver runs CUDA up to {found.group(1)}" if found else ""


def check_kernel_toolchain() -> None:
    """Refuse a CUDA device Triton cannot build kernel launchers for: they need a C compiler ($CC, gcc or clang) and
    Python's headers, and without them the first launch fails obscurely."""
    compiler = os.environ.get("CC")
    if compiler:
        no_compiler = "" if shutil.which(compiler) else f"a C compiler (CC={compiler!r} is not a program)"
    else:
        no_compiler = ("" if shutil.which("gcc") or shutil.which("clang") else
                       "a C compiler (neither gcc nor clang is on PATH, and CC is unset)")
    scheme = sysconfig.get_default_scheme()
    header = Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"],
                  "Python.h")
    no_headers = "" if header.is_file() else f"Python's headers ({header} is missing)"
    missing = [need for need in (no_compiler, no_headers) if need]
    if missing:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        raise UserError(f"Triton, which builds this run's GPU kernels, needs {' and '.join(missing)}: install them "
                        f"(Debian/Ubuntu: apt-get install gcc python{version}-dev), or run in the project's Docker "
                        f"image")


def setup(device_flag: str, collective_timeout_s: int = TrainConfig.collective_timeout_s) -> Runtime:
    """Read torchrun's environment (absent: one process) and join the process group. A Watchdog ends a hung job after
    `collective_timeout_s`; collectives time out at twice that, so its message, naming the ranks, comes first."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = choose_device(device_flag, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1:
        launcher = die_with_launcher()
        timeout = datetime.timedelta(seconds=2 * collective_timeout_s)
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        global _watchdog
        _watchdog = Watchdog(rank, world_size, collective_timeout_s, launcher)
    return Runtime(rank, world_size, device)


def teardown():
    global _watchdog
    if _watchdog:
        _watchdog.stop()
        _watchdog = None
    if dist.is_initialized():
        dist.destroy_process_group()


def die_with_launcher() -> int | None:
    """Under torchrun on Linux, get SIGTERM when torchrun dies (even by kill -9), so no worker trains on alone.
    Returns torchrun's pid, or None elsewhere."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return None
    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != launcher:  # it died before prctl
        os.kill(os.getpid(), signal.SIGTERM)
    return launcher


class Watchdog:
    """Ends the job with HUNG_EXIT when a rank's heartbeat in the job's store stops for `timeout_s`, or the store
    does; the lowest answering rank says why. Threads beat, so a long step or compile never trips it."""

    def __init__(self, rank: int, world_size: int, timeout_s: int, launcher: int | None):
        self.rank, self.world_size, self.timeout_s, self.launcher = rank, world_size, timeout_s, launcher
        self.period = min(5.0, timeout_s / 4)
        self.peers = [r for r in range(world_size) if r != rank]
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        # its own connection, so a hung store blocks this one, never the training's
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives restarts
        self.store = dist.PrefixStore(f"gpt-speedrun/watchdog/{attempt}", store)
        now = time.monotonic()
        self.answered = now  # when the store last answered this rank
        self.heard = dict.fromkeys(self.peers, now)  # when each peer's counter last moved
        self.counts = dict.fromkeys(self.peers, -1)
        self.done: set[int] = set()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=target, name=f"watchdog-{name}", daemon=True)
                        for name, target in (("exchange", self._exchange), ("judge", self._judge))]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """Mark this rank done, so no other rank waits for it, and end the threads."""
        if self._store_alive():
            try:
                self.store.add(f"done/{self.rank}", 1)
            except dist.DistError:  # the store is gone, and with it the readers
                pass
        self.stopping.set()

    def _store_alive(self) -> bool:
        # torchrun's store dies with it; not asking then spares the log warnings
        return self.launcher is None or os.getppid() == self.launcher

    def _exchange(self) -> None:
        while not self.stopping.wait(self.period) and self._store_alive():
            try:
                self.store.add(f"beat/{self.rank}", 1)
                counts = {r: self.store.add(f"beat/{r}", 0) for r in self.peers}
                done = {r for r in self.peers if self.store.add(f"done/{r}", 0)}
            except dist.DistError:
                return  # not asked again; the judge sees it silent
            now = time.monotonic()
            for r, count in counts.items():
                if count != self.counts[r]:
                    self.counts[r], self.heard[r] = count, now
            self.done |= done
            self.answered = now

    def _judge(self) -> None:
        while not self.stopping.wait(self.period):
            now = time.monotonic()
            if now - self.answered > self.timeout_s:
                holder = "torchrun" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
                self._end(f"the job's store at {self.address}, which {holder} holds, has not answered for "
                          f"{self.timeout_s} s", reporter=self.rank == (1 if holder == "rank 0" else 0))
            silent = [r for r in self.peers if r not in self.done and now - self.heard[r] > self.timeout_s]
            if silent:
                answering = sorted(set(range(self.world_size)) - set(silent))
                ranks = f"rank {silent[0]} has" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))} have"
                self._end(f"{ranks} not answered for {self.timeout_s} s (stopped, frozen or cut off)",
                          reporter=self.rank == answering[0])

    def _end(self, cause: str, reporter: bool) -> NoReturn:
        """Exit with HUNG_EXIT. The reporter says why; the others wait two periods, so the reporter speaks first."""
        message = f"error: {cause}: ending the job (exit status {HUNG_EXIT}); --collective_timeout_s sets this wait"
        tell_torchrun(message)  # torchrun's summary shows the first rank to exit
        if reporter:
            os.write(2, f"{message}\n".encode())
        else:
            time.sleep(2 * self.period)
        os._exit(HUNG_EXIT)


_watchdog: Watchdog | None = None


def all_ranks_sum(value: float, rt: Runtime) -> float:
    """Sum a Python number over ranks (identity on one process)."""
    if rt.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=rt.device)
    dist.all_reduce(t)
    return t.item()


def agree_on_max(tensors: list[torch.Tensor], rt: Runtime) -> None:
    """Set `tensors` in place to the ranks' elementwise maximum, so that every rank holds the same."""
    if rt.world_size == 1 or not tensors:
        return
    stacked = torch.stack(tensors)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    for t, agreed in zip(tensors, stacked):
        t.copy_(agreed)


def broadcast_object(obj, rt: Runtime):
    """Rank 0's `obj` on every rank."""
    if rt.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
