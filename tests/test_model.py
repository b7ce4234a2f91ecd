"""model/gpt.py, the plain model: zero-init and the ln(V) first loss, untied head, softcap bound, parameter groups,
reductions, causality and document isolation on both attention backends, a tiny model that learns, the gate, the
U-net skips, the backout and the receptive field. model/fast's FastGPT is tested against it in tests/test_fast.py,
the key offset in tests/test_key_offset.py."""

import dataclasses
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model.attention import attend, dense_mask
from model.config import flops_per_token, mean_context, receptive_field, short_window
from model.gpt import GPT, IGNORE_INDEX, GPTConfig, apply_rotary, rotary_tables

BOS = 0
TINY = GPTConfig(vocab_size=256, num_layers=4, model_dim=64, num_heads=2, head_dim=32, num_value_embeds=1,
                 block_size=32, bos_id=BOS)
BACKOUT = dataclasses.replace(TINY, backout=True)
KEY_OFFSET = dataclasses.replace(TINY, key_offset=True)  # layers 0 and 3 long, so offset; 1 and 2 short
T = 128


def tiny_model(config=TINY, backend="sdpa", random=False) -> GPT:
    """Seeded tiny model in fp32; `random` replaces the zero-initialised projections and head by random weights so
    that information flows through attention (a zero-init model would pass causality tests trivially)."""
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    model.configure(torch.device("cpu"))
    model.attention_backend = backend
    if random:
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.3 if p.ndim >= 2 else 1.0)
    return model


def batch(vocab=TINY.vocab_size, bos=BOS, seed=0):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(1, vocab, (2, T), generator=g)
    inputs[:, 0] = bos
    inputs[0, [37, 90]] = bos
    targets = torch.randint(0, vocab, (2, T), generator=g)
    return inputs, targets


def no_grad_for(backend):
    # FlexAttention has no CPU backward, so its CPU checks run forward-only
    return torch.no_grad() if backend == "flex" else torch.enable_grad()


def test_zero_init_and_initial_loss_is_ln_vocab():
    config = GPTConfig(num_layers=2, model_dim=64, num_heads=2, head_dim=32, num_value_embeds=1, block_size=32)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    model.attention_backend = "sdpa"
    for block in model.blocks:
        assert not block.attn.proj_w.any() and not block.mlp.proj_w.any()
    assert not model.head.weight.any()
    inputs, targets = batch(config.vocab_size, config.bos_id)
    loss = model(inputs, targets, torch.tensor(T))  # default bf16 compute
    assert abs(loss.item() - math.log(50304)) < 1e-3


def test_head_and_embedding_do_not_share_storage():
    model = tiny_model()
    assert model.head.weight.untyped_storage().data_ptr() != model.embed.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        model.head.weight.fill_(1.0)
    assert not torch.equal(model.embed.weight, model.head.weight)


def test_logits_never_exceed_softcap():
    model = tiny_model(random=True)
    with torch.no_grad():
        model.head.weight.normal_(0.0, 100.0)  # raw logits in the thousands
        logits = model.logits(*batch()[:1], torch.tensor(T))
    assert logits.dtype == torch.float32
    assert logits.abs().max() <= TINY.logit_softcap
    assert logits.abs().max() > 0.99 * TINY.logit_softcap  # the cap was active, not merely unreached


def test_param_groups_cover_every_parameter_once():
    model = tiny_model()
    groups = model.param_groups()
    assert [(g["kind"], g["name"]) for g in groups] == [("muon", "hidden"), ("adam", "embed"), ("adam", "value_embed"),
                                                       ("adam", "head"), ("adam", "scalar")]
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    hidden = groups[0]["params"]
    assert len(hidden) == 5 * TINY.num_layers and all(p.ndim >= 2 for p in hidden)
    # qkv, attention output, attention gate (2 heads x 64 / 64 inputs), MLP in and out (both stored (D, F))
    assert [tuple(p.shape) for p in hidden[:5]] == [(3, 64, 64), (64, 64), (2, 1), (64, 256), (64, 256)]
    assert all(p.ndim <= 1 for p in groups[4]["params"])
    no_ve = tiny_model(dataclasses.replace(TINY, num_value_embeds=0))
    assert "value_embed" not in [g["name"] for g in no_ve.param_groups()]


