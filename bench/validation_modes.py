"""One validation micro-batch of the compiled record model (GPU only) under three modes, after one training step:
the time per call, the peak memory, and the first call's seconds (its compile, where the mode needs new graphs).

    python -m bench.validation_modes

- grad: autograd on throughout: the training graphs, and the head's graph for the sum;
- blocks_grad: the blocks with autograd on, the head under no_grad (train_gpt2.validation_loss_sum);
- no_grad: inference graphs for every region, compiled at the first call.
One 49,152-token sequence of random tokens with a BOS every 997 tokens, window 896, the FP8 head; the modes run in
the order of MODES, so each mode's second pass shows its time with nothing left to compile.
"""
import statistics
import time

import torch

MODES = ("grad", "blocks_grad", "no_grad", "grad", "blocks_grad")
CALLS = 20


def main():
    from model.gpt import GPT
    from runtime import dist
    from runtime.run import use_static_launcher
    from runtime.config import TrainConfig, model_config
    from train_gpt2 import validation_loss_sum

    torch.manual_seed(0)
    use_static_launcher()
    model = GPT(model_config(TrainConfig())).cuda()
    model.init_weights()
    dist.use_device_paths(model, torch.device("cuda"), fp8_head=True)
    model.compile_regions()
    T = 49152
    tokens = torch.randint(0, 50256, (1, T + 1), device="cuda")
    tokens[0, ::997] = 50256
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    window = torch.tensor(896, device="cuda")
    model(inputs, targets, window).backward()  # the training graphs
    model.zero_grad(set_to_none=True)

    def validation_batch(mode: str) -> torch.Tensor:
        if mode == "blocks_grad":
            return validation_loss_sum(model, inputs, targets, window, compiled=True)
        with torch.set_grad_enabled(mode == "grad"):
            return model(inputs, targets, window, reduction="sum").detach()

    for mode in MODES:
        t0 = time.perf_counter()
        validation_batch(mode)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(CALLS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            validation_batch(mode)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        print(f"{mode}: first call {first:.1f} s, ms per micro-batch median {statistics.median(times):.2f} "
              f"(min {min(times):.2f}), peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
