"""runtime/memory.py: the parameter count of the plain model, the CPU memory estimate against measured peaks, and the
check that refuses a CPU run that would not fit, naming flags that do."""
import re

import pytest
import torch

from model.gpt import GPT
from runtime import memory
from runtime.config import PRESETS, TrainConfig, derive
from runtime.errors import UserError


def config(preset: str, **flags) -> TrainConfig:
    return TrainConfig(**(PRESETS[preset] | flags))


@pytest.mark.parametrize("preset", ["smoke", "tiny", "d12"])
def test_num_params_counts_the_models_parameters(preset):
    model_config = derive(config(preset), 1).model
    with torch.device("meta"):
        assert memory.num_params(model_config) == GPT(model_config).num_params()


@pytest.mark.parametrize("preset, flags, measured_gib", [
    ("smoke", {}, 1.36),  # peak RSS of `python train_gpt2.py --preset=smoke`, 2 CPU cores
    ("tiny", {"seq_len": 1024, "batch_size": 8, "device_batch_size": 8, "model_dim": 256, "num_heads": 4},
     15.54),  # the same, for a 4-layer model of width 256, 8 x 1024 tokens per micro-step
])
def test_the_estimate_covers_measured_peaks_closely(preset, flags, measured_gib):
    cfg = config(preset, **flags)
    derived = derive(cfg, 1)
    estimate = memory.cpu_bytes(derived.model, derived.device_batch_size, cfg.seq_len) / memory.GiB
    assert measured_gib <= estimate <= 1.3 * measured_gib, estimate


def test_a_cpu_run_that_does_not_fit_is_refused_with_flags_that_fit(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 20 * memory.GiB)
    record = config("d12")
    derived = derive(record, 1)
    with pytest.raises(UserError, match=r"this CPU run needs about \d+\.\d GiB of memory \(1 process\(es\): weights, "
                                        r"optimizer state and one micro-batch of 49,152 tokens\) and 20\.0 GiB are "
                                        r"available: --device_batch_size=1 --seq_len=(\d+) --batch_size=(\d+) fits; or "
                                        r"train a small model with --preset smoke") as error:
        memory.check_cpu_memory(derived.model, 1, record.seq_len, record.batch_size, 1)
    seq_len, batch_size = (int(v) for v in re.search(r"--seq_len=(\d+) --batch_size=(\d+)", str(error.value)).groups())
    fits = config("d12", seq_len=seq_len, batch_size=batch_size)
    assert memory.cpu_bytes(derive(fits, 1).model, 1, fits.seq_len) <= 20 * memory.GiB
    assert fits.seq_len * fits.batch_size == record.seq_len * record.batch_size  # the same tokens per step
    small = derive(config("smoke"), 2)
    memory.check_cpu_memory(small.model, small.device_batch_size, 256, 2, 2)  # fits: no error
    monkeypatch.setattr(memory, "available_bytes", lambda: None)  # unknown: no check
    memory.check_cpu_memory(derived.model, 1, record.seq_len, record.batch_size, 1)