def test_default_config_sizes():
    with torch.device("meta"):
        model = GPT(GPTConfig())
    # 5 vocab x 768 tables (embed, 3 value embeds, head) + 12 blocks x (12 * 768^2 matrices + 6 x 12 gate weights
    # + 5 scalars) + 6 skips (GPTConfig keeps every block; TrainConfig drops layer 7's attention)
    assert model.num_params() == 5 * 50304 * 768 + 12 * (12 * 768 ** 2 + 72 + 5) + 6 == 278_102_946
    # 6 * N_matmul (12 * 12 * 768^2 + 50304 * 768 = 123,568,128) = 741,408,768; attention at T = window = 1024:
    # 4 long layers 12 * 768 * 512.5 + 8 short layers 12 * 768 * 352.5 = 44,881,920: a short layer's window of 4
    # blocks sees p + 1 keys in the first 4 blocks (mean 256.5), 3 blocks and the own block's r + 1 after (448.5)
    assert flops_per_token(GPTConfig(), 1024, 1024) == 786_290_688
    assert flops_per_token(GPTConfig(), 1024, 256) < flops_per_token(GPTConfig(), 1024, 1024)
    config = GPTConfig()
    assert [config.value_embed_index(i) for i in range(12)] == [0, 1, 2] + [None] * 6 + [0, 1, 2]
    assert [i for i in range(12) if config.is_short_window(i)] == [1, 2, 3, 5, 6, 8, 9, 10]


def test_init_is_reproducible_from_meta():
    with torch.device("meta"):
        model = GPT(TINY)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reference = tiny_model()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    assert model.blocks[0].lambdas.tolist() == [1.0, 0.0] and model.skip_weights.tolist() == [1.0, 1.0]


def test_reductions_agree_and_ignore_minus_100():
    model = tiny_model(random=True)
    inputs, targets = batch()
    targets[0, :10] = -100
    targets[1, 50] = -100
    window = torch.tensor(64)
    per_token = model(inputs, targets, window, reduction="none")
    assert per_token.shape == (2, T)
    assert torch.all(per_token[targets == -100] == 0) and torch.all(per_token[targets != -100] > 0)
    total = model(inputs, targets, window, reduction="sum")
    mean = model(inputs, targets, window)
    assert torch.allclose(total, per_token.sum(), rtol=1e-5)
    assert torch.allclose(mean, total / (targets != -100).sum(), rtol=1e-5)
    with pytest.raises(ValueError, match="reduction"):
        model(inputs, targets, window, reduction="avg")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_causality_and_document_isolation(backend):
    model = tiny_model(backend=backend, random=True)
    inputs, _ = batch()  # row 0: documents [0, 37), [37, 90), [90, 128)
    window = torch.tensor(T)
    with no_grad_for(backend), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is unfused
        base = model.logits(inputs, window)
        future = inputs.clone()
        future[1, 100] = 7 if inputs[1, 100] != 7 else 8
        changed = model.logits(future, window)
        other_doc = inputs.clone()
        for t in (60, 89):  # 89: the last token before a document start
            other_doc[0, t] = 7 if inputs[0, t] != 7 else 8
        isolated = model.logits(other_doc, window)
    # exact: masked keys get weight exp(-inf) = 0, so nothing of them can leak in
    assert torch.equal(changed[1, :100], base[1, :100]) and torch.equal(changed[0], base[0])
    assert not torch.allclose(changed[1, 100:], base[1, 100:])  # the change is visible where it is allowed
    assert torch.equal(isolated[0, :37], base[0, :37]) and torch.equal(isolated[0, 90:], base[0, 90:])
    assert not torch.allclose(isolated[0, 60:90], base[0, 60:90])


def test_flex_and_sdpa_models_agree():
    sdpa, flex = tiny_model(random=True), tiny_model(backend="flex", random=True)
    inputs, targets = batch()
    for window in (32, 80, T):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = sdpa(inputs, targets, torch.tensor(window), reduction="none")
            b = flex(inputs, targets, torch.tensor(window), reduction="none")
        assert (a - b).abs().max() < 1e-4  # fp32; losses of order 10 with random weights


