"""How much INT8/FP8 attention (--attention_forward=int8) changes and speeds up a trained model's forward passes.

    python -m dev.int8_attention --checkpoint logs/RUN --val_files '/tmp/proxy/fineweb_val_*.bin' --out int8.json

On one GPU, from one checkpoint: (1) each layer's attention output on the first validation batch, bf16 FlexAttention
and INT8/FP8 each against FlexAttention on fp32 inputs, max and mean absolute error per head; (2) one attention
call at the validation shape, FlexAttention against INT8/FP8, ms (median of 20, CUDA events); (3) the validation
loss and its pass's seconds (the second of two passes, the first compiles), bf16 and then INT8/FP8 with the per-layer
rule; (4) HellaSwag accuracy on a local file each way.
"""
import argparse
import json
import statistics
import time

import torch

from data.loader import ValLoader
from evals import hellaswag
from evals.validation import choose_int8_layers, validation_loss
from model.attention import attend
from model.fast.attention_kernels import Int8Mask
from model.fast.blocks import FastAttention
from runtime import dist
from runtime.checkpoint import load_model
from runtime.config import TrainConfig, derive


def gpu_ms(fn, repeats: int = 20) -> float:
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[3:])


def layer_errors(model, inputs_BT, window) -> tuple[list[dict], dict]:
    """Per layer and head, the errors of bf16 and INT8/FP8 attention against fp32 FlexAttention; and the first
    long-window layer's q, k, v and mask, for timing."""
    rows, kept = [], {}
    original = FastAttention.attend_and_project

    def spy(self, q, k, v, gate_in, mask):
        flex = mask.flex
        fp32 = attend(*(x.float().transpose(1, 2) for x in (q, k, v)), flex, self.scale).transpose(1, 2)
        bf16 = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), flex, self.scale).transpose(1, 2)
        int8 = mask.attend(q, k, v, self.scale)
        row = {"layer": len(rows)}
        for name, y in (("bf16", bf16), ("int8", int8)):
            err = (y.float() - fp32).abs()
            row[f"{name}_max_by_head"] = [round(x, 5) for x in err.amax(dim=(0, 1, 3)).tolist()]
            row[f"{name}_mean_by_head"] = [round(x, 6) for x in err.mean(dim=(0, 1, 3)).tolist()]
            row[f"{name}_rel_l1"] = round(float(err.sum() / fp32.abs().sum()), 5)
        rows.append(row)
        if "q" not in kept and int(mask.blocks) > 1:
            kept.update(q=q, k=k, v=v, mask=mask, scale=self.scale)
        return self.gate_and_project(bf16, gate_in)

    FastAttention.attend_and_project = spy
    try:
        model.use_int8_attention([True] * len(model.attentions()))  # so that the masks are Int8Masks
        with torch.no_grad():
            model.hidden_states(inputs_BT, window)
    finally:
        FastAttention.attend_and_project = original
        model.use_int8_attention([False] * len(model.attentions()))
    return rows, kept


def timed_validation(model, loader, window, rt) -> tuple[float, float]:
    """(val loss, seconds of the second of two passes)."""
    validation_loss(model, loader, window, rt)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = validation_loss(model, loader, window, rt)
    return loss, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--val_files", required=True)
    ap.add_argument("--hellaswag_file", default="tests/data/hellaswag_tiny.jsonl")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rt = dist.setup("cuda")
    model, saved = load_model(args.checkpoint, rt.device, attention_forward="int8")
    cfg = TrainConfig(**saved)
    derived = derive(cfg, 1)
    loader = ValLoader(args.val_files, val_tokens=cfg.val_tokens, seq_len=cfg.seq_len,
                       device_batch_size=derived.device_batch_size, rank=0, world_size=1, device=rt.device,
                       context=derived.val_context)
    window = torch.tensor(cfg.window_max_tokens, dtype=torch.int64, device=rt.device)
    inputs_BT, _ = next(iter(loader))
    result = {"checkpoint": args.checkpoint, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "val_shape": list(inputs_BT.shape), "window": cfg.window_max_tokens}

    rows, kept = layer_errors(model, inputs_BT, window)
    result["layers"] = rows
    q, k, v, mask, scale = (kept[n] for n in ("q", "k", "v", "mask", "scale"))
    result["attention_ms"] = {
        "flex_bf16": gpu_ms(lambda: attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask.flex, scale)),
        "int8_fp8": gpu_ms(lambda: mask.attend(q, k, v, scale)),
        "int8_fp8_compiled": gpu_ms(torch.compile(lambda: mask.attend(q, k, v, scale))),
    }
    print(json.dumps(result["attention_ms"]), flush=True)

    model.compile_regions()
    bf16_loss, bf16_s = timed_validation(model, loader, window, rt)
    note = choose_int8_layers(model, inputs_BT, window, rt)
    int8_loss, int8_s = timed_validation(model, loader, window, rt)
    result["validation"] = {"bf16": {"loss": bf16_loss, "seconds": bf16_s},
                            "int8": {"loss": int8_loss, "seconds": int8_s, "rule": note},
                            "difference": int8_loss - bf16_loss}
    print(json.dumps(result["validation"]), flush=True)

    examples = hellaswag.select_examples(args.hellaswag_file, None)
    model.use_int8_attention([False] * len(model.attentions()))
    result["hellaswag"] = {"file": args.hellaswag_file, "examples": len(examples),
                           "bf16": hellaswag.count_correct(model, rt, examples),
                           "int8": hellaswag.count_correct(model, rt, examples, int8_attention=True)}
    print(json.dumps(result["hellaswag"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
