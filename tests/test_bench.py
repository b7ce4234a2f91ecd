"""bench/run.py: how per-step times and the validation context come out of a run's log, and the guard on too few
timed steps; bench/gpu_monitor.py against a stand-in nvidia-smi; bench/gaps.py's sums on a small trace;
bench/determinism.py's comparison, and the CPU path's repeats."""
import glob
import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.gpu_monitor import QUERY, GpuMonitor, active_clock_reasons
from bench.run import MIN_STEPS, per_step_ms, val_context
from runtime.errors import exit_on_user_error

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
    """run_gpus: the first nproc of CUDA_VISIBLE_DEVICES (indices or UUIDs), else 0 .. nproc - 1; the monitor and
    active_clock_reasons pass them to nvidia-smi as --id, and the summary holds those GPUs only."""
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
    assert active_clock_reasons(["0", "1"]) == []  # the stand-in reports no reason, and was asked for both
    assert (tmp_path / "bin" / "nvidia-smi.args").read_text().split() == ["-q", "-d", "PERFORMANCE", "--id=0,1"]


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


def test_active_clock_reasons_from_nvidia_smi_q(tmp_path, monkeypatch):
    """The "... : Active" lines of `nvidia-smi -q -d PERFORMANCE` (its layout on the H200 machine, two GPUs), each
    reason once; a failing or missing nvidia-smi gives the reason instead."""
    gpu = ("    Clocks Event Reasons\n        Idle                              : Not Active\n"
           "        SW Power Cap                      : {}\n        HW Slowdown                       : Not Active\n"
           "            HW Thermal Slowdown           : {}\n    Clocks Event Reasons Counters\n"
           "        SW Power Capping                  : 1234 us\n")
    answer = "GPU 00000000:18:00.0\n" + gpu.format("Active", "Not Active") + "GPU 00000000:2A:00.0\n" + gpu.format(
        "Active", "Active")
    exe = fake_nvidia_smi(tmp_path / "bin", f"#!/bin/sh\ncat <<'END'\n{answer}END\n")
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")  # the stand-in first; cat after it
    assert active_clock_reasons() == ["SW Power Cap", "HW Thermal Slowdown"]
    fake_nvidia_smi(tmp_path / "bin", "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert active_clock_reasons() == "nvidia-smi exited with status 9: NVIDIA-SMI has failed"
    monkeypatch.setenv("PATH", str(tmp_path))
    assert active_clock_reasons() == "nvidia-smi not found"


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
                           "--keep", str(keep), "--", "--preset=smoke", "--num_iterations=4", "--val_loss_every=2",
                           "--val_tokens=1024", "--warmup_steps=0", "--log_every=1", "--device=cpu"],
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
    assert [row["step"] for row in result["val_rows"]] == [0, 2, 4]
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


def test_gaps_sums_the_idle_gpu_by_the_launch_after_it(tmp_path, monkeypatch, capsys):
    """bench/gaps.py on a two-kernel trace: one 50 us gap, before the kernel that aten::add launched 5 us before it
    started (the GPU waited for that launch)."""
    from bench import gaps

    def launch(ts, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "pid": 1, "tid": 1,
                "args": {"correlation": corr}}

    events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10, "pid": 1, "tid": 1}, launch(5, 1),
              {"cat": "cpu_op", "name": "aten::add", "ts": 100, "dur": 10, "pid": 1, "tid": 1}, launch(105, 2),
              {"cat": "kernel", "name": "gemm", "ts": 10, "dur": 50, "args": {"correlation": 1}},
              {"cat": "kernel", "name": "add", "ts": 110, "dur": 5, "args": {"correlation": 2}}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    monkeypatch.setattr(sys, "argv", ["gaps", str(trace)])
    gaps.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "span 0.1 ms, gaps > 2 us: 1, 0.05 ms"
    assert "  gaps below 100 us: 1 totalling 0.05 ms" in lines
    assert lines[-1] == "   0.05     1      5.0 | aten::add | add | gemm"


