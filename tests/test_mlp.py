"""The MLP's autograd.Function (model/fast/mlp.py, ReLU2MLP) against autograd through plain torch ops, and the Gluon
kernels of model/fast/mlp_kernels.py against the torch ops of model/fast/mlp.py (same names).

The kernels run on a Hopper GPU only (`pytest -m gpu`): Gluon has no interpreter, so the CPU tests cover the torch
ops that every other device runs."""
import re

import pytest
import torch
import torch.nn.functional as F

from helpers import output_and_grads as grads

pytest.importorskip("triton", reason="triton is not installed (CPU-only torch)")
from model.fast import mlp_kernels
from model.fast.blocks import FastMLP
from model.fast.mlp import ReLU2MLP, matmul_add, relu2_matmul

gpu = pytest.mark.gpu
# the kernels' own tests; elsewhere ReLU2MLP runs the torch ops (model.fast.mlp_kernels.supports)
hopper = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                            reason="the Gluon kernels need a Hopper GPU (compute capability 9)")


def operands(m, k, n, dtype, device, seed=0):
    """x (M, K) and the two (K, N) weights at the model's init scale, the residual stream r (M, K), an upstream
    gradient (M, K). x's last row is zero, so its pre-activations are exactly 0: relu's kink, where the gradient must
    be 0 on both paths."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device)
    x[-1] = 0.0
    w1 = torch.randn(k, n, generator=g, device=device) * 0.5 * k ** -0.5
    w2 = torch.randn(k, n, generator=g, device=device) * n ** -0.5
    r = torch.randn(m, k, generator=g, device=device)
    grad_y = torch.randn(m, k, generator=g, device=device)
    return [t.to(dtype) for t in (x, w1, w2, r, grad_y)]


def plain_mlp(x, w1, w2, r):
    """The MLP added to the residual stream by autograd's own rules: r + relu(x @ W1)^2 @ W2^T."""
    return r + F.relu(x @ w1).square() @ w2.t()


def fused_mlp(x, w1, w2, r):
    return ReLU2MLP.apply(x, w1, w2, r, False)


# --- CPU, torch ops -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_function_matches_autograd(dtype, rtol):
    """Output and all three gradients equal autograd's through relu(pre)^2, though the Function takes relu(pre)
    from sqrt(h): to rounding in fp64 and fp32."""
    args = operands(37, 16, 64, dtype, "cpu")
    for got, want in zip(grads(fused_mlp, *args), grads(plain_mlp, *args), strict=True):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


def test_function_matches_autograd_in_bf16():
    """In bf16 the two differ by the rounding of the saved tensor (h, against the pre-activation): each gradient stays
    within 1% of fp64 autograd's largest value, as autograd's own bf16 gradients do."""
    args = operands(64, 32, 128, torch.bfloat16, "cpu")
    want = grads(plain_mlp, *[t.double() for t in args])
    for got, own, exact in zip(grads(fused_mlp, *args), grads(plain_mlp, *args), want, strict=True):
        scale = exact.abs().max().item()
        assert (own.double() - exact).abs().max().item() < 1e-2 * scale  # the bound is not loose for autograd
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-2 * scale)


def test_mlp_module_uses_the_function():
    """FastMLP (model/fast/blocks.py) on (B, T, D) is the plain MLP on the flattened tokens, weights cast to x's
    dtype, added to the residual stream; the gradients reach its weights and both inputs as autograd's own."""
    torch.manual_seed(0)
    mlp = FastMLP(16, 64)
    mlp.init_weights()
    with torch.no_grad():
        mlp.proj_w.normal_()
    x, r = torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16, requires_grad=True)
    g = torch.randn(2, 5, 16)  # the upstream gradient
    inputs = (x, r, mlp.fc_w, mlp.proj_w)
    got = mlp(x, r)
    want = plain_mlp(x.flatten(0, 1), mlp.fc_w, mlp.proj_w, r.flatten(0, 1)).view(2, 5, 16)
    torch.testing.assert_close(got, want)
    for got_grad, want_grad in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g)):
        torch.testing.assert_close(got_grad, want_grad)


