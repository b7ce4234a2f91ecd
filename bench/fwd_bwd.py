"""One forward+backward of the 124M model at seq_len 49,152, compiled, with FlexAttention (GPU only).

    python -m bench.fwd_bwd --data /tmp/proxy --out bench/results/fwd_bwd.json

Times the model alone (no optimizer, no data loading): median of REPEATS after WARMUP iterations, CUDA events.
"""
import argparse
import glob
import json
import statistics
import time
from pathlib import Path

import torch

from bench.timing import WARMUP, cuda_times_ms
from data.shard import read_shard
from model.gpt import GPT, GPTConfig



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq_len", type=int, default=48 * 1024)
    ap.add_argument("--window", type=int, default=896)
    args = ap.parse_args()

    device = torch.device("cuda")
    tokens = read_shard(sorted(glob.glob(f"{args.data}/fineweb_train_*.bin"))[0])[: args.seq_len + 1]
    tokens = torch.from_numpy(tokens.astype("int64")).to(device)
    inputs, targets = tokens[:-1].view(1, -1).int(), tokens[1:].view(1, -1)
    window = torch.tensor(args.window, device=device)

    torch.manual_seed(0)
    model = GPT(GPTConfig()).to(device)
    model.init_weights()
    t0 = time.perf_counter()
    model.compile_regions()
    for _ in range(WARMUP):
        model(inputs, targets, window).backward()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0

    torch.cuda.reset_peak_memory_stats()
    times = cuda_times_ms(lambda: model(inputs, targets, window).backward(), warmup=0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seq_len": args.seq_len,
              "window": args.window, "compile_and_warmup_s": round(compile_s, 1),
              "fwd_bwd_ms_median": round(statistics.median(times), 2), "fwd_bwd_ms_min": round(min(times), 2),
              "fwd_bwd_ms_max": round(max(times), 2),
              "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