def test_a_failed_run_shows_its_error_line(tmp_path):
    """The harness names the training script's own message, not only the console file that holds it."""
    proc = subprocess.run([sys.executable, "-m", "bench.run", "speedrun", "--data", str(tmp_path), "--out",
                           str(tmp_path / "out.json"), "--", "--device=cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("train_gpt2.py failed with status 2 (error: no shard files match --train_files="), \
        proc.stderr
    assert f"; see {tmp_path / 'out.console.txt'}" in proc.stderr and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("tool", ["bench.gaps", "bench.kernel_table"])
def test_trace_tools_name_what_to_pass(tmp_path, tool, monkeypatch, capsys):
    """Each wrong input gets one line that says what the tool reads, not a traceback."""
    usage = f"usage: python -m {tool} RUN_DIR/profile_stepN.json (the trace of a GPU run with --profile_step=N)"
    (tmp_path / "log.txt").write_text("step:1/2 train_loss:10.8\n")
    (tmp_path / "other.json").write_text('{"a": 1}')
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": [{"cat": "cpu_op", "name": "aten::mm", "ts": 0}]}))
    cases = [([], usage), (["-h"], usage), ([str(tmp_path / "none.json")], "No such file or directory; usage"),
             ([str(tmp_path)], "Is a directory; usage"), ([str(tmp_path / "log.txt")], "is not a torch.profiler trace"),
             ([str(tmp_path / "other.json")], "is not a torch.profiler trace"),
             ([str(tmp_path / "cpu.json")], "holds no GPU work: a CPU run's trace")]
    module = importlib.import_module(tool)
    for args, message in cases:
        monkeypatch.setattr(sys, "argv", [tool, *args])
        with pytest.raises(SystemExit) as exit_info:
            exit_on_user_error(module.main)  # as `python -m` runs it
        out, err = capsys.readouterr()
        assert exit_info.value.code == 2 and err.startswith("error: ") and message in err, err
        assert len(err.splitlines()) == 1 and out == ""


def test_cold_profile_names_what_it_reads(tmp_path, monkeypatch, capsys):
    from bench import cold_profile

    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))  # a Chrome trace, not a py-spy recording
    # a recording of one process that never ran train(): py-spy was started without --subprocesses
    recording = {"shared": {"frames": [{"name": "main"}, {"name": "launch"}]},
                 "profiles": [{"name": "Process 7 Thread 7", "samples": [[0, 1]], "weights": [0.02]}]}
    (tmp_path / "parent.json").write_text(json.dumps(recording))
    for name, message in (("none.json", "none.json: No such file or directory"),
                          ("trace.json", "trace.json is not a py-spy recording in speedscope format (-f speedscope)"),
                          ("parent.json", "parent.json ran train_gpt2's train(): record with py-spy's "
                                          "--subprocesses")):
        monkeypatch.setattr(sys, "argv", ["cold_profile", str(tmp_path / name)])
        with pytest.raises(SystemExit) as exit_info:
            cold_profile.main()
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err, err


def test_cold_profile_splits_compile_seconds_by_caller():
    """Compile seconds go to the innermost frame of our code above dynamo's _compile, and to train_gpt2.py's line
    that led there, so the validation batch's compile of a block is told from a training step's."""
    from bench import cold_profile

    repo = "/r/"
    frames = [{"name": "train", "file": "/r/train_gpt2.py", "line": 447},
              {"name": "train_step", "file": "/r/train_gpt2.py", "line": 421},
              {"name": "GPT.hidden_states", "file": "/r/model/gpt.py", "line": 270},
              {"name": "_compile", "file": "/venv/torch/_dynamo/convert_frame.py", "line": 1},
              {"name": "MuonAdam.step", "file": "/r/optim/optimizer.py", "line": 146},
              {"name": "compile_fx_inner", "file": "/venv/torch/_inductor/compile_fx.py", "line": 2}]
    profile = {"samples": [[0, 2, 3, 5], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 4, 3], [0, 1, 2]],
               "weights": [0.5, 0.25, 0.25, 2.0, 9.0]}
    assert cold_profile.compile_callers(profile, frames, repo) == {
        ("_compile", "GPT.hidden_states (model/gpt.py:270) in train (train_gpt2.py:447)"): 0.5,
        ("_compile", "GPT.hidden_states (model/gpt.py:270) in train_step (train_gpt2.py:421)"): 0.5,
        ("_compile", "MuonAdam.step (optim/optimizer.py:146) in train_step (train_gpt2.py:421)"): 2.0}


