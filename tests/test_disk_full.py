"""A full disk is a clear stop, and nothing is lost: a checkpoint or log write that fails for lack of room ends the
run with one line (the file, the space it needs, the checkpoints that stay intact); the half-written checkpoints of
killed runs are removed when the next run starts, before its disk-space check; a run that check refuses leaves no
run folder behind.

The limits are real, not mocked exceptions: a small tmpfs where this machine lets the test mount one (root, and a
container allowed to mount), and everywhere RLIMIT_FSIZE, the per-process file-size limit, set on the training
process (Python ignores SIGXFSZ, so a write past the limit fails with EFBIG instead of killing it). A limit that must
come after the first checkpoints is set on the running process with prlimit, or the tmpfs is filled then.
"""
import errno
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import checkpoint
from runtime.config import derive, run_config

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300
MiB = 2**20
# The smallest smoke run on the shipped sample; long enough to be stopped by a full disk.
TINY = ["--preset=smoke", "--seq_len=128", "--batch_size=1", "--device_batch_size=1", "--num_value_embeds=0",
        "--val_tokens=256", "--warmup_steps=0", "--device=cpu", "--log_every=1"]
LONG = [*TINY, "--num_iterations=10000", "--cycle_data=1", "--checkpoint_every=2"]
LIMITS = ["file-size limit", "tmpfs"]


def env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SPEEDRUN_TRACEBACK")}


STARTED: list[subprocess.Popen] = []  # the test's runs, stopped at its end whatever its outcome


def train(log_dir: Path, *flags: str, preexec_fn=None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "train_gpt2.py", *flags, f"--log_dir={log_dir}"], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    STARTED.append(proc)
    return proc


def stop_started() -> None:
    """Kill the runs a failed assertion left going, which would hold a tmpfs busy and take the CPU from later tests."""
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture(autouse=True)
def runs_stop():
    yield
    stop_started()


def wait_for(log_dir: Path, name: str, proc: subprocess.Popen) -> Path:
    """The run folder under `log_dir` once its file `name` exists (a checkpoint appears complete, by its rename)."""
    deadline = time.monotonic() + TIMEOUT
    while not list(log_dir.glob(f"*/{name}")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {name} after {TIMEOUT} s"
        time.sleep(0.02)
    (run_dir,) = log_dir.iterdir()
    return run_dir


def one_line_error(proc: subprocess.Popen) -> str:
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 2, stdout + stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("error: "), stderr
    return line


def fill(folder: Path, leave: int) -> None:
    """Take all but `leave` bytes of the filesystem that holds `folder`: write until it is full, then give `leave`
    back, as a run may be writing there at the same time (a free-space reading would be stale by the write)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * MiB):
                pass
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        f.truncate(max(0, f.tell() - leave))


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size): a fresh tmpfs of `size` (mount's notation, e.g. 64m), or None where this machine refuses to mount
    one (not root, or a container without the right to)."""
    mounted = []

    def mount(size: str) -> Path | None:
        folder = tmp_path / f"tmpfs{len(mounted)}"
        folder.mkdir()
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
        if shutil.which("mount") is None or subprocess.run(command, capture_output=True).returncode != 0:
            return None
        mounted.append(folder)
        return folder

    yield mount
    stop_started()
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


def mounted(folder: Path | None) -> Path:
    if folder is None:
        pytest.skip("cannot mount a tmpfs here; the file-size limit cases stand in")
    return folder


def strerror(limit: str) -> str:
    return os.strerror(errno.EFBIG if limit == "file-size limit" else errno.ENOSPC)


def kept(run_dir: Path) -> str:
    return (f"; the earlier checkpoints in {run_dir} are intact: free space and resume from the newest with --resume "
            f"{run_dir}")


@pytest.mark.parametrize("limit", LIMITS)
def test_a_checkpoint_that_does_not_fit_stops_the_run_and_keeps_the_earlier_ones(limit, tmpfs, tmp_path):
    # the tmpfs holds the disk check's three checkpoints (3 x 16 bytes x 6.5M parameters) until it is filled
    log_dir = mounted(tmpfs("320m")) if limit == "tmpfs" else tmp_path / "logs"
    proc = train(log_dir, *LONG)
    run_dir = wait_for(log_dir, "ckpt_000004.pt", proc)
    if limit == "tmpfs":
        fill(log_dir, leave=4 * MiB)  # room for the log lines, not for a 74 MiB checkpoint
    else:
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (8 * MiB, 8 * MiB))  # log.txt is 0.3 MiB
    line = one_line_error(proc)
    failed = re.match(rf"error: writing checkpoint {re.escape(str(run_dir))}/ckpt_(\d+)\.pt failed", line)
    step = int(failed.group(1))  # 6, unless this machine paused the test past the next checkpoint
    free = r", which has \d+\.\d MiB free" if limit == "tmpfs" else ""
    assert re.fullmatch(rf"{failed.group(0)} \({strerror(limit)}\): it needs about 74\.\d MiB more in "
                        rf"{re.escape(str(run_dir))}{free}{re.escape(kept(run_dir))}", line), line
    # the checkpoints before it, whole, and no temporary file of the failed one
    earlier = [f"ckpt_{step - 4:06d}.pt", f"ckpt_{step - 2:06d}.pt"]
    assert sorted(p.name for p in run_dir.iterdir()) == [*earlier, "log.txt", "metrics.jsonl"]
    assert checkpoint.load_checkpoint(str(run_dir))["step"] == step - 2
    assert checkpoint.load_checkpoint(str(run_dir / earlier[0]))["step"] == step - 4


