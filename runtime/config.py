"""Every setting of a run (TrainConfig, whose defaults are the record run), the named presets, and the checks and
numbers that follow from them (derive). No torch here: run.sh asks `fineweb_shards` how many shards to fetch, which
checks the flags, before any download. Answered by importing train_gpt2 (torch, Triton, the kernels), that took
10.9-12.5 s on the H200 image; by this module, 0.7-1.0 s (bench/results/README.md)."""
import dataclasses
import math

import numpy as np

from data.shard import FINEWEB_SHARD_TOKENS, VOCAB_SIZE
from model.config import GPTConfig, receptive_field
from optim.iterations import check_method
from optim.schedule import attention_window, lr_multiplier, muon_momentum
from runtime.cli import parse_config
from runtime.errors import UserError

FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4e38, torch.finfo(torch.float32).max without torch


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
    # the blocks' forward products whose input has a scale known without a pass over it in FP8 (model/fp8.py)
    fp8_forward: bool = True  # attention's qkv and the MLP's two products in FP8 on Hopper GPUs, bf16 elsewhere
    # the gradient's scale is the previous micro-batch's amax (model/layers.py, ReLU2MLP and FP8QKV); it reads the
    # FP8 forward's copies, so without --fp8_forward it does nothing
    fp8_backward: bool = True  # with the FP8 forward: the MLP's four backward products and qkv's two
    # optimization
    num_iterations: int = 1750  # optimizer steps, about the length of the mid-2025 records
    cooldown_frac: float = 0.45  # last fraction of steps over which the learning rate decays (record #28)
    final_lr_frac: float = 0.1  # learning rate at the last step, as a fraction of the peak (record #28)
    lr_hidden: float = 0.05  # Muon learning rate for the hidden matrices (record #28)
    muon_method: str = "jordan"  # Muon's orthogonalisation: jordan (Muon's quintic) or polar_express (optim/muon.py)
    # NorMuon evens Muon's update out per neuron by a running mean square (optim/muon.py, neuron_scales)
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
    log_every: int = 1  # steps between train-loss lines (each read a step late: the GPU never waits for it)
    checkpoint_every: int = 0  # steps between checkpoints (0 = none)
    resume: str = ""  # checkpoint file, or run folder, to continue from
    log_dir: str = "logs"  # each run writes log.txt, metrics.jsonl and checkpoints into a new folder here
    seed: int = 0  # seeds the initial weights
    compile: bool = True  # torch.compile the model's regions (GPT.compile_regions), 1/0; the optimizer runs eagerly
    # The first step compiles every training graph. With 3 warm-up steps, the timed steps of strictly cold runs on
    # the H200 compiled nothing (each as fast as after the records' 10), and the warm-up took 2.6 and 8.7 s less
    # (strictly cold) and 3.1 s less (warm caches) than with 10, in three same-machine pairs
    # (bench/results/README.md)
    warmup_steps: int = 3  # untimed steps that compile and warm up, then the initial state is restored
    profile_step: int = 0  # if > 0, trace this step with torch.profiler: kernel table + trace in the run folder
    # Tracing the host's ops too gives each kernel the code that launched it, but slows the host: a step of 8c60c3c
    # took 617 ms traced against 544 (bench/results/README.md), so its GPU idle time is the profiler's, not the run's
    profile_cpu: bool = True  # with --profile_step on a GPU: 0 traces the GPU's work alone, for its idle time
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
    # The one-GPU time-to-loss run of bench/results (issue 7): record #28's model, 580 steps of 3 sequences (86M
    # tokens), with the learning-rate cooldown over 90% of the steps and the momentum warm-up over all of them. At
    # 550 steps these two beat the record's 45% and 300 steps, each alone and together (val 1.021-1.023 against
    # 1.037 on the proxy corpus). Polar Express then lowered 550 steps' loss by 0.005. With qkv's weight gradient in
    # FP8 too (371311c), seed 1 ended at 1.0254 after 560 steps, above the line (1.0157-1.0221 at the earlier FP8
    # steps). At that step 580 steps gave 1.0123, 1.0177, 1.0134 and 1.0107 for seeds 0-3 (560 steps: 1.0172, 1.0254,
    # 1.0135, 1.0198), seed 1 in 120.8 s on a 1,740 MHz machine: 20 steps, about 4.5 s, bought a margin of 0.0076 in
    # the worst of four seeds (bench/results/README.md, section "580 steps"). Every run there logged every 20th step;
    # until e569653 (the lagged log) each such step synced. Since df03885 (the MLP's transposed copies, other
    # roundings): 1.0091, 1.0142, 1.0116 and 1.0092 in 117.7-121.2 s (section df03885).
    "short": dict(batch_size=3, num_iterations=580, cooldown_frac=0.9, momentum_warmup_steps=-1, val_loss_every=0,
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
# compile and the fp8 flags change only rounding (kernels, precision of the same math), so a run can move
# between GPUs.
# device_batch_size only regroups the same sequences into micro-steps (the loader's position is global), as a
# different number of GPUs does: the advice for memory errors, a smaller device batch, must not block a resume.
RESUME_MAY_CHANGE = {"resume", "log_dir", "checkpoint_every", "val_loss_every", "log_every", "compile", "fp8_head",
                     "fp8_forward", "fp8_backward", "profile_step", "profile_cpu",
                     "warmup_steps", "device", "hellaswag", "hellaswag_file", "val_files", "val_tokens", "val_context",
                     "preset", "device_batch_size"}
BLOCK_SIZE = 128  # FlexAttention's tile: packed sequences are cut into blocks of this many tokens
RECORD_NO_ATTENTION_LAYERS = (7,)  # record #28 runs layer 7 of its 12 without attention
# BOS alignment skips from each sequence's start to the next document start: a margin of 10% covers skips of up to
# 4,900 tokens per 48K sequence (the proxy corpus's first 49,152 training tokens hold 28 documents, 1,755 tokens
# each on average: bench/results/attention_1xH200.json)
ALIGNMENT_MARGIN = 0.10


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
        # the optimizer's kernels compute in float32: a larger value cannot even be stored
        if not 0 <= getattr(cfg, name) <= FLOAT32_MAX:
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


def group_learning_rates(cfg: TrainConfig) -> dict[str, float]:
    """The base learning rate of each of the model's parameter groups (GPT.param_groups), as MuonAdam takes them:
    the token and value embeddings share --lr_embed."""
    return {"hidden": cfg.lr_hidden, "embed": cfg.lr_embed, "value_embed": cfg.lr_embed, "head": cfg.lr_head,
            "scalar": cfg.lr_scalar}


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