def test_host_profile_places_each_sample_in_our_code():
    """Each sample's seconds go to the innermost frame of our code and the frame below it (none: native code), and
    to each of our functions on its stack once; a virtual environment inside the checkout is not our code, and a
    sample without our code counts only as sampled."""
    from bench import host_profile

    frames = [{"name": "train", "file": "/r/train_gpt2.py", "line": 296},
              {"name": "train_step", "file": "/r/train_gpt2.py", "line": 198},
              {"name": "backward", "file": "/r/.venv/lib/python3.11/site-packages/torch/autograd/__init__.py",
               "line": 9},
              {"name": "launch", "file": "/r/model/mlp_kernels.py", "line": 340},
              {"name": "JITFunction.run", "file": "/venv/lib/python3.11/site-packages/triton/runtime/jit.py",
               "line": 5},
              {"name": "ReLU2MLP.backward", "file": "/r/model/layers.py", "line": 394}]
    profile = {"samples": [[0], [0, 1, 2], [5, 3, 4], [5, 3], [2], [0, 1, 2]],
               "weights": [0.5, 0.25, 0.125, 1.0, 2.0, 0.25]}
    sampled, python, where, inclusive = host_profile.thread_tables(profile, frames, "/r/")
    assert sampled == python == 4.125
    assert where == {("train (train_gpt2.py:296)", "none"): 0.5,
                     ("train_step (train_gpt2.py:198)", "backward (torch/autograd/__init__.py:9)"): 0.5,
                     ("launch (model/mlp_kernels.py:340)", "JITFunction.run (triton/runtime/jit.py:5)"): 0.125,
                     ("launch (model/mlp_kernels.py:340)", "none"): 1.0}
    assert inclusive == {"train (train_gpt2.py)": 1.0, "train_step (train_gpt2.py)": 0.5,
                         "launch (model/mlp_kernels.py)": 1.125, "ReLU2MLP.backward (model/layers.py)": 1.125}


def test_host_profile_counts_the_timed_steps_only():
    """The window runs from the end of the main thread's first validate() to the start of its last, in seconds
    before the recording's end, and applies to every thread counted back from the end: a thread that started late
    (the autograd engine's) is placed by its last samples."""
    from bench import host_profile

    frames = [{"name": "train", "file": "/r/train_gpt2.py", "line": 1},
              {"name": host_profile.VALIDATE, "file": "/r/train_gpt2.py", "line": 2},
              {"name": "GPT.forward", "file": "/r/model/gpt.py", "line": 3},
              {"name": "ReLU2MLP.backward", "file": "/r/model/layers.py", "line": 4}]
    # 10 ticks of 0.5 s: warm-up, validate x2, steps x5, validate x1; then one tick of exit
    main = {"samples": [[0, 2], [0, 1], [0, 1], [0, 2], [0, 2], [0, 2], [0, 2], [0, 2], [0, 1], [0]],
            "weights": [0.5] * 10}
    assert host_profile.timed_window(main, frames) == (3.5, 1.0)
    # the autograd thread's 6 ticks are the main thread's last 6: 4 in the window, one idle (only py-spy's thread
    # frame, which has no file)
    frames.append({"name": "thread (7)", "file": "", "line": 0})
    autograd = {"samples": [[4, 3], [4, 3], [4, 3], [4], [4, 3], [4]], "weights": [0.5] * 6}
    sampled, python, where, inclusive = host_profile.thread_tables(autograd, frames, "/r/", (3.5, 1.0))
    assert (sampled, python) == (2.0, 1.5) and where == {("ReLU2MLP.backward (model/layers.py:4)", "none"): 1.5}
    sampled, python, where, _ = host_profile.thread_tables(main, frames, "/r/", (3.5, 1.0))
    assert sampled == python == 2.5 and where == {("GPT.forward (model/gpt.py:3)", "none"): 2.5}
    with pytest.raises(ValueError, match="fewer than twice"):
        host_profile.timed_window({"samples": main["samples"][:8], "weights": [0.5] * 8}, frames)


