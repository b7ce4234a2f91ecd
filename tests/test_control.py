"""runtime/control.py's RunControl, without a model: which steps it logs and when, checkpoints, stops on a request,
and declares diverged (a non-finite loss, non-finite weights before a checkpoint, a stuck loss)."""
import math
from types import SimpleNamespace

import torch

from runtime.config import TrainConfig
from runtime.control import RunControl, TrainClock


class Log:
    def __init__(self):
        self.lines = []

    def step(self, step, total, train_time_ms, train_loss=None, **_):
        self.lines.append((step, train_loss))


def control(start_step=0, **flags) -> tuple[RunControl, Log, SimpleNamespace]:
    cfg = TrainConfig(**({"num_iterations": 10, "val_loss_every": 0, "log_every": 1} | flags))
    log, stop = Log(), SimpleNamespace(signal=0)
    clock = TrainClock(cuda=False)
    clock.start()
    return RunControl(cfg, 1, clock, log, stop, start_step), log, stop


def run(ctl: RunControl, losses: dict[int, float], weights=(torch.ones(3),)) -> list:
    """after_step for each step in `losses`; the decisions."""
    return [ctl.after_step(step, torch.tensor(loss), list(weights)) for step, loss in losses.items()]


def test_each_loss_is_logged_a_step_late_except_where_the_step_validates_or_ends():
    ctl, log, _ = control(val_loss_every=3, num_iterations=5)
    decisions = []
    for step in range(1, 6):
        decisions.append(ctl.after_step(step, torch.tensor(10.0 - step), [torch.ones(2)]))
        logged = [s for s, _ in log.lines]
        # step 3 validates and step 5 ends the run: each reads its own loss at once, after the one queued before it
        assert logged == {1: [], 2: [1], 3: [1, 2, 3], 4: [1, 2, 3], 5: [1, 2, 3, 4, 5]}[step], (step, logged)
    assert [loss for _, loss in log.lines] == [9.0, 8.0, 7.0, 6.0, 5.0]
    assert not any(d.save or d.stop or d.diverged for d in decisions)


def test_checkpoints_where_due_and_at_the_end():
    ctl, _, _ = control(checkpoint_every=4)
    saves = [step for step, d in zip(range(1, 11), run(ctl, {s: 5.0 for s in range(1, 11)})) if d.save]
    assert saves == [4, 8, 10]


def test_a_stop_request_is_acted_on_alike_and_logs_the_queued_step():
    """The vote rides on the next logged record; the step queued since is logged too, and a checkpoint follows when
    checkpoints are on."""
    for every, save in ((0, False), (5, True)):
        ctl, log, stop = control(checkpoint_every=every)
        assert not any(d.stop for d in run(ctl, {1: 5.0, 2: 4.0}))
        stop.signal = 15
        first = ctl.after_step(3, torch.tensor(3.0), [torch.ones(1)])  # votes now, read a step late
        second = ctl.after_step(4, torch.tensor(2.0), [torch.ones(1)])
        assert not first.stop and second.stop and second.save == save
        assert [s for s, _ in log.lines] == [1, 2, 3, 4]


def test_a_non_finite_loss_or_weights_before_a_checkpoint_diverge():
    ctl, _, _ = control()
    assert run(ctl, {1: 5.0, 2: math.nan, 3: 4.0})[-1].diverged == "train loss is nan at step 2"
    ctl, _, _ = control(checkpoint_every=2)
    bad = (torch.tensor([1.0, math.inf]),)
    decisions = run(ctl, {1: 5.0, 2: 4.0}, weights=bad)
    assert not decisions[0].diverged  # no checkpoint at step 1: the weights are not read
    assert decisions[1].diverged == "the weights hold inf/nan at step 2" and not decisions[1].save


def test_a_stuck_loss_is_declared_diverged_after_stall_steps():
    """A fresh run whose loss is not below its first after --stall_steps steps is stuck; a resumed run, whose first
    loss after the resume says nothing of its start, is not checked; --stall_steps=0 turns the check off."""
    ctl, _, _ = control(stall_steps=4)
    decisions = run(ctl, {s: math.log(50304) for s in range(1, 6)})
    assert [bool(d.diverged) for d in decisions] == [False, False, False, False, True]
    assert decisions[-1].diverged == ("train loss is still 10.8258 at step 4, not below its first, 10.8258: the run "
                                      "is not learning")  # step 4, read a step late
    ctl, _, _ = control(stall_steps=4)
    assert not any(d.diverged for d in run(ctl, {1: 10.8, 2: 9.0, 3: 10.0, 4: 10.7, 5: 10.79}))
    for start, stall in ((3, 4), (0, 0)):
        ctl, _, _ = control(start_step=start, stall_steps=stall)
        assert not any(d.diverged for d in run(ctl, {s: 10.8 for s in range(start + 1, start + 7)}))