@pytest.mark.parametrize("config", [TINY, BACKOUT], ids=["plain", "backout"])
def test_every_parameter_gets_a_gradient(config):
    model = tiny_model(config, random=True)
    model(*batch(), torch.tensor(64)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("num_layers", [1, 3])
def test_every_parameter_gets_a_gradient_at_odd_depths(num_layers):
    """One block has no U-net skip at all; three blocks leave the middle one unpaired."""
    config = dataclasses.replace(TINY, num_layers=num_layers, num_value_embeds=num_layers // 2)
    model = tiny_model(config, random=True)
    model(*batch(), torch.tensor(64)).backward()
    for name, p in model.named_parameters():  # an unpaired block whose output were dropped would get zeros
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert sum(len(g["params"]) for g in model.param_groups()) == len(list(model.parameters()))


def test_user_errors():
    model = tiny_model(backend="flex")
    inputs, targets = batch()
    with pytest.raises(ValueError, match="attention_backend 'sdpa'"):
        model(inputs, targets, torch.tensor(64))
    with torch.no_grad(), pytest.raises(ValueError, match="multiple of the attention block size"):
        model(inputs[:, :100], targets[:, :100], torch.tensor(64))
    with pytest.raises(ValueError, match=r"num_value_embeds=3 must be between 0 and num_layers // 2 = 2: .*; try "
                                         r"num_value_embeds=2$"):
        GPTConfig(num_layers=4, num_value_embeds=3)
    for bad, words in (({"num_layers": 0}, "num_layers=0 must be positive"),
                       ({"model_dim": 0}, "model_dim=0 must be positive"),
                       ({"head_dim": 6}, "head_dim=6 must be a multiple of 4"),
                       ({"bos_id": 50304}, "bos_id=50304 must be a token id below vocab_size=50304"),
                       ({"short_window_layers": (12,)}, r"short_window_layers=\(12,\) must be layer indices")):
        with pytest.raises(ValueError, match=words):
            GPTConfig(**bad)
    for cap in (0.0, -1.0, math.inf, math.nan):  # nan would pass a plain `<= 0` test and poison the loss
        with pytest.raises(ValueError, match=r"logit_softcap=.* must be a positive finite number"):
            GPTConfig(logit_softcap=cap)


@pytest.mark.gpu
def test_flex_refuses_heads_below_16_on_the_gpu():
    """Inductor's FlexAttention lowering fails deep inside a compile for heads of fewer than 16 channels; the model
    says so first, naming the setting."""
    model = tiny_model(dataclasses.replace(TINY, model_dim=16, head_dim=8), backend="flex").cuda()
    inputs, targets = batch()
    with torch.no_grad(), pytest.raises(ValueError, match="head_dim=8: FlexAttention's GPU kernels need at least 16"):
        model(inputs.cuda(), targets.cuda(), torch.tensor(64, device="cuda"))


def test_tiny_model_learns_a_repeating_pattern():
    """50 AdamW steps on a periodic sequence in the default bf16 compute: the loss must fall far below ln(V)."""
    model = tiny_model()
    model.compute_dtype = torch.bfloat16
    seq_len = 64  # two attention blocks: small, because bf16 matmuls are emulated on most CPUs
    pattern = torch.randint(1, TINY.vocab_size, (16,), generator=torch.Generator().manual_seed(3))
    stream = torch.cat([torch.tensor([BOS]), pattern.repeat(seq_len // 16 + 1)])
    inputs, targets = stream[:seq_len].repeat(2, 1), stream[1:seq_len + 1].repeat(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for _ in range(50):
        loss = model(inputs, targets, torch.tensor(seq_len))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert abs(losses[0] - math.log(TINY.vocab_size)) < 1e-3
    assert losses[-1] < 0.01 * losses[0], losses[::10]  # measured: 5.55 -> 0.0006 (the rows are memorisable)


PARTIAL = dataclasses.replace(TINY, no_mlp_layers=(0,), no_attention_layers=(2,))


def test_blocks_without_mlp_or_attention_equal_zeroed_ones():
    """A block without an MLP (attention) computes exactly what a complete block computes when that part's output
    projection is zero, so dropping it (record #28) changes the FLOPs, not the function."""
    partial = tiny_model(PARTIAL, random=True)
    assert partial.blocks[0].mlp is None and partial.blocks[2].attn is None
    complete = tiny_model(random=True)
    state = {k: v for k, v in complete.state_dict().items()}
    state.update(partial.state_dict())
    complete.load_state_dict(state)
    with torch.no_grad():
        complete.blocks[0].mlp.proj_w.zero_()
        complete.blocks[2].attn.proj_w.zero_()
    inputs, targets = batch()
    window = torch.tensor(64)
    torch.testing.assert_close(partial(inputs, targets, window, reduction="none"),
                               complete(inputs, targets, window, reduction="none"), rtol=0, atol=0)
    partial(inputs, targets, window).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in partial.parameters())


def test_zero_attention_gate_halves_each_head():
    """Record #28's gate starts at sigmoid(0) = 1/2 for every head and token: the gated output is exactly half the
    ungated heads' projected output (scaling by 1/2 is exact in floating point). The gate then learns: its weights
    get a gradient."""
    model = tiny_model(random=True)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.gate_w.zero_()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, T, TINY.num_heads, TINY.head_dim, generator=g) for _ in range(3))
    x = torch.randn(2, T, TINY.model_dim, generator=g)
    mask = dense_mask(torch.zeros(2, T, dtype=torch.int32), torch.tensor(64), TINY.block_size)
    gated = attn.attend_and_project(q, k, v, x[..., :attn.gate_w.size(1)], mask)
    heads = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, attn.scale).transpose(1, 2)
    torch.testing.assert_close(gated, 0.5 * F.linear(heads.flatten(2), attn.proj_w), rtol=0, atol=0)
    inputs, targets = batch()
    model(inputs, targets, torch.tensor(64)).backward()
    assert all(block.attn.gate_w.grad.abs().sum() > 0 for block in model.blocks)


def test_mean_context_counts_the_keys_of_the_attention_rule():
    """mean_context (plain Python, for the FLOPs count) against the keys the SDPA mask lets each query see, in one
    document: the window in whole blocks, a short last block included."""
    for seq_len, window, block_size in ((128, 64, 32), (100, 40, 16), (96, 500, 32), (64, 1, 16)):
        mask = dense_mask(torch.zeros(1, seq_len, dtype=torch.int32), torch.tensor(window), block_size)
        assert mean_context(seq_len, window, block_size) == pytest.approx(mask.sum().item() / seq_len, rel=1e-15)


def test_dropped_parts_leave_the_flops_count():
    A, D = TINY.num_heads * TINY.head_dim, TINY.model_dim
    mlp0 = 6 * 2 * TINY.mlp_ratio * D * D
    attn2 = 6 * 4 * A * D + 12 * A * mean_context(T, int(short_window(torch.tensor(T), TINY.block_size)),
                                                  TINY.block_size)
    assert TINY.is_short_window(2)
    assert flops_per_token(PARTIAL, T, T) == pytest.approx(flops_per_token(TINY, T, T) - mlp0 - attn2)


def test_partial_block_config_errors():
    with pytest.raises(ValueError, match="layer 0 must keep its attention"):
        GPTConfig(value_residual=True, no_attention_layers=(0,))
    GPTConfig(no_attention_layers=(0,))  # fine without the value residual
    with pytest.raises(ValueError, match="no_mlp_layers"):
        GPTConfig(num_layers=4, num_value_embeds=1, no_mlp_layers=(4,))
    # a value embedding read by no layer would never get a gradient; the advice keeps the ones that are read
    with pytest.raises(ValueError, match=re.escape("value embedding 0 feeds layers [0, 2], which no_attention_layers="
                                                   "[0, 2] leaves without attention") + ".*num_value_embeds=0$"):
        GPTConfig(num_layers=3, num_value_embeds=1, no_attention_layers=(0, 2))
    # without any attention no token sees another, whatever else the config says
    for value_embeds in (0, 1):
        with pytest.raises(ValueError, match=re.escape("no_attention_layers=[1, 0] names every layer: no token would "
                                                       "see an earlier one; keep attention in at least one layer")):
            GPTConfig(num_layers=2, num_value_embeds=value_embeds, no_attention_layers=(1, 0))
    with pytest.raises(ValueError, match=r"value embedding 1 feeds layers \[1, 10\].*num_value_embeds=2$"):
        GPTConfig(no_attention_layers=(1, 10))
    GPTConfig(no_attention_layers=(1, 10), num_value_embeds=2)  # the advice: layers (0, 10) and (1, 11)
    GPTConfig(no_attention_layers=(0, 11))  # each embedding keeps a reader: layers 9 and 2


# layers 0 and 3 long (64 = 2 blocks), 1 and 2 short (32 = 1 block): each moves 64 - 32 or 0 tokens back from a
# block's end to a block's end, and one reaches on to the first token of its block, 31 further. Offset keys reach
# one position before their window's first block, the end of the block before: from 255, layer 3 reaches 191,
# layers 2 and 1 160, layer 0 127.
@pytest.mark.parametrize("config, reach", [(TINY, 2 * 32 + 2 * 0 + 31), (KEY_OFFSET, 255 - 127)],
                         ids=["plain", "key_offset"])
def test_receptive_field_is_how_far_back_an_input_reaches(config, reach):
    """In one long document, changing the input token receptive_field() positions before a query changes the
    output there; one position further back it changes nothing, bit for bit (masked keys weigh exactly 0)."""
    window = 64
    rf = receptive_field(config, window)
    assert rf == reach
    model = tiny_model(config, random=True)
    inputs = torch.randint(1, TINY.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    inputs[0, 0] = BOS

    def output_at(q, changed=None):
        x = inputs.clone()
        if changed is not None:
            x[0, changed] = 1 + x[0, changed] % (TINY.vocab_size - 1)  # another token, never BOS
        with torch.no_grad():
            return model.hidden_states(x, torch.tensor(window))[0, q]

    # the last token of a block reaches rf back; the first token of one reaches 31 less (windows are whole blocks)
    for q, reach in ((255, rf), (224, rf - 31)):
        base = output_at(q)
        assert not torch.equal(output_at(q, q - reach), base)
        assert torch.equal(output_at(q, q - reach - 1), base)


@pytest.mark.parametrize("num_layers", [1, 4, 5])
def test_backout_adds_its_weight_times_the_stream_entering_the_middle_block(num_layers):
    """The backout's output is the plain model's plus its weight times the stream that enters block L // 2 (at odd
    depths and one block, too); the weight starts at -0.2 and sits in the scalar group."""
    config = dataclasses.replace(BACKOUT, num_layers=num_layers, num_value_embeds=num_layers // 2)
    backout = tiny_model(config)
    assert backout.backout_weight.tolist() == pytest.approx([-0.2])
    assert any(p is backout.backout_weight for p in backout.param_groups()[-1]["params"])
    plain = tiny_model(dataclasses.replace(config, backout=False), random=True)
    backout.load_state_dict(plain.state_dict(), strict=False)
    entering = []
    plain.blocks[num_layers // 2].register_forward_pre_hook(lambda module, args: entering.append(args[0]))
    inputs, window = batch()[0], torch.tensor(64)
    with torch.no_grad():
        expected = plain.hidden_states(inputs, window) - 0.2 * entering[0]
        got = backout.hidden_states(inputs, window)
    assert (got - expected).abs().max() < 1e-5


BLOCK_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
               "full_q_num_blocks", "full_q_indices")


def test_compiled_attention_inputs_equal_eager():
    """compile_regions compiles the masks and rotary tables in one graph (dynamo traces BlockMask.from_kv_blocks and
    hands back each BlockMask with its mask_mod): the same block lists, the same mask_mod answers, the same tables."""
    model = tiny_model(backend="flex")
    inputs, _ = batch()
    window = torch.tensor(3 * TINY.block_size)
    eager_masks, *eager_tables = model.attention_inputs(inputs, window)
    masks, *tables = torch.compile(model.attention_inputs, backend="aot_eager", fullgraph=True)(inputs, window)
    grid = (torch.arange(2)[:, None, None, None], torch.zeros(1, 1, 1, 1, dtype=torch.int64),
            torch.arange(T)[:, None], torch.arange(T)[None, :])
    for short in (False, True):
        for name in BLOCK_LISTS:
            assert torch.equal(getattr(masks[short], name), getattr(eager_masks[short], name)), (short, name)
        assert torch.equal(masks[short].mask_mod(*grid), eager_masks[short].mask_mod(*grid))
    assert all(torch.equal(a, b) for a, b in zip(tables, eager_tables))


def test_scored_loss_sum_is_the_loss_of_the_scored_tokens():
    """GPT.scored_loss_sum (validation's sum): the head sees only the scored rows, nothing keeps a gradient, and the
    sum is the model's; a batch where nothing is scored sums to 0."""
    model = tiny_model(random=True)
    inputs, targets = batch()
    targets[1, :T // 2] = IGNORE_INDEX
    with torch.no_grad():
        want = model(inputs, targets, torch.tensor(T), reduction="sum")
    head_rows = []
    model.head.register_forward_pre_hook(lambda _, args: head_rows.append(args[0].shape[:2]))
    got = model.scored_loss_sum(inputs, targets, torch.tensor(T))
    assert head_rows == [(1, T + T // 2)] and not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert model.scored_loss_sum(inputs, torch.full_like(targets, IGNORE_INDEX), torch.tensor(T)).item() == 0


def test_rotary_scores_depend_on_the_offset_only():
    """RoPE's point: q·k after the rotation depends on the two positions only through their offset, and the rotation
    keeps each vector's norm. Half the pairs (frequency 0) do not turn at all."""
    torch.manual_seed(0)
    T, head_dim = 24, 16
    cos, sin = rotary_tables(T, head_dim, 1024.0, torch.device("cpu"))
    q, k = torch.randn(head_dim, dtype=torch.float64), torch.randn(head_dim, dtype=torch.float64)
    q_T, k_T = (apply_rotary(v.float().expand(1, T, 1, head_dim), cos, sin)[0, :, 0].double() for v in (q, k))
    torch.testing.assert_close(q_T.norm(dim=-1), q.norm().expand(T), rtol=1e-6, atol=0)
    for offset in (0, 3, 10):
        scores = (q_T[offset:] * k_T[:T - offset]).sum(-1)  # query at t + offset, key at t, for every t
        torch.testing.assert_close(scores, scores[:1].expand_as(scores), rtol=0, atol=1e-5)
    still = torch.cat([torch.arange(head_dim // 4, head_dim // 2), torch.arange(3 * head_dim // 4, head_dim)])
    torch.testing.assert_close(q_T[:, still], q[still].float().double().expand(T, -1), rtol=0, atol=0)


def test_unet_skips_pair_block_i_with_block_l_minus_1_minus_i():
    """The second half's blocks read the stream plus the mirrored first-half block's output times its own skip weight:
    block 2 of 4 adds block 1's output times skip_weights[0], block 3 adds block 0's times skip_weights[1]. At init
    every block is the identity and the weights are 1, so only random weights tell the pairs apart."""
    model = tiny_model(TINY, random=True)
    inputs, outputs = {}, {}
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda _, args, i=i: inputs.__setitem__(i, args[0].detach()))
        block.register_forward_hook(lambda _, args, out, i=i: outputs.__setitem__(i, out[0].detach()))
    with torch.no_grad():
        model(*batch(), torch.tensor(64))
    w = model.skip_weights.detach()
    assert not torch.equal(w[0], w[1])
    torch.testing.assert_close(inputs[1], outputs[0], rtol=0, atol=0)  # first half: no skip
    torch.testing.assert_close(inputs[2], outputs[1] + w[0] * outputs[1])
    torch.testing.assert_close(inputs[3], outputs[2] + w[1] * outputs[0])