def test_host_profile_reports_the_training_process_only(tmp_path, monkeypatch, capsys):
    """A recording with --subprocesses holds bench.run's process too, whose frames are ours: only the threads of
    the process that ran validate() are reported."""
    from bench import host_profile

    frames = [{"name": host_profile.VALIDATE, "file": "/r/train_gpt2.py", "line": 2},
              {"name": "GPT.forward", "file": "/r/model/gpt.py", "line": 3},
              {"name": "launch", "file": "/r/bench/run.py", "line": 4}]
    profiles = [{"name": "Process 1 Thread 1", "samples": [[2]] * 5, "weights": [0.5] * 5},
                {"name": "Process 2 Thread 2", "samples": [[0], [1], [1], [0]], "weights": [0.5] * 4},
                {"name": "Process 2 Thread 3", "samples": [[1], [1]], "weights": [0.5] * 2}]
    (tmp_path / "host.json").write_text(json.dumps({"shared": {"frames": frames}, "profiles": profiles}))
    monkeypatch.setattr(sys, "argv", ["host_profile", str(tmp_path / "host.json"), "--repo", "/r/"])
    host_profile.main()
    out = capsys.readouterr().out
    assert out.startswith("the timed steps: 1.00 s, from 1.50 to 0.50 s before the recording's end\n")
    assert "Process 2 Thread 2: 1.00 s sampled" in out and "Process 2 Thread 3: 0.50 s sampled" in out
    assert "Process 1" not in out and "bench/run.py" not in out


def test_host_profile_names_what_it_reads(tmp_path, monkeypatch, capsys):
    from bench import host_profile

    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": []}))
    frames = [{"name": "main", "file": "/elsewhere/x.py", "line": 1},
              {"name": host_profile.VALIDATE, "file": "/r/train_gpt2.py", "line": 2}]
    for file, samples in (("foreign.json", [[0]]), ("once.json", [[0], [1], [0]])):
        recording = {"shared": {"frames": frames},
                     "profiles": [{"name": "Thread 7", "samples": samples, "weights": [0.01] * len(samples)}]}
        (tmp_path / file).write_text(json.dumps(recording))
    for file, message in (("none.json", "none.json: No such file or directory"),
                          ("trace.json", "trace.json is not a py-spy recording in speedscope format"),
                          ("foreign.json", "ran train_gpt2's validate(): record the whole run"),
                          ("once.json", "once.json: the main thread ran validate() fewer than twice")):
        monkeypatch.setattr(sys, "argv", ["host_profile", str(tmp_path / file), "--repo", "/r/"])
        with pytest.raises(SystemExit) as exit_info:
            host_profile.main()
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err, err


def test_determinism_names_the_gradients_that_differ_between_repeats():
    """bench/determinism.py's comparison: a repeat's loss and each gradient against the first repeat's, bit for bit
    (a NaN where the first has one is equal; a NaN where it has a number is not)."""
    from bench.determinism import differences
    first = {"a": torch.tensor([1.0, 2.0, float("nan")]), "b": torch.zeros(4)}
    same = {name: t.clone() for name, t in first.items()}
    moved = {"a": torch.tensor([1.0, 2.0 + 2 ** -22, float("nan")]), "b": torch.tensor([0.0, float("nan"), 0, 0])}
    report = differences([(2.5, first), (2.5, same), (2.5000002, moved)])
    assert report[0] == {"loss": 2.5, "loss_equal": True, "gradients_differing": []}
    assert report[1]["loss_equal"] is False
    a, b = report[1]["gradients_differing"]
    assert (a["parameter"], a["elements"], a["of"], a["max_abs_diff"]) == ("a", 1, 3, 2 ** -22)
    assert (b["parameter"], b["elements"]) == ("b", 1) and math.isnan(b["max_abs_diff"])
    with pytest.raises(RuntimeError, match=r"\['b'\]"):
        differences([(2.5, first), (2.5, {"a": first["a"]})])


