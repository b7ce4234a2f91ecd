"""bench/run.py: how per-step times and the validation context come out of a run's log, the checks made before a
run starts, and the harness end to end on the CPU; bench/gpu_monitor.py against a stand-in nvidia-smi."""
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_monitor import QUERY, GpuMonitor
from bench.run import MIN_STEPS, per_step_ms, val_context

REPO = Path(__file__).resolve().parent.parent

# A stand-in for nvidia-smi: two GPUs; GPU 0's clock falls by 10 MHz and its temperature rises by 1 C at each call.
# It answers for the GPUs of its --id list (all without one), and keeps its call count and last arguments beside
# itself.
FAKE_NVIDIA_SMI = """#!/bin/sh
n=$(cat "$0.count" 2>/dev/null || echo 0)
echo $((n + 1)) > "$0.count"
echo "$@" > "$0.args"
ids=0,1
for a in "$@"; do case $a in --id=*) ids=${a#--id=};; esac; done
case ",$ids," in *,0,*) echo "0, $((1980 - 10 * n)), 650.5, 700.00, $((60 + n))";; esac
case ",$ids," in *,1,*) echo "1, 1755, 690.0, 700.00, 66";; esac
"""


def fake_nvidia_smi(folder: Path, script: str = FAKE_NVIDIA_SMI) -> Path:
    folder.mkdir(exist_ok=True)
    exe = folder / "nvidia-smi"
    exe.write_text(script)
    exe.chmod(0o755)
    return exe


def test_per_step_times_skip_gaps_and_the_profiled_step():
    # train_time_ms at the line after each step; step 4 was profiled (slow), step 6 has no line before it
    lines = [(1, 100.0), (2, 180.0), (3, 260.0), (4, 1300.0), (5, 1380.0), (7, 1540.0), (8, 1620.0)]
    metrics = [{"step": s, "train_loss": 1.0, "train_time_ms": t} for s, t in lines] + [{"step": 8, "val_loss": 1.0}]
    assert per_step_ms(metrics, profiled_step=4) == [80.0, 80.0, 80.0, 80.0]
    assert per_step_ms(metrics) == [80.0, 80.0, 1040.0, 80.0, 80.0]


def test_val_context_from_the_run_folder_line():
    # train_gpt2's line (tests/test_reliability.py case 11 checks that it prints it), and one from before the option
    line = "run folder logs/x | 1 process(es) on cpu | grad accumulation 1 | validation 4 steps ({} per sequence)"
    assert val_context(["warm-up: ...", line.format("64 tokens of context")]) == 64
    assert val_context([line.replace(" ({} per sequence)", "")]) == 0


def test_compile_caches_are_counted(tmp_path, monkeypatch):
    """A start counts as strictly cold only when inductor's and Triton's caches hold no file."""
    from bench.run import compile_cache_files

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert compile_cache_files() == {str(tmp_path / "inductor"): 0, str(tmp_path / "triton"): 0}
    (tmp_path / "inductor" / "fxgraph" / "ab").mkdir(parents=True)
    for name in ("x", "y"):
        (tmp_path / "inductor" / "fxgraph" / "ab" / name).write_text("")
    assert compile_cache_files() == {str(tmp_path / "inductor"): 2, str(tmp_path / "triton"): 0}


