"""Signals and hangs (issue 72): no job hangs on a rank that stops answering, a second Ctrl-C ends a process even
while it waits inside a collective, the workers end when torchrun is killed, and a stop under torchrun is clean.

Each case runs real processes: train_gpt2 under torchrun, two gloo ranks on the CPU, on the small synthetic corpus
of tests/test_reliability.py, signalled once their first step is logged.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime import control
from test_reliability import (LONG, NO_GPU, ROOT, TIMEOUT, as_from_a_terminal, assert_stopped_with_checkpoint,
                              child_env, children, train_args)
from test_reliability import corpus  # noqa: F401  (the session's synthetic corpus, a fixture)

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# the active environment, which run.sh then uses as it is instead of setting up ./.venv
RUN_SH_ENV = {"VIRTUAL_ENV": sys.prefix}
STOP_NOTICE = "stopping after the next logged step; a second SIGINT or SIGTERM, 2 s or more later, stops at once"


def two_ranks(corpus, log_dir, *flags) -> list[str]:
    """torchrun with two CPU ranks (gloo) of a tiny run that goes on until signalled."""
    return [*TORCHRUN, "train_gpt2.py", *train_args(corpus, log_dir, *LONG, "--batch_size=2", *flags)]


class Job:
    """A command in a session of its own, its output read line by line with the time each line came."""

    def __init__(self, cmd, **env):
        self.proc = subprocess.Popen(as_from_a_terminal(cmd), cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=child_env(**env), start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(self, pattern: str, timeout: float = TIMEOUT) -> float:
        """When the first line matching `pattern` came, waiting for it up to `timeout` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for at, line in list(self.lines):
                if re.search(pattern, line):
                    return at
            if self.proc.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} in:\n{self.text}")

    def finish(self, timeout: float = TIMEOUT) -> int:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return self.proc.returncode

    def kill(self):
        """SIGKILL to the whole session's process group, stopped processes included."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def running(pid: int) -> bool:
    """Whether `pid` runs: it exists and is not a zombie waiting for its parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pids, timeout: float) -> float:
    """Seconds until none of `pids` runs; fails after `timeout`."""
    start = time.monotonic()
    while any(map(running, pids)):
        assert time.monotonic() - start < timeout, [pid for pid in pids if running(pid)]
        time.sleep(0.05)
    return time.monotonic() - start


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def workers(launcher: int) -> list[int]:
    """torchrun's children, the training processes, in the order of their local ranks."""
    def local_rank(pid):
        environ = dict(entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if entry)
        return int(environ["LOCAL_RANK"])
    return sorted(children(launcher), key=local_rank)


def stop_after(cmd, send, first: str = r"^step:1/", **env) -> tuple[int, str]:
    """Start `cmd`, call send(process) once a line matches `first`, and return (status, output)."""
    job = Job(cmd, **env)
    try:
        job.wait_for(first)
        send(job.proc)
        status = job.finish()
    finally:
        job.kill()
    return status, job.text


# --- a rank that stops answering ------------------------------------------------------------------------------

