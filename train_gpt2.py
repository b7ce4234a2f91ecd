"""Train a GPT-2-class model as fast as the hardware allows: the story of one run, top to bottom.

    torchrun --standalone --nproc_per_node=8 train_gpt2.py            # the 124M speedrun (record config)
    python train_gpt2.py --preset smoke                                # tiny CPU run on the shipped sample

1. config  2. data  3. run folder  4. model and optimizer  5. compile warm-up, then restore
6. resume  7. the training loop  8. the end of the run
"""
import copy
import dataclasses
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

from data.loader import TrainLoader, ValLoader
from data.prepare import ensure_sample_shards
from data.shard import FINEWEB_SHARD_TOKENS, VOCAB_SIZE
from model.gpt import GPT, GPTConfig, receptive_field
from model.head import IGNORE_INDEX
from optim.muon import check_method
from optim.optimizer import MuonAdam
from optim.schedule import attention_window, lr_multiplier, muon_momentum
from runtime import checkpoint, dist
from runtime.bytecode import bytecode_note
from runtime.cli import parse_config
from runtime.errors import UserError, exit_on_user_error
from runtime.logger import RunLog
from runtime.run import StopRequest, all_finite, check_disk_space, make_run_dir, profiled, use_static_launcher


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run. The defaults are the 124M speedrun on FineWeb: modded-nanogpt record #28, with NorMuon
    in Muon's place as in the records after it (bench/results: a lower loss at equal steps, no cost per step)."""
    preset: str = "d12"  # named overrides applied before the flags: d12 (default), short, smoke, d24, d36, d48
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of training shards; "sample" = data/sample
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"  # glob of validation shards; "sample" = data/sample
    val_tokens: int = 10_485_760  # tokens per validation, fixed by the speedrun so runs are comparable
    # -1 = the model's receptive field at window_max_tokens in whole blocks (record: 3 x 1,664 + 8 x 768 + 127 =
    # 11,263 -> 11,264), at most half a sequence; 0 = consecutive cut sequences (the runs in bench/results before this
    # option: the tokens after a cut lose their document's beginning). Attention windows count whole blocks of each
    # sequence, so only a multiple of 128 keeps the sequences' blocks on the unbroken stream's
    val_context: int = -1  # unscored tokens each validation sequence repeats, so every token sees its whole context
    seq_len: int = 48 * 1024  # tokens per packed sequence, a multiple of 128 (record #28)
    batch_size: int = 8  # sequences per optimizer step over all GPUs: 8 x 48K = 393,216 tokens (record #28)
    device_batch_size: int = 1  # sequences per GPU per micro-step; lower it (or seq_len) when memory is short
    align_to_bos: bool = True  # start each sequence at a document start (record #28's aligned batches)
    cycle_data: bool = False  # start over at the first shard when the shards run out, instead of stopping
    # model
    num_layers: int = 12  # GPT-2 small depth
    model_dim: int = 768  # GPT-2 small width
    num_heads: int = 6  # 6 heads of 128 (modded-nanogpt), not GPT-2's 12 of 64
    head_dim: int = 128  # per-head width
    vocab_size: int = 50304  # GPT-2's 50,257 padded to a multiple of 128 for fast matmuls
    num_value_embeds: int = 3  # value embeddings shared by the first and last 3 layers (record #28); 0 = off
    no_mlp_layers: str = ""  # comma-separated layers without an MLP, e.g. "0"; "" = none (record #28 keeps all)
    no_attention_layers: str = "auto"  # comma-separated layers without attention; "" = none; auto = 7 at 12 layers
    value_residual: bool = False  # mix layer 0's values into every later layer's (Zhou et al. 2024); not in #28
    attn_gate: bool = True  # per-head sigmoid gate on the attention output (record #28's sparse attention gate)
    smear: bool = False  # add a gated share of the previous token's embedding (modded-nanogpt after #28); not in #28
    backout: bool = False  # the head sees the last block's output less 0.2 (learned) of the mid-stream; not in #28
    logit_softcap: float = 15.0  # cap * tanh(logits / cap) (Gemma 2); 15 since modded-nanogpt's 2025-01-04 record
    fp8_head: bool = True  # LM head matmuls in FP8 on GPUs that have it (compute capability 8.9+), bf16 elsewhere
    # optimization
    num_iterations: int = 1750  # optimizer steps, about the length of the mid-2025 records
    cooldown_frac: float = 0.45  # last fraction of steps over which the learning rate decays (record #28)
    final_lr_frac: float = 0.1  # learning rate at the last step, as a fraction of the peak (record #28)
    lr_hidden: float = 0.05  # Muon learning rate for the hidden matrices (record #28)
    muon_method: str = "jordan"  # Muon's orthogonalisation: jordan (Muon's quintic) or polar_express (optim/muon.py)
    # NorMuon evens Muon's update out per neuron by a running mean square (optim/muon.py, normalize_neurons)
    normuon_beta2: float = 0.95  # NorMuon's averaging factor (Li et al. 2025: 0.95); 0 = plain Muon (record #28)
    lr_embed: float = 0.6  # Adam learning rate for token and value embeddings (record #28: 0.008 x lr_mul 75)
    lr_head: float = 0.008  # Adam learning rate for the LM head (record #28)
    lr_scalar: float = 0.04  # Adam learning rate for the mixing scalars (record #28)
    momentum_start: float = 0.85  # Muon momentum at step 0, warmed up linearly (the records' 0.85 -> 0.95)
    momentum_end: float = 0.95  # Muon momentum after the warm-up (Muon's default)
    momentum_warmup_steps: int = 300  # steps of the Muon momentum warm-up (the records' 300); -1 = every step
    window_min_tokens: int = 128  # attention window at step 0 (one block), grown linearly during training
    window_max_tokens: int = 1792  # attention window at the last step (record #28's long window)
    # auto is record #28's pattern; with layer 7 without attention, 3 layers attend over the long window
    long_window_layers: str = "auto"  # long-window layers (others: half); auto = every 4th from each end: 0,4,7,11
    # run
    val_loss_every: int = 125  # steps between validations (0 = only at the start and the end)
    log_every: int = 1  # steps between train-loss lines; each line syncs the GPU once
    checkpoint_every: int = 0  # steps between checkpoints (0 = none)
    resume: str = ""  # checkpoint file, or run folder, to continue from
    log_dir: str = "logs"  # each run writes log.txt, metrics.jsonl and checkpoints into a new folder here
    seed: int = 0  # seeds the initial weights
    compile: bool = True  # torch.compile the model's regions (GPT.compile_regions) and the optimizer's updates (1/0)
    # The first step compiles every training graph. With 3 warm-up steps, the timed steps of strictly cold runs on
    # the H200 compiled nothing (each as fast as after the records' 10), and the warm-up took 2.6 and 8.7 s less
    # (strictly cold) and 3.1 s less (warm caches) than with 10, in three same-machine pairs
    # (bench/results/README.md)
    warmup_steps: int = 3  # untimed steps that compile and warm up, then the initial state is restored
    profile_step: int = 0  # if > 0, trace this step with torch.profiler: kernel table + trace in the run folder
    device: str = "auto"  # auto, cuda or cpu
    hellaswag: bool = False  # run the HellaSwag evaluation at the end of training
    hellaswag_file: str = ""  # local hellaswag_val.jsonl for machines without network


