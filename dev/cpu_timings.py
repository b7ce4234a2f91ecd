"""Two CPU timings behind choices in the code, for a machine without a GPU (the development machine has 2 cores):

- the LM head: one forward + backward of the smoke model's head (512 tokens, width 64, V = 50,304) through the
  fused path (HeadLoss, the torch reference ops on the CPU) and through plain F.cross_entropy;
- checkpoints (runtime/checkpoint.py): seconds per GiB of the CRC-32 check (zipfile.testzip) and of torch.load, on
  a checkpoint read from the page cache.

    python -m dev.cpu_timings --out cpu_timings.json

Each figure is the median of REPEATS runs after one untimed run (first-call allocations, the page cache).
"""
import argparse
import json
import os
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from runtime.checkpoint import save_checkpoint
from runtime.config import PRESETS, TrainConfig

REPEATS = 5
CHECKPOINT_MIB = 512  # large enough that fixed costs (opening the zip, unpickling) stay below 1% of each timing


def median_s(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times), 3)


def head_seconds(fused: bool) -> float:
    """One forward + backward of the smoke preset's head on one device batch of random activations."""
    smoke = TrainConfig(**PRESETS["smoke"])
    torch.manual_seed(0)
    if fused:  # model/fast's head; its import needs triton
        from model.fast.head import FastHead as Head
    else:
        from model.gpt import Head
    head = Head(smoke.model_dim, smoke.vocab_size, smoke.logit_softcap)
    torch.nn.init.normal_(head.weight, std=0.02)
    x = torch.randn(smoke.batch_size, smoke.seq_len, smoke.model_dim, requires_grad=True)
    targets = torch.randint(0, smoke.vocab_size, (smoke.batch_size, smoke.seq_len))
    return median_s(lambda: head(x, targets, "mean").backward())


def checkpoint_seconds_per_gib(folder: Path) -> dict:
    path = folder / "ckpt_000001.pt"
    save_checkpoint(path, {"weights": torch.randn(CHECKPOINT_MIB * 2**20 // 4)})
    gib = path.stat().st_size / 2**30

    def crc():
        with zipfile.ZipFile(path) as archive:
            assert archive.testzip() is None

    return {"file_gib": round(gib, 3),
            "crc_check_s_per_gib": round(median_s(crc) / gib, 3),
            "torch_load_s_per_gib": round(median_s(lambda: torch.load(path, map_location="cpu")) / gib, 3)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = checkpoint_seconds_per_gib(Path(folder))
    result = {"cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "head_fwd_bwd_s": {"fused": head_seconds(True), "cross_entropy": head_seconds(False)},
              "checkpoint": checkpoint}
    print(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
