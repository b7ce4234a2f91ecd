"""The CLI generated from TrainConfig: flag syntax, presets, type errors, suggestions, derived numbers."""
import dataclasses
import re

import pytest

from runtime.cli import HELP_COLUMN, parse_config
from runtime.errors import UserError
from runtime.config import PRESETS, TrainConfig, derive, model_config


def test_defaults_are_the_record_run():
    cfg = parse_config(TrainConfig, [], PRESETS)
    assert cfg == TrainConfig()
    assert cfg.batch_size * cfg.seq_len == 393_216  # record #28's tokens per step (BENCHMARKS.md)
    assert derive(cfg, world_size=8).grad_accum == 1
    assert derive(cfg, world_size=1).grad_accum == 8


def test_val_context_resolves_to_the_receptive_field():
    """-1: long layers 0, 4, 11 move 1,792 - 128 tokens back each, the 8 short ones 896 - 128, one of them 127 more
    (layer 7 has no attention; model.config.receptive_field), rounded up to whole blocks; capped at half a sequence;
    an explicit value is kept."""
    assert derive(TrainConfig(), world_size=1).val_context == 88 * 128 == 3 * 1664 + 8 * 768 + 127 + 1
    # offset keys: each long layer moves a whole window back, to the end of the block before it, where layer 0 stops
    assert derive(TrainConfig(key_offset=True), world_size=1).val_context == 90 * 128 == 3 * 1792 + 8 * 768
    assert derive(TrainConfig(seq_len=16_384), world_size=1).val_context == 8_192
    assert derive(TrainConfig(val_context=0), world_size=1).val_context == 0


def test_both_flag_spellings_and_preset_then_flags():
    cfg = parse_config(TrainConfig, ["--preset", "smoke", "--seq_len=512", "--num_iterations", "7",
                                     "--compile=1", "--cooldown_frac", "0.5"], PRESETS)
    assert cfg.preset == "smoke"
    assert cfg.num_layers == PRESETS["smoke"]["num_layers"]  # from the preset
    assert (cfg.seq_len, cfg.num_iterations, cfg.compile, cfg.cooldown_frac) == (512, 7, True, 0.5)  # flags win