def test_the_cpu_path_repeats_a_micro_batch_bit_for_bit(tmp_path):
    """The smoke model's forward and backward on the CPU, three times in one process and once more in another: the
    same loss and the same bits in every gradient (the golden-loss test relies on it), and the same digests of the
    weights, loss, gradients and buffers in both processes."""
    out, a, b = tmp_path / "determinism.json", tmp_path / "a.json", tmp_path / "b.json"
    run = [sys.executable, "-m", "bench.determinism", "--device", "cpu"]
    subprocess.run(run + ["--repeats", "3", "--digests", str(a)], cwd=REPO, check=True, capture_output=True)
    subprocess.run(run + ["--digests", str(b), "--against", str(a), "--out", str(out)], cwd=REPO, check=True,
                   capture_output=True)
    first = json.loads(a.read_text())
    assert list(first)[0].startswith("weight ") and "loss" in first and "buffer blocks.0.mlp.grad_amax" in first
    assert json.loads(b.read_text()) == first
    report = json.loads(out.read_text())
    assert report["against"] == {"file": str(a), "of": len(first), "differing": []}
    a.write_text(json.dumps({name: "0" * 64 for name in first}))  # another process whose every digest differs
    result = subprocess.run(run + ["--against", str(a)], cwd=REPO, check=True, capture_output=True, text=True)
    assert f"{len(first)} of {len(first)} digests differ\n    {list(first)[0]}\n" in result.stdout


def test_determinism_digests_name_what_differs_between_processes():
    """bench/determinism.py's digests: one changed bit in one weight, the loss or one buffer is named; files of two
    model configs are refused."""
    from bench.determinism import digests, digests_differing
    weights, grads, buffers = {"w": torch.ones(3)}, {"w": torch.zeros(3)}, {"amax": torch.tensor(0.5)}
    mine = digests(weights, 2.5, grads, buffers)
    assert list(mine) == ["weight w", "loss", "gradient w", "buffer amax"]
    assert digests_differing(mine, digests(weights, 2.5, grads, {"amax": torch.tensor(0.5)})) == []
    moved = torch.ones(3)
    moved.view(torch.int32)[1] += 1  # the next float up
    assert digests_differing(mine, digests({"w": moved}, 2.5000001, grads, {"amax": torch.tensor(-0.5)})) == [
        "weight w", "loss", "buffer amax"]
    with pytest.raises(RuntimeError, match=r"\['gradient v'\]"):
        digests_differing(mine, digests(weights, 2.5, {"v": torch.zeros(3)}, buffers) | {"gradient w": "x"})


def test_determinism_repeats_start_from_the_same_gradient_history():
    """The MLPs' FP8 backward records each gradient's amax for the next pass's scale: bench/determinism.py's repeats
    start from the same recorded values, else every repeat after the first would differ by design. On the CPU the
    FP8 path runs in torch ops when set by hand (use_device_paths keeps it for Hopper GPUs)."""
    from bench.determinism import differences, repeats
    from model.config import GPTConfig
    from model.gpt import GPT
    from runtime.dist import use_device_paths

    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2, model_dim=64, num_heads=2, head_dim=32, num_value_embeds=1, vocab_size=128,
                        bos_id=0))
    model.init_weights()
    use_device_paths(model, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().max() == 0:  # W2's zero init would leave the gradient that the history records at 0
                p.normal_(0, 0.02)
    for block in model.blocks:
        block.mlp.fp8 = block.mlp.fp8_backward = True
    tokens = torch.randint(0, 128, (1, 257), generator=torch.Generator().manual_seed(1))
    results = repeats(model, tokens[:, :-1].int(), tokens[:, 1:].long(), torch.tensor(128), 3)
    assert [r["gradients_differing"] for r in differences(results)] == [[], []]
    assert all(b.mlp.grad_amax.item() > 0 for b in model.blocks)
