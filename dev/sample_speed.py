"""sample.py's decoding speed on the record model, with each attention (--attention_forward), and how much of its
GPU time attention takes.

    python -m dev.sample_speed --out sample_speed.json       # one GPU; both attentions
    python -m dev.sample_speed --checkpoint RUN_DIR --prompt_shard DIR/fineweb_val_000000.bin --out X.json

The record model with random weights (non-zero projections and head), built as load_model builds it, and a prompt
of 32 <|endoftext|> tokens; or a trained checkpoint and the first --prompt_tokens tokens of a shard. sample.py's
generate, 256 new tokens, 1 and 8 samples, for bf16 (SDPA) and int8 (INT8/FP8 in the layers sample.py's rule keeps,
chosen on the prompt before timing): tokens/s (the second of two calls) and, for bf16, the share of CUDA kernel time
in attention kernels (a third call under torch.profiler). The share bounds what a faster attention could save in
sampling; int8's torch ops carry no attention kernel's name, so it has none. With both attentions, also how many of
the 256 greedy tokens of one row the two give alike before they first differ.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import sample  # noqa: E402
import test_fast as tf  # noqa: E402
from data.shard import read_shard  # noqa: E402
from dev.gradient_precision import initial_state  # noqa: E402
from runtime.backend import build_model  # noqa: E402
from runtime.checkpoint import load_model  # noqa: E402
from runtime.config import ATTENTION_FORWARDS  # noqa: E402

ATTENTION_KERNELS = ("flash", "attention", "fmha", "sdpa", "efficient")


def attention_share(prof) -> float:
    total = attention = 0.0
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total += event.device_time_total
            if any(k in event.key.lower() for k in ATTENTION_KERNELS):
                attention += event.device_time_total
    return attention / max(total, 1e-9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--attention_forward", nargs="+", choices=ATTENTION_FORWARDS, default=list(ATTENTION_FORWARDS),
                    help="the attentions to measure, one after the other on this GPU")
    ap.add_argument("--checkpoint", help="a trained checkpoint or run folder instead of random weights")
    ap.add_argument("--prompt_shard", help="with --checkpoint: a .bin shard whose first tokens are the prompt")
    ap.add_argument("--prompt_tokens", type=int, default=512)
    args = ap.parse_args()
    device = torch.device("cuda")
    if args.checkpoint:
        model, config = load_model(args.checkpoint, device)
        window, max_context = config["window_max_tokens"], config["seq_len"]
        prompt = [int(t) for t in read_shard(args.prompt_shard)[:args.prompt_tokens]]
    else:
        model, _ = build_model(tf.RECORD, device, "auto", fp8=False)
        model.load_state_dict(initial_state(device))
        model.eval()
        window, max_context, prompt = tf.RECORD_WINDOW, tf.RECORD_T, [50256] * 32
    result, greedy = {}, {}
    for forward in args.attention_forward:
        int8_layers, result[forward] = set(), {}
        if forward == "int8":
            int8_layers, line = sample.choose_int8_layers(model, prompt, window, max_context)
            result[forward]["layers"] = line
            print(line, flush=True)
        for samples in (1, 8):
            kwargs = dict(max_new_tokens=256, temperature=1.0, top_k=0, num_samples=samples, window=window,
                          max_context=max_context, generator=torch.Generator(device).manual_seed(0),
                          int8_layers=int8_layers)
            sample.generate(model, prompt, **kwargs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rows = sample.generate(model, prompt, **kwargs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            new = sum(len(r) for r in rows)
            row = {"new_tokens": new, "seconds": round(seconds, 3), "tokens_per_s": round(new / seconds, 1)}
            if forward == "bf16":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    sample.generate(model, prompt, **kwargs)
                row["attention_share_of_cuda_time"] = round(attention_share(prof), 4)
            result[forward][samples] = row
            print(forward, samples, row, flush=True)
        greedy[forward] = sample.generate(model, prompt, **(kwargs | dict(temperature=0, num_samples=1)))[0]
    if len(greedy) == 2:
        a, b = greedy.values()
        result["greedy_tokens_alike"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print("greedy tokens alike before the first difference:", result["greedy_tokens_alike"], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
