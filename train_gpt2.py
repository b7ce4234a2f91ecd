"""Train a GPT-2-class model as fast as the hardware allows: the story of one run, top to bottom.

    torchrun --standalone --nproc_per_node=8 train_gpt2.py            # the 124M speedrun (record config)
    python train_gpt2.py --preset smoke                                # tiny CPU run on the shipped sample

1. config  2. data  3. run folder  4. model and optimizer  5. compile warm-up, then restore
6. resume  7. the training loop  8. the end of the run

Every setting, its default (the record run) and the reason for it: TrainConfig in runtime/config.py.
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
from data.shard import FINEWEB_SHARD_TOKENS
from model.gpt import GPT
from model.head import IGNORE_INDEX
from optim.optimizer import MuonAdam
from optim.schedule import attention_window, lr_multiplier, muon_momentum
from runtime import checkpoint, dist
from runtime.bytecode import bytecode_note
from runtime.cli import parse_config
from runtime.config import (BLOCK_SIZE, PRESETS, RESUME_MAY_CHANGE, TrainConfig, derive, group_learning_rates,
                            oom_advice)
from runtime.errors import UserError, exit_on_user_error, tell_torchrun
from runtime.logger import RunLog
from runtime.memory import keep_freed_memory
from runtime.run import (LossRecord, StopRequest, TrainClock, all_finite, check_disk_space, make_run_dir, profiled,
                         use_static_launcher)

DIVERGED_EXIT = 3  # exit status when the loss or the weights become inf/nan (2 is a user error)


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
    if not cuda:
        keep_freed_memory()  # as run.sh's GLIBC_TUNABLES do, for a run started without it: twice as fast
    if cfg.resume:
        check_resume(cfg, argv)
    if cfg.profile_step and not cfg.profile_cpu and not cuda:
        raise UserError("--profile_cpu=0 traces the GPU's work alone, and this run has no GPU: drop it (a CPU run's "
                        "trace is of its ops)")
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
    dist.use_device_paths(model, device, fp8_head=cfg.fp8_head, fp8_forward=cfg.fp8_forward,
                          fp8_backward=cfg.fp8_backward)
    if cfg.fp8_head and cuda and not model.head.fp8:
        log.print(f"note: this GPU (compute capability {torch.cuda.get_device_capability(device)}) has no FP8 "
                  f"matrix units, so the LM head runs in bf16; pass --fp8_head 0 to make that explicit")
    if cfg.fp8_forward and cuda and not dist.fp8_forward_supported(device):
        log.print(f"note: the blocks' FP8 products are Hopper kernels (compute capability 9), and this GPU's is "
                  f"{torch.cuda.get_device_capability(device)}, so they run in bf16; pass --fp8_forward 0 to make "
                  f"that explicit")
    if cfg.compile:
        if cuda:
            use_static_launcher()
        model.compile_regions()
        if cuda and (note := bytecode_note(torch, sys.flags.dont_write_bytecode)):
            log.print(note)
    initial_weights = copy.deepcopy(model.state_dict())

    def new_optimizer():
        return MuonAdam(model.param_groups(), lr=group_learning_rates(cfg), rank=rt.rank, world_size=rt.world_size,
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
        dist.agree_on_scales(model, rt)  # the ranks' FP8 gradient scales, one history for the next step
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

    def save(step: int, train_time_ms: float) -> Path | None:
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
    clock = TrainClock(cuda, train_time_ms)
    clock.start()
    pending = None  # the last logged step's record, read once the next step is queued (runtime.run.LossRecord)
    for step in range(start_step, cfg.num_iterations + 1):
        last = step == cfg.num_iterations
        if last or (cfg.val_loss_every and step % cfg.val_loss_every == 0) or step == start_step == 0:
            train_time_ms = clock.stop()
            t_val = time.perf_counter()
            val_loss = validate(step)  # ends in .item(): the GPU's work is done when it returns
            log.step(step, cfg.num_iterations, train_time_ms, val_loss=val_loss,
                     val_time_s=time.perf_counter() - t_val)
            clock.start()
        if last:
            break

        if step + 1 == cfg.profile_step:
            loss_sum = profiled(train_step, step, run_dir if rt.is_master else None, cfg.profile_cpu)
        else:
            loss_sum = train_step(step)
        done = step + 1

        checkpoint_due = cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.num_iterations)
        # a step that validates, saves or ends the run reads its own record at once, so its line comes first
        at_once = (checkpoint_due or done == cfg.num_iterations
                   or bool(cfg.val_loss_every and done % cfg.val_loss_every == 0))
        records = [pending] if pending else []
        pending = None
        if done % cfg.log_every == 0 or at_once:
            # One collective carries the loss and any stop request, so every rank decides alike. The loss is
            # also checked before every checkpoint, so a checkpoint never holds a diverged model.
            record = LossRecord(done, loss_sum / derived.grad_accum, stop.signal != 0, rt.world_size, clock)
            if at_once:
                records.append(record)
            else:
                pending = record
        stopping = False
        while records:
            record = records.pop(0)
            train_loss, stop_votes, elapsed = record.read()
            # The loss lags the update by one step: an update that overflowed shows only in the weights.
            saving = cfg.checkpoint_every and (checkpoint_due or stop_votes)
            diverged = (f"train loss is {train_loss} at step {record.step}" if not math.isfinite(train_loss) else
                        f"the weights hold inf/nan at step {done}" if saving and not all_finite(model.parameters())
                        else "")
            if diverged:
                where = (f"the last good checkpoint is {last_checkpoint} (--resume it if a hardware fault caused "
                         f"this)" if last_checkpoint else "no checkpoint was written")
                message = (f"error: {diverged}; stopping, {where}. Restart with lower learning "
                           f"rates (--lr_hidden, --lr_embed, --lr_head, --lr_scalar)")
                log.print(message)
                tell_torchrun(message)  # every rank: torchrun's summary shows the first to exit
                log.close()
                return DIVERGED_EXIT
            log.step(record.step, cfg.num_iterations, elapsed, train_loss=train_loss)
            stopping = stopping or stop_votes
            if stopping and pending:  # the vote was read a step late: log the step queued since, then stop
                records.append(pending)
                pending = None
        if stopping:
            path = save(done, clock.stop()) if cfg.checkpoint_every else None
            log.print(f"stopped by a signal after step {done}" +
                      (f"; resume with --resume {path}" if path else " (no checkpoint: --checkpoint_every 0)"))
            log.close()
            return 0

        if checkpoint_due:
            last_checkpoint = save(done, clock.stop()) or last_checkpoint
            clock.start()

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
