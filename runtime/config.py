"""A run's settings (TrainConfig, defaults = the record run), the presets, and derive(): the checks and the numbers
that follow. No torch here, so run.sh checks the flags before any download."""
import contextlib
import dataclasses
import math

from data.shard import FINEWEB_SHARD_TOKENS, VOCAB_SIZE
from model.config import GPTConfig, receptive_field
from optim.iterations import check_method
from optim.schedule import attention_window, lr_multiplier, muon_momentum
from runtime.cli import parse_config, parse_flags
from runtime.errors import UserError

KERNEL_CHOICES = ("auto", "1", "0")
ATTENTION_FORWARDS = ("bf16", "int8")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of a run; each field's comment is its --help text."""
    # model
    num_layers: int = 12  # transformer blocks
    model_dim: int = 768  # residual stream width
    num_heads: int = 6  # attention heads
    head_dim: int = 128  # per-head width
    vocab_size: int = 50304  # GPT-2's 50,257 padded to a multiple of 128
    num_value_embeds: int = 3  # value embeddings for the first and last layers; 0 = off
    no_mlp_layers: str = ""  # comma-separated layers without an MLP
    no_attention_layers: str = "auto"  # comma-separated layers without attention; auto = 7 at 12 layers
    long_window_layers: str = "auto"  # long-window layers (others: half); auto = every 4th from each end
    value_residual: bool = False  # mix layer 0's values into later layers'
    backout: bool = False  # subtract a learned share of the mid-stream before the head
    key_offset: bool = False  # long-window layers' keys take the previous token's non-rotating dims
    logit_softcap: float = 15.0  # cap * tanh(logits / cap)
    # optimizer
    lr_hidden: float = 0.05  # Muon LR of the hidden matrices
    muon_method: str = "jordan"  # orthogonalisation: jordan or polar_express
    normuon_beta2: float = 0.95  # NorMuon's per-neuron averaging; 0 = plain Muon
    lr_embed: float = 0.6  # Adam LR of the token and value embeddings
    lr_head: float = 0.008  # Adam LR of the LM head
    lr_scalar: float = 0.04  # Adam LR of the mixing scalars
    momentum_start: float = 0.85  # Muon momentum at step 0, warmed up linearly
    momentum_end: float = 0.95  # Muon momentum after the warm-up
    # schedule
    num_iterations: int = 1750  # optimizer steps
    cooldown_frac: float = 0.45  # final fraction of steps, over which the LR decays
    final_lr_frac: float = 0.1  # last step's LR as a fraction of the peak
    momentum_warmup_steps: int = 300  # momentum warm-up steps; -1 = all
    window_min_tokens: int = 128  # attention window at step 0, grown linearly
    window_max_tokens: int = 1792  # attention window at the last step
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # glob of training shards; "sample" = data/sample
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"  # glob of validation shards; "sample" = data/sample
    val_tokens: int = 10_485_760  # tokens per validation, fixed so runs compare
    val_context: int = -1  # unscored context per validation sequence; -1 = receptive field
    seq_len: int = 48 * 1024  # tokens per packed sequence, a multiple of 128
    batch_size: int = 8  # sequences per step over all GPUs
    align_to_bos: bool = True  # start each sequence at a document start
    cycle_data: bool = False  # restart at the first shard when they run out
    # run
    preset: str = "d12"  # named overrides applied before the flags
    seed: int = 0  # seeds the initial weights
    val_loss_every: int = 125  # steps between validations; 0 = start and end only
    log_every: int = 1  # steps between train-loss lines
    checkpoint_every: int = 0  # steps between checkpoints; 0 = none
    stall_steps: int = 100  # steps by which a fresh run's loss must fall below its first; 0 = off
    collective_timeout_s: int = 600  # seconds a rank waits for the others before the job stops
    resume: str = ""  # checkpoint or run folder to continue; flags beside it override
    log_dir: str = "logs"  # parent of each run's folder
    device: str = "auto"  # auto, cuda or cpu
    hellaswag: bool = False  # run the HellaSwag evaluation after training
    hellaswag_file: str = ""  # local hellaswag_val.jsonl, for offline machines
    # performance
    device_batch_size: int = 1  # sequences per GPU and micro-step (0 = all); lower to save memory
    kernels: str = "auto"  # fused Triton kernels: auto = on CUDA, 1 = required, 0 = plain model
    fp8: bool = True  # FP8 matmuls with the kernels (blocks: Hopper, head: 8.9+)
    attention_forward: str = "bf16"  # validation and HellaSwag attention: bf16, or int8 (INT8/FP8, kernels, 8.9+)
    compile: bool = True  # torch.compile the model, 1/0
    warmup_steps: int = 3  # untimed warm-up steps; the initial state is then restored
    profile_step: int = 0  # trace this step with torch.profiler; 0 = none
    profile_cpu: bool = True  # with --profile_step on a GPU: 0 traces the GPU alone


