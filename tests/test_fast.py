"""model/fast's FastGPT against the plain GPT of model/gpt.py: the same parameters, initialisation and losses, the
same gradients on the CPU (through the fused paths' torch ops), and on the GPU (compiled, kernels, FP8) within the
roundings of bf16 and FP8 at the record's shape; and its compiled regions: one graph per block pattern, repeatable
inductor options, validation reusing the training graphs, no zero gradients filled for outputs nothing reads."""
import dataclasses
import glob

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from helpers import recorded_compile  # noqa: E402
from model.fast import gpt as fast_module  # noqa: E402
from model.fast.gpt import FastGPT  # noqa: E402
from model.fast.routing import add_all  # noqa: E402
from model.gpt import GPT, IGNORE_INDEX, GPTConfig  # noqa: E402
from test_model import BOS, T, TINY, batch  # noqa: E402

CPU = torch.device("cpu")


def pair(config=TINY, random=True) -> tuple[FastGPT, GPT]:
    """A FastGPT and a GPT from the same seed, both configured for the CPU (fp32, SDPA); `random` replaces every
    weight by a random one (as test_model.tiny_model does), in both alike."""
    models = []
    for cls in (FastGPT, GPT):
        torch.manual_seed(0)
        model = cls(config)
        model.init_weights()
        model.configure(CPU)
        if random:
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0.0, 0.3 if p.ndim >= 2 else 1.0)
        models.append(model)
    return models[0], models[1]


def test_same_parameters_initialisation_and_state():
    """FastGPT declares GPT's parameters under the same names and draws the same initial values; its FP8 histories
    (grad_amax buffers) load into a plain GPT, which drops them, and a plain state loads into FastGPT, which starts
    them at 0."""
    fast, plain = pair(random=False)
    assert fast.state_dict().keys() - plain.state_dict().keys() == {n for n, _ in fast.named_buffers()}
    for name, value in plain.state_dict().items():
        assert torch.equal(fast.state_dict()[name], value), name
    for amax in fast.scale_histories() or [b for n, b in fast.named_buffers()]:
        amax.fill_(3.0)
    plain.load_state_dict(fast.state_dict())
    fast.load_state_dict(plain.state_dict())
    assert all(b.item() == 0 for _, b in fast.named_buffers())


@pytest.mark.parametrize("key_offset", [False, True], ids=["plain", "key_offset"])
def test_routed_gradients_equal_the_plain_models(key_offset):
    """TableRows, FanOut and SkipAdd only route gradients, and the fused head's loss and gradient are the plain
    head's: over two micro-batches each parameter's accumulated gradient equals the plain model's (fp32, SDPA), with
    the key offset too."""
    config = dataclasses.replace(TINY, num_value_embeds=2, key_offset=key_offset)
    fast, plain = pair(config)
    micro_batches = [batch(seed=0), batch(seed=1)]
    grads, losses = [], []
    for model in (fast, plain):
        for inputs, targets in micro_batches:
            loss = model(inputs, targets, torch.tensor(T))
            loss.backward()
            losses.append(loss.item())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert losses[:2] == pytest.approx(losses[2:], rel=1e-6)
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert all(emb.weight.grad.abs().sum() > 0 for emb in (fast.embed, *fast.value_embeds))


@pytest.mark.parametrize("kwargs, options", [
    ({}, fast_module.REPEATABLE_COMPILE),
    ({"options": {"shape_padding": True, "max_autotune": False}},  # given options are kept, and win
     fast_module.REPEATABLE_COMPILE | {"shape_padding": True, "max_autotune": False}),
    ({"backend": "aot_eager"}, None),  # options are inductor's
    ({"mode": "max-autotune-no-cudagraphs"}, None),  # torch.compile takes a mode or options, not both
])
def test_compile_regions_asks_inductor_for_repeatable_kernels(monkeypatch, kwargs, options):
    """compile_regions gives every region compiled by inductor the options under which two processes make the same
    kernels (REPEATABLE_COMPILE), the masks' graph persistent reductions off as well. torch.compile rejects an option
    this torch does not know when it is called."""
    calls = []
    real_compile = torch.compile

    def spy(fn, **given):
        calls.append(given)
        return real_compile(fn, **given)

    monkeypatch.setattr(torch, "compile", spy)
    model, _ = pair(random=False)
    with torch._dynamo.config.patch(recompile_limit=8):  # compile_regions raises it; undone after
        model.compile_regions(**kwargs)
    assert len(calls) == 5 + TINY.num_layers  # embeddings, masks, each block, head, x0's gradient sum, x0's norm
    if options is None:
        assert all("options" not in c for c in calls)
        return
    masks = [c for c in calls if c["options"].get("triton.persistent_reductions") is False]
    assert len(masks) == 1 and masks[0]["options"] == options | {"triton.persistent_reductions": False}
    assert all(c["options"] == options for c in calls if c is not masks[0])
    assert all(c["dynamic"] is False and c["fullgraph"] is True for c in calls)


