"""Reliability (issue 5): every bad input or fault ends in a short message that names the cause and the fix, with
exit status 2 (a user error) or 3 (the run diverged), and leaves the data and the checkpoints on disk as they were.

Each case runs a real entry point in a subprocess (train_gpt2.py, run.sh, `python -m data.prepare`,
data/cached_fineweb10B.py) on a small synthetic corpus. A train_gpt2 process spends ~3 s importing torch on the
2-core CI machine, so the train_gpt2 cases that fail before training are processes forked from one that imported it
(FORKED_RUNS), started together with the rest, three at a time, and the runs that do train use the smallest model the
smoke preset allows. What a CPU cannot produce (CUDA out-of-memory) runs train_gpt2.main() in this process with the
failing call replaced; tests/test_disk_full.py fills a real disk.
"""
import collections
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt2
from model.gpt import GPT
from data.loader import DataExhausted, TrainLoader, ValLoader
from data.shard import BOS_ID, HEADER_BYTES, ShardError, write_shard
from runtime import checkpoint
from runtime import config
from runtime import errors
from runtime.errors import UserError, exit_on_user_error

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300  # seconds per subprocess: generous, CI machines are small and shared
MAX_LINES = 5  # a user error is a message, not a page
# The smallest run the smoke preset allows: one 128-token sequence per step, no value embeddings.
TINY = ["--preset=smoke", "--seq_len=128", "--batch_size=1", "--device_batch_size=1", "--num_value_embeds=0",
        "--num_iterations=2", "--val_tokens=256", "--warmup_steps=0", "--device=cpu"]
# The base run: a checkpoint after each of its 2 steps, and a validation of 300 tokens, which is not a multiple
# of the 128 tokens of a validation batch (case 11).
BASE = ["--val_tokens=300", "--checkpoint_every=1", "--log_every=1"]
# Runs long enough to be stopped by a signal after their first step.
LONG = ["--checkpoint_every=50", "--num_iterations=10000", "--log_every=1", "--cycle_data=1"]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="run.sh and --device cuda behave differently with a GPU")


# --- helpers ------------------------------------------------------------------------------------------------

