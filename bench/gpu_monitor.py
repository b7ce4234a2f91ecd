"""The GPUs' clocks, power and temperature, sampled by nvidia-smi beside a benchmark run (bench/run.py), so that each
figure carries the state of the machine that made it.

Why: the step runs at the GPU's power limit, so its time follows the SM clock a machine holds there, which differs
between machines of one model by more than most changes move the step.

A thread asks `nvidia-smi --query-gpu=...` every INTERVAL_S seconds, about the GPUs the run uses (`--id`, from
CUDA_VISIBLE_DEVICES as run_gpus reads it; on a shared 8-GPU box the idle ones would otherwise sit in the figures);
each answer is one row per GPU. The summary covers the samples between two times (bench/run.py passes the end of the
compile warm-up and the last step's line: the teardown after it idles at full clock and would set the maximum), per
GPU: the SM clock's median, minimum and maximum, the median power against the power limit, the highest temperature;
and the whole series from the start. Where nvidia-smi is missing (CPU machines) or fails, the summary says why
instead, and the run goes on: the monitor only watches.
"""
import os
import shutil
import statistics
import subprocess
import threading
import time

INTERVAL_S = 0.5
QUERY = ("index", "clocks.sm", "power.draw", "power.limit", "temperature.gpu")  # stable fields of nvidia-smi


def number(field: str) -> float | None:
    """A field of nvidia-smi's answer: a number, or None where the driver does not report it ("[N/A]")."""
    field = field.strip()
    return None if field.startswith("[") else float(field)


def run_gpus(nproc: int) -> list[str]:
    """nvidia-smi's ids of the GPUs that a run of nproc processes uses: the first nproc of CUDA_VISIBLE_DEVICES
    (indices or UUIDs, as nvidia-smi takes them), else 0 .. nproc - 1. nvidia-smi numbers the GPUs in PCI bus
    order; CUDA does too with CUDA_DEVICE_ORDER=PCI_BUS_ID, or where all GPUs are one model (its default order puts
    the fastest first)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return (visible or [str(i) for i in range(nproc)])[:nproc]


def id_args(gpus: list[str] | None) -> list[str]:
    """nvidia-smi's arguments that limit a query to these GPU ids (None: all GPUs)."""
    return [f"--id={','.join(gpus)}"] if gpus else []


def query(executable: str, gpus: list[str] | None = None) -> list[list[float | None]]:
    """One row [index, SM clock MHz, power W, power limit W, temperature C] per GPU (None: not reported), of the
    GPUs with these nvidia-smi ids (None: all); ValueError on an answer that is neither."""
    command = [executable, f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits"]
    out = subprocess.run(command + id_args(gpus), capture_output=True, text=True, timeout=10, check=True).stdout
    return [[number(v) for v in line.split(",")] for line in out.splitlines() if line.strip()]


def failed(e: Exception) -> str:
    """Why an nvidia-smi call gave no answer, on one line: its exit status and stderr, or the error."""
    if isinstance(e, subprocess.CalledProcessError):
        return f"nvidia-smi exited with status {e.returncode}: {' '.join(e.stderr.split())[:200]}"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def reported(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None]


class GpuMonitor:
    """Context manager: samples the GPUs with these nvidia-smi ids (None: all) from entering to leaving;
    summary(since_s, until_s) afterwards (seconds from entering)."""

    def __init__(self, interval_s: float = INTERVAL_S, gpus: list[str] | None = None):
        self.interval_s = interval_s
        self.gpus = gpus
        self.samples: list[tuple[float, list[list[float | None]]]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuMonitor":
        self._t0 = time.perf_counter()
        executable = shutil.which("nvidia-smi")
        if executable is None:
            self.error = "nvidia-smi not found"
        else:
            self._thread = threading.Thread(target=self._sample, args=(executable,), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self, executable: str) -> None:
        while not self._stop.is_set():
            t = time.perf_counter() - self._t0
            try:
                self.samples.append((t, query(executable, self.gpus)))
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                self.error = failed(e)
                return
            self._stop.wait(self.interval_s)

    def summary(self, since_s: float = 0.0, until_s: float | None = None) -> dict:
        """The samples taken from since_s to until_s (None: the end), per GPU; where there are none, the reason."""
        end = float("inf") if until_s is None else until_s
        rows = [row for t, answer in self.samples if since_s <= t <= end for row in answer]
        if not rows:
            return {"error": self.error or f"no sample from {since_s:.1f} s to {end:.1f} s"}
        gpus = []
        for index in sorted({int(r[0]) for r in rows}):
            mine = [r for r in rows if int(r[0]) == index]
            clocks, power, limit, temperature = (reported([r[i] for r in mine]) for i in range(1, 5))
            gpus.append({"index": index, "samples": len(mine),  # a figure the driver never reported is None
                         "sm_clock_mhz_median": statistics.median(clocks) if clocks else None,
                         "sm_clock_mhz_min": min(clocks, default=None), "sm_clock_mhz_max": max(clocks, default=None),
                         "power_w_median": statistics.median(power) if power else None,
                         "power_limit_w": limit[-1] if limit else None,
                         "temperature_c_max": max(temperature, default=None)})
        # every sample from the start, [seconds, SM clock, power, temperature] per GPU: how the clocks moved through
        # the compile, the first steps and the teardown, which the summary leaves out
        series = {index: [[round(t, 2), *row[1:3], row[4]] for t, answer in self.samples for row in answer
                          if int(row[0]) == index] for index in (gpu["index"] for gpu in gpus)}
        for gpu in gpus:
            gpu["series_s_mhz_w_c"] = series[gpu["index"]]
        result = {"interval_s": self.interval_s, "gpu_ids": self.gpus, "since_s": round(since_s, 1),
                  "until_s": None if until_s is None else round(until_s, 1), "gpus": gpus}
        if self.error:  # sampling stopped early: the figures cover only the samples before it
            result["error"] = self.error
        return result