PRESETS: dict[str, dict] = {
    # the record run: modded-nanogpt record #28 (2025-08-23), 124M, 393,216 tokens per step
    "d12": {},
    # a tiny model on the sample corpus that ships in the repo: trains in well under a minute on 2 CPU cores
    "smoke": dict(train_files="sample", val_files="sample", val_tokens=4_096, seq_len=256, batch_size=2,
                  device_batch_size=2, num_layers=2, model_dim=64, num_heads=2, head_dim=32, num_value_embeds=1,
                  num_iterations=40, cooldown_frac=0.3,
                  window_min_tokens=128, window_max_tokens=256, val_loss_every=20, log_every=5,
                  lr_embed=0.1, lr_head=0.01, warmup_steps=1, compile=False),
    # The one-GPU time-to-loss run of bench/results (issue 7): record #28's model, 540 steps of 3 sequences (80M
    # tokens), with the learning-rate cooldown over 90% of the steps and the momentum warm-up over all of them. At
    # 550 steps these two beat the record's 45% and 300 steps, each alone and together (val 1.021-1.023 against
    # 1.037 on the proxy corpus). Polar Express then lowered 550 steps' loss by 0.005, and 540 steps gave 1.018-1.023
    # in four seeds at 127.8-128.1 s on a 1,665 MHz machine, where 550 steps take 130.3 s (bench/results/README.md).
    # Every run there logged every 20th step: each logged step syncs the GPU once, and the margin is about 2 s.
    "short": dict(batch_size=3, num_iterations=540, cooldown_frac=0.9, momentum_warmup_steps=-1, val_loss_every=0,
                  log_every=20, muon_method="polar_express"),
    # The larger shapes keep every block complete (no_attention_layers="auto" cuts layer 7 at 12 layers only).
    # GPT-2 medium shape (350M; 24 layers, 1024 wide, 16 heads of 64); target val 2.92 = llm.c's GPT-2 medium
    "d24": dict(num_layers=24, model_dim=1024, num_heads=16, head_dim=64,
                num_iterations=5000, lr_hidden=0.03, lr_embed=0.3),
    # GPT-2 large shape (774M; 36 layers, 1280 wide, 20 heads of 64); lower LRs as width grows (muP intuition)
    "d36": dict(num_layers=36, model_dim=1280, num_heads=20, head_dim=64,
                seq_len=32 * 1024, batch_size=16, num_iterations=7000, lr_hidden=0.025, lr_embed=0.2),
    # GPT-2 XL shape (1.5B; 48 layers, 1600 wide, 25 heads of 64), as in the speedrun's 1.5B scale-up
    "d48": dict(num_layers=48, model_dim=1600, num_heads=25, head_dim=64,
                seq_len=16 * 1024, batch_size=32, num_iterations=10000, lr_hidden=0.02, lr_embed=0.15),
}

