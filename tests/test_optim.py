"""optim/: Newton–Schulz against the exact polar factor, Adam against torch.optim.AdamW, Muon (and NorMuon) against
the formula written out by hand, on the CPU and on CUDA (`gpu`), checkpoint round trips, and no communication at
world size 1."""
import io

import pytest
import torch
import torch.distributed as dist

from optim.muon import ITERATIONS, neuron_scales, neuron_shape, newton_schulz
from optim.optimizer import MuonAdam


def well_conditioned(shape, cond=100.0, scale=37.0, seed=0):
    """A random matrix batch with singular values log-spaced over [1/cond, 1] (times `scale`, to show the
    result does not depend on it) and its exact polar factor U V^T."""
    gen = torch.Generator().manual_seed(seed)
    *batch, m, n = shape
    k = min(m, n)
    u = torch.linalg.qr(torch.randn(*batch, m, k, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(*batch, n, k, generator=gen)).Q
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k)[torch.randperm(k, generator=gen)]
    return scale * (u * s) @ v.mT, u @ v.mT


# Measured over these shapes with condition number 100 (5 seeds each): jordan's singular values in
# [0.667, 1.206], cosine to the polar factor >= 0.981 (the quintic's fixed band is about [0.68, 1.2]: its maximum
# on [0, 1] is 1.2024 at x = 0.554; bf16 rounding adds a little); polar_express's in [0.837, 1.146], cosine
# >= 0.993: closer to the polar factor, which is what its per-step coefficients are for.
BOUNDS = {"jordan": (0.6, 1.22, 0.97), "polar_express": (0.8, 1.16, 0.99)}


@pytest.mark.parametrize("method", sorted(ITERATIONS))
@pytest.mark.parametrize("shape", [(64, 64), (96, 32), (32, 96), (4, 48, 48), (3, 16, 8)])
def test_newton_schulz_singular_values_near_one_and_direction_is_polar_factor(shape, method):
    g, polar = well_conditioned(shape)
    out = newton_schulz(g, method)
    assert out.dtype == torch.bfloat16 and out.shape == g.shape
    s = torch.linalg.svdvals(out.float())
    low, high, min_cosine = BOUNDS[method]
    assert s.min() > low and s.max() < high, (s.min().item(), s.max().item())
    out = out.float()
    cosine = (out * polar).sum((-2, -1)) / (out.norm(dim=(-2, -1)) * polar.norm(dim=(-2, -1)))
    assert cosine.min() > min_cosine, cosine


def test_newton_schulz_batch_matches_one_matrix_at_a_time_and_zero_stays_zero():
    g, _ = well_conditioned((5, 24, 40))
    one_by_one = torch.stack([newton_schulz(x) for x in g])
    # Batching must not mix matrices: any mixing would move entries by O(0.1), one bf16 rounding by < 1e-2.
    torch.testing.assert_close(newton_schulz(g).float(), one_by_one.float(), atol=1e-2, rtol=0)
    # Rank padding in the distributed optimizer relies on a zero matrix giving a zero update (no NaN).
    assert torch.equal(newton_schulz(torch.zeros(2, 8, 4)), torch.zeros(2, 8, 4, dtype=torch.bfloat16))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# gradients of 1e-6 against eps = 1e-6: the update's denominator is half eps, so where eps enters is checked too
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_scale, eps", [(1.0, 1e-10), (1e-6, 1e-6)])
def test_adam_groups_match_torch_adamw_over_ten_steps(grad_scale, eps, device):
    """Ours is torch's fused Adam kernel; the reference is AdamW's default, unfused code path."""
    torch.manual_seed(0)
    shapes = {"embed": [(10, 6)], "scalar": [(), (3,)]}
    lr = {"embed": 0.01, "scalar": 0.003}
    ours = {n: [torch.randn(s).to(device) for s in ss] for n, ss in shapes.items()}
    theirs = {n: [p.clone().requires_grad_() for p in ps] for n, ps in ours.items()}
    opt = MuonAdam([{"kind": "adam", "name": n, "params": ps} for n, ps in ours.items()], lr=lr,
                   adam_betas=(0.8, 0.95), adam_eps=eps)
    ref = torch.optim.AdamW([{"params": ps, "lr": lr[n]} for n, ps in theirs.items()], betas=(0.8, 0.95),
                            eps=eps, weight_decay=0.0)
    for step in range(10):
        mult = 1.0 - 0.05 * step  # a changing schedule value must reach both the same way
        for n in shapes:
            for p, q in zip(ours[n], theirs[n]):
                p.grad = grad_scale * torch.randn_like(p)
                q.grad = p.grad.clone()
        for group, n in zip(ref.param_groups, shapes):
            group["lr"] = lr[n] * mult
        opt.step(mult, 0.95)
        ref.step()
    for n in shapes:
        for p, q in zip(ours[n], theirs[n]):
            # Same arithmetic up to where fp32 rounds (the fused kernel's order of operations against AdamW's).
            torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-7)