PRESETS: dict[str, dict] = {
    "d12": {},  # the record run
    # a tiny model on the repo's sample corpus, for a CPU
    "smoke": dict(train_files="sample", val_files="sample", val_tokens=4_096, seq_len=256, batch_size=2,
                  device_batch_size=0, num_layers=2, model_dim=64, num_heads=2, head_dim=32, num_value_embeds=1,
                  num_iterations=40, cooldown_frac=0.3, window_min_tokens=128, window_max_tokens=256,
                  val_loss_every=20, log_every=5, lr_embed=0.1, lr_head=0.01, warmup_steps=1, compile=False),
    # a small model for your own corpus (python -m data.prepare); narrow, as Muon's bf16 iterations are slow on CPUs
    "tiny": dict(val_tokens=65_536, seq_len=512, batch_size=8, device_batch_size=2, num_layers=4, model_dim=128,
                 num_heads=2, head_dim=64, num_value_embeds=1, num_iterations=200, cooldown_frac=0.5,
                 window_min_tokens=128, window_max_tokens=512, val_loss_every=50, log_every=10, lr_embed=0.1,
                 lr_head=0.01, warmup_steps=1),
    # the one-GPU time-to-loss run: the record candidate's model, fewer and smaller steps
    "short": dict(key_offset=True, batch_size=3, num_iterations=450, cooldown_frac=0.9, momentum_warmup_steps=-1,
                  val_loss_every=0, log_every=20, muon_method="polar_express"),
    # a candidate for the next record (unverified on FineWeb): with the ideas that won on the proxy corpus (short),
    # 50 steps fewer, as modded-nanogpt's key offset record took off
    "record_candidate": dict(key_offset=True, num_iterations=1700),
    # GPT-2 medium, large and XL shapes; the LRs fall as width grows
    "d24": dict(num_layers=24, model_dim=1024, num_heads=16, head_dim=64,
                num_iterations=5000, lr_hidden=0.03, lr_embed=0.3),
    "d36": dict(num_layers=36, model_dim=1280, num_heads=20, head_dim=64,
                seq_len=32 * 1024, batch_size=16, num_iterations=7000, lr_hidden=0.025, lr_embed=0.2),
    "d48": dict(num_layers=48, model_dim=1600, num_heads=25, head_dim=64,
                seq_len=16 * 1024, batch_size=32, num_iterations=10000, lr_hidden=0.02, lr_embed=0.15),
}

# Flags a resume may change: they leave the training math the same
RESUME_MAY_CHANGE = {"resume", "log_dir", "checkpoint_every", "val_loss_every", "log_every", "compile", "kernels",
                     "fp8", "attention_forward", "profile_step", "profile_cpu", "warmup_steps", "device", "hellaswag",
                     "hellaswag_file", "val_files", "val_tokens", "val_context", "preset", "device_batch_size",
                     "stall_steps", "collective_timeout_s"}
BLOCK_SIZE = 128  # FlexAttention's tile
RECORD_NO_ATTENTION_LAYERS = (7,)  # the record's cut, found at 12 layers
ALIGNMENT_MARGIN = 0.10  # share of tokens that BOS alignment skips
# beyond these a run trains nothing
LR_RANGES = {"lr_hidden": (0.0, 1.0), "lr_embed": (0.0, 10.0), "lr_head": (0.0, 1.0), "lr_scalar": (0.0, 10.0)}


