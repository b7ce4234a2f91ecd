"""How far each way of computing the record model's gradients is from fp32, parameter by parameter, over 21 steps.

    python -m dev.gradient_precision --out gradients.pt      # one GPU, about two minutes

tests/test_fast.py's record comparison with three arms against the plain GPT in fp32, all at the same weights each
step (the fp32 model's MuonAdam updates, copied to every arm): FastGPT compiled with kernels and FP8 ("fast8"),
the same without FP8 ("fast16"), and the plain GPT in bf16 ("bf16"). Prints each step's losses and each arm's
lowest and median gradient cosine; saves every cosine and every scalar parameter's gradients (a list of per-step
dicts, torch.save) for the scalar errors the test asserts (error over the RMS of the fp32 gradient across steps).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_fast as tf  # noqa: E402
from model.fast.gpt import FastGPT  # noqa: E402
from model.gpt import GPT  # noqa: E402
from optim.optimizer import MuonAdam  # noqa: E402
from runtime.config import TrainConfig, group_learning_rates  # noqa: E402

STEPS = 21
SMALL = 64  # parameters with at most this many elements have their gradients saved


def initial_state(device) -> dict:
    """test_fast's initial weights: init_weights, then non-zero output projections and head."""
    torch.manual_seed(0)
    model = FastGPT(tf.RECORD).to(device)
    model.init_weights()
    with torch.no_grad():
        for block in model.blocks:
            for part in (block.attn, block.mlp):
                if part is not None:
                    part.proj_w.normal_(std=0.02)
        model.head.weight.normal_(std=0.02)
    return {k: v.clone() for k, v in model.state_dict().items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="where to torch.save the per-step cosines and scalar gradients")
    args = ap.parse_args()
    device = torch.device("cuda")
    state = initial_state(device)
    arms = {}
    for name, fp8 in (("fast8", True), ("fast16", False)):
        model = FastGPT(tf.RECORD).to(device)
        model.load_state_dict(state)
        model.configure(device, fp8=fp8)
        model.compile_regions()
        arms[name] = model
    torch._dynamo.config.recompile_limit = 512  # two FastGPTs share the compiled functions
    for name, dtype in (("bf16", None), ("ref", torch.float32)):
        model = GPT(tf.RECORD).to(device).configure(device)
        model.load_state_dict(state)
        if dtype is not None:
            model.compute_dtype = dtype
        tf.checkpointed_blocks(model)
        arms[name] = model
    ref = arms.pop("ref")
    window = torch.tensor(tf.RECORD_WINDOW, device=device)
    batches = tf.record_batches(STEPS)
    for name in ("fast8", "fast16"):  # the FP8 scales' first history, as in the test
        arms[name](*batches[0], window).backward()
        arms[name].zero_grad(set_to_none=True)
    optimizer = MuonAdam(ref.param_groups(), lr=group_learning_rates(TrainConfig()), normuon_beta2=0.95)
    ref_params = dict(ref.named_parameters())
    log = []
    for step, (inputs, targets) in enumerate(batches):
        rec = {"step": step, "loss": {}, "cos": {}, "small": {}}
        grads = {}
        for name, model in list(arms.items()) + [("ref", ref)]:
            fast = name.startswith("fast")
            loss = model(inputs, targets, window) if fast else tf.reference_loss(model, inputs, targets, window)
            loss.backward()
            rec["loss"][name] = loss.item()
            grads[name] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for name in arms:
            rec["cos"][name] = tf.cosines(grads[name], grads["ref"])
        for n, g in grads["ref"].items():
            if g.numel() <= SMALL:
                rec["small"][n] = {a: grads[a][n].double().cpu() for a in grads}
        log.append(rec)
        line = f"step {step} loss " + " ".join(f"{a} {v:.6f}" for a, v in rec["loss"].items())
        for name in arms:
            c = rec["cos"][name]
            worst = min(c, key=c.get)
            line += f" | {name} min {c[worst]:.4f} ({worst}) median {sorted(c.values())[len(c) // 2]:.5f}"
        print(line, flush=True)
        optimizer.step(1.0, 0.95)
        optimizer.zero_grad()
        with torch.no_grad():
            for model in arms.values():
                model.zero_grad(set_to_none=True)
                for n, p in model.named_parameters():
                    p.copy_(ref_params[n])
    torch.save(log, args.out)


if __name__ == "__main__":
    main()