def test_every_field_is_a_flag_with_help(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(TrainConfig, ["--help"], PRESETS)
    assert e.value.code == 0
    out = capsys.readouterr().out
    columns = set()
    for f in dataclasses.fields(TrainConfig):
        line = next(l for l in out.splitlines() if l.strip().startswith(f"--{f.name}="))
        flag, text = line.strip().split("  ", 1)
        assert len(text.strip()) > 5, f"--{f.name} has no help text"
        if len(flag) <= HELP_COLUMN:
            columns.add(line.index(text.strip()))
    assert len(columns) == 1, columns  # the help texts start in one column


def test_unknown_flag_suggests_the_nearest():
    with pytest.raises(UserError, match=r"unknown flag --num_iteration; did you mean --num_iterations\?"):
        parse_config(TrainConfig, ["--num_iteration=5"], PRESETS)


@pytest.mark.parametrize("flag, expected", [("--num_iterations=abc", "an integer"), ("--cooldown_frac=x", "a number"),
                                            ("--compile=maybe", "1 or 0")])
def test_wrong_type_names_flag_and_expectation(flag, expected):
    with pytest.raises(UserError, match=f"{flag.split('=')[0]} expects {expected}"):
        parse_config(TrainConfig, [flag], PRESETS)


def test_attention_forward_names_its_choices():
    with pytest.raises(UserError, match=r"--attention_forward='fp4': use bf16 \(FlexAttention\) or int8"):
        derive(parse_config(TrainConfig, ["--attention_forward=fp4"], PRESETS), world_size=1)


def test_missing_value_and_unknown_preset():
    with pytest.raises(UserError, match="--seq_len needs a value"):
        parse_config(TrainConfig, ["--seq_len"], PRESETS)
    with pytest.raises(UserError, match="choose one of: d12, smoke"):
        parse_config(TrainConfig, ["--preset=huge"], PRESETS)


def test_grad_accum_must_divide():
    cfg = TrainConfig(batch_size=8, device_batch_size=3)
    with pytest.raises(ValueError, match=r"--batch_size=8 must be a positive multiple of --device_batch_size=3 x 2 "
                                         r"processes = 6; try --device_batch_size=2 \(it must divide 4, "):
        derive(cfg, world_size=2)
    assert derive(TrainConfig(batch_size=8, device_batch_size=2), world_size=2).grad_accum == 2


@pytest.mark.parametrize("batch, device_batch, world, fix", [
    (24, 5, 1, "try --device_batch_size=4 "),  # the largest divisor of 24 up to the 5 asked for
    (8, -1, 1, "try --device_batch_size=1 "),
    (3, 2, 2, "try --batch_size=4"),  # no device batch splits 3 sequences over 2 processes
    (2, 2, 8, "try --batch_size=16, or keep --batch_size=2 on 1 process (NPROC=1 bash run.sh, or torchrun "
              "--nproc_per_node=1)"),  # fewer sequences than processes
    (3, 1, 8, "try --batch_size=8, or keep --batch_size=3 on 3 processes (NPROC=3 "),  # --preset short on 8 GPUs
])
def test_batch_size_errors_name_a_fix_that_works(batch, device_batch, world, fix):
    with pytest.raises(UserError, match=re.escape(fix)) as error:
        derive(TrainConfig(batch_size=batch, device_batch_size=device_batch), world_size=world)
    flag, value = re.search(r"--(\w+)=(\d+)", str(error.value).split(";")[1]).groups()
    fixed = {"batch_size": batch, "device_batch_size": device_batch, flag: int(value)}
    assert derive(TrainConfig(**fixed), world_size=world).grad_accum >= 1  # the suggestion alone is enough
    fewer = re.search(r"on (\d+) process", str(error.value))
    if fewer:  # so is the other: the same batch on fewer processes
        assert derive(TrainConfig(batch_size=batch, device_batch_size=device_batch),
                      world_size=int(fewer.group(1))).grad_accum >= 1


@pytest.mark.parametrize("batch, world, device_batch", [(2, 1, 2), (2, 2, 1), (8, 2, 4), (3, 8, 1)])
def test_device_batch_zero_takes_all_of_a_process_sequences(batch, world, device_batch):
    """--device_batch_size=0 (the smoke preset's): one micro-step of all the sequences a process has, so the same
    flags run on one process or several; with fewer sequences than processes, the batch error says so."""
    cfg = TrainConfig(batch_size=batch, device_batch_size=0)
    if batch < world:
        with pytest.raises(UserError, match=rf"--batch_size={batch} must be a positive multiple"):
            derive(cfg, world)
        return
    derived = derive(cfg, world)
    assert (derived.device_batch_size, derived.grad_accum) == (device_batch, 1)


def test_momentum_warmup_of_every_step_follows_the_run_length():
    assert derive(TrainConfig(num_iterations=700, momentum_warmup_steps=-1), 1).momentum_warmup_steps == 700
    assert derive(TrainConfig(num_iterations=700), 1).momentum_warmup_steps == 300
    with pytest.raises(ValueError, match=r"--momentum_warmup_steps=-2 must be 0 or more \(0 = no warm-up\), or -1 "):
        derive(TrainConfig(momentum_warmup_steps=-2), 1)


def test_seq_len_must_be_a_multiple_of_the_block():
    with pytest.raises(ValueError, match=r"--seq_len=1000 must be a multiple of the attention block size 128; "
                                         r"try --seq_len=896"):
        derive(TrainConfig(seq_len=1000), world_size=1)


def test_layer_lists_reach_the_model():
    """--long_window_layers, --no_attention_layers and --no_mlp_layers become the model config's layer sets;
    "auto" keeps the model's own long/short pattern (record #28's: every 4th layer from each end is long)."""
    default = model_config(parse_config(TrainConfig, [], PRESETS))
    assert [i for i in range(12) if not default.is_short_window(i)] == [0, 4, 7, 11]
    assert (default.no_attention_layers, default.no_mlp_layers) == ((7,), ())
    custom = model_config(parse_config(TrainConfig, ["--long_window_layers=0,4,8,11", "--no_attention_layers=",
                                                     "--no_mlp_layers=0"], PRESETS))
    assert [i for i in range(12) if not custom.is_short_window(i)] == [0, 4, 8, 11]
    assert (custom.no_attention_layers, custom.no_mlp_layers) == ((), (0,))


@pytest.mark.parametrize("num_layers, cut", [(12, (7,)), (8, ()), (16, ()), (24, ())])
def test_record_attention_cut_only_at_the_records_depth(num_layers, cut):
    """--no_attention_layers=auto drops layer 7's attention at record #28's 12 layers only: a lone --num_layers
    (without a preset) must not carry the cut to a depth it was not found for; a list given keeps its layers."""
    cfg = parse_config(TrainConfig, [f"--num_layers={num_layers}"], PRESETS)
    assert model_config(cfg).no_attention_layers == cut
    named = parse_config(TrainConfig, [f"--num_layers={num_layers}", "--no_attention_layers=7"], PRESETS)
    assert model_config(named).no_attention_layers == (7,)


def test_flags_reach_the_config_and_the_model():
    """Booleans in any case, the preset's own name kept in the config (the log and resume's advice read it), and the
    flags that switch model parts on reaching GPTConfig (dropped there, they would train the plain model silently)."""
    cfg = parse_config(TrainConfig, ["--preset=smoke", "--compile=TRUE", "--fp8=False", "--backout=Yes",
                                     "--value_residual=true", "--key_offset=1"], PRESETS)
    assert (cfg.preset, cfg.compile, cfg.fp8) == ("smoke", True, False)
    model = model_config(cfg)
    assert (model.backout, model.value_residual, model.key_offset) == (True, True, True)
    assert model_config(parse_config(TrainConfig, ["--preset=smoke"], PRESETS)).key_offset is False
    with pytest.raises(UserError, match=r"--log_every=0 must be positive"):  # the loop divides by it
        derive(TrainConfig(log_every=0), world_size=1)


def test_help_groups_the_flags_and_shows_the_presets_values(capsys):
    """--help lists the flags under six groups, each with its value under the preset given beside it."""
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--preset", "smoke", "--help"], PRESETS)
    out = capsys.readouterr().out
    groups = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert groups == ["model", "optimizer", "schedule", "data", "run", "performance"]
    assert "--num_layers=2 " in out and "--preset='smoke'" in out and "--num_layers=12 " not in out