def child_env(**extra) -> dict:
    """This environment without torchrun's or our own switches, plus `extra`."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SPEEDRUN_TRACEBACK",
            "HF_HUB_OFFLINE", "HF_ENDPOINT"}
    # run.sh uses this interpreter's environment instead of making ./.venv
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "VIRTUAL_ENV": sys.prefix, **extra}


def as_from_a_terminal(cmd: list[str]) -> list[str]:
    """cmd, started with SIGINT at its default, as a terminal's shell starts it. A pytest run in the background
    passes SIGINT on ignored, and bash cannot trap a signal that was ignored when it started, so run.sh would not
    forward a Ctrl-C; the wrapper restores the default and becomes cmd (same process id)."""
    return [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "os.execvp(sys.argv[1], sys.argv[1:])", *cmd]


def run(cmd, **env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=child_env(**env))


def train_args(corpus, log_dir, *flags) -> list[str]:
    """Flags for a tiny run on the synthetic corpus; later flags override earlier ones."""
    return [*TINY, f"--train_files={corpus.train}", f"--val_files={corpus.val}", f"--log_dir={log_dir}", *flags]


def train_cmd(corpus, log_dir, *flags) -> list[str]:
    return [sys.executable, "train_gpt2.py", *train_args(corpus, log_dir, *flags)]


def output(result) -> str:
    return result.stdout + result.stderr


def assert_user_error(result, status: int, *needles: str) -> None:
    """The exit status, one short `error:` message without a traceback, and every needle (cause, fix) in it."""
    text = output(result)
    assert result.returncode == status, text
    assert "Traceback" not in text, text
    assert re.search(r"^error: ", text, re.M), text
    assert len(text.strip().splitlines()) <= MAX_LINES, text
    for needle in needles:
        assert needle in text, f"{needle!r} missing from: {text}"


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with the hash of its bytes and its modification time."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def weights_finite(path) -> bool:
    return all(torch.isfinite(t).all() for t in checkpoint.load_checkpoint(path)["model"].values())


def tokens(n: int, seed: int) -> np.ndarray:
    """`n` GPT-2 ids with a document start (BOS) every 100 tokens, like real shards."""
    ids = np.random.default_rng(seed).integers(0, BOS_ID, n).astype(np.uint16)
    ids[::100] = BOS_ID
    return ids


class Corpus:
    """200k training and 20k validation tokens, plus broken shards under bad/ (read-only by convention)."""

    def __init__(self, root: Path):
        self.root, self.bad = root, root / "bad"
        self.train, self.val = str(root / "syn_train_*.bin"), str(root / "syn_val_*.bin")
        self.bad.mkdir()
        write_shard(root / "syn_train_000001.bin", tokens(200_000, 0))
        write_shard(root / "syn_val_000000.bin", tokens(20_000, 1))
        good = (root / "syn_train_000001.bin").read_bytes()
        header = np.frombuffer(good[:HEADER_BYTES], dtype="<i4")
        for name, index, value in (("magic.bin", 0, 123), ("version.bin", 1, 7)):
            changed = header.copy()
            changed[index] = value
            (self.bad / name).write_bytes(changed.tobytes() + good[HEADER_BYTES:])
        (self.bad / "truncated.bin").write_bytes(good[:HEADER_BYTES + 1000])  # 500 of 200,000 tokens
        (self.bad / "short.bin").write_bytes(good[:100])
        ids = tokens(20_000, 2)
        ids[50] = 60_000  # fits uint16, but no GPT-2 id
        write_shard(self.bad / "vocab.bin", ids)
        write_shard(self.bad / "small_000001.bin", tokens(100, 3))  # below one step of 129 tokens
        write_shard(self.bad / "small_000002.bin", tokens(20_000, 4))
        (root / "a_file").write_text("a regular file, so a folder below it cannot be made, even by root\n")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    return Corpus(tmp_path_factory.mktemp("corpus"))


# --- cases that fail before training: one subprocess each, all started together ---------------------------

# (case, flags, words the message must hold: the cause and the fix); {bad} and {root} are corpus folders
EARLY = [
    ("01 wrong magic", ["--train_files={bad}/magic.bin"],
     ["magic.bin: magic number 123, expected 20240520", "python -m data.prepare"]),
    ("02 wrong version", ["--train_files={bad}/version.bin"],
     ["version.bin: format version 7, expected 1", "python data/cached_fineweb10B.py N"]),
    ("03 header count beyond the file", ["--train_files={bad}/truncated.bin"],
     ["truncated.bin: header says 200000 tokens (400000 bytes) but only 1000 bytes follow",
      "delete it and re-download"]),
    ("04 file shorter than the header", ["--train_files={bad}/short.bin"],
     ["short.bin: only 100 bytes, shorter than the 1024-byte header", "delete it and re-download"]),
    ("05 empty --train_files glob", ["--train_files={root}/none_*.bin"],
     ["no shard files match --train_files=", "python data/cached_fineweb10B.py N", "python -m data.prepare"]),
    ("06 empty --val_files glob", ["--val_files={root}/none_*.bin"],
     ["no shard files match --val_files=", "python data/cached_fineweb10B.py N", "or fix --val_files"]),
    ("06 relative glob names its folder", ["--train_files=nowhere/none_*.bin"],
     ["no shard files match --train_files='nowhere/none_*.bin' (a relative glob, read from /"]),
    ("06 validation on training shards", ["--val_files={root}/syn_train_*.bin"],
     ["share 1 shard(s) (", "syn_train_000001.bin): validation would score tokens the model trains on",
      "point them at different shards"]),
    ("07 val shards below --val_tokens", ["--val_tokens=30000"],
     ["hold 20,000 tokens, but --val_tokens=30,000 needs 30,001", "lower --val_tokens or point --val_files"]),
    ("08 first shard below one step", ["--train_files={bad}/small_*.bin"],
     ["small_000001.bin holds 100 tokens", "--batch_size=1 x --seq_len=128 + 1 = 129",
      "lower --batch_size or --seq_len"]),
    ("08 all shards below --num_iterations", ["--num_iterations=2000"],
     ["hold 200,000 tokens, but --num_iterations=2000 x 128 tokens/step needs at least 256,001",
      "python data/cached_fineweb10B.py 1", "--cycle_data=1",
      "(at most 1562 fit, fewer with --align_to_bos=1, which skips to a document start per sequence)"]),
    ("09 batch_size vs device_batch_size", ["--batch_size=3", "--device_batch_size=2"],
     ["--batch_size=3 must be a positive multiple of --device_batch_size=2 x 1 processes",
      "try --device_batch_size=1 "]),
    ("10 seq_len not a multiple of 128", ["--seq_len=200"],
     ["--seq_len=200 must be a multiple of the attention block size 128", "try --seq_len=128"]),
    ("11 val_tokens zero", ["--val_tokens=0"], ["--val_tokens=0 must be positive", "--val_tokens=10485760"]),
    ("12 unknown flag", ["--num_iteration=5"], ["unknown flag --num_iteration; did you mean --num_iterations?"]),
    ("13 wrong flag type", ["--num_iterations=abc"], ["--num_iterations expects an integer, got 'abc'", "--help"]),
    ("14 --device cuda without a GPU", ["--device=cuda"], ["no CUDA GPU is visible", "--device cpu"]),
    ("16 --resume of a missing file", ["--resume={root}/missing.pt"],
     ["error: --resume ", "missing.pt: no such file", "pass a ckpt_<step>.pt file or the run folder"]),
    ("16 --resume of a file that is no checkpoint", ["--resume={root}/a_file"],
     ["a_file: not a checkpoint (a run writes them as ckpt_<step>.pt); pass one of those, or the run folder"]),
    ("16 --hellaswag_file without the evaluation", ["--hellaswag_file={root}/a_file"],
     ["a_file' is read only by the HellaSwag evaluation: add --hellaswag=1, or drop --hellaswag_file"]),
    ("20 --log_dir below a regular file", ["--log_dir={root}/a_file/logs"],
     ["a_file/logs is not writable (Not a directory)", "pass a folder you can write to"]),
    ("25 token id beyond the vocabulary", ["--train_files={bad}/vocab.bin"],
     ["vocab.bin: holds token id 60000, but the GPT-2 vocabulary has 50257 ids", "python -m data.prepare"]),
    ("12 unknown flag via run.sh", ["--num_iteration=5"],
     ["unknown flag --num_iteration; did you mean --num_iterations?"]),
    ("26 --profile_cpu=0 without a GPU", ["--profile_step=1", "--profile_cpu=0"],
     ["--profile_cpu=0 traces the GPU's work alone, and this run has no GPU: drop it"]),
    ("27 --attention_forward=int8 without a GPU", ["--attention_forward=int8"],
     ["--attention_forward=int8 runs in the fused kernels on CUDA GPUs of compute capability 8.9 or newer",
      "use --attention_forward=bf16"]),
]
EARLY_IDS = [case for case, _, _ in EARLY]
NEEDS_NO_GPU = ({"14 --device cuda without a GPU", "26 --profile_cpu=0 without a GPU",
                 "27 --attention_forward=int8 without a GPU"}
                | {case for case in EARLY_IDS if "run.sh" in case})


# train_gpt2 whose optimizer multiplies the first MLP's input weight by FACTOR in its update number AFTER: a run that
# diverges, as a learning rate far too large makes one (such learning rates are refused before a run starts).
POISONED_UPDATE = """
import sys
import train_gpt2
from model.gpt import GPT
from optim.optimizer import MuonAdam
from runtime.errors import exit_on_user_error