def wait_for_samples(monitor: GpuMonitor, n: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(monitor.samples) < n and monitor.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(monitor.samples) >= n, monitor.error


def test_gpu_monitor_summarises_each_gpu_after_a_time(tmp_path, monkeypatch):
    exe = fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    with GpuMonitor(interval_s=0.01) as monitor:
        wait_for_samples(monitor, 5)
    calls = int((tmp_path / "bin" / "nvidia-smi.count").read_text())
    assert (tmp_path / "bin" / "nvidia-smi.args").read_text().split() == [
        f"--query-gpu={','.join(QUERY)}", "--format=csv,noheader,nounits"]
    summary = monitor.summary()
    assert summary["interval_s"] == 0.01 and summary["since_s"] == 0.0 and "error" not in summary
    assert summary["gpu_ids"] is None and summary["until_s"] is None
    first, second = summary["gpus"]
    times = [round(t, 2) for t, _ in monitor.samples]
    assert times == sorted(times) and len(times) == calls
    assert first == {"index": 0, "samples": calls, "sm_clock_mhz_median": 1980 - 10 * ((calls - 1) / 2),
                     "sm_clock_mhz_min": 1980 - 10 * (calls - 1), "sm_clock_mhz_max": 1980, "power_w_median": 650.5,
                     "power_limit_w": 700.0, "temperature_c_max": 60 + calls - 1,
                     "series_s_mhz_w_c": [[t, 1980 - 10 * n, 650.5, 60 + n] for n, t in enumerate(times)]}
    assert second["index"] == 1 and second["sm_clock_mhz_min"] == second["sm_clock_mhz_max"] == 1755
    # only the samples at or after since_s: the later ones have the lower clocks
    later = monitor.summary(since_s=monitor.samples[2][0])["gpus"][0]
    assert later["samples"] == calls - 2 and later["sm_clock_mhz_max"] == 1980 - 20
    assert later["series_s_mhz_w_c"] == first["series_s_mhz_w_c"]  # the series always starts at the start
    # and only those up to until_s: the first two, with the higher clocks
    early = monitor.summary(until_s=monitor.samples[1][0])
    assert early["until_s"] == round(monitor.samples[1][0], 1)
    assert early["gpus"][0]["samples"] == 2 and early["gpus"][0]["sm_clock_mhz_min"] == 1980 - 10
    assert monitor.summary(since_s=1e9) == {"error": "no sample from 1000000000.0 s to inf s"}


def test_gpu_monitor_asks_only_for_the_gpus_of_the_run(tmp_path, monkeypatch):
    """run_gpus: the first nproc of CUDA_VISIBLE_DEVICES (indices or UUIDs), else 0 .. nproc - 1; the monitor passes
    them to nvidia-smi as --id, and the summary holds those GPUs only."""
    from bench.gpu_monitor import run_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert run_gpus(2) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,6")
    assert run_gpus(2) == ["3", "5"] and run_gpus(1) == ["3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8a1b,GPU-77c0")
    assert run_gpus(1) == ["GPU-8a1b"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # set but empty: no GPU named, as if unset
    assert run_gpus(1) == ["0"]

    exe = fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    with GpuMonitor(interval_s=0.01, gpus=["1"]) as monitor:
        wait_for_samples(monitor, 2)
    assert (tmp_path / "bin" / "nvidia-smi.args").read_text().split()[-1] == "--id=1"
    summary = monitor.summary()
    assert summary["gpu_ids"] == ["1"] and [gpu["index"] for gpu in summary["gpus"]] == [1]


def test_gpu_monitor_says_why_it_has_no_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
    with GpuMonitor(interval_s=0.01) as monitor:
        pass
    assert monitor.summary() == {"error": "nvidia-smi not found"}
    failing = fake_nvidia_smi(tmp_path / "bin", "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    monkeypatch.setenv("PATH", str(failing.parent))
    with GpuMonitor(interval_s=0.01) as monitor:
        time.sleep(0.1)
    summary = monitor.summary()
    assert summary == {"error": "nvidia-smi exited with status 9: NVIDIA-SMI has failed"}
    assert monitor.samples == []  # the first call failed: sampling stopped, the run goes on


def test_gpu_monitor_leaves_out_what_the_driver_does_not_report(tmp_path, monkeypatch):
    exe = fake_nvidia_smi(tmp_path / "bin", "#!/bin/sh\necho '0, 1980, [N/A], [N/A], 61'\n")
    monkeypatch.setenv("PATH", str(exe.parent))
    with GpuMonitor(interval_s=0.01) as monitor:
        wait_for_samples(monitor, 2)
    (gpu,) = monitor.summary()["gpus"]
    assert gpu["sm_clock_mhz_median"] == 1980 and gpu["temperature_c_max"] == 61
    assert gpu["power_w_median"] is None and gpu["power_limit_w"] is None


@pytest.mark.parametrize("args,message", [
    ([f"--steps={MIN_STEPS - 1}"], f"use --steps={MIN_STEPS} or more"),
    (["--nproc=0"], "--nproc=0: give the number of GPUs to run on, 1 or more"),
    (["--out={tmp}"], "is a folder: give a .json file"),
    (["--out={tmp}/a_file/out.json"], "a_file/out.json: cannot make its folder (File exists)"),
    (["--keep={tmp}/a_file"], "a_file is a file: give a folder for the run folder's copy"),
    (["--", "--num_iterations=8"], "throughput mode sets --num_iterations, --log_every, --val_loss_every, "
                                   "--window_min_tokens, --window_max_tokens itself (--steps for the run's length); "
                                   "drop --num_iterations=8 after --, or use the speedrun mode"),
])
def test_throughput_refuses_what_would_fail_after_the_run(tmp_path, args, message):
    """Options that would only fail once the run is over (and its minutes lost) are refused at the start."""
    (tmp_path / "a_file").write_text("a regular file")
    args = [a.format(tmp=tmp_path) for a in args]
    split = args.index("--") if "--" in args else len(args)
    proc = subprocess.run([sys.executable, "-m", "bench.run", "throughput", "--data", str(tmp_path),
                           "--out", str(tmp_path / "out.json"), *args[:split], *args[split:]],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "out.json").exists() and not list(tmp_path.glob("*.console.txt"))


def test_speedrun_on_the_cpu_writes_its_rows_and_keeps_the_run_folder(tmp_path):
    """The harness end to end, as a GPU session runs it, on the sample corpus named like FineWeb shards: the
    JSON holds the config and one row per validation, and --keep leaves the run folder for later inspection."""
    from data.prepare import ensure_sample_shards

    train_glob, val_glob = ensure_sample_shards()
    data = tmp_path / "data"
    data.mkdir()
    for kind, pattern in (("train", train_glob), ("val", val_glob)):
        for i, shard in enumerate(sorted(glob.glob(pattern))):
            (data / f"fineweb_{kind}_{i:06d}.bin").symlink_to(shard)
    out, keep = tmp_path / "results" / "run.json", tmp_path / "kept"
    exe = fake_nvidia_smi(tmp_path / "bin")
    # started outside the repository with relative paths, as a user in their own folder would (train_gpt2.py
    # itself runs in the repository); the folder of --out is made
    proc = subprocess.run([sys.executable, "-m", "bench.run", "speedrun", "--data", "data", "--out", "results/run.json",
                           "--keep", str(keep), "--", "--preset=smoke", "--num_iterations=2", "--val_loss_every=1",
                           "--val_tokens=256", "--warmup_steps=0", "--log_every=1", "--device=cpu"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
                               "PYTHONPATH": str(REPO),
                               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                               "TRITON_CACHE_DIR": str(tmp_path / "triton"), "CUDA_VISIBLE_DEVICES": "1",
                               "PATH": f"{exe.parent}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "speedrun" and result["world_size"] == 1
    # counted before the launch, in the test's own cache folders (below), which did not exist yet
    assert result["compile_cache_files_at_start"] == {str(tmp_path / "inductor"): 0, str(tmp_path / "triton"): 0}
    assert result["strictly_cold"] is True
    # Python writes bytecode here, so there is no step before the launch (run.sh's; tests/test_packaging.py runs it)
    assert result["bytecode_step"]["ran"] is False and result["torch_compiled_from_source_each_start"] is False
    assert result["config"]["tokens_per_step"] == 2 * 256 and result["config"]["val_context"] > 0
    assert [row["step"] for row in result["val_rows"]] == [0, 1, 2]
    assert result["val_rows"][0]["val_loss"] > result["val_rows"][-1]["val_loss"] > 0
    # each validation's wall time, which train_time leaves out: the run's wall time holds both
    rows = result["val_rows"]
    assert all(row["val_wall_s"] > 0 for row in rows)
    assert sum(row["val_wall_s"] for row in rows) + rows[-1]["train_time_s"] < result["wall_s"]
    # the stand-in nvidia-smi's GPU 1, the one CUDA_VISIBLE_DEVICES gives the run, sampled up to the last step's
    # line (from the start: --warmup_steps=0 prints no warm-up line), not through the exit after it
    monitor = result["gpu_monitor"]
    assert monitor["gpu_ids"] == ["1"] and [gpu["index"] for gpu in monitor["gpus"]] == [1]
    assert monitor["gpus"][0]["sm_clock_mhz_median"] == 1755
    assert result["startup_to_warm_s"] is None and result["cold_start_s"] is None and monitor["since_s"] == 0.0
    assert 0 < monitor["until_s"] < result["wall_s"]
    (run_folder,) = keep.iterdir()
    assert {"log.txt", "metrics.jsonl"} <= {p.name for p in run_folder.iterdir()}


def test_a_failed_run_shows_its_error_line(tmp_path):
    """The harness names the training script's own message, not only the console file that holds it."""
    proc = subprocess.run([sys.executable, "-m", "bench.run", "speedrun", "--data", str(tmp_path), "--out",
                           str(tmp_path / "out.json"), "--", "--device=cpu", "--preset=tiny"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("train_gpt2.py failed with status 2 (error: no shard files match --train_files="), \
        proc.stderr
    assert f"; see {tmp_path / 'out.console.txt'}" in proc.stderr and not (tmp_path / "out.json").exists()