def test_a_log_line_that_does_not_fit_stops_the_run_and_keeps_the_checkpoints(tmp_path):
    log_dir = tmp_path / "logs"
    proc = train(log_dir, *LONG)
    run_dir = wait_for(log_dir, "ckpt_000002.pt", proc)
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (MiB // 8, MiB // 8))  # below log.txt's size already
    line = one_line_error(proc)
    assert re.fullmatch(rf"error: writing the log {re.escape(str(run_dir))}/log\.txt failed \(File too large\): it "
                        rf"needs about \d+\.\d MiB more in {re.escape(str(run_dir))}{re.escape(kept(run_dir))}",
                        line), line
    assert checkpoint.load_checkpoint(str(run_dir))["step"] >= 2
    assert not list(run_dir.glob(".ckpt_*"))


@pytest.mark.parametrize("limit", LIMITS)
def test_a_log_that_does_not_fit_at_the_start_says_no_checkpoint_was_written(limit, tmpfs, tmp_path):
    """The header (config, versions and the 0.3 MiB of source, one write) fills a 256 KiB disk or passes a 128 KiB
    limit; the message gives the part of it that did not fit."""
    if limit == "tmpfs":
        log_dir, preexec_fn = mounted(tmpfs("256k")), None
    else:
        def preexec_fn():
            resource.setrlimit(resource.RLIMIT_FSIZE, (MiB // 8, MiB // 8))
        log_dir = tmp_path / "logs"
    line = one_line_error(train(log_dir, *TINY, "--num_iterations=2", preexec_fn=preexec_fn))
    (run_dir,) = log_dir.iterdir()
    free = r", which has 0\.0 KiB free" if limit == "tmpfs" else ""
    assert re.fullmatch(rf"error: writing the log {re.escape(str(run_dir))}/log\.txt failed \({strerror(limit)}\): "
                        rf"it needs about \d+\.\d KiB more in {re.escape(str(run_dir))}{free}; no checkpoint was "
                        rf"written in {re.escape(str(run_dir))} yet: free space and start the run again", line), line


def test_a_run_refused_by_the_disk_check_leaves_no_folder(tmpfs):
    disk = mounted(tmpfs("64m"))
    log_dir = disk / "logs"  # not made yet: the check reads the filesystem it would be on
    line = one_line_error(train(log_dir, *TINY, "--num_iterations=1", "--checkpoint_every=1"))
    assert re.fullmatch(rf"error: --log_dir={re.escape(str(log_dir))} has 6\d\.\d MiB free but checkpointing needs "
                        rf"about 299\.3 MiB; free some space or pass another --log_dir", line), line
    assert list(disk.iterdir()) == []


# Writes half a checkpoint through save_checkpoint, then dies by SIGKILL ("die") or waits, its lock held ("wait").
HALF_WRITER = """
import io, os, signal, sys, time, torch
from runtime import checkpoint
real_save = torch.save
def save_half(obj, f):
    buffer = io.BytesIO()
    real_save(obj, buffer)
    f.write(buffer.getvalue()[:buffer.tell() // 2])
    f.flush()
    print("half written", flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
torch.save = save_half
checkpoint.save_checkpoint(checkpoint.checkpoint_path(sys.argv[1], 3), {"weights": torch.zeros(250_000)})
"""


def half_writes(*jobs: tuple[Path, str]) -> list[tuple[subprocess.Popen, Path]]:
    """For each (folder, then): a complete checkpoint in the folder, and HALF_WRITER's half-written next one; the
    writers start together (each mostly imports torch). [(writer, its temporary file)], the "die" writers dead."""
    writers = []
    for folder, then in jobs:
        folder.mkdir(parents=True)
        (folder / "ckpt_000002.pt").write_bytes(b"a complete checkpoint")
        writers.append(subprocess.Popen([sys.executable, "-c", HALF_WRITER, str(folder), then], cwd=ROOT, env=env(),
                                        stdout=subprocess.PIPE, text=True))
    try:
        for writer, (folder, then) in zip(writers, jobs):
            assert writer.stdout.readline() == "half written\n"
            if then == "die":
                assert writer.wait(TIMEOUT) == -signal.SIGKILL
    except BaseException:
        for writer in writers:
            writer.kill()
            writer.wait(TIMEOUT)
        raise
    return [(writer, folder / f".ckpt_000003.pt.tmp{writer.pid}") for writer, (folder, _) in zip(writers, jobs)]


def age(path: Path) -> None:
    """As a file last written a minute ago."""
    past = time.time() - 60
    os.utime(path, (past, past))


def test_only_the_half_written_checkpoints_of_dead_writers_are_removed(tmp_path):
    logs = tmp_path / "logs"
    (_, killed_tmp), (waiting, live_tmp), (_, resumed_tmp) = half_writes(
        (logs / "run_a", "die"), (logs / "run_b", "wait"),
        (tmp_path / "elsewhere" / "run_c", "die"))  # the folder of a resumed checkpoint
    try:
        young = logs / "run_a" / ".ckpt_000009.pt.tmp99999"  # a writer may be creating it, not yet locked
        young.write_bytes(b"\0" * 1000)
        for tmp in (killed_tmp, live_tmp, resumed_tmp):
            age(tmp)
        sizes = killed_tmp.stat().st_size + resumed_tmp.stat().st_size
        assert checkpoint.remove_stale_temps(str(logs), resume=str(resumed_tmp.parent)) == sizes
        assert not killed_tmp.exists() and not resumed_tmp.exists()
        assert live_tmp.exists() and young.exists()  # its writer is alive; it is too new to tell
        assert all((folder / "ckpt_000002.pt").exists() for folder in (logs / "run_a", logs / "run_b"))
    finally:
        waiting.kill()
        waiting.wait(TIMEOUT)
    size = live_tmp.stat().st_size
    assert checkpoint.remove_stale_temps(str(logs)) == size  # killed now: its lock went with it
    assert not live_tmp.exists()


def test_the_next_run_removes_them_before_its_disk_check(tmpfs, tmp_path):
    """On a tmpfs, the half-written checkpoint takes the room the run's checkpoints need: the run starts only because
    it is removed first. Where no tmpfs can be mounted, the same run on the ordinary disk removes it all the same."""
    disk = tmpfs("400m")
    log_dir = disk or tmp_path / "logs"
    stale = log_dir / "20260101-000000-abcdef" / ".ckpt_000040.pt.tmp4194305"  # its writer died: no lock held
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"\1" * 150 * MiB)
    age(stale)
    flags = [*TINY, "--num_iterations=1", "--checkpoint_every=1"]
    if disk:
        cfg, _ = run_config(flags)
        assert shutil.disk_usage(log_dir).free < checkpoint.space_needed(derive(cfg, 1).model)
    proc = train(log_dir, *flags)
    stdout, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stdout + stderr
    assert "removed the half-written checkpoints of killed runs: 150.0 MiB freed" in stdout
    assert not stale.exists()