after, factor = int(sys.argv[1]), float(sys.argv[2])
models, updates, init, step = [], [], GPT.init_weights, MuonAdam.step

def init_weights(self):
    models.append(self)
    init(self)

def poisoned_step(self, *args):
    step(self, *args)
    updates.append(1)
    if len(updates) == after:  # the tiny runs have no warm-up steps
        models[-1].blocks[0].mlp.fc_w.data.mul_(factor)

GPT.init_weights, MuonAdam.step = init_weights, poisoned_step
sys.exit(exit_on_user_error(train_gpt2.main, sys.argv[3:]))
"""


# `python train_gpt2.py ARGS` for each ARGS of a JSON file {name: ARGS} (argv[1]), at the cost of one torch import:
# this process imports train_gpt2, then forks a process per name, one at a time, which runs the script's last line
# (sys.exit(exit_on_user_error(main))) with sys.argv as the script has it, its stdout and stderr (file descriptors 1
# and 2) in the files name.stdout and name.stderr beside the JSON, and ends through that SystemExit as the script
# does. The exit status of each, as subprocess gives it, goes into statuses.json there.
FORKED_RUNS = """
import gc
import json
import os
import sys

import train_gpt2
from runtime.errors import exit_on_user_error

listing = sys.argv[1]
folder = os.path.dirname(listing)
with open(listing) as f:
    runs = json.load(f)