# Fields that never change the training math: a resumed run may differ in these and still be the same run.
# compile and fp8_head change only rounding (kernels, precision of the same math), so a run can move between GPUs.
# device_batch_size only regroups the same sequences into micro-steps (the loader's position is global), as a
# different number of GPUs does: the advice for memory errors, a smaller device batch, must not block a resume.
RESUME_MAY_CHANGE = {"resume", "log_dir", "checkpoint_every", "val_loss_every", "log_every", "compile", "fp8_head",
                     "warmup_steps", "device", "hellaswag", "hellaswag_file", "val_files", "val_tokens", "val_context",
                     "preset", "device_batch_size"}
BLOCK_SIZE = 128  # FlexAttention's tile: packed sequences are cut into blocks of this many tokens
RECORD_NO_ATTENTION_LAYERS = (7,)  # record #28 runs layer 7 of its 12 without attention
# BOS alignment skips from each sequence's start to the next document start: a margin of 10% covers skips of up to
# 4,900 tokens per 48K sequence (the proxy corpus's first 49,152 training tokens hold 28 documents, 1,755 tokens
# each on average: bench/results/attention_1xH200.json)
ALIGNMENT_MARGIN = 0.10
DIVERGED_EXIT = 3  # exit status when the loss or the weights become inf/nan (2 is a user error)


@dataclasses.dataclass(frozen=True)
class Derived:
    model: GPTConfig  # the model's config, from the flags
    grad_accum: int  # micro-steps per optimizer step on each rank
    tokens_per_step: int  # all ranks together
    val_context: int  # tokens each validation sequence repeats from the one before (data/loader.py, ValLoader)
    momentum_warmup_steps: int  # steps of Muon's momentum warm-up, -1 resolved to --num_iterations