def test_a_stopped_rank_ends_the_job_with_a_message_that_names_it(corpus, tmp_path):
    """SIGSTOP freezes rank 1 (as a hung host would): rank 0's watchdog ends rank 0 after --collective_timeout_s,
    with one message naming rank 1 and exit status 4, and torchrun exits 1, its summary showing the message as the
    root cause (the test kills the frozen rank rather than wait out torchrun's grace period). Nothing is left
    running."""
    timeout_s = 10  # the least that runtime.config accepts
    job = Job(two_ranks(corpus, tmp_path, f"--collective_timeout_s={timeout_s}"))
    try:
        job.wait_for(r"^step:1/")
        ranks = workers(job.proc.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        said = job.wait_for(r"^error: rank 1 has not answered")
        # rank 0 last saw rank 1's counter move up to a period (timeout/4) before the stop, and looks every period
        assert timeout_s / 2 <= said - stopped < timeout_s + 10, job.text
        deadline = time.monotonic() + 20
        while running(ranks[0]) and time.monotonic() < deadline:  # rank 0 ends itself...
            time.sleep(0.1)
        assert not running(ranks[0]), job.text
        os.kill(ranks[1], signal.SIGKILL)  # ...and the frozen rank would wait for torchrun's grace period
        status = job.finish(timeout=60)
    finally:
        job.kill()
    text = job.text
    message = (f"error: rank 1 has not answered for {timeout_s} s (stopped, frozen or cut off): ending the job "
               f"(exit status 4); --collective_timeout_s sets this wait")
    assert [line for line in text.splitlines() if line.startswith("error:")] == [message], text
    assert status == 1 and "exitcode  : 4" in text and f"traceback : {message}" in text, text
    assert not any(map(running, ranks))


# --- the launcher dies ------------------------------------------------------------------------------------------

def test_workers_stop_when_torchrun_is_killed(corpus, tmp_path):
    """The workers are torchrun's children, and get SIGTERM from the kernel when it dies (PR_SET_PDEATHSIG): they
    stop at the next logged step, rank 0 with a checkpoint, instead of training on as orphans."""
    job = Job(two_ranks(corpus, tmp_path))
    try:
        job.wait_for(r"^step:1/")
        ranks = workers(job.proc.pid)
        assert len(ranks) == 2 and {parent(pid) for pid in ranks} == {job.proc.pid}
        job.proc.kill()
        assert wait_gone(ranks, timeout=30) < 30
        job.finish()
    finally:
        job.kill()
    match = re.search(r"^stopped by a signal after step (\d+); resume with --resume (\S+)$", job.text, re.M)
    assert match and Path(match.group(2)).is_file(), job.text


# --- a clean stop under torchrun -----------------------------------------------------------------------------------

@NO_GPU
@pytest.mark.parametrize("how", ["SIGTERM to bash run.sh", "SIGINT to its process group (Ctrl-C)"])
def test_run_sh_with_two_processes_stops_cleanly(how, corpus, tmp_path):
    """run.sh passes the signal on to the workers, not to torchrun: both stop after the same step, rank 0 writes the
    checkpoint and prints the resume command once, and the job, torchrun included, ends with status 0."""
    def send(proc):
        if "SIGTERM" in how:
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)

    cmd = ["bash", "run.sh", *train_args(corpus, tmp_path, *LONG, "--batch_size=2")]
    status, text = stop_after(cmd, send, **RUN_SH_ENV, NPROC="2")
    assert "2 process(es) on cpu" in text
    assert_stopped_with_checkpoint(status, text, tmp_path)
    assert text.count("resume with --resume") == 1, text


@pytest.mark.parametrize("sig, how", [(signal.SIGTERM, "launcher"), (signal.SIGINT, "group")])
def test_bare_torchrun_signalled_exits_1_after_the_workers_stop_cleanly(sig, how, corpus, tmp_path):
    """torchrun signalled itself (SIGTERM to it, or a Ctrl-C, which reaches it and its workers) passes the signal
    to the workers, which stop cleanly; torchrun then exits 1 with its SignalException's traceback. Its forwarded
    SIGINT reaches the workers within moments of the terminal's, so it counts as the same request."""
    signalled = []

    def send(proc):
        signalled.append(proc.pid)
        (os.kill if how == "launcher" else os.killpg)(proc.pid, sig)

    status, text = stop_after(two_ranks(corpus, tmp_path), send)
    assert status == 1 and text.count("Traceback") == 1, text
    workers_part, torchrun_part = text.split("Traceback (most recent call last):")
    assert_stopped_with_checkpoint(0, workers_part, tmp_path)
    assert text.count("resume with --resume") == 1 and " again: " not in text, text
    assert torchrun_part.rstrip().endswith(
        f"torch.distributed.elastic.multiprocessing.api.SignalException: Process {signalled[0]} got signal: "
        f"{int(sig)}"), text


# --- a second stop request ---------------------------------------------------------------------------------------

def test_a_second_sigint_ends_a_process_blocked_in_a_collective(corpus, tmp_path):
    """Rank 1 frozen, rank 0 waits in a collective, where no Python signal handler runs: the first SIGINT is only
    noted, the second, past the duplicate window, ends rank 0 at once with status 130."""
    job = Job(two_ranks(corpus, tmp_path, "--collective_timeout_s=120"))
    try:
        job.wait_for(r"^step:1/")
        rank0, rank1 = workers(job.proc.pid)
        os.kill(rank1, signal.SIGSTOP)
        time.sleep(1)  # rank 0 reaches its next collective
        steps = job.text.count("\nstep:")
        os.kill(rank0, signal.SIGINT)
        job.wait_for(re.escape(f"SIGINT: {STOP_NOTICE}"))
        time.sleep(control.DUPLICATE_WINDOW_S + 0.5)
        assert running(rank0) and job.text.count("\nstep:") == steps  # blocked: the flag alone does nothing
        os.kill(rank0, signal.SIGINT)
        assert wait_gone([rank0], timeout=5) < 5
        job.wait_for(r"^rank 0: SIGINT again: stopping at once, without a checkpoint \(exit status 130\)$")
        os.kill(rank1, signal.SIGCONT)  # rank 1 then finds rank 0 gone, and torchrun need not wait to kill it
        job.wait_for(r"^\s*exitcode\s+: 130 ")  # rank 0's, in torchrun's summary
    finally:
        job.kill()