# --- GPU ----------------------------------------------------------------------------------------------------------
def check_kernels(m, k, n, device, rtol):
    """relu2_matmul, relu2_matmul_grad and matmul_add against fp64 torch ops of the same bf16 operands: within one
    bf16 rounding of each value (rtol) plus fp32 accumulation over the product's K, and exactly 0 where the
    pre-activation is 0."""
    x, w1, w2, r, grad_y = operands(m, k, n, torch.bfloat16, device)
    h = mlp_kernels.relu2_matmul(x, w1)
    want_h = relu2_matmul(x.double(), w1.double())
    assert h.dtype == torch.bfloat16 and h.shape == (m, n)
    torch.testing.assert_close(h.double(), want_h, rtol=rtol, atol=1e-5 * want_h.abs().max().item())
    g = mlp_kernels.relu2_matmul_grad(grad_y, w2, h)
    # the reference takes relu(pre) from the exact pre-activation, not from the bf16 h: sqrt(h) adds half of h's
    # rounding to the kernel's own
    want_g = (grad_y.double() @ w2.double()) * 2.0 * F.relu(x.double() @ w1.double())
    torch.testing.assert_close(g.double(), want_g, rtol=1.5 * rtol, atol=1e-5 * want_g.abs().max().item())
    assert not h[-1].any() and not g[-1].any()
    y = mlp_kernels.matmul_add(h, w2, r)
    want_y = matmul_add(h.double(), w2.double(), r.double())
    assert y.dtype == torch.bfloat16 and y.shape == (m, k)
    torch.testing.assert_close(y.double(), want_y, rtol=rtol, atol=1e-5 * want_y.abs().max().item())
    torch.testing.assert_close(y[-1], r[-1])  # h's last row is 0: the residual passes unchanged


@gpu
@hopper
@pytest.mark.parametrize("m, k, n", [(49152, 768, 3072), (300, 72, 520), (4100, 72, 1032)])
def test_kernels_on_gpu(m, k, n):
    """The record's MLP (49,152 tokens: about 70 tiles per program) and sizes off every tile: 300 = 2 x 128 + 44
    rows, 72 = 64 + 8 inputs, 520 = 4 x 128 + 8 hidden units (15 tiles, one per program); and 4100 x 1032 (297
    tiles: programs that walk two or three, with the next tile's h requested during the products). matmul_add's
    tiles run the other way: 72 = 64 + 8 outputs, K = 520 or 1032 hidden units, 8 past a whole k-step."""
    check_kernels(m, k, n, "cuda", rtol=2.0 ** -8)


@gpu
@hopper
@pytest.mark.parametrize("m, k, n", [(49152, 768, 3072), (4100, 72, 1032)])
def test_kernels_with_the_tile_in_the_output_buffer(m, k, n):
    """At 128 x 256 tiles in 3 stages, shared memory holds no second tile beside the ring and the output's, so the
    backward's h and the residual land in the output's buffer (SHARED_TILE): the kernels' results as at CONFIG. The
    training shape walks 8-9 tiles per program; 4100 x 1032 some programs two."""
    config = (128, 256, 64, 3, 8)
    x, w1, w2, r, grad_y = operands(m, k, n, torch.bfloat16, "cuda")
    h = mlp_kernels.relu2_matmul(x, w1)
    for epilogue, args in ((mlp_kernels.RELU2, (x, w1, None)), (mlp_kernels.RELU2_GRAD, (grad_y, w2, h)),
                           (mlp_kernels.ADD, (h, w2, r))):
        want = mlp_kernels.launch(*args, epilogue)
        torch.testing.assert_close(mlp_kernels.launch(*args, epilogue, config), want, rtol=0, atol=0)


@gpu
def test_function_on_gpu_matches_autograd():
    """The Function on the kernels against autograd's bf16 MLP, both against fp64: each result within 1% of fp64's
    largest value, and at least as close to fp64 as autograd's (within 10% of its error)."""
    args = operands(4096, 768, 3072, torch.bfloat16, "cuda")
    exact = grads(plain_mlp, *[t.double() for t in args])
    for got, own, want in zip(grads(fused_mlp, *args), grads(plain_mlp, *args), exact, strict=True):
        err, own_err = (got.double() - want).abs().max().item(), (own.double() - want).abs().max().item()
        assert err < 1e-2 * want.abs().max().item() and err <= 1.1 * own_err, (err, own_err)


@gpu
@hopper
def test_compiled_function_calls_the_kernels_without_copies():
    """Under torch.compile the Function's forward and backward call the two kernels' custom ops, each once, and
    launch no Triton kernel besides (no copy or cast of their operands); the compiled results equal the eager ones."""
    from torch._inductor.utils import run_and_get_code

    args = operands(4096, 768, 3072, torch.bfloat16, "cuda")

    got, codes = run_and_get_code(grads, torch.compile(fused_mlp, dynamic=False), *args)
    code = "\n".join(codes)
    assert sorted(re.findall(r"torch\.ops\.speedrun\.(\w+)\.default\(", code)) == ["matmul_add", "relu2_matmul",
                                                                                   "relu2_matmul_grad"]
    assert re.findall(r"(\w+)\.run\(", code) == []
    for a, b in zip(got, grads(fused_mlp, *args), strict=True):
        torch.testing.assert_close(a, b)