@pytest.mark.parametrize("parts, graphs", [
    ({"no_attention_layers": (3,)}, 6),  # the record's patterns: value embedding or not, a layer without attention
    ({"no_attention_layers": (3,), "no_mlp_layers": (0, 5), "value_residual": True}, 10),  # five: past the limit 8
    ({"no_attention_layers": (3,), "key_offset": True}, 8),  # the long layers 0 and 5 offset their keys
])
def test_compiled_regions_compile_one_graph_per_block_pattern(parts, graphs):
    """Training and validation together compile one block graph per presence pattern and mode; the embeddings, x0's
    norm, the masks and the head once per mode; x0's gradient sum once; no recompile for the first block, whose x
    starts as x0, and none past dynamo's limit (a fullgraph failure)."""
    config = dataclasses.replace(TINY, num_layers=6, num_value_embeds=2, **parts)
    model, _ = pair(config, random=False)
    inputs, targets = batch()
    with recorded_compile(model) as traced:
        model(inputs, targets, torch.tensor(T)).backward()
        with torch.no_grad():
            model(inputs, targets, torch.tensor(T))
    blocks = [gm for gm in traced if "lambdas" in gm.code]  # every block mixes x0 in
    assert len(traced) == graphs + 9
    assert len(blocks) == graphs