def test_a_duplicate_signal_within_the_window_is_the_same_request(corpus, tmp_path):
    """A second SIGINT a moment after the first (torchrun forwarding a Ctrl-C that its workers got too) leaves the
    stop clean: status 0, the checkpoint, no hard stop."""
    cmd = [sys.executable, "train_gpt2.py", *train_args(corpus, tmp_path, *LONG, "--log_every=5")]

    def twice(proc):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        assert proc.poll() is None  # the next logged step is 5 steps away: the duplicate reaches a running process
        proc.send_signal(signal.SIGINT)

    status, text = stop_after(cmd, twice, first=r"^step:5/")
    assert_stopped_with_checkpoint(status, text, tmp_path)
    assert f"SIGINT: {STOP_NOTICE}" in text and " again: " not in text, text


def test_stop_request_counts_a_signal_past_the_window_as_the_second(monkeypatch):
    """StopRequest.receive alone: the first request sets the flag, a repeat within DUPLICATE_WINDOW_S is the same
    one, and one past it ends the process with 128 + its number."""
    exits = []
    monkeypatch.setattr(control.os, "_exit", exits.append)
    monkeypatch.setattr(control, "say", lambda line: None)
    before = signal.getsignal(signal.SIGINT)
    stop = control.StopRequest(rank=1, world_size=2)
    try:
        stop.receive(signal.SIGTERM, now=100.0)
        stop.receive(signal.SIGINT, now=100.0 + control.DUPLICATE_WINDOW_S - 0.01)
        assert stop.signal == signal.SIGTERM and exits == []
        stop.receive(signal.SIGINT, now=100.0 + control.DUPLICATE_WINDOW_S)
        assert exits == [130]
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_stop_between_logged_steps_logs_the_step_it_stops_after():
    """With --log_every=5 the vote cast during step 7 rides on step 10's record, read a step late, at step 11, which
    logs no loss of its own: it is read then, so the last line before the stop is the step the run stops after."""
    from test_control import control as make_control

    ctl, log, stop = make_control(log_every=5, checkpoint_every=50, num_iterations=100)
    decisions = [ctl.after_step(step, torch.tensor(10.0 - step / 10), [torch.ones(1)]) for step in range(1, 8)]
    stop.signal = signal.SIGINT
    decisions += [ctl.after_step(step, torch.tensor(10.0 - step / 10), [torch.ones(1)]) for step in range(8, 12)]
    assert [(d.stop, d.save) for d in decisions] == [(False, False)] * 10 + [(True, True)]
    assert [s for s, _ in log.lines] == [5, 10, 11] and log.lines[-1][1] == pytest.approx(8.9)


# --- NPROC without a GPU ----------------------------------------------------------------------------------------

@NO_GPU
def test_run_sh_runs_nproc_cpu_processes_of_the_smoke_preset(tmp_path):
    """NPROC=2 on a machine without a GPU: two gloo processes under torchrun, the smoke preset as it is."""
    result = subprocess.run(["bash", "run.sh", "--num_iterations=2", f"--log_dir={tmp_path}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=TIMEOUT,
                            env=child_env(**RUN_SH_ENV, NPROC="2"))
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    assert "run.sh: no GPU found, running the CPU smoke preset" in text and "2 process(es) on cpu" in text, text
    assert re.search(r"^step:2/2 val_loss:", text, re.M), text


@NO_GPU
@pytest.mark.parametrize("nproc", ["0", "two", "-1"])
def test_run_sh_refuses_a_bad_nproc_without_a_gpu(nproc):
    result = subprocess.run(["bash", "run.sh"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                            env=child_env(**RUN_SH_ENV, NPROC=nproc))
    assert result.returncode == 2
    assert result.stderr == (f"error: NPROC={nproc}: give the number of CPU processes to train with, 1 or more "
                             f"(no GPU found)\n")
