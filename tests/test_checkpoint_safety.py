"""Checkpoints are data: every load uses torch.load's weights-only unpickler, so a checkpoint whose pickle would run
code is refused, with one line, by every entry point that reads one, and its code never runs.

The crafted checkpoints are a real run's checkpoint with one value replaced by an object whose unpickling would
create a marker file; each entry point runs in a subprocess, as a user would start it.
"""
import fractions
import os
import pickletools
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime import checkpoint
from runtime.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300
# The smallest smoke run on the shipped sample: one checkpoint after its only step.
TINY = ["--preset=smoke", "--seq_len=128", "--batch_size=1", "--device_batch_size=1", "--num_value_embeds=0",
        "--num_iterations=1", "--val_tokens=256", "--warmup_steps=0", "--device=cpu", "--checkpoint_every=1"]


def start(*cmd) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SPEEDRUN_TRACEBACK")}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(*cmd) -> subprocess.CompletedProcess:
    return finish(start(*cmd))


@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory) -> Path:
    logs = tmp_path_factory.mktemp("logs")
    result = run(sys.executable, "train_gpt2.py", *TINY, f"--log_dir={logs}")
    assert result.returncode == 0, result.stdout + result.stderr
    (run_dir,) = logs.iterdir()
    return run_dir / "ckpt_000001.pt"


class ShellCommand:
    """Unpickled, runs `touch marker` through os.system (pickled as posix.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class PythonCode:
    """Unpickled, runs Python that writes the marker, through the builtin exec."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


class Planted:
    """Pickled by reference to this module: unpickling it would import (run) tests/test_checkpoint_safety.py."""


def crafted(real: Path, folder: Path, value, key: str = "seed") -> Path:
    """A copy of the real checkpoint, in `folder`, with config[key] replaced by `value`."""
    state = torch.load(real, weights_only=True)
    state["config"][key] = value
    folder.mkdir()
    torch.save(state, folder / real.name)
    return folder / real.name


def one_line_error(result, *needles: str) -> str:
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "Traceback" not in text, text
    (line,) = text.strip().splitlines()
    assert line.startswith("error: "), text
    for needle in needles:
        assert needle in line, f"{needle!r} missing from: {line}"
    return line


def test_a_checkpoint_holds_only_what_the_weights_only_unpickler_allows(real_checkpoint):
    """What a checkpoint's pickle imports: torch's tensor rebuilding, its storage types and OrderedDict (the model's
    state dict), all in torch's default weights-only allowlist; nothing of ours needs allowlisting."""
    with zipfile.ZipFile(real_checkpoint) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        pickled = archive.read(name)
    imported = {arg for op, arg, _ in pickletools.genops(pickled) if op.name == "GLOBAL"}
    assert {"collections OrderedDict", "torch._utils _rebuild_tensor_v2"} <= imported
    assert all(g in {"collections OrderedDict", "torch._utils _rebuild_tensor_v2"} or
               re.fullmatch(r"torch \w+Storage", g) for g in imported), imported
    state = torch.load(real_checkpoint, weights_only=True)
    assert set(state) == {"model", "optimizer", "loader", "rng", "step", "train_time_ms", "config", "model_config"}


# (entry point, its command for a checkpoint path)
ENTRY_POINTS = {
    "train_gpt2 --resume": lambda ckpt, tmp: ["train_gpt2.py", f"--resume={ckpt}", f"--log_dir={tmp / 'logs'}"],
    "sample.py --checkpoint": lambda ckpt, tmp: ["sample.py", "--checkpoint", str(ckpt), "--device", "cpu"],
    "evals.hellaswag --checkpoint": lambda ckpt, tmp: ["-m", "evals.hellaswag", "--checkpoint", str(ckpt),
                                                       "--device", "cpu"],
    "runtime.checkpoint.load_model": lambda ckpt, tmp: [
        "-c", "import sys, torch; from runtime.checkpoint import load_model; from runtime.errors import "
              "exit_on_user_error; exit_on_user_error(load_model, sys.argv[1], torch.device('cpu'))", str(ckpt)],
}