def reference_newton_schulz(x, method):
    """The quintic iterations written out once more, step by step, for a single 2-D matrix: bf16 matrices, each
    product and its scale and add in fp32, rounded to bf16 once, as a bf16 GEMM with its epilogue does."""
    coefficients, margin = ITERATIONS[method]
    x = x.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) * margin + 1e-7)
    for a, b, c in coefficients:
        gram = (x.float() @ x.float().T).bfloat16()
        poly = (b * gram.float() + c * (gram.float() @ gram.float())).bfloat16()
        x = (a * x.float() + poly.float() @ x.float()).bfloat16()
    return x.T if tall else x


def reference_normalize_neurons(update, second_moment, beta2):
    """NorMuon's step for one 2-D matrix, one neuron at a time in float64: returns (update, new second moment)."""
    u, v = update.double(), second_moment.double().clone()
    rows = u.shape[0] >= u.shape[1]  # tall or square: the neurons are rows, else columns
    neurons = u if rows else u.T
    out = torch.empty_like(neurons)
    for i, neuron in enumerate(neurons):
        v.view(-1)[i] = beta2 * v.view(-1)[i] + (1 - beta2) * (neuron ** 2).sum() / len(neuron)
        out[i] = neuron / (v.view(-1)[i].sqrt() + 1e-10)
    out = out if rows else out.T
    return out * torch.linalg.matrix_norm(u) / torch.linalg.matrix_norm(out), v


