"""Train time, stop requests, and RunControl: what happens after each step, decided alike on every rank."""
import dataclasses
import math
import os
import signal
import threading
import time

import torch

from runtime.errors import tell_torchrun


def all_finite(tensors) -> bool:
    """No inf/nan in any of the tensors; one device sync."""
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


# A second request this soon is the first arriving twice: Ctrl-C reaches the workers, then torchrun forwards its own
DUPLICATE_WINDOW_S = 2.0


class StopRequest:
    """SIGINT and SIGTERM until close(). The first sets `signal`: the loop stops cleanly at its next logged step.
    Another, DUPLICATE_WINDOW_S or more later, exits at once with 128 + signum, even inside a collective (where no
    Python handler runs): a thread reads set_wakeup_fd. Create it in the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.signal = 0
        self.first_at = 0.0
        self.prefix = f"rank {rank}: " if world_size > 1 else ""
        self.announce = rank == 0
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # set_wakeup_fd requires it
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        # a no-op handler: without one there is no wakeup byte
        self._previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in self.SIGNALS}
        self._watcher = threading.Thread(target=self._watch, name="stop-request", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Restore the previous handlers and wakeup fd; end the watcher."""
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._write)  # the watcher reads EOF and returns
        self._watcher.join()
        os.close(self._read)

    def _watch(self) -> None:
        while data := os.read(self._read, 64):
            for signum in data:
                if signum in self.SIGNALS:
                    self.receive(signum, time.monotonic())

    def receive(self, signum: int, now: float) -> None:
        """Act on signal `signum` received at `now` (time.monotonic())."""
        name = signal.Signals(signum).name
        if not self.signal:
            self.signal, self.first_at = signum, now
            if self.announce:
                say(f"{name}: stopping after the next logged step; a second SIGINT or SIGTERM, "
                    f"{DUPLICATE_WINDOW_S:g} s or more later, stops at once")
        elif now - self.first_at >= DUPLICATE_WINDOW_S:
            message = f"{self.prefix}{name} again: stopping at once, without a checkpoint (exit status {128 + signum})"
            say(message)
            tell_torchrun(message)
            os._exit(128 + signum)


def say(line: str) -> None:
    """`line` on stderr in one write, bypassing sys.stderr's lock (the main thread may hold it)."""
    os.write(2, f"{line}\n".encode())


class TrainClock:
    """Train time in ms from start() to stop() (both sync). A mark() between reads when the GPU reached that point of
    its queue, without draining it (CUDA events)."""

    def __init__(self, cuda: bool, ms: float = 0.0):
        self.cuda, self.ms = cuda, ms

    def start(self) -> None:
        self._sync()
        self.t0 = time.perf_counter()
        if self.cuda:
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()

    def stop(self) -> float:
        self._sync()
        self.ms += 1e3 * (time.perf_counter() - self.t0)
        return self.ms

    def mark(self):
        """A function returning the train time at this point of the GPU's queue."""
        base = self.ms
        if not self.cuda:
            at = 1e3 * (time.perf_counter() - self.t0)
            return lambda: base + at
        origin, event = self.origin, torch.cuda.Event(enable_timing=True)
        event.record()

        def read() -> float:
            event.synchronize()
            return base + origin.elapsed_time(event)
        return read

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


class LossRecord:
    """A step's train loss and stop votes, summed over the ranks by one collective (so every rank decides alike) and
    copied to the host without a sync (torch.full, not a tensor from a Python number)."""

    def __init__(self, step: int, loss: torch.Tensor, stop: bool, world_size: int, clock: TrainClock):
        flags = torch.stack([loss.float(), torch.full((), float(stop), device=loss.device)])
        if world_size > 1:
            torch.distributed.all_reduce(flags)
        self.step, self.world_size = step, world_size
        self.flags = torch.empty(2, pin_memory=flags.is_cuda)  # pinned, so the copy is not waited for
        self.flags.copy_(flags, non_blocking=True)
        self.time = clock.mark()  # after the copy, so reading it means the copy is done

    def read(self) -> tuple[float, bool, float]:
        """(mean train loss, whether any rank asked to stop, train ms at the step's end)."""
        ms = self.time()
        loss, votes = self.flags.tolist()
        return loss / self.world_size, votes > 0, ms


@dataclasses.dataclass(frozen=True)
class Decision:
    """After a step: checkpoint, stop (a stop request), or end with DIVERGED_EXIT for the reason given."""
    save: bool = False
    stop: bool = False
    diverged: str = ""


class RunControl:
    """Reads each logged loss a step late, so the GPU never waits (steps that validate or checkpoint read at once);
    declares divergence on a non-finite loss, non-finite weights before a checkpoint, or a fresh run's loss not below
    its first after `stall_steps`; turns a stop request into a last checkpoint and the end of the run."""

    def __init__(self, cfg, world_size: int, clock: TrainClock, log, stop: StopRequest, start_step: int):
        self.cfg, self.world_size, self.clock, self.log, self.stop = cfg, world_size, clock, log, stop
        self.start_step = start_step
        self.pending: LossRecord | None = None
        self.first_loss: float | None = None

    def validates(self, step: int) -> bool:
        """Whether step `step` (0 = before any update) validates."""
        every = self.cfg.val_loss_every
        return step == self.cfg.num_iterations or bool(every and step % every == 0) or step == self.start_step == 0

    def after_step(self, done: int, loss: torch.Tensor, parameters) -> Decision:
        """After update `done` (1-based), with its mean train loss as an unread 0-D tensor."""
        cfg = self.cfg
        checkpoint_due = bool(cfg.checkpoint_every) and (done % cfg.checkpoint_every == 0 or
                                                         done == cfg.num_iterations)
        at_once = checkpoint_due or self.validates(done)
        records = [self.pending] if self.pending else []
        self.pending = None
        if done % cfg.log_every == 0 or at_once:
            record = LossRecord(done, loss, self.stop.signal != 0, self.world_size, self.clock)
            if at_once:
                records.append(record)
            else:
                self.pending = record
        stopping = False
        while records:
            record = records.pop(0)
            train_loss, stop_votes, elapsed = record.read()
            saving = bool(cfg.checkpoint_every) and (checkpoint_due or stop_votes)
            if not math.isfinite(train_loss):
                return Decision(diverged=f"train loss is {train_loss} at step {record.step}")
            if saving and not all_finite(parameters):
                return Decision(diverged=f"the weights hold inf/nan at step {done}")
            if self.stalled(record.step, train_loss):
                return Decision(diverged=f"train loss is still {train_loss:.4f} at step {record.step}, not below "
                                         f"its first, {self.first_loss:.4f}: the run is not learning")
            self.log.step(record.step, cfg.num_iterations, elapsed, train_loss=train_loss)
            stopping = stopping or stop_votes
            if stopping and record.step < done and not records:
                # the vote was read a step late: log this step too, then stop (every rank read the same vote,
                # so all join the new record's collective)
                records.append(self.pending or LossRecord(done, loss, self.stop.signal != 0, self.world_size,
                                                          self.clock))
                self.pending = None
        return Decision(save=bool(cfg.checkpoint_every) and (checkpoint_due or stopping), stop=stopping)

    def stalled(self, step: int, train_loss: float) -> bool:
        if self.first_loss is None:
            self.first_loss = train_loss
        stall = self.cfg.stall_steps
        return bool(stall) and self.start_step == 0 and step >= stall and train_loss >= self.first_loss
