"""README.md's CPU commands run as written, so the README cannot drift from the code.

The blocks of the sections in RUN run in order in one copy of the repository, `python` being this interpreter. A
training command gets a few flags appended that shorten it (later flags win): 32 steps, so that the checkpoint the
README resumes from (step 30) is kept; the HellaSwag evaluation reads a 5-example file instead of downloading the
dataset. Nothing else of a command changes. The first section's commands (run.sh, the test suite)
are CI's own (.ci/run); the GPU-only sections (the record run, several nodes, Docker, benchmarks) need what CI lacks.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ("Your own corpus", "Resume, sample and evaluate")  # README sections whose bash blocks run here, in order
# flags appended to the commands that name the program: fewer steps and tokens (a resume continues its run: only
# flags that keep its math), and HellaSwag's file from the tests
SHORTER = {"--resume": "--warmup_steps=0 --val_loss_every=0",
           "--preset tiny": "--num_iterations=2 --batch_size=2 --val_loss_every=0 --val_tokens=4096 --warmup_steps=0",
           "train_gpt2.py": "--num_iterations=32 --val_loss_every=16 --val_tokens=4096 --warmup_steps=0",
           "evals.hellaswag": f"--hellaswag_file={ROOT / 'tests' / 'data' / 'hellaswag_tiny.jsonl'}",
           "sample.py": "--max_new_tokens=8"}


def readme_blocks(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", body, re.S)


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def shortened(command: str) -> str:
    for program, flags in SHORTER.items():  # the first that the command names
        if program in command:
            return f"{command} {flags}"
    return command


def test_readme_names_the_sections_it_runs():
    for section in RUN:
        assert readme_blocks(section), f"README.md has no bash block under '## {section}'"


@pytest.mark.slow
def test_the_readmes_cpu_commands_run_as_written(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", ".venv", "logs", "__pycache__", ".bench",
                                                              ".oldmain", "fineweb10B", "mine", "shards"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a script, not a link: a link to a venv's python would run outside the venv
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    for section in RUN:
        for block in readme_blocks(section):
            for command in commands(block):
                result = subprocess.run(shortened(command), shell=True, cwd=repo, env=env, capture_output=True,
                                        text=True, timeout=300)
                assert result.returncode == 0, f"$ {command}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
