"""model/fast/head.py: the fused head loss (HeadLoss, FastHead; bf16/fp32 and FP8 paths) against F.cross_entropy of
capped logits, the loss of model/gpt.py's Head."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from model.gpt import IGNORE_INDEX, Head, capped

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch)")
from model.fast import head as head_module
from model.fast.head import FastHead, HeadLoss, bounded_logsumexp

SOFTCAP = 15.0


def problem(n=96, d=64, v=320, dtype=torch.float64, weight_std=0.3, seed=0):
    """Normed inputs (as the head sees them), a weight, targets with a few ignored positions."""
    g = torch.Generator().manual_seed(seed)
    x = F.rms_norm(torch.randn(n, d, generator=g, dtype=torch.float64), (d,)).to(dtype)
    w = (weight_std * torch.randn(v, d, generator=g, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[[3, 50]] = IGNORE_INDEX
    return x, w, targets


def loss_and_grads(fn, x, w, targets, upstream):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w, targets)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad, w.grad


def fused(fp8, with_grad=True):
    return lambda x, w, t: HeadLoss.apply(x, w, t, SOFTCAP, fp8, with_grad)


def reference(x, w, t):
    """Per-token cross-entropy (N,) in fp32 of the capped logits of normed x (N, D) and w (V, D), the product in x's
    dtype; 0 where ignored: model/gpt.py's Head after its norm."""
    return F.cross_entropy(capped(F.linear(x, w.type_as(x)), SOFTCAP), t, ignore_index=IGNORE_INDEX,
                           reduction="none")