@pytest.mark.parametrize("shape", [(6, 3), (3, 6), (4, 4), (2, 5, 3)])
def test_neuron_scales_against_one_neuron_at_a_time(shape):
    gen = torch.Generator().manual_seed(3)
    scales = torch.arange(1.0, shape[-2] + 1)[:, None] * torch.arange(1.0, shape[-1] + 1)  # uneven neurons
    update = (torch.randn(shape, generator=gen) * scales).bfloat16()
    second_moment = torch.rand(neuron_shape(shape), generator=gen)
    want = [reference_normalize_neurons(u, v, 0.9) for u, v in zip(update.view(-1, *shape[-2:]),
                                                                   second_moment.view(-1, *second_moment.shape[-2:]))]
    factor = neuron_scales(update, second_moment, 0.9)
    assert factor.dtype == torch.float32 and factor.shape == neuron_shape(shape)
    out = update * factor
    torch.testing.assert_close(out.view(-1, *shape[-2:]), torch.stack([u for u, _ in want]).float(), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(second_moment.view(-1, *second_moment.shape[-2:]),
                               torch.stack([v for _, v in want]).float(), rtol=1e-6, atol=0)
    # the norm of each matrix is kept; from a zero state every neuron comes out with the same mean square
    torch.testing.assert_close(out.norm(dim=(-2, -1)), update.float().norm(dim=(-2, -1)), rtol=1e-5, atol=0)
    fresh = update * neuron_scales(update, torch.zeros(neuron_shape(shape)), 0.9)
    mean_square = fresh.square().mean(dim=-1 if shape[-2] >= shape[-1] else -2)
    torch.testing.assert_close(mean_square, mean_square.mean(-1, keepdim=True).expand_as(mean_square), rtol=1e-4,
                               atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", sorted(ITERATIONS))
@pytest.mark.parametrize("normuon_beta2", [0.0, 0.9])
@pytest.mark.parametrize("shape, scale", [((12, 6), 2 ** 0.5), ((6, 12), 1.0)])  # tall: sqrt(rows/cols); wide: 1
def test_muon_step_matches_the_formula_by_hand(method, normuon_beta2, shape, scale, device, monkeypatch):
    # cuBLAS may reduce bf16 products in reduced precision (torch's default allows it): on the H200 that put
    # b*gram + c*gram@gram 1-2 bf16 ulps from the fp32 sum rounded once, where with it off the two were equal, and
    # Newton-Schulz's outputs up to 0.047 from the reference's (bench/results/README.md, section fa4c217). That is
    # cuBLAS's rounding, not the formula under test, so it is off here.
    if device == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    torch.manual_seed(1)
    w = torch.randn(shape, device=device)
    # one second moment per neuron: the rows of a tall matrix, the columns of a wide one
    ref_w, momentum = w.clone(), torch.zeros_like(w)
    second_moment = torch.zeros(max(shape), 1, device=device)
    opt = MuonAdam([{"kind": "muon", "name": "hidden", "params": [w]}], lr={"hidden": 0.05}, muon_method=method,
                   normuon_beta2=normuon_beta2)
    for step, (mult, beta) in enumerate([(1.0, 0.85), (0.5, 0.9), (0.25, 0.95)]):
        g = torch.randn(shape).to(device)
        w.grad = g.clone()
        opt.step(mult, beta)
        momentum = beta * momentum + (1 - beta) * g
        nesterov = (1 - beta) * g + beta * momentum
        update = reference_newton_schulz(nesterov, method).float()
        if normuon_beta2:
            update, second_moment = reference_normalize_neurons(update, second_moment, normuon_beta2)
        ref_w -= 0.05 * mult * scale * update.float()
        # Over 30 seeds on the CPU, at most 1.4e-4 apart: the GEMMs sum in another order than the fp32 products
        # here and flip a bf16 rounding now and then. The tolerance (1% of lr) allows that; a wrong scale,
        # momentum, Nesterov term or neuron normalisation moves entries by O(lr), and so does rounding each
        # product to bf16 before its scale and add (the reference before the epilogues: it failed here).
        torch.testing.assert_close(w, ref_w, atol=0.05 * 1e-2, rtol=0, msg=f"step {step}")


def test_muon_treats_leading_dims_of_a_3d_parameter_as_separate_matrices():
    torch.manual_seed(2)
    qkv = torch.randn(3, 8, 8)
    slices = [qkv[i].clone() for i in range(3)]
    batched = MuonAdam([{"kind": "muon", "name": "hidden", "params": [qkv]}], lr={"hidden": 0.05})
    separate = MuonAdam([{"kind": "muon", "name": "hidden", "params": slices}], lr={"hidden": 0.05})
    for _ in range(2):
        g = torch.randn(3, 8, 8)
        qkv.grad = g.clone()
        for i, s in enumerate(slices):
            s.grad = g[i].clone()
        batched.step(1.0, 0.9)
        separate.step(1.0, 0.9)
    torch.testing.assert_close(qkv, torch.stack(slices), atol=1e-6, rtol=0)


def make_groups(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(8, 8, generator=gen), torch.randn(16, 8, generator=gen), torch.randn(8, 8, generator=gen),
              torch.randn(2, 8, 8, generator=gen)]
    embed = [torch.randn(11, 8, generator=gen)]
    scalar = [torch.randn((), generator=gen), torch.randn(4, generator=gen)]
    return [{"kind": "muon", "name": "hidden", "params": hidden}, {"kind": "adam", "name": "embed", "params": embed},
            {"kind": "adam", "name": "scalar", "params": scalar}]


LR = {"hidden": 0.05, "embed": 0.3, "scalar": 0.02}


def run_steps(opt, groups, steps):
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for g in groups:
            for p in g["params"]:
                p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step(1.0 - 0.1 * step, 0.85 + 0.02 * step)
        opt.zero_grad()


@pytest.mark.parametrize("normuon_beta2", [0.0, 0.9])
def test_state_dict_round_trip_resumes_bitwise(normuon_beta2):
    straight = make_groups()
    opt = MuonAdam(straight, lr=LR, normuon_beta2=normuon_beta2)
    run_steps(opt, straight, range(5))

    first = make_groups()
    opt = MuonAdam(first, lr=LR, normuon_beta2=normuon_beta2)
    run_steps(opt, first, range(3))
    buf = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "params": [p for g in first for p in g["params"]]}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = make_groups(seed=1)  # different values: everything must come from the checkpoint
    for p, q in zip([p for g in resumed for p in g["params"]], saved["params"]):
        p.copy_(q)
    opt = MuonAdam(resumed, lr=LR, normuon_beta2=normuon_beta2)
    opt.load_state_dict(saved["optimizer"])
    assert opt.step_count == 3
    run_steps(opt, resumed, range(3, 5))

    for a, b in zip([p for g in straight for p in g["params"]], [p for g in resumed for p in g["params"]]):
        assert torch.equal(a, b)


def test_load_state_dict_refuses_a_different_model():
    """Other shapes, and a group more or less than the model has (a saved group would be dropped unread, a missing
    one a bare KeyError): each names the model configuration."""
    opt = MuonAdam(make_groups(), lr=LR)
    state = opt.state_dict()
    other = make_groups()
    other[1]["params"] = [torch.randn(12, 8)]
    with pytest.raises(ValueError, match="model configuration"):
        MuonAdam(other, lr=LR).load_state_dict(state)
    extra = {**state, "groups": {**state["groups"], "head": state["groups"]["embed"]}}
    missing = {**state, "groups": {k: v for k, v in state["groups"].items() if k != "scalar"}}
    for groups in (extra, missing):
        with pytest.raises(ValueError, match=r"optimizer state has groups .* but the model has .*model configuration"):
            MuonAdam(make_groups(), lr=LR).load_state_dict(groups)


def test_load_state_dict_refuses_the_state_of_the_other_muon():
    """NorMuon's state holds a second moment that plain Muon's lacks: neither resumes from the other's."""
    plain, normuon = MuonAdam(make_groups(), lr=LR), MuonAdam(make_groups(), lr=LR, normuon_beta2=0.95)
    assert [len(t) for t in normuon.state_dict()["groups"]["hidden"]["second_moment"]] == [8, 16, 8, 2]
    for source, target in ((plain, normuon), (normuon, plain)):
        with pytest.raises(ValueError, match="written by another optimizer"):
            target.load_state_dict(source.state_dict())


def test_missing_learning_rate_is_a_value_error():
    with pytest.raises(ValueError, match="'scalar'"):
        MuonAdam(make_groups(), lr={"hidden": 0.05, "embed": 0.3})


def test_world_size_one_never_communicates(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a collective was called at world size 1")

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                 "broadcast", "barrier"):
        monkeypatch.setattr(dist, name, forbidden)
    groups = make_groups()
    before = [p.clone() for g in groups for p in g["params"]]
    run_steps(MuonAdam(groups, lr=LR), groups, range(2))
    assert all(not torch.equal(a, b) for a, b in zip(before, [p for g in groups for p in g["params"]]))