def derive(cfg: TrainConfig, world_size: int) -> Derived:
    """The numbers that follow from the config; a ValueError names the flag when they do not fit."""
    per_micro_step = cfg.device_batch_size * world_size
    if cfg.device_batch_size <= 0 or cfg.batch_size <= 0 or cfg.batch_size % per_micro_step:
        per_rank, left_over = divmod(cfg.batch_size, world_size)
        device_batch = max(cfg.device_batch_size, 1)
        if per_rank > 0 and not left_over:  # the largest device batch up to the one asked for that fits
            fit = max(d for d in range(1, min(device_batch, per_rank) + 1) if per_rank % d == 0)
            fix = f"try --device_batch_size={fit} (it must divide {per_rank}, the sequences per process and step)"
        else:  # no device batch fits: the sequences do not split evenly over the processes
            step = device_batch * world_size
            fix = f"try --batch_size={max(cfg.batch_size // step, 1) * step}"
            if cfg.batch_size > 0 and cfg.batch_size % device_batch == 0:  # or fewer processes, the same run
                fewer = max(p for p in range(1, world_size) if cfg.batch_size // device_batch % p == 0)
                fix += (f", or keep --batch_size={cfg.batch_size} on {fewer} process{'es' * (fewer > 1)} "
                        f"(NPROC={fewer} bash run.sh, or torchrun --nproc_per_node={fewer})")
        raise ValueError(f"--batch_size={cfg.batch_size} must be a positive multiple of --device_batch_size="
                         f"{cfg.device_batch_size} x {world_size} processes = {per_micro_step}; {fix}")
    if cfg.seq_len <= 0 or cfg.seq_len % BLOCK_SIZE:
        fit = max(BLOCK_SIZE, cfg.seq_len // BLOCK_SIZE * BLOCK_SIZE)
        raise ValueError(f"--seq_len={cfg.seq_len} must be a multiple of the attention block size {BLOCK_SIZE}; "
                         f"try --seq_len={fit}")
    # the schedules check their own flags (ValueErrors naming them); one call each fails before any work
    lr_multiplier(0, cfg.num_iterations, cfg.cooldown_frac, cfg.final_lr_frac)
    if cfg.momentum_warmup_steps < -1:
        raise ValueError(f"--momentum_warmup_steps={cfg.momentum_warmup_steps} must be 0 or more (0 = no warm-up), "
                         f"or -1 for all of the run's steps")
    momentum_warmup = cfg.num_iterations if cfg.momentum_warmup_steps == -1 else cfg.momentum_warmup_steps
    muon_momentum(0, momentum_warmup, cfg.momentum_start, cfg.momentum_end)
    attention_window(0, cfg.num_iterations, cfg.window_min_tokens, cfg.window_max_tokens, BLOCK_SIZE)
    for name in ("val_loss_every", "checkpoint_every", "warmup_steps"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{name}={getattr(cfg, name)} must be 0 or more")
    if cfg.log_every <= 0:
        raise ValueError(f"--log_every={cfg.log_every} must be positive")
    if cfg.hellaswag_file and not cfg.hellaswag:
        raise ValueError(f"--hellaswag_file={cfg.hellaswag_file!r} is read only by the HellaSwag evaluation: add "
                         f"--hellaswag=1, or drop --hellaswag_file")
    if not 0 <= cfg.profile_step <= cfg.num_iterations:  # else no step would be traced, and nothing would say so
        raise ValueError(f"--profile_step={cfg.profile_step} must name a step from 1 to --num_iterations="
                         f"{cfg.num_iterations}, or be 0 for none")
    if cfg.vocab_size < VOCAB_SIZE:
        raise ValueError(f"--vocab_size={cfg.vocab_size} is smaller than the shards' GPT-2 vocabulary of "
                         f"{VOCAB_SIZE} ids; keep the default --vocab_size={TrainConfig.vocab_size}")
    check_method(cfg.muon_method)
    if not 0 <= cfg.normuon_beta2 < 1:
        raise ValueError(f"--normuon_beta2={cfg.normuon_beta2} must be from 0 (plain Muon) to below 1; NorMuon's "
                         f"paper uses --normuon_beta2=0.95")
    for name in ("lr_hidden", "lr_embed", "lr_head", "lr_scalar"):
        # the optimizer holds learning rates in float32 tensors: a larger value cannot even be stored
        if not 0 <= getattr(cfg, name) <= torch.finfo(torch.float32).max:
            raise ValueError(f"--{name}={getattr(cfg, name)} must be a number from 0 to 3.4e38 (float32); the "
                             f"record uses --{name}={getattr(TrainConfig, name)}")
    if not -1 <= cfg.val_context < cfg.seq_len:
        raise ValueError(f"--val_context={cfg.val_context} must be from 0 to --seq_len - 1 = {cfg.seq_len - 1}, "
                         f"or -1 for the model's receptive field at the longest window")
    mcfg = model_config(cfg)  # the layer lists and the model's own checks, before any work
    val_context = cfg.val_context
    if val_context == -1:
        # whole blocks: then every sequence starts on a block of the stream, and each scored token attends exactly
        # as in the unbroken stream (half a sequence is whole blocks too, for any seq_len a multiple of 256)
        receptive_blocks = -(-receptive_field(mcfg, cfg.window_max_tokens) // BLOCK_SIZE)
        val_context = min(receptive_blocks * BLOCK_SIZE, cfg.seq_len // 2)
    return Derived(model=mcfg, grad_accum=cfg.batch_size // per_micro_step,
                   tokens_per_step=cfg.batch_size * cfg.seq_len, val_context=val_context,
                   momentum_warmup_steps=momentum_warmup)


def check_resume(cfg: TrainConfig, argv: list[str]) -> None:
    """Refuse a missing, damaged or incompatible --resume now, not after minutes of compile warm-up; `argv`, the
    flags cfg came from, tells the advice which preset the checkpoint needs."""
    saved = checkpoint.load_checkpoint(cfg.resume, mmap=True)["config"]  # mmap: only the config is read
    differs = checkpoint.config_diff(saved, dataclasses.asdict(cfg), RESUME_MAY_CHANGE, cfg.resume)
    if differs:
        # a run resumed without the --preset it was started with differs in all of that preset's fields: name it
        preset = next((name for name in PRESETS if name != cfg.preset and not checkpoint.config_diff(
            saved, dataclasses.asdict(parse_config(TrainConfig, [*argv, f"--preset={name}"], PRESETS)),
            RESUME_MAY_CHANGE, cfg.resume)), None)
        fix = f"add --preset={preset}, the preset it was started with" if preset else "pass the same values"
        raise UserError(f"--resume {cfg.resume}: the checkpoint was trained with a different config, which "
                        f"would change the math: {'; '.join(differs)}. To resume, {fix}")


def layer_list(flag: str, value: str, num_layers: int, fallback: str = "''") -> tuple[int, ...]:
    """'0,7' -> (0, 7); a ValueError names the flag, and the `fallback` value, when an entry is not a layer index."""
    try:
        layers = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        raise ValueError(f"--{flag}={value!r} must be comma-separated layer numbers, e.g. --{flag}=0,7, "
                         f"or --{flag}={fallback}") from None
    if not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"--{flag}={value!r} names a layer outside 0..{num_layers - 1} (--num_layers="
                         f"{num_layers}); pass layers inside it, or --{flag}={fallback}")
    return layers


def short_window_layers(cfg: TrainConfig) -> tuple[int, ...] | None:
    """The layers not named by --long_window_layers, or None for the model's default pattern ("auto")."""
    if cfg.long_window_layers == "auto":
        return None
    long = layer_list("long_window_layers", cfg.long_window_layers, cfg.num_layers, fallback="auto")
    return tuple(i for i in range(cfg.num_layers) if i not in long)


def no_attention_layers(cfg: TrainConfig) -> tuple[int, ...]:
    """The layers named by --no_attention_layers; "auto" is record #28's (layer 7) at 12 layers and none otherwise:
    the cut was found for that depth, and layer 7 of 24 is another place in the network."""
    if cfg.no_attention_layers == "auto":
        return RECORD_NO_ATTENTION_LAYERS if cfg.num_layers == TrainConfig.num_layers else ()
    return layer_list("no_attention_layers", cfg.no_attention_layers, cfg.num_layers, fallback="auto")


def model_config(cfg: TrainConfig) -> GPTConfig:
    return GPTConfig(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, model_dim=cfg.model_dim,
                     num_heads=cfg.num_heads, head_dim=cfg.head_dim, num_value_embeds=cfg.num_value_embeds,
                     logit_softcap=cfg.logit_softcap, block_size=BLOCK_SIZE, value_residual=cfg.value_residual,
                     attn_gate=cfg.attn_gate, smear=cfg.smear, backout=cfg.backout,
                     short_window_layers=short_window_layers(cfg),
                     no_mlp_layers=layer_list("no_mlp_layers", cfg.no_mlp_layers, cfg.num_layers),
                     no_attention_layers=no_attention_layers(cfg))


def validation_loss_sum(model: GPT, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, window: torch.Tensor,
                        compiled: bool) -> torch.Tensor:
    """The summed loss of one validation micro-batch, with no gradient to keep.

    A compiled model runs its blocks with autograd on, so that they reuse their training graphs: under no_grad dynamo
    compiles every region again, for inference, which took 4.8 s of a strictly cold start on the H200
    (bench/results/cold_profile_1xH200_4bf3998_one_graph_optimizer.txt); a strictly cold start went from 70.8 to
    65.8 s. Their autograd graph is freed on return. The head runs under no_grad: its graph for the sum is new either
    way, and without autograd it writes no gradient. The price, per 49,152-token micro-batch on one machine: 27.8-30.0
    ms against 25.7 under no_grad (29.9-31.5 with the head's autograd too), at a peak of 19.3 GiB, below training's
    (bench/results/README.md, 795b0c1). Eager models run all of it under no_grad, which keeps no activations.

    Eager models also give the head only the scored rows: with the default context, half of each row is context,
    and the head is most of a small model's work on the CPU. The smoke run's validations took 1.6 s each instead of
    3.9-4.2 on a 2-core AMD EPYC, with the same losses to the 4 decimals logged. A compiled model keeps its one
    shape, which the scored rows' count would change."""
    with torch.set_grad_enabled(compiled):
        hidden_BTD = model.hidden_states(inputs_BT, window)
    with torch.no_grad():
        if compiled:
            return model.head(hidden_BTD, targets_BT, "sum")
        scored_BT = targets_BT != IGNORE_INDEX
        return model.head(hidden_BTD[scored_BT][None], targets_BT[scored_BT][None], "sum")


def oom_advice(cfg: TrainConfig) -> str:
    """Flags that need less memory per GPU and still pass derive()."""
    if cfg.device_batch_size > 1:
        # a divisor of device_batch_size, so it still divides batch_size / world_size
        smaller = max(d for d in range(1, cfg.device_batch_size) if cfg.device_batch_size % d == 0)
        return (f"try --device_batch_size={smaller} (gradient accumulation keeps the global batch of "
                f"{cfg.batch_size} sequences)")
    if cfg.seq_len > BLOCK_SIZE:
        half = max(BLOCK_SIZE, cfg.seq_len // 2 // BLOCK_SIZE * BLOCK_SIZE)
        return (f"try --seq_len={half} --batch_size={cfg.batch_size * 2} (twice as many sequences, half as long: "
                f"about the same tokens per step)")
    return "even one sequence of 128 tokens does not fit: use a smaller model (--num_layers, --model_dim)"


def fineweb_shards(argv: list[str], asked: str = "", world_size: int = 1) -> int:
    """FineWeb train shards that run.sh fetches for a run with these flags on `world_size` processes: `asked`
    (its FINEWEB_SHARDS) when given, else the run's tokens with the alignment margin, plus one shard, at most the
    dataset's 103 (record #28: 1,750 x 393,216 tokens = 688M -> 9 shards). The flags are checked first, so that a
    bad one stops run.sh before a download of gigabytes."""
    from data.cached_fineweb10B import TRAIN_SHARDS  # here: training runs need not import huggingface_hub

    cfg = parse_config(TrainConfig, argv, PRESETS)
    derive(cfg, world_size)
    tokens = cfg.num_iterations * cfg.batch_size * cfg.seq_len * (1 + ALIGNMENT_MARGIN)
    reads = min(math.ceil(tokens / FINEWEB_SHARD_TOKENS) + 1, TRAIN_SHARDS)
    if not asked:
        return reads
    if not (asked.isascii() and asked.isdigit() and 1 <= int(asked) <= TRAIN_SHARDS):
        raise UserError(f"FINEWEB_SHARDS={asked} must be a whole number of train shards from 1 to {TRAIN_SHARDS}; "
                        f"leave it unset to fetch the {reads} this run reads")
    return int(asked)


def main(argv: list[str] | None = None) -> int:
    # ----------------------------------------------------------------------------------------------
    # 1. config
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_config(TrainConfig, argv, PRESETS)
    rt = dist.setup(cfg.device)
    try:
        return train(cfg, rt, argv)
    except torch.OutOfMemoryError:  # anywhere, not only in the loop: the compile warm-up runs the first steps
        raise UserError(f"CUDA out of memory at --device_batch_size={cfg.device_batch_size} --seq_len="
                        f"{cfg.seq_len}: {oom_advice(cfg)}") from None
    finally:
        dist.teardown()


def train(cfg: TrainConfig, rt: dist.Runtime, argv: list[str]) -> int:
    """The run of `cfg`, parsed from the flags `argv`."""
    derived = derive(cfg, rt.world_size)
    device, cuda = rt.device, rt.device.type == "cuda"
    if cfg.resume:
        check_resume(cfg, argv)
    if cfg.hellaswag:  # its data file now, not after the training that a missing file would waste
        from evals.hellaswag import check_available
        check_available(cfg.hellaswag_file or None)

    # ----------------------------------------------------------------------------------------------
    # 2. data: every rank reads its share of the same global token stream
    train_files, val_files = cfg.train_files, cfg.val_files
    if "sample" in (train_files, val_files):  # tokenized on first use; safe when all ranks race to do it
        sample_train, sample_val = ensure_sample_shards()
        train_files = sample_train if train_files == "sample" else train_files
        val_files = sample_val if val_files == "sample" else val_files

    def new_train_loader():
        return TrainLoader(train_files, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                           device_batch_size=cfg.device_batch_size, rank=rt.rank, world_size=rt.world_size,
                           device=device, align_to_bos=cfg.align_to_bos, cycle=cfg.cycle_data)

    train_loader = new_train_loader()
    have, need = sum(train_loader.counts), cfg.num_iterations * derived.tokens_per_step + 1
    if not cfg.cycle_data and have < need:  # need is a lower bound (BOS alignment skips tokens): sure to run out
        # the skips depend on the documents' lengths, unknown before the run reads them
        alignment = ", fewer with --align_to_bos=1, which skips to a document start per sequence" * cfg.align_to_bos
        raise UserError(f"the {len(train_loader.paths)} shard(s) matching --train_files={cfg.train_files!r} hold "
                        f"{have:,} tokens, but --num_iterations={cfg.num_iterations} x {derived.tokens_per_step:,} "
                        f"tokens/step needs at least {need:,}: add shards (FineWeb: `python data/cached_fineweb10B.py "
                        f"{math.ceil(need / FINEWEB_SHARD_TOKENS)}`), pass --cycle_data=1, or lower --num_iterations "
                        f"(at most {(have - 1) // derived.tokens_per_step} fit{alignment})")
    val_loader = ValLoader(val_files, val_tokens=cfg.val_tokens, seq_len=cfg.seq_len,
                           device_batch_size=cfg.device_batch_size, rank=rt.rank, world_size=rt.world_size,
                           device=device, context=derived.val_context)
    shared = sorted(set(map(os.path.realpath, train_loader.paths)) & set(map(os.path.realpath, val_loader.paths)))
    if shared:
        raise UserError(f"--train_files={cfg.train_files!r} and --val_files={cfg.val_files!r} share {len(shared)} "
                        f"shard(s) ({shared[0]}): validation would score tokens the model trains on; point them at "
                        f"different shards")

    # ----------------------------------------------------------------------------------------------
    # 3. run folder and log, made only once the config and the data are known to be good
    run_dir = make_run_dir(cfg.log_dir, rt)
    log = RunLog(run_dir, cfg.num_iterations, derived.tokens_per_step, enabled=rt.is_master)

    # ----------------------------------------------------------------------------------------------
    # 4. model and optimizer
    torch.manual_seed(cfg.seed)
    mcfg = derived.model
    model = GPT(mcfg).to(device)
    model.init_weights()
    dist.use_device_paths(model, device, fp8_head=cfg.fp8_head)
    if cfg.fp8_head and cuda and not model.head.fp8:
        log.print(f"note: this GPU (compute capability {torch.cuda.get_device_capability(device)}) has no FP8 "
                  f"matrix units, so the LM head runs in bf16; pass --fp8_head 0 to make that explicit")
    if cfg.compile:
        if cuda:
            use_static_launcher()
        model.compile_regions()
        if cuda and (note := bytecode_note(torch, sys.flags.dont_write_bytecode)):
            log.print(note)
    initial_weights = copy.deepcopy(model.state_dict())

    def new_optimizer():
        return MuonAdam(model.param_groups(), lr={"hidden": cfg.lr_hidden, "embed": cfg.lr_embed,
                                                  "value_embed": cfg.lr_embed, "head": cfg.lr_head,
                                                  "scalar": cfg.lr_scalar},
                        rank=rt.rank, world_size=rt.world_size, compile=cfg.compile and cuda,
                        muon_method=cfg.muon_method, normuon_beta2=cfg.normuon_beta2)

    optimizer = new_optimizer()
    log.header(cfg, mcfg, device)
    log.print(f"run folder {run_dir} | {rt.world_size} process(es) on {device} | {model.num_params():,} parameters | "
              f"{derived.tokens_per_step:,} tokens/step = {cfg.batch_size} x {cfg.seq_len} | "
              f"grad accumulation {derived.grad_accum} | validation {val_loader.num_steps} steps "
              f"({derived.val_context} tokens of context per sequence)")
    if cfg.checkpoint_every and rt.is_master:
        # fp32 weights + Adam's two moments + Muon's momentum: at most 4 copies of the parameters, KEEP files
        check_disk_space(run_dir, 4 * 4 * model.num_params() * (checkpoint.KEEP + 1), "checkpointing")

    windows: dict[int, torch.Tensor] = {}  # one device tensor per window size: schedule changes never recompile

    def window_at(step: int) -> torch.Tensor:
        w = attention_window(step, cfg.num_iterations, cfg.window_min_tokens, cfg.window_max_tokens, BLOCK_SIZE)
        if w not in windows:
            windows[w] = torch.tensor(w, dtype=torch.int64, device=device)
        return windows[w]

    def train_step(step: int) -> torch.Tensor:
        """One optimizer step: grad_accum micro-batches, then the update. Returns the summed loss (no sync)."""
        window = window_at(step)
        loss_sum = torch.zeros((), device=device)
        for _ in range(derived.grad_accum):
            inputs, targets = train_loader.next_batch()
            loss = model(inputs, targets, window)
            (loss / derived.grad_accum).backward()
            loss_sum += loss.detach()
        optimizer.step(lr_multiplier(step, cfg.num_iterations, cfg.cooldown_frac, cfg.final_lr_frac),
                       muon_momentum(step, derived.momentum_warmup_steps, cfg.momentum_start, cfg.momentum_end))
        optimizer.zero_grad()
        return loss_sum

    def val_loss_sum(inputs: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        return validation_loss_sum(model, inputs, targets, window_at(step), compiled=cfg.compile)

    def validate(step: int) -> float:
        total = torch.zeros((), device=device, dtype=torch.float64)
        for inputs, targets in val_loader:
            total += val_loss_sum(inputs, targets, step)
        return dist.all_ranks_sum(total.item(), rt) / cfg.val_tokens

    # ----------------------------------------------------------------------------------------------
    # 5. warm-up: compile and run a few untimed steps, then restore the initial state so that the timed
    # run starts from exactly the state it would have had without them (the records' rule)
    if cfg.warmup_steps:
        t0 = time.perf_counter()
        for step in range(cfg.warmup_steps):
            train_step(min(step, cfg.num_iterations))  # a run shorter than the warm-up repeats its last schedule
        val_loss_sum(*next(iter(val_loader)), 0)  # compiles what validation needs beyond the training graphs
        if cuda:
            torch.cuda.synchronize()
        model.load_state_dict(initial_weights)
        optimizer, train_loader = new_optimizer(), new_train_loader()
        log.print(f"warm-up: {cfg.warmup_steps} steps + 1 validation batch in {time.perf_counter() - t0:.1f}s "
                  f"(compile included), initial state restored")
    del initial_weights

    # ----------------------------------------------------------------------------------------------
    # 6. resume: continue exactly where a checkpoint left off
    start_step, train_time_ms = 0, 0.0
    if cfg.resume:
        # check_resume has checked its config and its bytes already
        state = checkpoint.load_checkpoint(cfg.resume, mmap=True, verify=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        train_loader.load_state_dict(state["loader"])
        checkpoint.set_rng_state(state["rng"])
        start_step, train_time_ms = state["step"], state["train_time_ms"]
        log.print(f"resumed from {checkpoint.resolve(cfg.resume)} at step {start_step}")
        del state

    def save(step: int) -> Path | None:
        if not rt.is_master:
            return None
        path = checkpoint.checkpoint_path(run_dir, step)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "loader": train_loader.state_dict(), "rng": checkpoint.rng_state(), "step": step,
                 "train_time_ms": train_time_ms, "config": dataclasses.asdict(cfg),
                 "model_config": dataclasses.asdict(mcfg)}
        try:
            checkpoint.save_checkpoint(path, state)
        except OSError as e:
            raise UserError(f"writing checkpoint {path} failed ({e.strerror}); earlier checkpoints in {run_dir} "
                            f"are intact: free space and resume from the newest with --resume {run_dir}") from None
        log.print(f"checkpoint: {path}")
        return path

    # ----------------------------------------------------------------------------------------------
    # 7. the training loop: time only training (validation and checkpoints pause the clock)
    stop = StopRequest()
    last_checkpoint = cfg.resume or None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(start_step, cfg.num_iterations + 1):
        last = step == cfg.num_iterations
        if last or (cfg.val_loss_every and step % cfg.val_loss_every == 0) or step == start_step == 0:
            if cuda:
                torch.cuda.synchronize()
            t_val = time.perf_counter()
            train_time_ms += 1e3 * (t_val - t0)
            val_loss = validate(step)  # ends in .item(): the GPU's work is done when it returns
            log.step(step, cfg.num_iterations, train_time_ms, val_loss=val_loss,
                     val_time_s=time.perf_counter() - t_val)
            t0 = time.perf_counter()
        if last:
            break

        if step + 1 == cfg.profile_step:
            loss_sum = profiled(train_step, step, run_dir if rt.is_master else None)
        else:
            loss_sum = train_step(step)
        done = step + 1

        checkpoint_due = cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.num_iterations)
        if done % cfg.log_every == 0 or done == cfg.num_iterations or checkpoint_due:
            # One collective carries the loss and any stop request, so every rank decides alike. The loss is
            # also checked before every checkpoint, so a checkpoint never holds a diverged model.
            flags = torch.stack([loss_sum / derived.grad_accum, torch.tensor(float(stop.signal != 0), device=device)])
            if rt.world_size > 1:
                torch.distributed.all_reduce(flags)
            train_loss, stop_votes = (flags / torch.tensor([rt.world_size, 1.0], device=device)).tolist()
            if cuda:
                torch.cuda.synchronize()
            elapsed = train_time_ms + 1e3 * (time.perf_counter() - t0)
            # The loss lags the update by one step: an update that overflowed shows only in the weights.
            saving = cfg.checkpoint_every and (checkpoint_due or stop_votes)
            diverged = (f"train loss is {train_loss}" if not math.isfinite(train_loss) else
                        "the weights hold inf/nan" if saving and not all_finite(model.parameters()) else "")
            if diverged:
                where = (f"the last good checkpoint is {last_checkpoint} (--resume it if a hardware fault caused "
                         f"this)" if last_checkpoint else "no checkpoint was written")
                log.print(f"error: {diverged} at step {done}; stopping, {where}. Restart with lower learning "
                          f"rates (--lr_hidden, --lr_embed, --lr_head, --lr_scalar)")
                log.close()
                return DIVERGED_EXIT
            log.step(done, cfg.num_iterations, elapsed, train_loss=train_loss)
            if stop_votes:
                train_time_ms = elapsed
                path = save(done) if cfg.checkpoint_every else None
                log.print(f"stopped by a signal after step {done}" +
                          (f"; resume with --resume {path}" if path else " (no checkpoint: --checkpoint_every 0)"))
                log.close()
                return 0

        if checkpoint_due:
            if cuda:
                torch.cuda.synchronize()
            train_time_ms += 1e3 * (time.perf_counter() - t0)
            last_checkpoint = save(done) or last_checkpoint
            t0 = time.perf_counter()

    # ----------------------------------------------------------------------------------------------
    # 8. the end: optional HellaSwag, memory
    if cfg.hellaswag:
        from evals.hellaswag import evaluate_hellaswag
        accuracy = evaluate_hellaswag(model, rt, path=cfg.hellaswag_file or None)
        log.print(f"hellaswag accuracy: {accuracy:.4f}")
    if cuda:
        log.print(f"peak memory allocated: {torch.cuda.max_memory_allocated(device) // 2**20} MiB "
                  f"reserved: {torch.cuda.max_memory_reserved(device) // 2**20} MiB")
    else:
        log.print(f"peak memory (process RSS): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_user_error(main))
