"""Train a GPT-2-class model as fast as the hardware allows: the story of one run, top to bottom.

    torchrun --standalone --nproc_per_node=8 train_gpt2.py   # the 124M speedrun (record config)
    python train_gpt2.py --preset smoke                       # tiny CPU run on the shipped sample

Every setting and its default (the record run): TrainConfig in runtime/config.py.
"""
import copy
import math
import os
import resource
import sys
import time

import torch

from data.loader import TrainLoader, ValLoader
from data.prepare import ensure_sample_shards
from data.shard import FINEWEB_SHARD_TOKENS, check_shards
from evals.validation import choose_int8_layers, validation_loss
from optim.optimizer import MuonAdam
from optim.schedule import attention_window, lr_multiplier, muon_momentum
from runtime import checkpoint, dist
from runtime.backend import build_model, check_int8_attention
from runtime.bytecode import bytecode_note
from runtime.config import BLOCK_SIZE, Derived, TrainConfig, derive, group_learning_rates, oom_advice, run_config
from runtime.control import RunControl, StopRequest, TrainClock
from runtime.errors import UserError, exit_on_user_error, tell_torchrun
from runtime.logger import RunLog
from runtime.memory import check_cpu_memory, keep_freed_memory
from runtime.profile import profiled
from runtime.run import check_disk_space, make_run_dir, size, use_static_launcher

DIVERGED_EXIT = 3  # exit status for an inf/nan or stuck loss, or inf/nan weights (2: a user error)


def main(argv: list[str] | None = None) -> int:
    cfg, resume_changes = run_config(sys.argv[1:] if argv is None else argv)
    rt = dist.setup(cfg.device, cfg.collective_timeout_s)
    stop = StopRequest(rt.rank, rt.world_size)  # SIGINT/SIGTERM stop the run from here on
    try:
        return train(cfg, rt, resume_changes, stop)
    except torch.OutOfMemoryError:  # anywhere: the warm-up runs the first steps
        device_batch = derive(cfg, rt.world_size).device_batch_size
        raise UserError(f"CUDA out of memory at --device_batch_size={device_batch} --seq_len={cfg.seq_len}: "
                        f"{oom_advice(cfg, device_batch)}") from None
    finally:
        stop.close()
        dist.teardown()


def open_data(cfg: TrainConfig, derived: Derived, rt: dist.Runtime) -> tuple[TrainLoader, ValLoader]:
    """This rank's train and validation loaders, after the checks that fail before any work: enough tokens, no shard
    in both, valid headers and token ids."""
    train_files, val_files = cfg.train_files, cfg.val_files
    if "sample" in (train_files, val_files):  # tokenized on first use, race-safe
        sample_train, sample_val = ensure_sample_shards()
        train_files = sample_train if train_files == "sample" else train_files
        val_files = sample_val if val_files == "sample" else val_files
    train_loader = TrainLoader(train_files, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                               device_batch_size=derived.device_batch_size, rank=rt.rank, world_size=rt.world_size,
                               device=rt.device, align_to_bos=cfg.align_to_bos, cycle=cfg.cycle_data)
    have, need = sum(train_loader.counts), cfg.num_iterations * derived.tokens_per_step + 1
    if not cfg.cycle_data and have < need:  # need is a lower bound (BOS alignment skips tokens): sure to run out
        alignment = ", fewer with --align_to_bos=1, which skips to a document start per sequence" * cfg.align_to_bos
        raise UserError(f"the {len(train_loader.paths)} shard(s) matching --train_files={cfg.train_files!r} hold "
                        f"{have:,} tokens, but --num_iterations={cfg.num_iterations} x {derived.tokens_per_step:,} "
                        f"tokens/step needs at least {need:,}: add shards (FineWeb: `python data/cached_fineweb10B.py "
                        f"{math.ceil(need / FINEWEB_SHARD_TOKENS)}`), pass --cycle_data=1, or lower --num_iterations "
                        f"(at most {(have - 1) // derived.tokens_per_step} fit{alignment})")
    val_loader = ValLoader(val_files, val_tokens=cfg.val_tokens, seq_len=cfg.seq_len,
                           device_batch_size=derived.device_batch_size, rank=rt.rank, world_size=rt.world_size,
                           device=rt.device, context=derived.val_context)
    shared = sorted(set(map(os.path.realpath, train_loader.paths)) & set(map(os.path.realpath, val_loader.paths)))
    if shared:
        raise UserError(f"--train_files={cfg.train_files!r} and --val_files={cfg.val_files!r} share {len(shared)} "
                        f"shard(s) ({shared[0]}): validation would score tokens the model trains on; point them at "
                        f"different shards")
    check_shards(train_loader.paths_for(cfg.num_iterations) + val_loader.paths, vocab_size=cfg.vocab_size)
    return train_loader, val_loader


