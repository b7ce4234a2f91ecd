"""run.sh's environment: the active virtual environment as it is, else ./.venv, set up on first use with torch's CPU
build where there is no GPU (PyPI's torch where that index cannot be reached), then `pip install .`.

A copy of run.sh runs with fake `python3`, `nvidia-smi`, and the `python`, `pip` and `torchrun` of the environment it
makes, which only record how they were called, so nothing is downloaded and nothing trains.
"""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
RECORD = 'echo "{name} $*" >> "$RECORD"\n'
# the environment's programs: python answers run.sh's readiness question (-I -c ...) by whether `pip install .` ran
VENV_PYTHON = ('#!/bin/sh\nif [ "$1" = "-I" ]; then [ -e "$(dirname "$0")/../installed" ]; exit; fi\n'
               + RECORD.format(name="python"))
VENV_PIP = ("#!/bin/sh\n" + RECORD.format(name="pip") +
            'case "$*" in *--index-url*) [ -z "$CPU_INDEX_DOWN" ] || { echo "pip: no network" >&2; exit 1; };; esac\n'
            'if [ "$*" = "install ." ]; then touch "$(dirname "$0")/../installed"; fi\n')
# python3 -m venv DIR: a fake environment in DIR; VENV_STATUS makes it fail
PYTHON3 = f"""#!/bin/sh
{RECORD.format(name="python3")}[ -z "$VENV_STATUS" ] || exit "$VENV_STATUS"
mkdir -p "$3/bin"
printf '%s' '{VENV_PYTHON}' > "$3/bin/python"
printf '%s' '{VENV_PIP}' > "$3/bin/pip"
printf '%s' '#!/bin/sh
{RECORD.format(name="torchrun")}' > "$3/bin/torchrun"
chmod +x "$3/bin/python" "$3/bin/pip" "$3/bin/torchrun"
"""
TWO_GPUS = '#!/bin/sh\necho "GPU 0: NVIDIA H100 (UUID: GPU-0)"\necho "GPU 1: NVIDIA H100 (UUID: GPU-1)"\n'
SETUP = "run.sh: setting up ./.venv for this project (once)"


@pytest.fixture
def run_sh(tmp_path):
    """Runs a copy of run.sh in tmp_path/repo with the fakes on PATH; returns (status, commands run, stderr)."""
    work, fakebin, record = tmp_path / "repo", tmp_path / "bin", tmp_path / "record.txt"
    work.mkdir()
    fakebin.mkdir()
    shutil.copy(ROOT / "run.sh", work / "run.sh")
    (fakebin / "python3").write_text(PYTHON3)
    (fakebin / "python3").chmod(0o755)
    for utility in ("dirname", "grep", "mkdir", "chmod", "touch"):
        (fakebin / utility).symlink_to(shutil.which(utility))

    def run(*args, gpus=False, **env):
        if gpus:
            (fakebin / "nvidia-smi").write_text(TWO_GPUS)
            (fakebin / "nvidia-smi").chmod(0o755)
        record.unlink(missing_ok=True)
        env = {"PATH": str(fakebin), "RECORD": str(record), **env}
        result = subprocess.run([shutil.which("bash"), str(work / "run.sh"), *args], cwd=tmp_path,
                                capture_output=True, text=True, env=env)
        calls = record.read_text().splitlines() if record.exists() else []
        return result.returncode, calls, result.stderr

    return run


def test_a_first_run_without_a_gpu_sets_up_the_cpu_build_then_the_project(run_sh):
    status, calls, stderr = run_sh("--seed=1")
    assert status == 0, stderr
    assert calls == ["python3 -m venv .venv", f"pip install torch==2.11.0 --index-url {CPU_INDEX}", "pip install .",
                     "python train_gpt2.py --preset smoke --seed=1"]
    assert stderr.splitlines()[0] == SETUP
    # set up once: the next run goes straight to the training
    status, calls, stderr = run_sh("--seed=1")
    assert (status, calls) == (0, ["python train_gpt2.py --preset smoke --seed=1"]) and SETUP not in stderr


def test_pypi_torch_where_the_cpu_index_cannot_be_reached(run_sh):
    """One line says so; pip's own complaints about the index are not shown."""
    status, calls, stderr = run_sh(CPU_INDEX_DOWN="1")
    assert status == 0, stderr
    assert calls[1:4] == [f"pip install torch==2.11.0 --index-url {CPU_INDEX}", "pip install torch==2.11.0",
                          "pip install ."]
    assert f"run.sh: {CPU_INDEX} cannot be reached; installing PyPI's torch==2.11.0 instead" in stderr.splitlines()
    assert "pip: no network" not in stderr


def test_a_gpu_machine_installs_the_project_alone_and_trains_with_the_environments_torchrun(run_sh):
    """torch comes with `pip install .` (pyproject.toml pins it); torchrun is the new environment's."""
    status, calls, stderr = run_sh("--preset=smoke", gpus=True)
    assert status == 0, stderr
    assert calls == ["python3 -m venv .venv", "pip install .",
                     "torchrun --standalone --nproc_per_node=2 train_gpt2.py --preset=smoke"]


def test_an_active_virtual_environment_is_used_as_it_is(run_sh, tmp_path):
    mine = tmp_path / "mine"
    (mine / "bin").mkdir(parents=True)
    (mine / "bin" / "python").write_text("#!/bin/sh\n" + RECORD.format(name="my-python"))
    (mine / "bin" / "python").chmod(0o755)
    status, calls, stderr = run_sh("--seed=1", VIRTUAL_ENV=str(mine))
    assert (status, calls) == (0, ["my-python train_gpt2.py --preset smoke --seed=1"]), stderr
    assert not (tmp_path / "repo" / ".venv").exists()


def test_a_failed_venv_says_what_to_install(run_sh):
    status, calls, stderr = run_sh(VENV_STATUS="1")
    assert (status, calls) == (2, ["python3 -m venv .venv"])
    assert stderr.splitlines()[-1] == ("error: python3 -m venv .venv failed (see above): install Python 3.10 or newer "
                                       "with its venv module, or activate a virtual environment that has this "
                                       "project's packages")

