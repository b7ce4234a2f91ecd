"""runtime/dist.py: which device a run takes. --device auto trains on the CPU only where the machine has no GPU;
where it has GPUs that torch cannot use, the run stops and says why (a CUDA build newer than the driver, a CPU-only
build, CUDA_VISIBLE_DEVICES) instead of training the record model on the CPU. A CUDA run also stops where Triton
lacks the C compiler or Python's headers that it builds its kernel launchers with."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from runtime import dist
from runtime.errors import UserError

REPO = Path(__file__).resolve().parent.parent
GPUS = ["/dev/nvidia0", "/dev/nvidia1"]


@pytest.fixture
def no_cuda(monkeypatch, tmp_path):
    """torch sees no GPU; no CUDA_VISIBLE_DEVICES; an nvidia-smi that reports a CUDA 12.8 driver."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '| NVIDIA-SMI 570.86.15   Driver Version: 570.86.15   CUDA Version: 12.8     |'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return monkeypatch


def test_device_files_are_the_numbered_gpus(tmp_path):
    for name in ("nvidia10", "nvidia2", "nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-caps", "nvme0"):
        (tmp_path / name).touch()
    assert dist.nvidia_device_files(str(tmp_path)) == [str(tmp_path / f"nvidia{i}") for i in (0, 2, 10)]
    assert dist.nvidia_device_files(str(tmp_path / "missing")) == []


def test_auto_takes_the_cpu_only_where_there_is_no_gpu(no_cuda):
    no_cuda.setattr(dist, "nvidia_device_files", lambda: [])
    assert dist.choose_device("auto", 0) == torch.device("cpu")
    with pytest.raises(UserError, match=r"^--device cuda, but no CUDA GPU is visible .*--device cpu$"):
        dist.choose_device("cuda", 0)
    no_cuda.setattr(dist, "nvidia_device_files", lambda: GPUS)
    assert dist.choose_device("cpu", 0) == torch.device("cpu")  # asked for
    with pytest.raises(UserError, match="^this machine has NVIDIA GPUs \\(/dev/nvidia0, /dev/nvidia1\\), but "):
        dist.choose_device("auto", 0)


def test_run_sh_asks_for_the_device_that_the_flags_give_train_gpt2(no_cuda):
    """device_for_flags, which run.sh asks before a download: the flags' --device through choose_device, on a machine
    whose GPUs torch cannot use, and a mistyped flag named as train_gpt2 names it."""
    no_cuda.setattr(dist, "nvidia_device_files", lambda: GPUS)
    assert dist.device_for_flags(["--device=cpu", "--seed=3"]) == torch.device("cpu")
    with pytest.raises(UserError, match="^this machine has NVIDIA GPUs"):
        dist.device_for_flags(["--seed=3"])
    with pytest.raises(UserError, match="--device='gpu' is not a device"):
        dist.device_for_flags(["--device=gpu"])
    with pytest.raises(UserError, match="--sed"):
        dist.device_for_flags(["--sed=3"])


def test_the_message_names_why_torch_sees_no_gpu(no_cuda):
    def message(flag="auto"):
        with pytest.raises(UserError) as error:
            dist.choose_device(flag, 0)
        return str(error.value)

    no_cuda.setattr(dist, "nvidia_device_files", lambda: GPUS)
    no_cuda.setattr(torch.version, "cuda", "13.0")
    assert message() == (
        f"this machine has NVIDIA GPUs (/dev/nvidia0, /dev/nvidia1), but torch {torch.__version__}, built for CUDA "
        "13.0, cannot use them (torch.cuda.is_available() is False; the driver runs CUDA up to 12.8): install the "
        "torch build for your driver's CUDA, e.g. `pip install torch --index-url https://download.pytorch.org/whl/"
        "cu128` for a CUDA 12 driver, or update the driver; or train on the CPU with --device cpu")
    assert message("cuda").startswith("--device cuda: this machine has NVIDIA GPUs")
    no_cuda.setenv("PATH", "/nonexistent")  # no nvidia-smi: no driver note
    assert "(torch.cuda.is_available() is False): install" in message()
    no_cuda.setattr(torch.version, "cuda", None)
    assert f"but torch {torch.__version__} is a CPU-only build: install a CUDA build of torch" in message()
    for hiding in ("", "-1", "2", "2,0", " "):  # CUDA stops at the first entry that names no GPU (here: 0 and 1)
        no_cuda.setenv("CUDA_VISIBLE_DEVICES", hiding)
        assert f"but CUDA_VISIBLE_DEVICES={hiding!r} leaves torch none: unset it or name GPUs that exist" in message()
    for naming in ("1", "0,7", "GPU-8a1b", "MIG-77c0"):  # a GPU is named: the cause is elsewhere (SLURM sets it)
        no_cuda.setenv("CUDA_VISIBLE_DEVICES", naming)
        assert "is a CPU-only build" in message()


