"""The GPT-2-shaped presets: standard shapes, parameter counts (built on the meta device, no memory) and batch
settings that fit one GPU and eight."""
import pytest
import torch

from model.gpt import GPT
from runtime.config import PRESETS, TrainConfig, derive, model_config

# (layers, width, heads) of GPT-2 small, medium, large and XL (Radford et al. 2019, table 2); d12 keeps the
# speedrun's 6 heads of 128 instead of 12 of 64 (the same attention width)
GPT2_SHAPES = {"d12": (12, 768, 6), "d24": (24, 1024, 16), "d36": (36, 1280, 20), "d48": (48, 1600, 25)}

# Computed once by hand with V = 50,304, three value embeddings of width A = D, blocks of 12 D^2 weights + 5
# scalars + an attention gate of H x D/64 weights, and L // 2 skip weights:
#   d12: 5 x 50,304 x 768  + 12 x (12 x 768^2  + 5 + 6 x 12) +  6 = 278,102,946, less layer 7's attention
#        (4 x 768^2 + 3 value weights + 72 gate weights), as in record #28:               275,743,575
#   d24: 5 x 50,304 x 1024 + 24 x (12 x 1024^2 + 5 + 16 x 16) + 12 =   559,552,644
#   d36: 5 x 50,304 x 1280 + 36 x (12 x 1280^2 + 5 + 20 x 20) + 18 = 1,029,748,998
#   d48: 5 x 50,304 x 1600 + 48 x (12 x 1600^2 + 5 + 25 x 25) + 24 = 1,877,022,264
# The blocks' square matrices alone (85M, 302M, 708M, 1,475M) are GPT-2's non-embedding counts; the names 124M ...
# 1.5B count GPT-2's tied embedding once, while this model adds an untied head and three value embeddings.
EXPECTED_PARAMS = {"d12": 275_743_575, "d24": 559_552_644, "d36": 1_029_748_998, "d48": 1_877_022_264}


def formula(cfg: TrainConfig) -> int:
    """Parameter count from the shape, term by term."""
    V, D, L = cfg.vocab_size, cfg.model_dim, cfg.num_layers
    A = cfg.num_heads * cfg.head_dim  # attention width
    embeddings = V * D + cfg.num_value_embeds * V * A + V * D  # token embedding, value embeddings, untied head
    gate = cfg.num_heads * (D // 64)  # attention gate: one weight per head and input channel
    matrices = 3 * A * D + D * A + gate + 2 * 4 * D * D  # q, k, v; attention output; gate; MLP in and out
    scalars = 3 + 2  # value mixing weights (own, first layer, value embedding); residual / x0 mix
    dropped = (len(model_config(cfg).no_mlp_layers) * 2 * 4 * D * D
               + len(model_config(cfg).no_attention_layers) * (3 * A * D + D * A + gate + 3))
    return embeddings + L * (matrices + scalars) + L // 2 - dropped  # + U-net skip weights


@pytest.mark.parametrize("name", list(GPT2_SHAPES))
def test_preset_shape_and_parameter_count(name):
    cfg = TrainConfig(**PRESETS[name])
    layers, width, heads = GPT2_SHAPES[name]
    assert (cfg.num_layers, cfg.model_dim, cfg.num_heads) == (layers, width, heads)
    assert cfg.num_heads * cfg.head_dim == cfg.model_dim
    with torch.device("meta"):
        model = GPT(model_config(cfg))
    assert model.num_params() == formula(cfg) == EXPECTED_PARAMS[name]
    block_matrices = sum(p.numel() for block in model.blocks for p in block.parameters() if p.ndim >= 2)
    mcfg = model_config(cfg)
    complete = cfg.num_layers - len(mcfg.no_mlp_layers) * 8 / 12 - len(mcfg.no_attention_layers) * 4 / 12
    gates = (cfg.num_layers - len(mcfg.no_attention_layers)) * cfg.num_heads * (cfg.model_dim // 64)
    assert block_matrices == complete * 12 * cfg.model_dim ** 2 + gates


@pytest.mark.parametrize("name", list(GPT2_SHAPES))
@pytest.mark.parametrize("world_size", [1, 8])
def test_preset_batch_fits_one_and_eight_gpus(name, world_size):
    cfg = TrainConfig(**PRESETS[name])
    derived = derive(cfg, world_size)
    assert derived.grad_accum * cfg.device_batch_size * world_size == cfg.batch_size
    assert derived.tokens_per_step == cfg.batch_size * cfg.seq_len


def test_short_preset_is_the_candidate_model_on_a_shorter_schedule():
    """The time-to-loss figures of bench/results are the record candidate's model (the record's with the ideas that
    won there): the preset may change the batch, the schedule, Muon's coefficients (and how often it logs, as those
    runs did) only, and its momentum warm-up ends at its last step (450, the runs' value)."""
    short, candidate = TrainConfig(**PRESETS["short"]), TrainConfig(**PRESETS["record_candidate"])
    changed = {f for f in TrainConfig.__dataclass_fields__ if getattr(short, f) != getattr(candidate, f)}
    assert changed == {"batch_size", "num_iterations", "cooldown_frac", "momentum_warmup_steps", "val_loss_every",
                       "log_every", "muon_method"}
    assert short.log_every == 20
    assert model_config(short) == model_config(candidate) != model_config(TrainConfig())
    assert short.key_offset and not TrainConfig().key_offset
    assert derive(short, 1).momentum_warmup_steps == short.num_iterations == 450
    assert derive(short, 1).tokens_per_step == 3 * 48 * 1024