def cosine(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def test_fused_equals_reference_in_fp64():
    """Same math in fp64, per-token upstream gradients of both signs: agreement to rounding."""
    x, w, targets = problem()
    upstream = torch.randn(len(targets), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = loss_and_grads(fused(False), x, w, targets, upstream)
    want = loss_and_grads(reference, x, w, targets, upstream)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert got[0][3] == 0 and got[0][50] == 0  # ignored targets: no loss ...
    assert not got[1][3].any()  # ... and no gradient


def test_fused_softcap_is_active():
    """Large weights push raw logits far past the cap: the fused loss still matches (tanh' ~ 0 there)."""
    x, w, targets = problem(weight_std=20.0)
    upstream = torch.ones(len(targets), dtype=torch.float64)
    got = loss_and_grads(fused(False), x, w, targets, upstream)
    want = loss_and_grads(reference, x, w, targets, upstream)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    raw = (x @ w.T).abs().max().item()
    assert raw > 10 * SOFTCAP, raw


def test_fused_bf16_matches_fp32_reference():
    """bf16 operands (the GPU path without FP8): loss to 1e-2 relative, gradients aligned to 0.999."""
    x, w, targets = problem(n=128, d=128, v=512, dtype=torch.float32)
    upstream = torch.full((len(targets),), 1.0 / len(targets))
    want = loss_and_grads(reference, x, w, targets, upstream)
    loss, gx, gw = loss_and_grads(fused(False), x.bfloat16(), w, targets, upstream)
    torch.testing.assert_close(loss, want[0], rtol=1e-2, atol=1e-2)
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    assert cosine(gx, want[1]) > 0.999 and cosine(gw, want[2]) > 0.999


def test_fp8_matches_reference():
    """FP8 e4m3 operands and e5m2 gradients (torch._scaled_mm, here on the CPU): the loss within 2% and both
    gradients aligned with the fp32 reference to 0.99, for the mean reduction's tiny upstream gradients."""
    x, w, targets = problem(n=128, d=128, v=512, dtype=torch.float32)
    upstream = torch.full((len(targets),), 1.0 / (8 * len(targets)))  # mean over tokens and 8 micro-batches
    want = loss_and_grads(reference, x, w, targets, upstream)
    loss, gx, gw = loss_and_grads(fused(True), x.bfloat16(), w, targets, upstream)
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()
    torch.testing.assert_close(loss.sum(), want[0].sum(), rtol=2e-2, atol=0)
    assert cosine(gx, want[1]) > 0.99 and cosine(gw, want[2]) > 0.99
    # the gradient keeps its magnitude through the FP8 scaling (not just its direction)
    assert gw.norm().item() == pytest.approx(want[2].norm().item(), rel=0.05)


def test_fp8_per_token_upstream_gradients():
    """Upstream gradients of both signs over three orders of magnitude: HeadLoss.backward scales the e5m2 unit
    gradient by the largest and applies each token's ratio to x's rows (grad_w) and grad_x's rows; both gradients
    stay aligned with the fp32 reference to 0.99 and keep its magnitude. Dropping the ratio (every token at the
    largest gradient) takes both alignments to about 0.1."""
    x, w, targets = problem(n=128, d=128, v=512, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    upstream = torch.randn(len(targets), generator=g) * 10.0 ** (-3 * torch.rand(len(targets), generator=g))
    want = loss_and_grads(reference, x, w, targets, upstream)
    _, gx, gw = loss_and_grads(fused(True), x.bfloat16(), w, targets, upstream)
    assert cosine(gx, want[1]) > 0.99 and cosine(gw, want[2]) > 0.99
    assert gw.norm().item() == pytest.approx(want[2].norm().item(), rel=0.05)
    assert gx.float().norm().item() == pytest.approx(want[1].norm().item(), rel=0.05)


@pytest.mark.parametrize("fp8", [False, True])
def test_loss_without_grad_is_the_same(fp8, monkeypatch):
    """Without a backward to follow (validation), HeadLoss skips the gradient's pass: the same loss, bit for bit,
    and FastHead picks that path under torch.no_grad (the gradient's ops are made to fail there)."""
    x, w, targets = problem(n=64, d=64, v=256, dtype=torch.bfloat16)
    with_grad = fused(fp8)(x, w.float(), targets)
    assert torch.equal(fused(fp8, with_grad=False)(x, w.float(), targets), with_grad)
    head = FastHead(64, 256, SOFTCAP)
    head.fp8 = fp8
    head.weight.data.copy_(w.float())

    def no_gradient_pass(*args):
        raise AssertionError("the gradient's pass ran under torch.no_grad")

    monkeypatch.setattr(head_module, "TORCH_OPS", SimpleNamespace(
        lse_and_loss=head_module.lse_and_loss, loss_and_unit_grad=no_gradient_pass,
        loss_and_unit_grad_fp8=no_gradient_pass))
    with torch.no_grad():
        loss = head(x[None], targets[None], "none")
    assert loss.grad_fn is None and torch.equal(loss.flatten(), with_grad)


def test_fp8_zero_weight_gives_log_vocab():
    """The zero-initialised head in FP8: uniform logits, loss exactly ln(V), finite non-zero weight gradient."""
    x, w, targets = problem(n=64, d=64, v=256, dtype=torch.bfloat16)
    loss, _, gw = loss_and_grads(fused(True), x, torch.zeros_like(w, dtype=torch.float32), targets,
                                 torch.ones(len(targets)))
    valid = targets != IGNORE_INDEX
    assert torch.allclose(loss[valid], torch.full_like(loss[valid], math.log(256)), atol=1e-6)
    assert torch.isfinite(gw).all() and gw.abs().sum() > 0


@pytest.mark.parametrize("make_head", [FastHead, Head])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_head_reductions(reduction, make_head):
    """FastHead (HeadLoss) and model/gpt.py's Head: each reduction of F.cross_entropy of Head.logits."""
    torch.manual_seed(0)
    head = make_head(32, 160, SOFTCAP)
    torch.nn.init.normal_(head.weight, std=0.5)
    x = torch.randn(2, 48, 32)
    targets = torch.randint(0, 160, (2, 48))
    targets[0, :5] = IGNORE_INDEX
    logits = head.logits(x)
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    want = {"none": per_token, "sum": per_token.sum(), "mean": per_token.sum() / (targets != IGNORE_INDEX).sum()}
    torch.testing.assert_close(head(x, targets, reduction), want[reduction], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("fp8", [False, True])
def test_head_on_gpu(fp8, compiled):
    """The record's shapes (D 768, V 50,304; 8,192 tokens) compiled as in training (and eager, as with --compile 0:
    the Triton kernels of model/fast/head_kernels.py either way), against model/gpt.py's Head in fp32: bf16 to 0.999
    gradient alignment, FP8 to 0.99."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    head = FastHead(768, 50304, SOFTCAP).to(device)
    torch.nn.init.normal_(head.weight, std=0.02)
    head.fp8 = fp8
    if compiled:
        head.compile(dynamic=False, fullgraph=True)
    x = torch.randn(1, 8192, 768, device=device)
    targets = torch.randint(0, 50257, (1, 8192), device=device)
    xb = x.bfloat16().requires_grad_()
    loss = head(xb, targets, "mean")
    loss.backward()
    gw = head.weight.grad.clone()

    xr = x.clone().requires_grad_()
    reference_head = Head(768, 50304, SOFTCAP).to(device)
    with torch.no_grad():
        reference_head.weight.copy_(head.weight)
    want = reference_head(xr, targets, "mean")
    want.backward()
    wr = reference_head.weight
    torch.testing.assert_close(loss.float(), want, rtol=1e-2, atol=0)
    bound = 0.99 if fp8 else 0.999
    assert cosine(xb.grad, xr.grad) > bound and cosine(gw, wr.grad) > bound


def test_bounded_logsumexp_equals_logsumexp_at_the_extremes():
    """One-pass log-sum-exp of capped logits == torch.logsumexp, also with every logit at -cap or +cap."""
    z = torch.cat([capped(100 * torch.randn(6, 50304), SOFTCAP), torch.full((1, 50304), -SOFTCAP),
                   torch.full((1, 50304), SOFTCAP)])
    torch.testing.assert_close(bounded_logsumexp(z, SOFTCAP), torch.logsumexp(z, dim=-1), rtol=1e-6, atol=1e-5)


def test_fp8_backward_of_an_all_ignored_batch_is_zero():
    """A micro-batch whose targets are all ignored sends a zero upstream gradient: the FP8 backward's rescaling by
    the largest |grad| must not turn that into 0/0 = nan gradients."""
    x, w, targets = problem(n=64, d=64, v=256, dtype=torch.bfloat16)
    x.requires_grad_()
    w = w.float().requires_grad_()
    fused(True)(x, w, torch.full_like(targets, IGNORE_INDEX)).sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))
