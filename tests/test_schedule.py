"""optim/schedule.py: endpoints pinned exactly, monotone in between, bad arguments name their flag."""
import pytest

from optim.schedule import attention_window, lr_multiplier, muon_momentum


def test_lr_multiplier_is_flat_then_linear_to_final_frac():
    n, cooldown = 1000, 0.4  # the cooldown starts at step 600
    assert lr_multiplier(0, n, cooldown) == 1.0
    assert lr_multiplier(599, n, cooldown) == 1.0
    assert lr_multiplier(600, n, cooldown) == 1.0
    assert lr_multiplier(800, n, cooldown) == pytest.approx(0.55)  # halfway from 1.0 to 0.1
    assert lr_multiplier(999, n, cooldown) == pytest.approx(0.1 + 0.9 / 400)
    assert lr_multiplier(n, n, cooldown) == 0.1
    assert lr_multiplier(n, n, cooldown, final_frac=0.0) == 0.0
    values = [lr_multiplier(s, n, cooldown) for s in range(n + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert all(a > b for a, b in zip(values[600:], values[601:]))


def test_lr_multiplier_edge_fractions():
    assert [lr_multiplier(s, 10, 0.0) for s in (0, 9, 10)] == [1.0, 1.0, 1.0]
    assert lr_multiplier(0, 10, 1.0) == 1.0
    assert lr_multiplier(5, 10, 1.0) == pytest.approx(0.55)
    assert lr_multiplier(10, 10, 1.0) == 0.1


def test_muon_momentum_warms_up_then_holds():
    assert muon_momentum(0) == 0.85
    assert muon_momentum(150) == pytest.approx(0.90)
    assert muon_momentum(300) == 0.95
    assert muon_momentum(10_000) == 0.95
    assert muon_momentum(0, warmup_steps=0) == 0.95
    values = [muon_momentum(s) for s in range(400)]
    assert all(a < b for a, b in zip(values[:300], values[1:301]))
    assert all(v == 0.95 for v in values[300:])


def test_attention_window_grows_in_whole_blocks_from_min_to_max():
    n, lo, hi, block = 1000, 128, 1792, 128
    assert attention_window(0, n, lo, hi, block) == lo
    assert attention_window(n, n, lo, hi, block) == hi
    assert attention_window(1, n, lo, hi, block) == lo + block  # rounded up, never lagging the ramp
    assert attention_window(500, n, lo, hi, block) == 128 * 8  # 1 block + ceil(13 blocks * 0.5) = 8 blocks
    assert attention_window(n - 1, n, lo, hi, block) == hi
    windows = [attention_window(s, n, lo, hi, block) for s in range(n + 1)]
    assert all(w % block == 0 and lo <= w <= hi for w in windows)
    assert all(a <= b for a, b in zip(windows, windows[1:]))
    assert len(set(windows)) == hi // block - lo // block + 1  # every block count is visited
    assert attention_window(7, 10, 256, 256, 128) == 256


@pytest.mark.parametrize("call, flag", [
    (lambda: lr_multiplier(0, 10, 1.5), "--cooldown_frac"),
    (lambda: lr_multiplier(0, 10, -0.1), "--cooldown_frac"),
    (lambda: lr_multiplier(0, 0, 0.5), "--num_iterations"),
    (lambda: lr_multiplier(0, 10, 0.5, final_frac=2.0), "--final_lr_frac"),
    (lambda: lr_multiplier(0, 10, 0.5, final_frac=-0.1), "--final_lr_frac"),  # would end the cooldown below 0
    (lambda: muon_momentum(0, warmup_steps=-1), "--momentum_warmup_steps"),
    (lambda: muon_momentum(0, start=1.0), "--momentum_start"),
    (lambda: muon_momentum(0, end=-0.5), "--momentum_end"),
    (lambda: muon_momentum(0, end=1.0), "--momentum_end"),  # momentum 1 never forgets: the range is [0, 1)
    (lambda: muon_momentum(0, end=1.5), "--momentum_end"),
    (lambda: attention_window(0, 10, 100, 256, 128), "--window_min_tokens"),
    (lambda: attention_window(0, 10, 128, 300, 128), "--window_max_tokens"),
    (lambda: attention_window(0, 10, 0, 256, 128), "--window_min_tokens"),  # 0 is a multiple, but no window
    (lambda: attention_window(0, 10, 512, 256, 128), "--window_min_tokens"),
    (lambda: attention_window(0, 0, 128, 256, 128), "--num_iterations"),
])
def test_bad_arguments_raise_value_errors_naming_the_flag(call, flag):
    with pytest.raises(ValueError, match=flag):
        call()