@dataclasses.dataclass(frozen=True)
class Derived:
    model: GPTConfig
    device_batch_size: int  # sequences per process and micro-step, 0 resolved
    grad_accum: int  # micro-steps per optimizer step on each rank
    tokens_per_step: int  # all ranks together
    val_context: int  # -1 resolved
    momentum_warmup_steps: int  # -1 resolved


@contextlib.contextmanager
def flag_checks():
    """Turn the ValueErrors of model/ and optim/ checks on flag values into UserErrors."""
    try:
        yield
    except ValueError as e:
        raise UserError(str(e)) from None


def derive(cfg: TrainConfig, world_size: int) -> Derived:
    """The numbers that follow from the config; a UserError names the flag when they do not fit."""
    device_batch = cfg.device_batch_size or max(cfg.batch_size // world_size, 1)
    per_micro_step = device_batch * world_size
    if device_batch < 0 or cfg.batch_size <= 0 or cfg.batch_size % per_micro_step:
        raise UserError(f"--batch_size={cfg.batch_size} must be a positive multiple of --device_batch_size="
                        f"{device_batch} x {world_size} processes = {per_micro_step}; "
                        f"{batch_fix(cfg.batch_size, device_batch, world_size)}")
    if cfg.seq_len <= 0 or cfg.seq_len % BLOCK_SIZE:
        fit = max(BLOCK_SIZE, cfg.seq_len // BLOCK_SIZE * BLOCK_SIZE)
        raise UserError(f"--seq_len={cfg.seq_len} must be a multiple of the attention block size {BLOCK_SIZE}; "
                        f"try --seq_len={fit}")
    if cfg.momentum_warmup_steps < -1:
        raise UserError(f"--momentum_warmup_steps={cfg.momentum_warmup_steps} must be 0 or more (0 = no warm-up), "
                        f"or -1 for all of the run's steps")
    momentum_warmup = cfg.num_iterations if cfg.momentum_warmup_steps == -1 else cfg.momentum_warmup_steps
    with flag_checks():  # one call each: a bad flag fails before any work
        lr_multiplier(0, cfg.num_iterations, cfg.cooldown_frac, cfg.final_lr_frac)
        muon_momentum(0, momentum_warmup, cfg.momentum_start, cfg.momentum_end)
        attention_window(0, cfg.num_iterations, cfg.window_min_tokens, cfg.window_max_tokens, BLOCK_SIZE)
        check_method(cfg.muon_method)
    for name in ("val_loss_every", "checkpoint_every", "warmup_steps", "stall_steps"):
        if getattr(cfg, name) < 0:
            raise UserError(f"--{name}={getattr(cfg, name)} must be 0 or more")
    if cfg.log_every <= 0:
        raise UserError(f"--log_every={cfg.log_every} must be positive")
    if cfg.collective_timeout_s < 10:
        raise UserError(f"--collective_timeout_s={cfg.collective_timeout_s} must be at least 10 seconds: a rank "
                        f"waits this long for the others before the job stops (default "
                        f"{TrainConfig.collective_timeout_s})")
    if cfg.hellaswag_file and not cfg.hellaswag:
        raise UserError(f"--hellaswag_file={cfg.hellaswag_file!r} is read only by the HellaSwag evaluation: add "
                        f"--hellaswag=1, or drop --hellaswag_file")
    if not 0 <= cfg.profile_step <= cfg.num_iterations:  # else no step would be traced, and nothing would say so
        raise UserError(f"--profile_step={cfg.profile_step} must name a step from 1 to --num_iterations="
                        f"{cfg.num_iterations}, or be 0 for none")
    if cfg.vocab_size < VOCAB_SIZE:
        raise UserError(f"--vocab_size={cfg.vocab_size} is smaller than the shards' GPT-2 vocabulary of "
                        f"{VOCAB_SIZE} ids; keep the default --vocab_size={TrainConfig.vocab_size}")
    if cfg.kernels not in KERNEL_CHOICES:
        raise UserError(f"--kernels={cfg.kernels!r}: use auto (the fused kernels on CUDA), 1 (require them) or 0 "
                        f"(the plain model of model/gpt.py)")
    if cfg.attention_forward not in ATTENTION_FORWARDS:
        raise UserError(f"--attention_forward={cfg.attention_forward!r}: use bf16 (FlexAttention) or int8 (INT8/FP8 "
                        f"attention in validation and HellaSwag)")
    if not 0 <= cfg.normuon_beta2 < 1:
        raise UserError(f"--normuon_beta2={cfg.normuon_beta2} must be from 0 (plain Muon) to below 1; NorMuon's "
                        f"paper uses --normuon_beta2=0.95")
    for name, (low, high) in LR_RANGES.items():
        if not low <= getattr(cfg, name) <= high:  # also false for nan
            raise UserError(f"--{name}={getattr(cfg, name)} is outside {low:g} to {high:g}, the range a run can "
                            f"train in; the record uses --{name}={getattr(TrainConfig, name)}")
    if not -1 <= cfg.val_context < cfg.seq_len:
        raise UserError(f"--val_context={cfg.val_context} must be from 0 to --seq_len - 1 = {cfg.seq_len - 1}, "
                        f"or -1 for the model's receptive field at the longest window")
    mcfg = model_config(cfg)  # the layer lists and model checks, before any work
    val_context = cfg.val_context
    if val_context == -1:
        # whole blocks, so each scored token attends exactly as in the unbroken stream
        receptive_blocks = -(-receptive_field(mcfg, cfg.window_max_tokens) // BLOCK_SIZE)
        val_context = min(receptive_blocks * BLOCK_SIZE, cfg.seq_len // 2)
    return Derived(model=mcfg, device_batch_size=device_batch, grad_accum=cfg.batch_size // per_micro_step,
                   tokens_per_step=cfg.batch_size * cfg.seq_len, val_context=val_context,
                   momentum_warmup_steps=momentum_warmup)


def batch_fix(batch_size: int, device_batch: int, world_size: int) -> str:
    """The nearest flags that divide: a smaller device batch, another batch size, or fewer processes."""
    per_rank, left_over = divmod(batch_size, world_size)
    device_batch = max(device_batch, 1)
    if per_rank > 0 and not left_over:
        fit = max(d for d in range(1, min(device_batch, per_rank) + 1) if per_rank % d == 0)
        return f"try --device_batch_size={fit} (it must divide {per_rank}, the sequences per process and step)"
    step = device_batch * world_size
    fix = f"try --batch_size={max(batch_size // step, 1) * step}"
    if batch_size > 0 and batch_size % device_batch == 0:
        fewer = max(p for p in range(1, world_size) if batch_size // device_batch % p == 0)
        fix += (f", or keep --batch_size={batch_size} on {fewer} process{'es' * (fewer > 1)} "
                f"(NPROC={fewer} bash run.sh, or torchrun --nproc_per_node={fewer})")
    return fix


def layer_list(flag: str, value: str, num_layers: int, fallback: str = "''") -> tuple[int, ...]:
    """'0,7' -> (0, 7); a UserError names the flag and `fallback` for an entry that is not a layer."""
    try:
        layers = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
    except ValueError:
        raise UserError(f"--{flag}={value!r} must be comma-separated layer numbers, e.g. --{flag}=0,7, "
                        f"or --{flag}={fallback}") from None
    if not all(0 <= i < num_layers for i in layers):
        raise UserError(f"--{flag}={value!r} names a layer outside 0..{num_layers - 1} (--num_layers="
                        f"{num_layers}); pass layers inside it, or --{flag}={fallback}")
    return layers


def short_window_layers(cfg: TrainConfig) -> tuple[int, ...] | None:
    """The layers not named by --long_window_layers, or None for the model's default pattern ("auto")."""
    if cfg.long_window_layers == "auto":
        return None
    long = layer_list("long_window_layers", cfg.long_window_layers, cfg.num_layers, fallback="auto")
    return tuple(i for i in range(cfg.num_layers) if i not in long)


def no_attention_layers(cfg: TrainConfig) -> tuple[int, ...]:
    """The layers named by --no_attention_layers; "auto" is the record's cut at 12 layers, none at other depths."""
    if cfg.no_attention_layers == "auto":
        return RECORD_NO_ATTENTION_LAYERS if cfg.num_layers == TrainConfig.num_layers else ()
    return layer_list("no_attention_layers", cfg.no_attention_layers, cfg.num_layers, fallback="auto")


def model_config(cfg: TrainConfig) -> GPTConfig:
    with flag_checks():  # GPTConfig's fields are the flags of the same names
        return GPTConfig(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, model_dim=cfg.model_dim,
                         num_heads=cfg.num_heads, head_dim=cfg.head_dim, num_value_embeds=cfg.num_value_embeds,
                         logit_softcap=cfg.logit_softcap, block_size=BLOCK_SIZE, value_residual=cfg.value_residual,
                         backout=cfg.backout, key_offset=cfg.key_offset, short_window_layers=short_window_layers(cfg),
                         no_mlp_layers=layer_list("no_mlp_layers", cfg.no_mlp_layers, cfg.num_layers),
                         no_attention_layers=no_attention_layers(cfg))


def group_learning_rates(cfg: TrainConfig) -> dict[str, float]:
    """The base learning rate of each parameter group of GPT.param_groups; both embeddings share --lr_embed."""
    return {"hidden": cfg.lr_hidden, "embed": cfg.lr_embed, "value_embed": cfg.lr_embed, "head": cfg.lr_head,
            "scalar": cfg.lr_scalar}


def oom_advice(cfg: TrainConfig, device_batch_size: int) -> str:
    """Flags that need less memory per GPU and still pass derive()."""
    if device_batch_size > 1:
        # a divisor, so it still divides batch_size / world_size
        smaller = max(d for d in range(1, device_batch_size) if device_batch_size % d == 0)
        return (f"try --device_batch_size={smaller} (gradient accumulation keeps the global batch of "
                f"{cfg.batch_size} sequences)")
    if cfg.seq_len > BLOCK_SIZE:
        half = max(BLOCK_SIZE, cfg.seq_len // 2 // BLOCK_SIZE * BLOCK_SIZE)
        return (f"try --seq_len={half} --batch_size={cfg.batch_size * 2} (twice as many sequences, half as long: "
                f"about the same tokens per step)")
    return "even one sequence of 128 tokens does not fit: use a smaller model (--num_layers, --model_dim)"


def run_config(argv: list[str]) -> tuple[TrainConfig, list[str]]:
    """The run's config from its flags, and the changes a resume accepted ('name: saved -> new'). With --resume the
    checkpoint's config is the run's; flags beside it may change only RESUME_MAY_CHANGE."""
    given = parse_flags(TrainConfig, argv, PRESETS)
    if not given.get("resume"):
        return TrainConfig(**(PRESETS[given.get("preset", TrainConfig.preset)] | given)), []
    from runtime.checkpoint import OTHER_VERSION_FIX, saved_config  # imports torch

    saved = saved_config(given["resume"])
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if set(saved) != fields:
        odd = sorted(set(saved) ^ fields)
        raise UserError(f"--resume {given['resume']}: the checkpoint was written by another gpt-speedrun version (its "
                        f"config differs in the fields {', '.join(odd)}); resume it with that version: "
                        f"{OTHER_VERSION_FIX}")
    values = saved | (PRESETS[given["preset"]] if "preset" in given else {}) | given
    changed = [name for name in sorted(fields - {"resume"}) if values[name] != saved[name]]
    refused = [f"--{name}: {saved[name]!r} -> {values[name]!r}" for name in changed if name not in RESUME_MAY_CHANGE]
    if refused:
        raise UserError(f"--resume {given['resume']} continues its run exactly, and these flags would change its "
                        f"training math: {'; '.join(refused)}. Drop them to resume, or start a new run from scratch")
    return TrainConfig(**values), [f"{name}: {saved[name]!r} -> {values[name]!r}" for name in changed]


def fineweb_shards(argv: list[str], asked: str = "", world_size: int = 1) -> int:
    """FineWeb train shards run.sh fetches for these flags: `asked` (FINEWEB_SHARDS) if given, else the run's tokens
    with the alignment margin plus one shard. Checks the flags first, so a bad one stops run.sh before a download."""
    from data.cached_fineweb10B import TRAIN_SHARDS  # imports huggingface_hub, which training does not need

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