def test_validation_reuses_the_training_graphs_of_a_compiled_model():
    """FastGPT.scored_loss_sum, compiled: the blocks run with autograd on, so that after a training step a validation
    batch compiles one graph only, the head's for the sum, under no_grad; the head sees the whole batch (one shape).
    The sum is the model's, and 0 where nothing is scored."""
    model, _ = pair(dataclasses.replace(TINY, num_layers=4, num_value_embeds=2))
    inputs, targets = batch()
    targets[1, :T // 2] = IGNORE_INDEX
    with torch.no_grad():
        want = model(inputs, targets, torch.tensor(T), reduction="sum")
    with recorded_compile(model) as traced:
        model.compiled = True
        model(inputs, targets, torch.tensor(T)).backward()
        trained = len(traced)
        head_rows = []
        model.head.register_forward_pre_hook(lambda _, args: head_rows.append(args[0].shape[:2]))
        got = model.scored_loss_sum(inputs, targets, torch.tensor(T))
        assert len(traced) - trained == 1 and "sum" in traced[-1].code
    assert head_rows == [(2, T)] and not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert model.scored_loss_sum(inputs, torch.full_like(targets, IGNORE_INDEX), torch.tensor(T)).item() == 0


class ZeroFills(TorchDispatchMode):
    """Records the shape of every tensor that an op creates filled with zeros."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.zeros.default:
            self.shapes.append(tuple(args[0]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("value_residual", [False, True])
def test_compiled_backward_fills_no_zero_gradient_for_unread_outputs(value_residual):
    """A compiled region's backward gets a gradient for every output, and autograd fills zeros for an output nothing
    read: only the block whose values the value residual shares returns them, and the later blocks still read
    them."""
    model, _ = pair(dataclasses.replace(TINY, value_residual=value_residual))
    model.compile_regions(backend="aot_eager")  # aot_autograd's runtime fills the zeros, whatever the backend
    model.add_gradients = add_all  # dynamo runs nothing under a dispatch mode (ZeroFills); this makes no zeros
    inputs, targets = batch()
    model(inputs, targets, torch.tensor(64)).backward()  # compiles outside the recording
    loss = model(inputs, targets, torch.tensor(64))
    with ZeroFills() as fills:
        loss.backward()
    assert [shape for shape in fills.shapes if len(shape) > 0] == []  # scalar zeros are the only ones left
    first_value_weights = [block.attn.value_lambdas.grad[1].item() for block in model.blocks[1:]]
    assert all((w != 0) == value_residual for w in first_value_weights), first_value_weights


# ---- on the GPU: the accelerated model against the plain model at the record's shape ------------------------------

RECORD = GPTConfig(no_attention_layers=(7,))  # record #28's model (runtime.config's default flags)
RECORD_T = 48 * 1024
RECORD_WINDOW = 1792


def record_batches(count: int):
    """`count` (inputs, targets) pairs of one 49,152-token sequence each, from the sample corpus's training shard."""
    from data.loader import TrainLoader
    from data.prepare import ensure_sample_shards

    loader = TrainLoader(ensure_sample_shards()[0], seq_len=RECORD_T, batch_size=1, device_batch_size=1, rank=0,
                         world_size=1, device=torch.device("cuda"), align_to_bos=True, cycle=True)
    return [loader.next_batch() for _ in range(count)]


def reference_loss(model: GPT, inputs, targets, window) -> torch.Tensor:
    """The plain model's mean loss in fp32, its blocks recomputed in the backward and its head in chunks of tokens
    (torch.utils.checkpoint): the same math in the memory of one GPU."""
    checkpoint = torch.utils.checkpoint.checkpoint
    hidden = model.hidden_states(inputs, window)
    chunks = [checkpoint(lambda h, t: model.head(h, t, "sum"), h, t, use_reentrant=False)
              for h, t in zip(hidden.split(RECORD_T // 8, dim=1), targets.split(RECORD_T // 8, dim=1))]
    return torch.stack(chunks).sum() / (targets != IGNORE_INDEX).sum()


def checkpointed_blocks(model: GPT) -> None:
    for block in model.blocks:
        forward = block.forward
        block.forward = lambda *args, forward=forward: torch.utils.checkpoint.checkpoint(forward, *args,
                                                                                          use_reentrant=False)


def cosines(a: dict, b: dict) -> dict[str, float]:
    return {name: F.cosine_similarity(a[name].flatten().double(), b[name].flatten().double(), dim=0).item()
            for name in a}


@pytest.mark.gpu
def test_the_accelerated_model_is_the_model_at_the_record_shape():
    """From the same weights, on a record-shaped batch (one 49,152-token sequence of text), FastGPT compiled with its
    kernels and FP8 (its gradient scales set by one backward) against the plain GPT in fp32, at step 0 and after 20
    identical optimizer steps (the plain model's updates, given to both, so both stand at the same weights; FastGPT's
    FP8 scales follow its own gradients): the losses agree within 0.5% (relative); every matrix's gradient has cosine
    similarity >= 0.99 with the plain model's; every scalar parameter's gradient error is under 0.14 of the plain
    gradient's RMS over the steps, the scale Adam divides it by (0.14: the error a cosine of 0.99 allows). A
    scalar's gradient is a sum over every token that passes near zero as it settles, so its cosine measures noise
    there, and plain bf16 math falls below 0.99 on some steps."""
    from optim.optimizer import MuonAdam
    from runtime.config import TrainConfig, group_learning_rates

    device = torch.device("cuda")
    torch.manual_seed(0)
    fast = FastGPT(RECORD).to(device)
    fast.init_weights()
    with torch.no_grad():  # non-zero output projections and head: every parameter gets a gradient at step 0
        for block in fast.blocks:
            for part in (block.attn, block.mlp):
                if part is not None:
                    part.proj_w.normal_(std=0.02)
        fast.head.weight.normal_(std=0.02)
    fast.configure(device, fp8=True)
    assert all(fast.fp8_in_use().values())
    plain = GPT(RECORD).to(device).configure(device)
    plain.load_state_dict(fast.state_dict())
    plain.compute_dtype = torch.float32
    checkpointed_blocks(plain)
    fast.compile_regions()
    window = torch.tensor(RECORD_WINDOW, device=device)
    batches = record_batches(21)
    # the FP8 backward scales each gradient copy by its site's previous amax (zero before any): one backward first,
    # as the previous micro-batch does in training
    fast(*batches[0], window).backward()
    fast.zero_grad(set_to_none=True)
    lr = group_learning_rates(TrainConfig())
    optimizer = MuonAdam(plain.param_groups(), lr=lr, normuon_beta2=0.95)
    plain_params = dict(plain.named_parameters())
    scalars = [name for name, p in plain_params.items() if p.ndim < 2]
    plain_scalar_grads, fast_scalar_grads = [], {}
    for step, (inputs, targets) in enumerate(batches):
        losses, grads = [], []
        for model, loss_of in ((fast, lambda m, *a: m(*a)), (plain, reference_loss)):
            loss = loss_of(model, inputs, targets, window)
            loss.backward()
            losses.append(loss.item())
            grads.append({name: p.grad.detach().double() for name, p in model.named_parameters()})
        plain_scalar_grads.append({name: grads[1][name] for name in scalars})
        if step in (0, 20):
            fast_scalar_grads[step] = {name: grads[0][name] for name in scalars}
            cos = cosines(*({n: g for n, g in side.items() if n not in scalars} for side in grads))
            worst = min(cos, key=cos.get)
            print(f"step {step}: loss fast {losses[0]:.6f} plain {losses[1]:.6f} "
                  f"(relative {abs(losses[0] / losses[1] - 1):.2e}); lowest matrix gradient cosine {cos[worst]:.5f} "
                  f"({worst}); median {sorted(cos.values())[len(cos) // 2]:.5f}")
            assert abs(losses[0] / losses[1] - 1) < 5e-3, losses
            assert all(c >= 0.99 for c in cos.values()), {n: c for n, c in cos.items() if c < 0.99}
        # the plain model's update, given to both: the next comparison stands at the same weights
        optimizer.step(1.0, 0.95)
        optimizer.zero_grad()
        fast.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in fast.named_parameters():
                p.copy_(plain_params[name])
    errors = {}
    for name in scalars:
        rms = torch.stack([g[name].norm() for g in plain_scalar_grads]).pow(2).mean().sqrt()
        for step, fast_grads in fast_scalar_grads.items():
            errors[name, step] = ((fast_grads[name] - plain_scalar_grads[step][name]).norm() / rms).item()
    worst = max(errors, key=errors.get)
    print(f"scalar parameters: largest gradient error {errors[worst]:.4f} of the plain gradient's RMS {worst}")
    assert errors[worst] < 0.14, {key: e for key, e in errors.items() if e >= 0.14}
