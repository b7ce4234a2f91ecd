"""Does one micro-batch's forward and backward repeat bit for bit? Which parameters' gradients differ between repeats?

    python -m dev.determinism --out determinism.json
    python -m dev.determinism --device cpu          # the smoke preset's model, the CPU path
    python -m dev.determinism --digests a.json; python -m dev.determinism --digests b.json --against a.json

The model of a run as train_gpt2.py builds it (the record config on CUDA, compiled, FP8 head and forward; without
its static launch of our Triton kernels, which changes how they launch, not what they compute), with the
zero-initialised weights drawn at random like the others, since a zero projection leaves most gradients zero. One
micro-batch of random tokens (a document start every DOC_EVERY), the same inputs each repeat, gradients from None.
Each repeat is compared with the first: the loss, then each parameter's gradient, element by element.

Repeats in one process can agree where two processes do not: inductor times candidates at a process's first run
and may pick differently in another (the model's REPEATABLE_COMPILE options turn those choices off). --digests
writes a SHA-256 of each weight before the first repeat, of its loss and gradients, and of the buffers after the
last; --against compares them with another process's file and names those that differ (weights first: two
processes that start from different weights prove nothing about the kernels).

Why it matters: when two runs of one seed differ, a difference between two configurations smaller than theirs is
not resolved by one run of each. The parameters whose gradients differ point to the kernel that made the first
difference (atomic adds in no fixed order are the usual cause).
"""
import argparse
import hashlib
import json
import struct
from pathlib import Path

import torch
from torch import Tensor

from runtime.backend import build_model
from runtime.config import PRESETS, TrainConfig, model_config, parse_config

DOC_EVERY = 937  # tokens between document starts in the random micro-batch: about 52 documents in 49,152 tokens
WINDOW = 896  # attention window in tokens: the throughput benchmark's fixed one (../shared/BENCHMARKS.md)


def repeats(model, inputs, targets, window, count: int) -> list[tuple[float, dict]]:
    """(loss, {name: gradient}) of `count` forward+backward passes over the same micro-batch, each from the same
    buffers: a first pass gives the MLPs' FP8 backward the history its scales read (grad_amax), which each pass
    records anew, so every repeat starts from the values the first pass left."""
    model(inputs, targets, window).backward()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    results = []
    for _ in range(count):
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        loss = model(inputs, targets, window)
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return results


def differences(results: list[tuple[float, dict]]) -> list[dict]:
    """For each repeat after the first: whether its loss equals the first's, and the gradients that do not (the
    count of differing elements, the largest difference, NaN where one repeat has a NaN and the other a number, and
    the largest gradient value of the first repeat)."""
    first_loss, first = results[0]
    report = []
    for loss, grads in results[1:]:
        if grads.keys() != first.keys():
            raise RuntimeError(f"the repeats' parameters with a gradient differ: {sorted(grads.keys() ^ first.keys())}")
        differing = []
        for name, want in first.items():
            got = grads[name]
            unequal = (got != want) & ~(got.isnan() & want.isnan())  # NaN against NaN counts as equal
            if unequal.any():
                gap = (got[unequal].double() - want[unequal].double()).abs()  # NaN where only one is NaN
                differing.append({"parameter": name, "elements": int(unequal.sum()), "of": want.numel(),
                                  "max_abs_diff": gap.max().item(), "max_abs_grad": want.abs().max().item()})
        report.append({"loss": loss, "loss_equal": loss == first_loss, "gradients_differing": differing})
    return report


def digests(weights: dict[str, Tensor], loss: float, grads: dict[str, Tensor],
            buffers: dict[str, Tensor]) -> dict[str, str]:
    """SHA-256 of each tensor's bytes, named "weight NAME" (before a pass), "loss", "gradient NAME" and "buffer NAME"
    (after it), in that order."""
    def sha(t: Tensor) -> str:
        return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    loss_sha = hashlib.sha256(struct.pack("<d", loss)).hexdigest()
    return ({f"weight {n}": sha(t) for n, t in weights.items()} | {"loss": loss_sha}
            | {f"gradient {n}": sha(t) for n, t in grads.items()} | {f"buffer {n}": sha(t) for n, t in buffers.items()})


def digests_differing(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """The names whose digests differ between two processes' files, in mine's order."""
    if mine.keys() != theirs.keys():
        raise RuntimeError(f"the two files name different tensors: {sorted(mine.keys() ^ theirs.keys())}; compare "
                           f"runs of one model config")
    return [name for name in mine if mine[name] != theirs[name]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path, help="write the report as JSON here too")
    parser.add_argument("--digests", type=Path, help="write the first repeat's digests here (JSON), for --against")
    parser.add_argument("--against", type=Path, help="another process's --digests file to compare this one's with")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error(f"--repeats={args.repeats}: at least 2, to compare one repeat with another")
    if args.against and not args.against.is_file():
        parser.error(f"--against {args.against}: no such file; write it first with --digests {args.against}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device that torch can use; pass --device cpu for the CPU path")
    device = torch.device(args.device)
    cfg = parse_config(TrainConfig, [] if cuda else ["--preset=smoke"], PRESETS)
    mcfg = model_config(cfg)
    torch.manual_seed(0)
    model, _ = build_model(mcfg, device, cfg.kernels, cfg.fp8)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().max() == 0:
                p.normal_(0, 0.02)
    if cuda:
        model.compile_regions()
    g = torch.Generator(device=device).manual_seed(1)
    tokens = torch.randint(0, mcfg.vocab_size, (1, cfg.seq_len + 1), device=device, generator=g)
    tokens[0, ::DOC_EVERY] = mcfg.bos_id
    inputs, targets = tokens[:, :-1].int(), tokens[:, 1:].long()
    window = torch.tensor(WINDOW, dtype=torch.int64, device=device)

    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    results = repeats(model, inputs, targets, window, args.repeats)
    # the buffers as the last repeat left them: the first's too where the repeats agree (each starts from the same)
    mine = digests(weights, *results[0], dict(model.named_buffers()))
    report = differences(results)
    parameters = len(list(model.parameters()))
    for i, r in enumerate(report, start=1):
        print(f"repeat {i} against repeat 0: loss {'equal' if r['loss_equal'] else 'DIFFERS'} ({r['loss']!r}), "
              f"{len(r['gradients_differing'])} of {parameters} gradients differ")
        for d in r["gradients_differing"]:
            print(f"    {d['parameter']}: {d['elements']} of {d['of']} elements, largest difference "
                  f"{d['max_abs_diff']:.3e}, largest gradient {d['max_abs_grad']:.3e}")
    against = None
    if args.against:
        differing = digests_differing(mine, json.loads(args.against.read_text()))
        against = {"file": str(args.against), "of": len(mine), "differing": differing}
        print(f"against {args.against}: {len(differing)} of {len(mine)} digests differ" + "".join(
            f"\n    {name}" for name in differing[:20]) + ("\n    ..." if len(differing) > 20 else ""))
    if args.digests:
        args.digests.write_text(json.dumps(mine, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                        "torch": torch.__version__, "seq_len": cfg.seq_len,
                                        "window_tokens": WINDOW, "repeats": report, "against": against}, indent=2))


if __name__ == "__main__":
    main()