def refused_smoke_run(log_dir: Path, **env: str) -> subprocess.CompletedProcess:
    """train_gpt2's smoke preset with `env` added, which must stop with a user error (status 2)."""
    proc = subprocess.run([sys.executable, "train_gpt2.py", "--preset=smoke", f"--log_dir={log_dir}"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


@pytest.mark.gpu
def test_a_gpu_machine_with_its_gpus_hidden_stops_instead_of_training_on_the_cpu(tmp_path):
    """On a real GPU machine: the device files are found, and the run stops with status 2 before it writes."""
    proc = refused_smoke_run(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert "error: this machine has NVIDIA GPUs (/dev/nvidia0" in proc.stderr
    assert "CUDA_VISIBLE_DEVICES='' leaves torch none" in proc.stderr and not list(tmp_path.iterdir())


def test_a_cuda_run_names_the_missing_compiler_or_headers(tmp_path, monkeypatch):
    """Looked up as Triton does: $CC, else gcc, else clang on PATH; Python.h in sysconfig's include folder."""
    include, bin_dir = tmp_path / "include", tmp_path / "bin"
    include.mkdir()
    bin_dir.mkdir()
    (include / "Python.h").touch()
    gcc = bin_dir / "gcc"
    gcc.write_text("#!/bin/sh\n")
    gcc.chmod(0o755)
    monkeypatch.setattr(sysconfig, "get_paths", lambda scheme=None: {"include": str(include)})
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CC", raising=False)
    dist.check_kernel_toolchain()  # all there: nothing to say
    monkeypatch.setenv("CC", str(tmp_path / "cc"))
    with pytest.raises(UserError, match=f"needs a C compiler \\(CC='{tmp_path}/cc' is not a program\\): install them"):
        dist.check_kernel_toolchain()
    monkeypatch.delenv("CC")
    gcc.rename(bin_dir / "clang")  # either one serves
    dist.check_kernel_toolchain()
    (bin_dir / "clang").unlink()
    (include / "Python.h").unlink()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    with pytest.raises(UserError) as error:
        dist.check_kernel_toolchain()
    assert str(error.value) == (
        "Triton, which builds this run's GPU kernels, needs a C compiler (neither gcc nor clang is on PATH, and CC is "
        f"unset) and Python's headers ({include}/Python.h is missing): install them (Debian/Ubuntu: apt-get install "
        f"gcc python{version}-dev), or run in the project's Docker image")


@pytest.mark.gpu
def test_a_cuda_run_without_its_compiler_stops_before_it_writes(tmp_path):
    """On the GPU: the check runs before anything is written (without it, the first kernel launch failed with
    FileNotFoundError: '/nonexistent/cc', bench/results/triton_toolchain_1xH200.txt)."""
    proc = refused_smoke_run(tmp_path, CC="/nonexistent/cc")
    assert proc.stderr.startswith("error: Triton, which builds this run's GPU kernels, needs a C compiler "
                                  "(CC='/nonexistent/cc' is not a program): install them"), proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())
