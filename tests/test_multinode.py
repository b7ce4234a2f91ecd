"""Two "nodes" of one process each, joined through torchrun's c10d rendezvous on localhost, train like one
process with the same global batch (there by gradient accumulation, here by two ranks)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# 4 steps of the smoke model, validated at steps 0, 2 and 4 on 2 sequences; 2 sequences per step, 1 per micro-step
TINY = ["--preset=smoke", "--num_iterations=4", "--val_loss_every=2", "--val_tokens=256", "--warmup_steps=0",
        "--batch_size=2", "--device_batch_size=1", "--device=cpu"]
TIMEOUT_S = 120  # a hung rendezvous fails the test instead of the CI job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str]) -> subprocess.Popen:
    # one thread per process: three trainers share CI's two cores
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> None:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]


def val_losses(log_dir: Path) -> list[tuple[int, float]]:
    (metrics,) = log_dir.glob("*/metrics.jsonl")  # rank 0 alone writes, into one run folder
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]


def test_two_nodes_through_c10d_match_one_process(tmp_path):
    port = free_port()
    # `python -m torch.distributed.run` is the `torchrun` command, without relying on PATH
    nodes = [start(["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test", "train_gpt2.py", *TINY,
                    f"--log_dir={tmp_path / 'two'}"]) for _ in range(2)]
    single = start(["train_gpt2.py", *TINY, f"--log_dir={tmp_path / 'one'}"])
    for proc in (*nodes, single):
        finish(proc)
    two, one = val_losses(tmp_path / "two"), val_losses(tmp_path / "one")
    assert [step for step, _ in one] == [step for step, _ in two] == [0, 2, 4]
    assert one[-1][1] < one[0][1] - 0.1  # the steps trained, so equal losses say something
    # 1e-4 relative: the same math in a different order (two ranks' gradients averaged vs accumulated)
    for (_, loss_one), (_, loss_two) in zip(one, two):
        assert loss_two == pytest.approx(loss_one, rel=1e-4)