gc.freeze()  # the children's garbage collections skip the imported objects: their exits copy fewer memory pages
statuses = {}
for name, args in runs.items():
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            file = os.open(os.path.join(folder, f"{name}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(file, fd)
            os.close(file)
        sys.argv = ["train_gpt2.py", *args]
        sys.exit(exit_on_user_error(train_gpt2.main))
    statuses[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with open(os.path.join(folder, "statuses.json"), "w") as f:
    json.dump(statuses, f)
"""


def run_forked(folder: Path, runs: dict, **env) -> dict[str, subprocess.CompletedProcess]:
    """`python train_gpt2.py ARGS` for each {name: ARGS} of `runs`, through FORKED_RUNS with its files in `folder`;
    {name: its result}, as run() gives it."""
    folder.mkdir()
    keys = {name: f"run{i}" for i, name in enumerate(runs)}
    (folder / "runs.json").write_text(json.dumps({keys[name]: args for name, args in runs.items()}))
    driver = run([sys.executable, "-c", FORKED_RUNS, str(folder / "runs.json")], **env)
    assert driver.returncode == 0, output(driver)
    statuses = json.loads((folder / "statuses.json").read_text())
    return {name: subprocess.CompletedProcess(["train_gpt2.py", *runs[name]], statuses[key],
                                              (folder / f"{key}.stdout").read_text(),
                                              (folder / f"{key}.stderr").read_text())
            for name, key in keys.items()}


class Jobs:
    """Subprocesses started together, three at a time (2 cores, mostly importing torch); awaited by name."""

    def __init__(self, logs: Path, corpus_before: dict):
        self.logs, self.corpus_before = logs, corpus_before  # a log folder per job; the corpus as it was
        self.pool = ThreadPoolExecutor(max_workers=3)
        self.futures = {}
        self.forked = {}  # a name of start_forked's: its job

    def start(self, name: str, cmd: list[str], **env) -> None:
        self.futures[name] = self.pool.submit(run, cmd, OMP_NUM_THREADS="1", **env)

    def start_forked(self, job: str, runs: dict[str, list[str]]) -> None:
        """run_forked(runs) as one job; result(name) gives each run's result."""
        self.futures[job] = self.pool.submit(run_forked, self.logs / job, runs, OMP_NUM_THREADS="1")
        self.forked.update({name: job for name in runs})

    def result(self, name: str) -> subprocess.CompletedProcess:
        if name in self.forked:
            return self.futures[self.forked[name]].result()[name]
        return self.futures[name].result()


@pytest.fixture(scope="session")
def jobs(corpus, tmp_path_factory):
    """The base run, the two diverging runs and every EARLY case, launched at once (longest first): the
    train_gpt2.py cases as one job of forked processes."""
    jobs = Jobs(tmp_path_factory.mktemp("logs"), snapshot(corpus.root))
    early = {}
    for i, (case, flags, _) in enumerate(EARLY):
        if case in NEEDS_NO_GPU and torch.cuda.is_available():
            continue
        flags = [f.format(bad=corpus.bad, root=corpus.root) for f in flags]
        early[case] = train_args(corpus, jobs.logs / f"early{i}", *flags)
    jobs.start_forked("forked", {case: args for case, args in early.items() if "run.sh" not in case})
    jobs.start("base", train_cmd(corpus, jobs.logs / "base", *BASE))
    for name, after_update, factor in (("15-loss", 2, 1e30), ("15-weights", 1, math.inf)):
        cmd = [sys.executable, "-c", POISONED_UPDATE, str(after_update), str(factor),
               *train_args(corpus, jobs.logs / name, "--num_iterations=5", "--checkpoint_every=1", "--log_every=1")]
        jobs.start(name, cmd, TORCHELASTIC_ERROR_FILE=str(jobs.logs / f"{name}.json"))
    for case, args in early.items():
        if "run.sh" in case:
            jobs.start(case, ["bash", "run.sh", *args])
    yield jobs
    jobs.pool.shutdown(wait=True)


@pytest.mark.parametrize("index", range(len(EARLY)), ids=EARLY_IDS)
def test_user_error_before_training(index, jobs, corpus):
    case, _, needles = EARLY[index]
    if case in NEEDS_NO_GPU and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert_user_error(jobs.result(case), 2, *needles)
    # Checks run before anything is written: no run folder appears, and no shard is touched.
    assert not (jobs.logs / f"early{index}").exists()
    assert snapshot(corpus.root) == jobs.corpus_before


def test_traceback_on_request(monkeypatch, capsys):
    """The entry points' wrapper prints `error: ...` and exits 2; SPEEDRUN_TRACEBACK=1 lets the exception through
    with its traceback, for bug reports."""
    def main():
        raise UserError("--x=1 is wrong; pass --x=2")

    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(main)
    assert exit_info.value.code == 2 and capsys.readouterr().err == "error: --x=1 is wrong; pass --x=2\n"
    monkeypatch.setenv("SPEEDRUN_TRACEBACK", "1")
    with pytest.raises(UserError, match="--x=1 is wrong"):
        exit_on_user_error(main)


def test_a_value_error_of_ours_keeps_its_traceback(capsys):
    """Only a UserError (a cause the user can fix) becomes the one-line message: any other exception, a ValueError
    from our own code included, is a bug and keeps its traceback."""
    def main():
        raise ValueError("shapes (3, 4) and (5, 6) do not match")

    with pytest.raises(ValueError, match="do not match"):
        exit_on_user_error(main)
    assert "error:" not in capsys.readouterr().err


def test_later_ranks_report_a_moment_later(monkeypatch, capsys):
    """Under torchrun, a process other than its node's first waits before it reports (so that torchrun, which stops
    the others once the first fails, shows a shared mistake once), and then still reports its own."""
    waits = []
    monkeypatch.setattr(errors.time, "sleep", waits.append)

    def main():
        raise UserError("device cuda:1 is missing")

    for local_rank, waited in (("0", []), ("1", [errors.LATER_RANKS_WAIT_S])):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(SystemExit):
            exit_on_user_error(main)
        assert waits == waited and capsys.readouterr().err == "error: device cuda:1 is missing\n"
        waits.clear()


def test_a_mistake_in_the_flags_is_reported_once_under_torchrun(tmp_path):
    """Both processes fail alike; the message shows once (it showed once per process, on one line), and torchrun's
    failure summary, printed last, gives it as the root cause (it said "To enable traceback see: <url>")."""
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  "train_gpt2.py", "--device=cpu", "--batch_size=3", f"--log_dir={tmp_path}"])
    message = "error: --batch_size=3 must be a positive multiple of --device_batch_size=1 x 2 processes = 2"
    lines = output(result).splitlines()
    assert result.returncode != 0 and sum(line.startswith(message) for line in lines) == 1, output(result)
    root_cause = "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("Root Cause")):])
    assert f"traceback : {message}" in root_cause and "rank      : 0" in root_cause, root_cause


def torchrun_summary(error_file: Path, exitcode: int) -> str:
    """The failure summary torchrun prints for one failed process, made by torch's own code from its error file."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("train_gpt2.py", {0: failure}).format_msg()


def test_torchrun_reads_the_message_from_the_error_file(tmp_path, monkeypatch, capsys):
    """torchrun's summary shows the message from the error file; outside torchrun, or where the file cannot be
    written, only stderr gets it. Other exceptions pass with their traceback, which the summary then shows."""
    def main():
        raise UserError("--x=1 is wrong; pass --x=2")

    def summary(path):
        with pytest.raises(SystemExit):
            exit_on_user_error(main)
        assert capsys.readouterr().err == "error: --x=1 is wrong; pass --x=2\n"
        return torchrun_summary(path, 2)

    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert "traceback : To enable traceback" in summary(tmp_path / "error.json") and not list(tmp_path.iterdir())
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert "traceback : error: --x=1 is wrong; pass --x=2\n" in summary(tmp_path / "error.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "missing" / "error.json"))
    assert "traceback : To enable traceback" in summary(tmp_path / "missing" / "error.json")

    # any other exception (a bug) goes through with its traceback, which the summary shows
    def crash():
        raise RuntimeError("boom")

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "crash.json"))
    with pytest.raises(RuntimeError, match="boom"):
        exit_on_user_error(crash)
    text = torchrun_summary(tmp_path / "crash.json", 1)
    assert "traceback : Traceback (most recent call last):" in text and "in crash\n" in text, text
    assert "  RuntimeError: boom\n" in text, text


# --- the data: a small later shard, bad ids in the validation shard -----------------------------------------

def test_08_small_later_shard_is_read_through(tmp_path):
    """Only the FIRST shard must hold one step (train_gpt2 refuses it above): the shards form one stream, so a
    tiny shard in the middle is simply read through, and when the stream ends the message names the last shard
    and the numbers."""
    streams = [tokens(300, 5), tokens(50, 6), tokens(400, 7)]
    for i, ids in enumerate(streams):
        write_shard(tmp_path / f"s_{i:06d}.bin", ids)
    loader = TrainLoader(str(tmp_path / "s_*.bin"), seq_len=128, batch_size=2, device_batch_size=2, rank=0,
                         world_size=1, device="cpu", align_to_bos=False)
    stream = np.concatenate(streams).astype(np.int64)
    for step in range(2):  # the second step spans all three shards
        inputs, targets = loader.next_batch()
        rows = np.stack([stream[step * 256 + j * 128:][:129] for j in range(2)])
        np.testing.assert_array_equal(inputs.numpy(), rows[:, :-1])
        np.testing.assert_array_equal(targets.numpy(), rows[:, 1:])
    with pytest.raises(DataExhausted) as error:
        loader.next_batch()
    for words in ("s_000002.bin", "hold 750 tokens", "--batch_size=2 x --seq_len=128 = 256", "about 2 steps",
                  "python data/cached_fineweb10B.py N", "lower --num_iterations"):
        assert words in str(error.value)


def test_25_bad_id_in_the_validation_shard(corpus):
    with pytest.raises(ShardError, match=r"vocab\.bin: holds token id 60000"):
        ValLoader(str(corpus.bad / "vocab.bin"), val_tokens=1000, seq_len=128, device_batch_size=1, rank=0,
                  world_size=1, device="cpu")


# --- checks in derive() that protect the optimizer and the model from impossible values -------------------

@pytest.mark.parametrize("flag, value, words", [
    ("vocab_size", 512, "smaller than the shards' GPT-2 vocabulary of 50257 ids; keep the default --vocab_size=50304"),
    ("lr_embed", 1e39, "--lr_embed=1e+39 is outside 0 to 10, the range a run can train in; the record uses "
     "--lr_embed=0.6"),
    ("lr_scalar", 1e30, "--lr_scalar=1e+30 is outside 0 to 10"),
    ("lr_hidden", math.nan, "--lr_hidden=nan is outside 0 to 1"),
    ("lr_head", -0.1, "--lr_head=-0.1 is outside 0 to 1"),
    ("muon_method", "newton", "--muon_method='newton': use one of ['jordan', 'polar_express']"),
    ("normuon_beta2", 1.0, "--normuon_beta2=1.0 must be from 0 (plain Muon) to below 1; NorMuon's paper uses "
     "--normuon_beta2=0.95"),
    ("no_attention_layers", "seven", "--no_attention_layers='seven' must be comma-separated layer numbers, e.g. "
     "--no_attention_layers=0,7, or --no_attention_layers=auto"),
    ("no_mlp_layers", "12", "--no_mlp_layers='12' names a layer outside 0..11 (--num_layers=12); pass layers inside "
     "it, or --no_mlp_layers=''"),
    ("no_attention_layers", "0,9,2,11", "value embedding 0 feeds layers [0, 9], which no_attention_layers=[0, 2, "
     "9, 11] leaves without attention, so it would never be read; keep attention in one of them, or set "
     "num_value_embeds=2"),
    ("long_window_layers", "0;4", "--long_window_layers='0;4' must be comma-separated layer numbers, e.g. "
     "--long_window_layers=0,7, or --long_window_layers=auto"),
    ("val_context", 49152, "--val_context=49152 must be from 0 to --seq_len - 1 = 49151, or -1 for the model's "
     "receptive field"),
    ("val_context", -2, "--val_context=-2 must be from 0"),
    ("profile_step", 1751, "--profile_step=1751 must name a step from 1 to --num_iterations=1750, or be 0 for none"),
    ("profile_step", -1, "--profile_step=-1 must name a step from 1"),
])
def test_impossible_values_are_refused(flag, value, words):
    cfg = config.TrainConfig(**{flag: value})
    with pytest.raises(ValueError, match=re.escape(words)):
        config.derive(cfg, world_size=1)


# --- case 11: a validation that is not a whole number of batches is counted exactly ------------------------

def test_11_val_tokens_not_a_multiple_of_the_validation_batch(jobs, corpus):
    """Not an error, by design: the last validation batch keeps the training shape (one compiled graph) and
    its targets past --val_tokens are -100 (ignored), so exactly --val_tokens tokens are scored and runs with
    different batch shapes stay comparable. The smoke preset's window (256) is longer than half the 128-token
    sequence, so each sequence after the first repeats 64 tokens (--val_context=-1) and scores 64 new ones."""
    result = jobs.result("base")
    assert result.returncode == 0, output(result)
    assert "validation 4 steps (64 tokens of context per sequence)" in result.stdout
    assert "val_loss:" in result.stdout
    kwargs = dict(val_tokens=300, seq_len=128, device_batch_size=1, rank=0, world_size=1, device="cpu")
    for context, want in ((64, [128, 64, 64, 44]), (0, [128, 128, 44])):
        counted = [int((targets != -100).sum()) for _, targets in ValLoader(corpus.val, context=context, **kwargs)]
        assert counted == want and sum(counted) == 300


# --- case 15: divergence ------------------------------------------------------------------------------------

def test_15_divergence_stops_at_once_and_keeps_the_last_good_checkpoint(jobs):
    """An update that leaves the weights finite but huge (the first MLP's input weight times 1e30 after update 2)
    makes the next loss nan: the run stops at that step, before logging or saving it, and the checkpoint of the step
    before is the newest."""
    result = jobs.result("15-loss")
    text = output(result)
    assert result.returncode == train_gpt2.DIVERGED_EXIT == 3, text
    assert "Traceback" not in text
    match = re.search(r"^error: train loss is nan at step (\d+); stopping, the last good checkpoint is (\S+) ", text,
                      re.M)
    assert match and "Restart with lower learning rates (--lr_hidden, --lr_embed" in text, text
    step, kept = int(match.group(1)), Path(match.group(2))
    assert step >= 2 and f"step:{step}/" not in text
    (run_dir,) = (jobs.logs / "15-loss").iterdir()
    assert checkpoint.list_checkpoints(run_dir)[-1] == kept == checkpoint.checkpoint_path(run_dir, step - 1)
    assert checkpoint.load_checkpoint(kept)["step"] == step - 1
    assert_only_finite_checkpoints(run_dir)
    # under torchrun (its error file, as torchrun names it for each process), its failure summary says the same
    line = match.group(0) + text[match.end():].splitlines()[0]
    assert f"traceback : {line}\n" in torchrun_summary(jobs.logs / "15-loss.json", 3)


def test_15_an_overflowing_update_is_caught_before_its_checkpoint(jobs):
    """The loss is computed before the update, so an update that overflows (a weight times inf: the first one) shows
    only in the weights: they are checked before every checkpoint, and none is written."""
    result = jobs.result("15-weights")
    assert result.returncode == 3 and "Traceback" not in output(result), output(result)
    assert re.search(r"^error: the weights hold inf/nan at step 1; stopping, no checkpoint was written. Restart "
                     r"with lower learning rates", result.stdout, re.M), output(result)
    (run_dir,) = (jobs.logs / "15-weights").iterdir()
    assert checkpoint.list_checkpoints(run_dir) == []
    assert_only_finite_checkpoints(run_dir)


def assert_only_finite_checkpoints(run_dir: Path) -> None:
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["log.txt", "metrics.jsonl"] + [p.name for p in checkpoint.list_checkpoints(run_dir)])  # no temp files
    for path in checkpoint.list_checkpoints(run_dir):
        assert weights_finite(path)


@pytest.fixture
def in_process():
    """For train_gpt2.main() in this process: give pytest its SIGINT/SIGTERM handlers back afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


# --- cases 17-19: checkpoints -------------------------------------------------------------------------------

@pytest.fixture
def base_run(jobs):
    result = jobs.result("base")
    assert result.returncode == 0, output(result)
    (run_dir,) = (jobs.logs / "base").iterdir()
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["ckpt_000001.pt", "ckpt_000002.pt"]
    return run_dir


def flip_a_bit_in_the_largest_record(path: Path) -> None:
    """Damage a checkpoint the way a bad disk or copy would: one bit inside the tensor data, the zip intact."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    data[record.header_offset + 30 + name_len + extra_len + record.file_size // 2] ^= 1
    path.write_bytes(bytes(data))


def test_17_resume_of_a_damaged_checkpoint(base_run, corpus, tmp_path):
    before = snapshot(base_run)
    truncated = tmp_path / "copy" / "ckpt_000002.pt"
    truncated.parent.mkdir()
    truncated.write_bytes((base_run / "ckpt_000002.pt").read_bytes()[:3_000_000])
    folder = tmp_path / "run"  # a run folder whose newest checkpoint has its first bytes zeroed
    shutil.copytree(base_run, folder)
    newest = folder / "ckpt_000002.pt"
    newest.write_bytes(b"\0" * 4096 + newest.read_bytes()[4096:])
    flipped = tmp_path / "flipped" / "ckpt_000002.pt"
    flipped.parent.mkdir()
    shutil.copy(base_run / "ckpt_000002.pt", flipped)
    flip_a_bit_in_the_largest_record(flipped)
    # torch.load alone takes the flipped bit for a weight: only the CRC check can refuse it
    loaded, intact = (torch.load(p, weights_only=False)["model"] for p in (flipped, base_run / "ckpt_000002.pt"))
    assert sum(not torch.equal(loaded[k], intact[k]) for k in intact) == 1
    results = run_forked(tmp_path / "forked", {p: train_args(corpus, tmp_path / "logs", *BASE, f"--resume={p}")
                                               for p in (truncated, folder, flipped)})
    file_result, folder_result, flipped_result = (results[p] for p in (truncated, folder, flipped))
    assert_user_error(file_result, 2, f"--resume {truncated}: the checkpoint is truncated or corrupt",
                      f"resume from an earlier ckpt_<step>.pt in {truncated.parent}")
    assert_user_error(folder_result, 2, f"--resume {newest}: the checkpoint is truncated or corrupt",
                      f"resume from an earlier ckpt_<step>.pt in {folder}")
    assert_user_error(flipped_result, 2, f"--resume {flipped}: the checkpoint is truncated or corrupt (BadZipFile)",
                      f"resume from an earlier ckpt_<step>.pt in {flipped.parent}")
    assert not (tmp_path / "logs").exists()
    assert snapshot(base_run) == before
    assert checkpoint.load_checkpoint(folder / "ckpt_000001.pt")["step"] == 1  # the spare is still good


def test_18_resume_with_a_config_that_changes_the_math(base_run, corpus, tmp_path):
    """Flags beside --resume that would change the run's math are refused, each named with its two values."""
    before = snapshot(base_run)
    result = run(train_cmd(corpus, tmp_path / "logs", *BASE, f"--resume={base_run}", "--lr_hidden=0.1",
                           "--seq_len=256"))
    assert_user_error(result, 2, "would change its training math: --lr_hidden: 0.05 -> 0.1; --seq_len: 128 -> 256. "
                                 "Drop them to resume, or start a new run from scratch")
    assert not (tmp_path / "logs").exists()
    assert snapshot(base_run) == before


def test_18e_resume_may_trace_another_step(base_run):
    """Tracing a step changes no math: a resumed run may profile a step, on the GPU without the host's ops; the
    accepted changes are listed."""
    cfg, changes = config.run_config([f"--resume={base_run}", "--profile_step=3", "--profile_cpu=0"])
    assert (cfg.profile_step, cfg.profile_cpu) == (3, False)
    assert changes == ["profile_cpu: True -> False", "profile_step: 0 -> 3"]


def test_18c_resume_alone_continues_with_the_checkpoints_config(base_run, tmp_path):
    """--resume RUN_DIR alone is the run's config: no flag of the run needs retyping, not even its --preset."""
    saved = checkpoint.load_checkpoint(base_run)["config"]
    cfg, changes = config.run_config([f"--resume={base_run}", f"--log_dir={tmp_path}"])
    assert {**dataclasses.asdict(cfg), "resume": "", "log_dir": ""} == {**saved, "resume": "", "log_dir": ""}
    assert cfg.preset == "smoke" and changes == [f"log_dir: {saved['log_dir']!r} -> {str(tmp_path)!r}"]
    with pytest.raises(UserError, match=r"--model_dim: 64 -> 96. Drop them"):
        config.run_config([f"--resume={base_run}", "--model_dim=96"])


def test_18b_resume_of_a_checkpoint_from_another_version(base_run, corpus, tmp_path):
    """A checkpoint from before a field existed (or after one was dropped) cannot say what that field was: the
    message sends the user to the version that wrote it."""
    state = torch.load(base_run / "ckpt_000002.pt", weights_only=False)
    del state["config"]["fp8"]  # as the versions before the one --fp8 flag wrote it
    state["config"]["dropped_option"] = 1
    older = tmp_path / "older" / "ckpt_000002.pt"
    older.parent.mkdir()
    torch.save(state, older)
    result = run(train_cmd(corpus, tmp_path / "logs", *BASE, f"--resume={older}"))
    assert_user_error(result, 2, f"--resume {older}: the checkpoint was written by another gpt-speedrun version (its "
                                 "config differs in the fields dropped_option, fp8); resume it with that version: "
                                 "check out the git_commit on the versions line of its run folder's log.txt")
    assert not (tmp_path / "logs").exists()


def test_checkpoints_are_pruned_to_the_newest_two(tmp_path):
    """Each save keeps the newest and one spare: a long run must not fill the disk with full checkpoints."""
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(checkpoint.checkpoint_path(tmp_path, step), {"step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000002.pt", "ckpt_000003.pt"]


def test_19_checkpoint_write_killed_midway(base_run, corpus, tmp_path):
    """A checkpoint write killed half-way (test_disk_full's writer, SIGKILLed mid-write) leaves its temporary file,
    never taken for a checkpoint; the older checkpoints are untouched, a resume continues from the newest complete
    one, and removes the dead writer's file."""
    from test_disk_full import HALF_WRITER

    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    before = snapshot(run_dir)
    killed = run([sys.executable, "-c", HALF_WRITER, str(run_dir), "die"])
    assert killed.returncode == -signal.SIGKILL, output(killed)
    (half,) = run_dir.glob(".ckpt_000003.pt.tmp*")  # the half-written file is there...
    assert half.stat().st_size > 0 and not (run_dir / "ckpt_000003.pt").exists()
    # ...but never taken for a checkpoint, and the older ones are untouched
    assert checkpoint.list_checkpoints(run_dir) == [run_dir / "ckpt_000001.pt", run_dir / "ckpt_000002.pt"]
    assert checkpoint.resolve(str(run_dir)) == run_dir / "ckpt_000002.pt"
    assert {k: v for k, v in snapshot(run_dir).items() if k != half.name} == before
    os.utime(half, (half.stat().st_mtime - 60,) * 2)  # as a file left by a run killed a minute ago
    resumed = run(train_cmd(corpus, tmp_path / "logs", *BASE, f"--resume={run_dir}"))
    assert resumed.returncode == 0, output(resumed)
    assert f"resumed from {run_dir / 'ckpt_000002.pt'} at step 2" in resumed.stdout
    assert not half.exists() and "removed the half-written checkpoints of killed runs" in resumed.stdout


# --- case 20: the disk -------------------------------------------------------------------------------------

def test_20_disk_full_is_refused_before_training(corpus, tmp_path, monkeypatch, in_process):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 2**40 - 2**20, 2**20))
    with pytest.raises(UserError) as error:
        train_gpt2.main(train_args(corpus, tmp_path, "--checkpoint_every=1"))
    message = str(error.value)
    assert message == (f"--log_dir={tmp_path} has 1.0 MiB free but checkpointing needs about 299.3 MiB; "
                       f"free some space or pass another --log_dir")
    assert list(tmp_path.iterdir()) == []  # a refused run leaves no run folder


# --- out of memory: advice that fits, from wherever CUDA runs out -------------------------------------------

@pytest.mark.parametrize("batch_size, device_batch_size, seq_len, world_size, advice", [
    (8, 4, 1024, 1, "--device_batch_size=2"),
    (10, 5, 1024, 1, "--device_batch_size=1"),  # 5 // 2 = 2 would not divide the batch
    (12, 6, 1024, 2, "--device_batch_size=3"),
    (8, 1, 48 * 1024, 8, "--seq_len=24576 --batch_size=16"),
    (8, 1, 384, 8, "--seq_len=128 --batch_size=16"),
    (8, 1, 128, 8, "use a smaller model (--num_layers, --model_dim)"),
])
def test_oom_advice_fits(batch_size, device_batch_size, seq_len, world_size, advice):
    """CUDA out-of-memory cannot happen on a CPU: the advice itself is checked, and every configuration it
    suggests passes derive() with fewer tokens per GPU micro-batch."""
    cfg = config.TrainConfig(batch_size=batch_size, device_batch_size=device_batch_size, seq_len=seq_len)
    text = config.oom_advice(cfg, device_batch_size)
    assert advice in text
    suggested = {name: int(value) for name, value in re.findall(r"--(\w+)=(\d+)", text)}
    if suggested:
        smaller = config.TrainConfig(**{**dict(batch_size=batch_size, device_batch_size=device_batch_size,
                                               seq_len=seq_len), **suggested})
        config.derive(smaller, world_size)
        assert smaller.device_batch_size * smaller.seq_len < device_batch_size * seq_len


def test_oom_anywhere_in_the_run_becomes_the_advice(corpus, tmp_path, monkeypatch, in_process):
    def forward(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(GPT, "forward", forward)
    with pytest.raises(UserError) as error:
        train_gpt2.main(train_args(corpus, tmp_path, "--seq_len=256"))
    assert str(error.value) == ("CUDA out of memory at --device_batch_size=1 --seq_len=256: try --seq_len=128 "
                                "--batch_size=2 (twice as many sequences, half as long: about the same tokens per "
                                "step)")


# --- graceful stop ------------------------------------------------------------------------------------------

def stop_after_first_step(cmd, send) -> tuple[int, str]:
    """Start `cmd`, call send(process) once it logs its first step, and return (status, output)."""
    proc = subprocess.Popen(as_from_a_terminal(cmd), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=child_env(), start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step:1/"):
                send(proc)
                break
        rest, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines) + rest


def assert_stopped_with_checkpoint(status: int, text: str, log_dir: Path) -> None:
    assert status == 0, text
    assert "Traceback" not in text, text
    match = re.search(r"^stopped by a signal after step (\d+); resume with --resume (\S+)$", text, re.M)
    assert match, text
    step, path = int(match.group(1)), Path(match.group(2))
    assert re.search(rf"^step:{step}/\d+ train_loss:", text, re.M), text  # the last step's loss is logged too
    (run_dir,) = log_dir.iterdir()
    assert checkpoint.list_checkpoints(run_dir) == [path] == [checkpoint.checkpoint_path(run_dir, step)]
    assert not list(run_dir.glob(".*tmp*"))
    assert checkpoint.load_checkpoint(path)["step"] == step


def children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


@pytest.mark.parametrize("how", [pytest.param("SIGTERM to bash run.sh", marks=NO_GPU), "SIGINT to train_gpt2.py"])
def test_signal_stops_cleanly_with_a_checkpoint(how, corpus, tmp_path):
    """A scheduler's SIGTERM or a Ctrl-C ends the run at the next log step with a checkpoint and status 0.
    run.sh execs python, so the signal reaches train_gpt2 itself."""
    args = train_args(corpus, tmp_path, *LONG)
    cmd, sig = ((["bash", "run.sh", *args], signal.SIGTERM) if "run.sh" in how
                else ([sys.executable, "train_gpt2.py", *args], signal.SIGINT))
    status, text = stop_after_first_step(cmd, lambda proc: proc.send_signal(sig))
    assert_stopped_with_checkpoint(status, text, tmp_path)


def test_sigterm_stops_both_torchrun_ranks_cleanly(corpus, tmp_path):
    """Both workers get SIGTERM (as from a scheduler); they decide together at the next log step, rank 0 writes
    the checkpoint, and torchrun's status 0 says that every rank exited cleanly."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt2.py",
           *train_args(corpus, tmp_path, *LONG, "--batch_size=2")]

    def terminate_workers(proc):
        workers = children(proc.pid)
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGTERM)

    status, text = stop_after_first_step(cmd, terminate_workers)
    assert "2 process(es) on cpu" in text
    assert_stopped_with_checkpoint(status, text, tmp_path)


# --- cases 21-22: the FineWeb downloader -------------------------------------------------------------------

@pytest.mark.parametrize("n, listed", [
    (2, "3 file(s) still missing in {out}: fineweb_val_000000.bin, fineweb_train_000001.bin, fineweb_train_000002.bin"),
    (103, "104 file(s) still missing in {out}: fineweb_val_000000.bin, fineweb_train_000001.bin, ..., "
          "fineweb_train_000103.bin"),
])
def test_21_downloader_offline_lists_the_missing_files(n, listed, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "fineweb_val_000000.bin").write_bytes(b"\0" * 10)  # a partial file counts as missing
    result = run([sys.executable, "data/cached_fineweb10B.py", str(n), "--out", str(out)], HF_HUB_OFFLINE="1",
                 HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"))
    assert_user_error(result, 2, f"{out / 'fineweb_val_000000.bin'} is incomplete: fetching it again",
                      "could not download from the hub dataset kjj0/fineweb10B-gpt2 (HF_HUB_OFFLINE is set)",
                      listed.format(out=out), f"run `python data/cached_fineweb10B.py {n}` again with network access",
                      f"or copy these files into {out}/")
    assert not list(out.glob("*.bin"))


def test_22_downloader_fetches_a_partial_file_again(tmp_path, hub, shard_bytes):
    endpoint, requests = hub
    out = tmp_path / "out"
    out.mkdir()
    for name, body in shard_bytes.items():
        (out / name).write_bytes(body)
    partial = out / "fineweb_train_000001.bin"
    partial.write_bytes(shard_bytes[partial.name][:-10])
    others = {k: v for k, v in snapshot(out).items() if k != partial.name}
    result = run([sys.executable, "data/cached_fineweb10B.py", "2", "--out", str(out)], HF_ENDPOINT=endpoint,
                 HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"))
    assert result.returncode == 0, output(result)
    assert f"{partial} is incomplete: fetching it again" in result.stderr and "Traceback" not in output(result)
    assert f"3 complete shards in {out}" in result.stdout
    assert partial.read_bytes() == shard_bytes[partial.name]
    assert {name for method, name in requests if method == "GET" and name.endswith(".bin")} == {partial.name}
    assert {k: v for k, v in snapshot(out).items() if k in others} == others


# --- cases 23-24: data.prepare -----------------------------------------------------------------------------

def test_23_prepare_skips_a_non_utf8_file_with_a_warning_and_a_count(tmp_path):
    """Documented choice (data/prepare.py): one mis-encoded file should not stop a large corpus, but it is
    never dropped silently: the warning names it and the summary counts it."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "good.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    (inputs / "latin1.txt").write_bytes("café crème brûlée ".encode("latin-1") * 20)
    before = snapshot(inputs)
    out = tmp_path / "out"
    result = run([sys.executable, "-m", "data.prepare", str(inputs), "--out", str(out), "--val_tokens=100",
                  "--workers=1"])
    assert result.returncode == 0, output(result)
    assert f"warning: skipping {inputs / 'latin1.txt'}: not UTF-8 text" in result.stderr
    assert "iconv" in result.stderr and "Traceback" not in output(result)
    assert "1 documents from 2 files (1 skipped: not UTF-8)" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["corpus_train_000001.bin", "corpus_val_000000.bin"]
    assert snapshot(inputs) == before


@pytest.mark.parametrize("kind", ["empty file", "empty folder"])
def test_24_prepare_of_an_empty_input(kind, tmp_path):
    if kind == "empty file":
        source = tmp_path / "empty.txt"
        source.write_text("")
    else:
        source = tmp_path / "empty"
        source.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    result = run([sys.executable, "-m", "data.prepare", str(source), "--out", str(out), "--workers=1"])
    assert_user_error(result, 2, f"no documents found in {source}", "give .txt/.md/.jsonl files with text in them")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # no shard, no staging folder left