@pytest.fixture(scope="module")
def refusals(real_checkpoint, tmp_path_factory) -> dict:
    """Each entry point started on its own crafted checkpoint, all at once (each process mostly imports torch);
    {entry: (its folder, the crafted checkpoint, the finished process)}."""
    started = {}
    for entry, command in ENTRY_POINTS.items():
        folder = tmp_path_factory.mktemp("entry")
        evil = crafted(real_checkpoint, folder / "evil", ShellCommand(folder / "MARKER"))
        # the folder, as a user passes a run folder: resolved to its newest checkpoint, which is the crafted one
        started[entry] = folder, evil, start(sys.executable, *command(evil.parent, folder))
    try:
        return {entry: (folder, evil, finish(proc)) for entry, (folder, evil, proc) in started.items()}
    finally:
        for _, _, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_refuses_a_checkpoint_that_would_run_code(entry, refusals):
    folder, evil, result = refusals[entry]
    marker = folder / "MARKER"
    flag = "--resume" if "resume" in entry else "--checkpoint"
    one_line_error(result, f"{flag} {evil}: refused: loading it would run posix.system, and a checkpoint holds only "
                           f"tensors and plain values; if you wrote this file and trust it, convert it once with "
                           f"`python -m runtime.checkpoint --convert {evil}` (which runs it)")
    assert not marker.exists()
    assert not (folder / "logs").exists()  # a refused resume makes no run folder


@pytest.mark.parametrize("payload, named", [(ShellCommand, "posix.system"), (PythonCode, "exec"),
                                            (lambda marker: Planted(), "test_checkpoint_safety.Planted")])
def test_no_payload_runs_in_any_kind_of_load(payload, named, real_checkpoint, tmp_path):
    """The config read of a resume, the lazy read of a restore (its bytes checked before) and a full read."""
    marker = tmp_path / "MARKER"
    evil = crafted(real_checkpoint, tmp_path / "evil", payload(marker))
    for kwargs in ({"mmap": True}, {"mmap": True, "verify": False}, {}):
        with pytest.raises(UserError, match=rf"refused: loading it would run {re.escape(named)}, and"):
            checkpoint.load_checkpoint(str(evil), **kwargs)
    with pytest.raises(UserError, match="refused"):
        checkpoint.load_model(str(evil), torch.device("cpu"))
    assert not marker.exists()


def test_a_checkpoint_with_other_types_is_converted_once_by_the_command_its_message_gives(real_checkpoint,
                                                                                          tmp_path):
    """A checkpoint written by code that saved numpy numbers or paths (no gpt-speedrun version did) is refused with
    the command that converts it; after that command it loads, its values as plain types, and resumes."""
    older = crafted(real_checkpoint, tmp_path / "older", np.int64(0))
    state = torch.load(older, weights_only=False)
    state["loader"]["shard_path"] = Path("/data/shard.bin")
    state["rng"]["numpy"] = np.arange(3, dtype=np.uint32)
    torch.save(state, older)
    refused = one_line_error(run(sys.executable, "sample.py", "--checkpoint", str(older), "--max_new_tokens=1"),
                             "refused: loading it would run pathlib.PosixPath")  # the first of them the pickle names
    command = re.search(r"`(python -m runtime\.checkpoint --convert \S+)`", refused).group(1)
    converted = run(sys.executable, *command.split()[1:])
    assert converted.returncode == 0, converted.stdout + converted.stderr
    assert converted.stdout == f"converted {older}: it loads as data now\n"
    state = checkpoint.load_checkpoint(str(older))
    assert type(state["config"]["seed"]) is int and state["loader"]["shard_path"] == "/data/shard.bin"
    assert torch.equal(state["rng"]["numpy"], torch.tensor([0, 1, 2], dtype=torch.uint32))
    sampled = run(sys.executable, "sample.py", "--checkpoint", str(older), "--max_new_tokens=1")
    assert sampled.returncode == 0, sampled.stdout + sampled.stderr


def test_conversion_refuses_a_type_it_cannot_make_data(real_checkpoint, tmp_path):
    odd = crafted(real_checkpoint, tmp_path / "odd", fractions.Fraction(1, 3), key="lr_hidden")
    before = odd.read_bytes()
    with pytest.raises(UserError, match=re.escape(f"--convert {odd}: the checkpoint['config']['lr_hidden'] is a "
                                                  f"fractions.Fraction, which a checkpoint cannot hold as data")):
        checkpoint.convert(str(odd))
    assert odd.read_bytes() == before and list(odd.parent.iterdir()) == [odd]  # nothing written