def train_step(model, optimizer: MuonAdam, loader: TrainLoader, window: torch.Tensor, grad_accum: int,
               lr_mult: float, momentum: float, rt: dist.Runtime) -> torch.Tensor:
    """One optimizer step over grad_accum micro-batches; returns the mean loss as an unread 0-D tensor (no sync)."""
    loss_sum = torch.zeros((), device=rt.device)
    for _ in range(grad_accum):
        inputs, targets = loader.next_batch()
        loss = model(inputs, targets, window)
        (loss / grad_accum).backward()
        loss_sum += loss.detach()
    dist.agree_on_max(model.scale_histories(), rt)  # one FP8 scale history on every rank
    optimizer.step(lr_mult, momentum)
    optimizer.zero_grad()
    return loss_sum / grad_accum


def train(cfg: TrainConfig, rt: dist.Runtime, resume_changes: list[str], stop: StopRequest) -> int:
    # ------------------------------------------------
    # 1. config and processes: everything that can be refused is refused before any work
    derived = derive(cfg, rt.world_size)
    device, cuda = rt.device, rt.device.type == "cuda"
    if not cuda:
        keep_freed_memory()
        check_cpu_memory(derived.model, derived.device_batch_size, cfg.seq_len, cfg.batch_size, rt.world_size)
    if cfg.profile_step and not cfg.profile_cpu and not cuda:
        raise UserError("--profile_cpu=0 traces the GPU's work alone, and this run has no GPU: drop it")
    if cfg.attention_forward == "int8":
        check_int8_attention(device, cfg.kernels, derived.model.head_dim)
    if cfg.hellaswag:  # its data file now, not after training
        from evals.hellaswag import check_available
        check_available(cfg.hellaswag_file or None)

    # ------------------------------------------------
    # 2. data: every rank reads its share of the same global token stream
    train_loader, val_loader = open_data(cfg, derived, rt)

    # ------------------------------------------------
    # 3. run folder and log, once config, data and free space are known to be good
    # killed runs' temporary checkpoints go first, so their space counts as free
    freed = checkpoint.remove_stale_temps(cfg.log_dir, cfg.resume) if rt.is_master else 0
    if cfg.checkpoint_every and rt.is_master:
        check_disk_space(cfg.log_dir, checkpoint.space_needed(derived.model), "checkpointing")
    run_dir = make_run_dir(cfg.log_dir, rt)
    log = RunLog(run_dir, cfg.num_iterations, derived.tokens_per_step, enabled=rt.is_master,
                 notes=[f"removed the half-written checkpoints of killed runs: {size(freed)} freed"] if freed else [])

    # ------------------------------------------------
    # 4. model and optimizer
    torch.manual_seed(cfg.seed)
    model, notes = build_model(derived.model, device, cfg.kernels, cfg.fp8, cfg.attention_forward)
    model.init_weights()
    if cfg.compile and cuda:
        use_static_launcher()
        model.compile_regions()
        notes.append(bytecode_note(torch, sys.flags.dont_write_bytecode))
    initial_weights = copy.deepcopy(model.state_dict())

    def new_optimizer() -> MuonAdam:
        return MuonAdam(model.param_groups(), lr=group_learning_rates(cfg), rank=rt.rank, world_size=rt.world_size,
                        muon_method=cfg.muon_method, normuon_beta2=cfg.normuon_beta2)

    optimizer = new_optimizer()
    log.header(cfg, derived.model, device)
    for note in [*notes, *(f"resume changes {change}" for change in resume_changes)]:
        if note:
            log.print(note)
    log.print(f"run folder {run_dir} | {rt.world_size} process(es) on {device} | {type(model).__name__} | "
              f"{model.num_params():,} parameters | {derived.tokens_per_step:,} tokens/step = {cfg.batch_size} x "
              f"{cfg.seq_len} | grad accumulation {derived.grad_accum} | validation {val_loader.num_steps} steps "
              f"({derived.val_context} tokens of context per sequence)")

    windows: dict[int, torch.Tensor] = {}  # one device tensor per window size: a growing window never recompiles

    def window_at(step: int) -> torch.Tensor:
        w = attention_window(step, cfg.num_iterations, cfg.window_min_tokens, cfg.window_max_tokens, BLOCK_SIZE)
        return windows.setdefault(w, torch.tensor(w, dtype=torch.int64, device=device))

    def step_at(step: int, loader: TrainLoader) -> torch.Tensor:
        return train_step(model, optimizer, loader, window_at(step), derived.grad_accum,
                          lr_multiplier(step, cfg.num_iterations, cfg.cooldown_frac, cfg.final_lr_frac),
                          muon_momentum(step, derived.momentum_warmup_steps, cfg.momentum_start, cfg.momentum_end),
                          rt)

    # ------------------------------------------------
    # 5. warm-up: compile in a few untimed steps, then restore the initial state (the records' rule)
    if cfg.warmup_steps:
        t0, loader_start = time.perf_counter(), train_loader.state_dict()
        for step in range(cfg.warmup_steps):
            step_at(min(step, cfg.num_iterations), train_loader)  # a run shorter than the warm-up repeats its last
        model.scored_loss_sum(*next(iter(val_loader)), window_at(0))  # compiles what validation adds
        if cuda:
            torch.cuda.synchronize()
        model.load_state_dict(initial_weights)
        optimizer = new_optimizer()
        train_loader.load_state_dict(loader_start)
        log.print(f"warm-up: {cfg.warmup_steps} steps + 1 validation batch in {time.perf_counter() - t0:.1f}s "
                  f"(compile included), initial state restored")
    del initial_weights

    # ------------------------------------------------
    # 6. resume: continue exactly where a checkpoint left off (run_config checked it)
    start_step, train_time_ms, last_checkpoint = 0, 0.0, cfg.resume or None
    if cfg.resume:
        start_step, train_time_ms = checkpoint.restore(cfg.resume, model, optimizer, train_loader)
        log.print(f"resumed from {checkpoint.resolve(cfg.resume)} at step {start_step}")

    # ------------------------------------------------
    # 7. the training loop: validation and checkpoints pause the clock
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    clock = TrainClock(cuda, train_time_ms)
    control = RunControl(cfg, rt.world_size, clock, log, stop, start_step)
    parameters = list(model.parameters())
    clock.start()
    for step in range(start_step, cfg.num_iterations + 1):
        if control.validates(step):
            train_time_ms = clock.stop()
            t_val = time.perf_counter()
            if cfg.attention_forward == "int8":  # the layers' errors change as the model trains
                log.print(choose_int8_layers(model, next(iter(val_loader))[0], window_at(step), rt))
            val_loss = validation_loss(model, val_loader, window_at(step), rt)
            log.step(step, cfg.num_iterations, train_time_ms, val_loss=val_loss,
                     val_time_s=time.perf_counter() - t_val)
            clock.start()
        if step == cfg.num_iterations:
            break
        if step + 1 == cfg.profile_step:
            loss = profiled(lambda s: step_at(s, train_loader), step, run_dir if rt.is_master else None,
                            cfg.profile_cpu)
        else:
            loss = step_at(step, train_loader)
        decision = control.after_step(step + 1, loss, parameters)
        if decision.diverged:
            where = (f"the last good checkpoint is {last_checkpoint} (--resume it if a hardware fault caused this)"
                     if last_checkpoint else "no checkpoint was written")
            message = (f"error: {decision.diverged}; stopping, {where}. Restart with lower learning rates "
                       f"(--lr_hidden, --lr_embed, --lr_head, --lr_scalar)")
            log.print(message)
            tell_torchrun(message)  # every rank: torchrun's summary shows the first to exit
            log.close()
            return DIVERGED_EXIT
        if decision.save:
            saved = checkpoint.save_run(run_dir, step + 1, clock.stop(), model, optimizer, train_loader, cfg,
                                        derived.model) if rt.is_master else None
            last_checkpoint = saved or last_checkpoint
            if saved:
                log.print(f"checkpoint: {saved}")
            clock.start()
        if decision.stop:
            log.print(f"stopped by a signal after step {step + 1}" + (f"; resume with --resume {last_checkpoint}"
                      if cfg.checkpoint_every else " (no checkpoint: --checkpoint_every 0)"))
            log.close()
            return 0

    # ------------------------------------------------
    # 8. the end: optional HellaSwag, memory
    if cfg.hellaswag:
        from evals.hellaswag import evaluate_hellaswag
        accuracy = evaluate_hellaswag(model, rt, path=cfg.hellaswag_file or None,
                                      int8_attention=cfg.attention_forward == "int8")
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
